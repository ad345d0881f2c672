"""The README's Python examples run as written, in order and in one namespace, as a reader
would paste them. Blocks after a `<!-- not tested: why -->` comment are skipped (they need
a download)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- not tested[^>]*-->\s*)?```python\n(.*?)```", re.S)


@pytest.mark.slow
def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [code for skip, code in BLOCK.findall(README.read_text()) if not skip]
    assert len(blocks) >= 5
    namespace = {"__name__": "__readme__"}
    for index, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
