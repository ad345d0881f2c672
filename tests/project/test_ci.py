"""CI's environment is the README's: `.ci/run` makes a new venv, installs nothing, and runs the README's
two commands first, as written; everything else (the PyTorch backend, the wheel in other environments) runs
after them, in venvs of its own."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CI_RUN = ROOT / ".ci" / "run"
INSTALLS = re.compile(r"\b(pip3?|uv|conda|mamba|easy_install)\b[^\n#]*\binstall\b|\bpip\.main\b|\bensurepip\b")
sys.path.insert(0, str(ROOT / ".ci"))
from readme_commands import readme_commands  # noqa: E402


def _before_readme_commands(text: str) -> list[str]:
    """The non-comment lines of a CI script before it runs the README's commands."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "readme_commands.py" in line), None)
    assert start is not None, "the CI script does not read the README's commands with .ci/readme_commands.py"
    return [line for line in lines[:start] if not line.lstrip().startswith("#")]


def _installs_before_readme(text: str) -> list[str]:
    return [line.strip() for line in _before_readme_commands(text) if INSTALLS.search(line)]


def test_ci_installs_nothing_before_the_readme_commands():
    assert _installs_before_readme(CI_RUN.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("line", ['pip install -q -c constraints.txt torch==2.13.0',
                                  'python -m pip install torch', '"$VENV/bin/pip3" install x',
                                  'uv pip install jax'])
def test_drift_check_catches_an_install_before_the_readme_commands(line):
    text = CI_RUN.read_text(encoding="utf-8")
    marker = next(line for line in text.splitlines() if "readme_commands.py" in line)
    assert _installs_before_readme(text.replace(marker, f"{line}\n{marker}")) == [line]


def test_ci_checks_the_venv_holds_only_pip_before_the_readme_commands():
    """At run time too: `pip list` of the new venv shows pip (and setuptools) alone, or CI stops."""
    before = "\n".join(_before_readme_commands(CI_RUN.read_text(encoding="utf-8")))
    assert "pip list --format=freeze" in before and "pip|setuptools" in before


def test_ci_runs_the_readme_commands_as_written():
    commands = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert commands[0].endswith("python demo.py") and "pytest" in commands[1]
    assert all(command.startswith('pip install -c constraints.txt -e ".[all]" && ') for command in commands)
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), str(ROOT / "README.md")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == commands


def test_readme_block_with_a_third_command_is_refused():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    extra = text.replace("python demo.py", "python demo.py\npip install torch", 1)
    with pytest.raises(SystemExit, match="expected the main job then the test suite"):
        readme_commands(extra)


def test_pytorch_backend_runs_in_ci_in_a_venv_of_its_own():
    text = CI_RUN.read_text(encoding="utf-8")
    after = text.split("readme_commands.py", 1)[1]
    assert "bash .ci/torch" in after
    torch_ci = (ROOT / ".ci" / "torch").read_text(encoding="utf-8")
    assert "python3 -m venv" in torch_ci and "pip install -q -c constraints.txt torch" in torch_ci
    # Every test that needs PyTorch is in its list, so none is left to skip unseen.
    needing_torch = set()
    for path in sorted((ROOT / "tests").glob("**/test_*.py")):
        for match in re.finditer(r'needs\("torch".*?\n(?:@.*\n)*def (test_\w+)|param\("torch".*?needs\("torch"',
                                 path.read_text(encoding="utf-8")):
            needing_torch.add(f"{path.name}::{match.group(1)}" if match.group(1) else path.name)
    assert needing_torch and all(any(name.split("::")[-1] in line for line in torch_ci.splitlines())
                                 for name in needing_torch), needing_torch
