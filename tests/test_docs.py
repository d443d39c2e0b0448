"""Every example in the docs, the README and the docstrings runs, so none can drift from the code."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import pytest
from torchrun_blocks import run_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_doc_page_examples_run(page):
    result = doctest.testfile(str(ROOT / "docs" / page), module_relative=False, optionflags=FLAGS)
    assert result.failed == 0


def _modules_with_examples() -> list[str]:
    """Every module of the package whose docstrings hold an example (found, not listed: none can be forgotten)."""
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "dist_optim").rglob("*.py") if ">>>" in path.read_text()
    )


@pytest.mark.parametrize("module", _modules_with_examples())
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=FLAGS)
    source = (ROOT / pathlib.Path(*module.split("."))).with_suffix(".py").read_text()
    live = any(">>>" in line and "doctest: +SKIP" not in line for line in source.splitlines())
    assert result.failed == 0 and (result.attempted > 0 or not live)


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_main_command_runs_the_trainer(tmp_path):
    """The README's main job, as written, with fewer steps (its own --steps keeps it at a minute or two)."""
    text = (ROOT / "README.md").read_text()
    main = re.search(r"<!-- main-command -->\n```\n(.*?)\n```", text, flags=re.S).group(1)
    script = main.rsplit("&&", 1)[1].split()
    assert script[:6] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "launch.train"]
    assert int(script[script.index("--steps") + 1]) <= 300
    torchrun = str(pathlib.Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, *script[1:], "--steps", "3", "--run-dir", str(tmp_path / "run")]  # the last flag wins
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: steps 0 to 2" in out.stderr


def _torchrun_blocks() -> dict[int, list[tuple[str, str]]]:
    """The blocks marked ``<!-- torchrun N -->`` (whole scripts), by N: (page-k, code)."""
    blocks: dict[int, list[tuple[str, str]]] = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        for k, (n, code) in enumerate(re.findall(r"<!-- torchrun (\d) -->\n```python\n(.*?)```", page.read_text(), re.S)):
            blocks.setdefault(int(n), []).append((f"{page.name}-{k}", code))
    return blocks


@pytest.mark.parametrize("nproc", sorted(_torchrun_blocks()))
def test_doc_torchrun_examples_run(nproc, tmp_path):
    """Blocks marked ``<!-- torchrun N -->`` are whole scripts: run them as the docs say, on N CPU processes (those
    of one N one after the other in one torchrun job; a failure's traceback names its block, page-k)."""
    blocks = _torchrun_blocks()[nproc]
    out = run_blocks(blocks, nproc, tmp_path, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.splitlines().count(f"ran {blocks[-1][0]}") == nproc  # every block ran on every rank
