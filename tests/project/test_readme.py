"""The README's and docs/*.md's Python examples run as written, in order and in one namespace per file, as a
reader would paste them. Blocks after a `<!-- not tested: why -->` comment are skipped (they need a
download). Every relative link of these files points to an existing file."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, *DOCS]
BLOCK = re.compile(r"(<!-- not tested[^>]*-->\s*)?```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _blocks(path: pathlib.Path) -> list[tuple[bool, str]]:
    return [(bool(skip), code) for skip, code in BLOCK.findall(path.read_text(encoding="utf-8"))]


def _run_blocks(path: pathlib.Path) -> int:
    """Executes the file's tested blocks in order in one namespace; returns how many ran."""
    blocks = [code for skip, code in _blocks(path) if not skip]
    namespace = {"__name__": f"__{path.stem}__"}
    name = path.relative_to(ROOT)
    for index, code in enumerate(blocks):
        exec(compile(code, f"{name} python block {index}", "exec"), namespace)
    return len(blocks)


@pytest.mark.slow
def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run_blocks(README) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("path", [path for path in DOCS if _blocks(path)], ids=lambda path: path.name)
def test_docs_examples_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run_blocks(path) >= 1, f"{path.name} has python blocks but none is tested"


def test_docs_exist_and_are_linked_from_readme():
    assert DOCS, "docs/*.md is missing"
    linked = {(README.parent / target.split("#")[0]).resolve()
              for target in LINK.findall(README.read_text(encoding="utf-8"))}
    assert [path.name for path in DOCS if path.resolve() not in linked] == []


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_to_files(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # links, not code
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s), mailto, ... and anchors within the file
        file = target.split("#")[0].split("?")[0]
        if not (path.parent / file).exists():
            missing.append(target)
    assert missing == [], f"{path.relative_to(ROOT)}: links to missing files"


# Speed figures (ratios "1.13x", latencies "235 ms", throughputs "4.10 img/s") quoted where the README and the
# performance page describe measured speed; each must appear in benchmarks/RESULTS.md, where the run behind it is.
FIGURE = re.compile(r"\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? ms\b|\b\d+(?:\.\d+)? img/s\b")


def _unsourced_figures(text: str, results: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [figure for figure in FIGURE.findall(prose) if figure not in results]


@pytest.mark.parametrize("path", [README, ROOT / "docs" / "performance.md"], ids=lambda path: path.name)
def test_quoted_speed_figures_come_from_results(path):
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    assert _unsourced_figures(path.read_text(encoding="utf-8"), results) == []


def test_unsourced_figure_check_catches_a_figure_not_in_results():
    assert _unsourced_figures("1.13x keras-hub, 999.9 ms, 12.34 img/s; ```9.99x```", "| 1.13x |") == [
        "999.9 ms", "12.34 img/s"]
