"""Line charts as PNG files: matplotlib when it is installed, else a small rasterizer of our own (zlib + struct,
a 3x5 pixel font), so that ``--compare`` always leaves a picture behind.

A chart is a list of panels, each ``{"title", "xlabel", "ylabel", "series": [(label, xs, ys), ...]}``, stacked
vertically.
"""

from __future__ import annotations

import importlib.util
import struct
import zlib
from typing import Any

__all__ = ["plot_panels"]

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]

# 3x5 glyphs: a character, then its five rows top to bottom ('#' = ink). Text is drawn in upper case.
_FONT = """
0 ### #.# #.# #.# ###
1 .#. ##. .#. .#. ###
2 ### ..# ### #.. ###
3 ### ..# .## ..# ###
4 #.# #.# ### ..# ..#
5 ### #.. ### ..# ###
6 ### #.. ### #.# ###
7 ### ..# ..# .#. .#.
8 ### #.# ### #.# ###
9 ### #.# ### ..# ###
A .#. #.# ### #.# #.#
B ##. #.# ##. #.# ##.
C .## #.. #.. #.. .##
D ##. #.# #.# #.# ##.
E ### #.. ##. #.. ###
F ### #.. ##. #.. #..
G .## #.. #.# #.# .##
H #.# #.# ### #.# #.#
I ### .#. .#. .#. ###
J ..# ..# ..# #.# .#.
K #.# #.# ##. #.# #.#
L #.. #.. #.. #.. ###
M #.# ### ### #.# #.#
N ##. #.# #.# #.# #.#
O .#. #.# #.# #.# .#.
P ##. #.# ##. #.. #..
Q .#. #.# #.# ##. .##
R ##. #.# ##. #.# #.#
S .## #.. .#. ..# ##.
T ### .#. .#. .#. .#.
U #.# #.# #.# #.# ###
V #.# #.# #.# #.# .#.
W #.# #.# ### ### #.#
X #.# #.# .#. #.# #.#
Y #.# #.# .#. .#. .#.
Z ### ..# .#. #.. ###
space ... ... ... ... ...
. ... ... ... ... .#.
- ... ... ### ... ...
: ... .#. ... .#. ...
/ ..# ..# .#. #.. #..
( .#. #.. #.. #.. .#.
) .#. ..# ..# ..# .#.
% #.# ..# .#. #.. #.#
= ... ### ... ### ...
, ... ... ... .#. #..
+ ... .#. ### .#. ...
_ ... ... ... ... ###
? ### ..# .#. ... .#.
"""
_GLYPHS = {(line.split()[0] if not line.startswith("space") else " "): line.split()[1:]
           for line in _FONT.strip().splitlines()}


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i : i + 3] = bytes(color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int], width: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for k in range(n + 1):
            x, y = round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n)
            for dx in range(width):
                for dy in range(width):
                    self.dot(x + dx, y + dy, color)

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _GLYPHS.get(ch, _GLYPHS["?"])
            for r in range(5):
                for c in range(3):
                    if glyph[r][c] == "#":
                        for sx in range(scale):
                            for sy in range(scale):
                                self.dot(x + c * scale + sx, y + r * scale + sy, color)
            x += 4 * scale

    def png(self) -> bytes:
        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        stride = self.w * 3
        raw = b"".join(b"\x00" + bytes(self.px[y * stride : (y + 1) * stride]) for y in range(self.h))
        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _draw_panel(cv: _Canvas, top: int, height: int, panel: dict[str, Any]) -> None:
    left, right, bottom = 90, cv.w - 20, top + height - 40
    y_top = top + 30
    cv.text(left, top + 8, panel["title"])
    series = [(lab, list(xs), list(ys)) for lab, xs, ys in panel["series"] if len(xs)]
    xs_all = [x for _, xs, _ in series for x in xs] or [0.0, 1.0]
    ys_all = [y for _, _, ys in series for y in ys] or [0.0, 1.0]
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(ys_all), max(ys_all)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def to_px(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - y_top)

    grey = (120, 120, 120)
    cv.line(left, y_top, left, bottom, grey)
    cv.line(left, bottom, right, bottom, grey)
    for frac in (0.0, 0.5, 1.0):
        yv = y0 + frac * (y1 - y0)
        _, py = to_px(x0, yv)
        cv.line(left - 4, py, left, py, grey)
        cv.text(4, int(py) - 5, _fmt(yv), grey)
        xv = x0 + frac * (x1 - x0)
        px, _ = to_px(xv, y0)
        cv.line(px, bottom, px, bottom + 4, grey)
        cv.text(int(px) - 10, bottom + 8, _fmt(xv), grey)
    cv.text(right - 8 * len(panel["xlabel"]), bottom + 22, panel["xlabel"], grey)
    cv.text(4, top + 8, panel["ylabel"], grey)
    for k, (label, xs, ys) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        pts = [to_px(x, y) for x, y in zip(xs, ys)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            cv.line(ax, ay, bx, by, color, width=2 if k == 0 else 1)
        cv.text(right - 260, y_top + 4 + 14 * k, label, color)


def _plot_own(path: str, panels: list[dict[str, Any]], width: int = 900, panel_height: int = 300) -> None:
    cv = _Canvas(width, panel_height * len(panels))
    for k, panel in enumerate(panels):
        _draw_panel(cv, k * panel_height, panel_height, panel)
    with open(path, "wb") as f:
        f.write(cv.png())


def _plot_matplotlib(path: str, panels: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        for k, (label, xs, ys) in enumerate(panel["series"]):
            ax.plot(list(xs), list(ys), label=label, linewidth=2 if k == 0 else 1)
        ax.set_title(panel["title"])
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_panels(path: str, panels: list[dict[str, Any]], *, backend: str = "auto") -> str:
    """Write ``panels`` to the PNG file ``path``; returns the backend used ("matplotlib" or "builtin")."""
    if backend == "auto":
        backend = "matplotlib" if importlib.util.find_spec("matplotlib") else "builtin"
    (_plot_matplotlib if backend == "matplotlib" else _plot_own)(path, panels)
    return backend
