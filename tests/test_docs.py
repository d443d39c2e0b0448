"""Every example in the docs, the README and the docstrings runs, so none can drift from the code."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_doc_page_examples_run(page):
    result = doctest.testfile(str(ROOT / "docs" / page), module_relative=False, optionflags=FLAGS)
    assert result.failed == 0


@pytest.mark.parametrize("module", ["dist_optim.optimizer", "dist_optim._per_param", "dist_optim.averaging"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=FLAGS)
    assert result.attempted > 0 and result.failed == 0


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_main_command_runs_the_example():
    text = (ROOT / "README.md").read_text()
    main = re.search(r"<!-- main-command -->\n```\n(.*?)\n```", text, flags=re.S).group(1)
    script = main.rsplit("&&", 1)[1].split()
    assert script[0] == "python"
    out = subprocess.run([sys.executable, *script[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "parameters bitwise equal to the standard loop after 20 steps: True" in out.stderr
