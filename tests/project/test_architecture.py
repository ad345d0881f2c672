"""The import contracts of `.importlinter` hold: the library never imports the tools, checkpoint code never
imports the models, no import cycles (run by `python -m pytest`, hence by CI). And the code keeps within
120 characters a line.

import-linter reads the package from disk, where the repository's `training/` and `export/` are not inside
`keras_vit/`. The test lays the package out as it installs (setup.py's package_dir: `keras_vit.training`,
`keras_vit.export`) in a temporary folder and runs `lint-imports` there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.testing import python_path

ROOT = Path(__file__).resolve().parents[2]


def _installed_layout(folder: Path) -> Path:
    """Copies keras_vit/, training/ and export/ into `folder` as the wheel lays them out; returns `folder`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "keras_vit", folder / "keras_vit", ignore=ignore)
    for tool in ("training", "export"):
        shutil.copytree(ROOT / tool, folder / "keras_vit" / tool, ignore=ignore)
    return folder


def _lint_imports(folder: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("lint-imports")
    command = [str(script)] if script.exists() else [
        sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    env = dict(os.environ, PYTHONPATH=python_path(str(folder)))  # This copy, not the installed (editable) keras_vit.
    return subprocess.run([*command, "--config", str(ROOT / ".importlinter"), "--no-cache"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold(tmp_path):
    result = _lint_imports(_installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in result.stdout, result.stdout[-3000:]


def test_a_broken_contract_fails(tmp_path):
    """The check is live: the core importing the tools, or checkpoint code importing the models, fails it."""
    folder = _installed_layout(tmp_path)
    with open(folder / "keras_vit" / "variants.py", "a", encoding="utf-8") as file:
        file.write("\nfrom keras_vit.training import configs  # noqa\n")
    with open(folder / "keras_vit" / "checkpoints" / "npz.py", "a", encoding="utf-8") as file:
        file.write("\nfrom keras_vit import models  # noqa\n")
    result = _lint_imports(folder)
    assert result.returncode != 0
    assert "keras_vit.variants -> keras_vit.training.configs" in result.stdout, result.stdout[-3000:]
    assert "keras_vit.checkpoints.npz -> keras_vit.models" in result.stdout, result.stdout[-3000:]


LINE_LIMIT = 120
CODE_FOLDERS = ("keras_vit", "training", "export", "tests", "benchmarks")


def _long_lines(files) -> list[str]:
    return [f"{path}:{number}: {len(line)} characters"
            for path in files for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > LINE_LIMIT]


def test_code_lines_are_at_most_120_characters(tmp_path):
    files = [*ROOT.glob("*.py"), *(path for folder in CODE_FOLDERS for path in (ROOT / folder).rglob("*.py"))]
    assert len(files) > 50, files
    assert _long_lines(files) == []
    too_long = tmp_path / "too_long.py"
    too_long.write_text("x = 1\n" + "#" * 121 + "\n", encoding="utf-8")
    assert _long_lines([too_long]) == [f"{too_long}:2: 121 characters"]
