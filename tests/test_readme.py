"""The README's Python examples run as written (blocks after a `<!-- not tested: why -->`
comment are skipped: they need a download)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- not tested[^>]*-->\s*)?```python\n(.*?)```", re.S)


def python_blocks():
    return [(i, code) for i, (skip, code) in enumerate(BLOCK.findall(README.read_text())) if not skip]


@pytest.mark.parametrize("index, code", python_blocks(), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_readme_example_runs(index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__readme__"})
