"""What each part of the package imports is declared by the extra that installs it, and each command says
which extra to install when it is missing.

`setup.py` is the one source of the declarations: it is executed here with `setuptools.setup` captured.
Import names map to distributions through `IMPORT_NAMES`, a table, not through what happens to be installed,
so the verdict is the same on every machine (a user's venv from the README has no PyTorch, CI's torch venv has).
The fresh-environment runs of `.ci/packaging` (base install; `[training,export,tensorflow]` on the newest
TensorFlow; `[training,export]` beside an installed tensorflow-cpu) check the same from the outside.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import pathlib
import re
import runpy
import sys
from unittest import mock

import pytest
import setuptools

from keras_vit import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Calls that need a distribution which no import names: the distribution, and the text of the call.
CALLS_NEEDING = {"tensorboard": ("keras.callbacks.TensorBoard(", "tf.summary.")}


def _setup_arguments() -> dict:
    """The keyword arguments `setup.py` passes to `setuptools.setup` (run from the repository root)."""
    captured, cwd = {}, os.getcwd()
    with mock.patch.object(setuptools, "setup", lambda **kwargs: captured.update(kwargs)):
        try:
            os.chdir(ROOT)
            runpy.run_path(str(ROOT / "setup.py"))
        finally:
            os.chdir(cwd)
    return captured


def _names(requirements) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9._-]+", req).group(0)) for req in requirements}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


SETUP = _setup_arguments()
BASE = _names(SETUP["install_requires"])
EXTRAS = {extra: _names(reqs) for extra, reqs in SETUP["extras_require"].items()}
# The distribution that provides each top-level import name the package uses. A new import name fails the
# checks below until it is added here, with the distribution that setup.py declares for it. `tensorflow` is
# declared by the `tensorflow` extra only: `training` and `export` run on it without declaring it, so that they
# keep the one an image has (tensorflow-cpu, tensorflow-tpu), and their commands check it by import.
IMPORT_NAMES = {
    "absl": "absl-py", "ai_edge_litert": "ai-edge-litert", "jax": "jax", "keras": "keras",
    "matplotlib": "matplotlib", "numpy": "numpy", "PIL": "pillow", "sklearn": "scikit-learn",
    "tensorflow": "tensorflow", "tensorflow_datasets": "tensorflow-datasets", "torch": "torch",
    "onnxruntime": "onnxruntime", "openvino": "openvino", "nncf": "nncf",
}
# Extras that a subpackage's code may use inside functions only, after saying what to install where they are missing:
# keras-vit-export --format onnx (export/onnx_file.py) needs keras_vit[onnx] besides keras_vit[export], and
# --format openvino (export/openvino_file.py) keras_vit[openvino].
LAZY_EXTRAS = {"export": ("onnx", "openvino")}


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """The top-level modules a file imports at module level, and inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_level, in_functions = set(), set()

    def visit(node, inside_function):
        for child in ast.iter_child_nodes(node):
            nested = inside_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = {alias.name.split(".")[0] for alias in child.names}
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                names = {child.module.split(".")[0]}
            else:
                names = set()
            (in_functions if inside_function else module_level).update(names)
            visit(child, nested)

    visit(tree, False)
    return module_level, in_functions


def _distributions(modules: set[str], where: str) -> set[str]:
    found = set()
    for module in modules - set(sys.stdlib_module_names) - {"keras_vit", "__future__"}:
        assert module in IMPORT_NAMES, (f"{where} imports {module!r}, which tests/project/test_dependencies.py's "
                                        f"IMPORT_NAMES does not map to a distribution: add it there")
        found.add(IMPORT_NAMES[module])
    return found


def _calls(path: pathlib.Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    return {dist for dist, calls in CALLS_NEEDING.items() if any(call in text for call in calls)}


def _files(folder: str):
    return sorted(p for p in (ROOT / folder).glob("*.py"))


KERAS_BACKEND_DISTRIBUTIONS = {"jax", "torch"}  # besides tensorflow, an extra of its own


def _library_files():
    """keras_vit/ with its subpackages (keras_vit.checkpoints, ...), without the command lines (checked below)."""
    library = ROOT / "keras_vit"
    return sorted(p for p in library.rglob("*.py") if p.relative_to(library).parts[0] != "cli")


def _command_extra(path: pathlib.Path) -> str | None:
    match = re.search(r'cli\.require\("[^"]+", (?:"(\w+)"|None)\)', path.read_text(encoding="utf-8"))
    assert match, f"{path.name} does not call cli.require(command, extra) before its heavy imports"
    return match.group(1)


def _declared_for(extra: str) -> set[str]:
    """What an extra's code may use: its distributions, and TensorFlow for the extras that check it by import."""
    return BASE | EXTRAS[extra] | (EXTRAS["tensorflow"] if extra in cli.TENSORFLOW_EXTRAS else set())


@pytest.mark.parametrize("folder, extra", [("training", "training"), ("export", "export")])
def test_subpackage_uses_only_what_its_extra_declares(folder, extra):
    declared = _declared_for(extra)
    for path in _files(folder):
        module_level, in_functions = _imports(path)
        # A Keras backend's own package (jax: training/multihost.py) only inside functions that run on that backend.
        lazy_backends = (_distributions(in_functions, path.name) & KERAS_BACKEND_DISTRIBUTIONS) - _distributions(
            module_level, path.name)
        used = (_distributions(module_level | in_functions, path.name) | _calls(path)) - lazy_backends
        lazy_extras = set().union(*(EXTRAS[name] for name in LAZY_EXTRAS.get(folder, ())))
        assert not _distributions(module_level, path.name) & lazy_extras, f"{folder}/{path.name}: imported at the top"
        assert used <= declared | lazy_extras, (f"{folder}/{path.name} uses {sorted(used - declared - lazy_extras)}, "
                                                f"which keras_vit[{extra}] does not declare in setup.py")


def test_library_core_imports_optional_distributions_only_inside_functions():
    optional = set().union(*(EXTRAS[e] for e in ("tensorflow", "training", "export", "inspect")))
    for path in _library_files():
        name = path.relative_to(ROOT).as_posix()
        module_level, in_functions = _imports(path)
        top = _distributions(module_level, name)
        if name == "keras_vit/image_io.py":  # tf.data image decoding, imported only by training/ and export/
            top -= EXTRAS["tensorflow"]
        assert top <= BASE, f"{name} imports {sorted(top - BASE)} at module level"
        lazy = _distributions(in_functions, name) | _calls(path)
        # A Keras backend's own package is imported only where keras.backend.backend() names it: installed.
        allowed = BASE | optional | KERAS_BACKEND_DISTRIBUTIONS
        assert lazy <= allowed, f"{name} uses undeclared {sorted(lazy - allowed)}"


def test_each_command_imports_its_extra_only_after_requiring_it():
    commands = dict(entry.split("=") for entry in SETUP["entry_points"]["console_scripts"])
    for command, target in commands.items():
        path = ROOT / (target.split(":")[0].replace(".", "/") + ".py")
        module_level, in_functions = _imports(path)
        top = _distributions(module_level, path.name)
        assert top <= BASE, f"{command}: {path.name} imports {sorted(top - BASE)} before --help can run"
        extra = _command_extra(path)
        declared = (_declared_for(extra) if extra else BASE) | EXTRAS["tensorflow"]
        lazy = _distributions(in_functions, path.name)
        assert lazy <= declared, f"{command} imports {sorted(lazy - declared)}, not in keras_vit[{extra}]"


def test_one_version_string():
    import keras_vit
    assert keras_vit.__version__ == SETUP["version"]
    try:
        installed = importlib.metadata.version("keras_vit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("keras_vit is not installed (a source tree on sys.path)")
    assert installed == keras_vit.__version__


# ---------------------------------------------------------------------------------------
# Commands: --help without a backend, one line naming the missing extra
# ---------------------------------------------------------------------------------------

_NO_BACKEND = """
import sys
sys.modules["keras"] = None  # `import keras` raises ImportError, as on the base install (no backend)
import keras_vit
print("version", keras_vit.__version__)
from keras_vit.cli import {module}
try:
    {module}.{entry}()
except SystemExit as done:
    print("exit", done.code)
"""

COMMANDS = [("train", "run"), ("export", "main"), ("tflite", "main"), ("inspect", "main"), ("convert", "main"),
            ("fewshot", "main"), ("masked_digits", "main")]


@pytest.mark.parametrize("module, entry", COMMANDS)
def test_help_works_without_a_keras_backend(module, entry):
    import subprocess
    script = _NO_BACKEND.format(module=module, entry=entry)
    done = subprocess.run([sys.executable, "-c", script, "--help"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"keras-vit-{module.replace('_', '-')}" in done.stdout
    assert "--" in done.stdout and done.stdout.strip().endswith("exit 0")


def test_keras_vit_without_a_backend_names_what_to_install():
    import subprocess
    script = ("import sys\nsys.modules['keras'] = None\nimport keras_vit\nprint(keras_vit.__version__)\n"
              "keras_vit.ViTB16\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 1
    assert done.stdout.strip() == SETUP["version"]
    assert 'ImportError: keras_vit.ViTB16 needs Keras with a backend' in done.stderr
    assert 'pip install "keras_vit[tensorflow]"' in done.stderr


def _uninstall(monkeypatch, distribution_name: str) -> None:
    """Makes `importlib.metadata` report one distribution as not installed."""
    try:
        importlib.metadata.version("keras_vit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("keras_vit is not installed: no declared extras to read")
    real = importlib.metadata.distribution

    def distribution(name):
        if _normalize(name) == distribution_name:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


@pytest.mark.parametrize("module, extra, argv", [
    ("tflite", "export", ["--variant", "Ti/16", "--out", "x"]),
    ("export", "export", ["--variant", "Ti/16", "--out", "x"]),
    ("export", "onnx", ["--variant", "Ti/16", "--out", "x", "--format", "onnx"]),
    ("export", "openvino", ["--variant", "Ti/16", "--out", "x", "--format", "openvino"]),
    ("inspect", "inspect", ["--variant", "Ti/16", "--out", "x", "--image", "a.png"]),
    ("fewshot", "training", ["--variant", "Ti/16"]),
    ("masked_digits", "training", ["--workdir", "x"]),
])
def test_command_without_its_extra_says_which_to_install(module, extra, argv, monkeypatch):
    absent = sorted(EXTRAS[extra] - BASE)[-1]
    _uninstall(monkeypatch, absent)
    command = importlib.import_module(f"keras_vit.cli.{module}")
    with pytest.raises(SystemExit) as done:
        command.main(argv)
    message = str(done.value.code)
    assert "\n" not in message
    assert message.startswith(f"keras-vit-{module.replace('_', '-')} needs keras_vit[{extra}]")
    assert f"missing: {absent}" in message and message.endswith(f'pip install "keras_vit[{extra}]"')


def test_train_without_tensorboard_says_which_extra_to_install(monkeypatch):
    from keras_vit import cli
    _uninstall(monkeypatch, "tensorboard")
    with pytest.raises(SystemExit, match=r'^keras-vit-train needs keras_vit\[training\].*missing: tensorboard.*'
                                         r'pip install "keras_vit\[training\]"$'):
        cli.require("keras-vit-train", "training")


# ---------------------------------------------------------------------------------------
# TensorFlow: any distribution that provides `import tensorflow` (tensorflow, tensorflow-cpu, tensorflow-tpu)
# ---------------------------------------------------------------------------------------

def test_tensorflow_is_declared_only_by_its_extra_and_all():
    """`training` and `export` install beside whichever TensorFlow is there; `[tensorflow]` and `[all]` (the
    README's set-up command) install one; the range cli.require checks is the extra's."""
    tensorflows = {_normalize(name) for name in cli.TENSORFLOW_DISTRIBUTIONS}
    for extra, names in EXTRAS.items():
        if extra not in ("tensorflow", "all", "test"):  # test: tensorflow-serving-api, which needs `tensorflow`
            assert not names & tensorflows, f"keras_vit[{extra}] declares {sorted(names & tensorflows)}"
    assert SETUP["extras_require"]["tensorflow"] == ["tensorflow>=2.19,<3"]
    assert "tensorflow>=2.19,<3" in SETUP["extras_require"]["all"]
    assert cli.TENSORFLOW_RANGE == ((2, 19), (3, 0))
    assert set(cli.TENSORFLOW_EXTRAS) == {"training", "export"}


def _installed_as_setup_declares(monkeypatch, absent: set[str]) -> None:
    """keras_vit's metadata as setup.py declares it now, with the distributions `absent` not installed."""
    requirements = [*SETUP["install_requires"]] + [
        f'{req}; extra == "{extra}"' for extra, reqs in SETUP["extras_require"].items() for req in reqs]
    real_requires, real_distribution = importlib.metadata.requires, importlib.metadata.distribution

    def requires(name):
        return requirements if _normalize(name) == "keras-vit" else real_requires(name)

    def distribution(name):
        if _normalize(name) in absent:
            raise importlib.metadata.PackageNotFoundError(name)
        return real_distribution(name)

    monkeypatch.setattr(importlib.metadata, "requires", requires)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


@pytest.mark.parametrize("command, extra", [("keras-vit-train", "training"), ("keras-vit-export", "export")])
def test_tensorflow_is_checked_by_import_not_by_distribution_name(command, extra, monkeypatch):
    """As on a JAX TPU image: `import tensorflow` works, and the distribution `tensorflow` is not installed."""
    pytest.importorskip("tensorflow")
    _installed_as_setup_declares(monkeypatch, absent={"tensorflow"})
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("tensorflow")
    assert cli.missing_distributions(extra) == []
    cli.require(command, extra)  # does not exit


@pytest.mark.parametrize("command, extra", [("keras-vit-train", "training"), ("keras-vit-export", "export")])
def test_command_without_tensorflow_says_in_one_line_what_to_install(command, extra, monkeypatch):
    _installed_as_setup_declares(monkeypatch, absent=set())
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` fails as where none is installed
    with pytest.raises(SystemExit) as done:
        cli.require(command, extra)
    assert done.value.code == (f"{command} needs TensorFlow (tensorflow, tensorflow-cpu or tensorflow-tpu >= 2.19), "
                               f'which is not installed: pip install "keras_vit[{extra},tensorflow]"')


def test_without_tensorflow_or_the_extra_one_line_names_both(monkeypatch):
    _installed_as_setup_declares(monkeypatch, absent={"tensorflow-datasets", "tensorboard"})
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(SystemExit) as done:
        cli.require("keras-vit-train", "training")
    assert done.value.code == (
        "keras-vit-train needs TensorFlow (tensorflow, tensorflow-cpu or tensorflow-tpu >= 2.19) and "
        "keras_vit[training], which are not installed (missing: tensorflow-datasets, tensorboard): "
        'pip install "keras_vit[training,tensorflow]"')


def test_tensorflow_out_of_range_is_upgraded_where_it_is_installed(monkeypatch):
    """An old tensorflow-tpu is upgraded as tensorflow-tpu: installing `tensorflow` would add a second one."""
    import types
    _installed_as_setup_declares(monkeypatch, absent={"tensorflow"})
    monkeypatch.setitem(sys.modules, "tensorflow", types.SimpleNamespace(__version__="2.15.1"))
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"tensorflow": ["tensorflow-tpu"]})
    with pytest.raises(SystemExit) as done:
        cli.require("keras-vit-train", "training")
    assert done.value.code == ("keras-vit-train needs TensorFlow (tensorflow, tensorflow-cpu or tensorflow-tpu "
                               ">= 2.19), and tensorflow-tpu 2.15.1 is installed: "
                               'pip install -U "tensorflow-tpu>=2.19,<3"')


def test_command_constants_equal_the_library_ones():
    """The parsers spell a few library constants so that --help imports no TensorFlow."""
    from keras_vit import fewshot, kernels
    from keras_vit import inspection as inspect
    from keras_vit.cli import export as export_cli
    from keras_vit.cli import fewshot as fewshot_cli
    from keras_vit.cli import inspect as inspect_cli
    from keras_vit.cli import tflite as tflite_cli
    from keras_vit.cli import train as train_cli
    from keras_vit.export import ALL_MODES, data, serving
    from keras_vit.training import configs, distribute
    assert tflite_cli.MODES == ALL_MODES and tflite_cli.DATASETS == data.DATASETS
    assert (export_cli.DEFAULT_MAX_PIXELS, export_cli.DEFAULT_MAX_BATCH) == (serving.DEFAULT_MAX_PIXELS,
                                                                             serving.DEFAULT_MAX_BATCH)
    assert export_cli.SIGNATURES == serving.EXTRA_SIGNATURES and export_cli.SERVING_KERNELS == kernels.SERVING_KERNELS
    assert inspect_cli.FIGURES == inspect.FIGURES and fewshot_cli.SHOTS == fewshot.SHOTS
    assert set(train_cli.RECIPES) == set(configs.RECIPES) and train_cli.STRATEGIES == distribute.STRATEGIES


def test_import_names_table_is_declared_and_agrees_with_installed_metadata():
    """IMPORT_NAMES names only declared distributions; where one is installed, its metadata agrees (this checks
    the table against the machine, the other tests check the package against the table)."""
    declared = BASE | set().union(*EXTRAS.values()) | KERAS_BACKEND_DISTRIBUTIONS
    assert set(IMPORT_NAMES.values()) <= declared, sorted(set(IMPORT_NAMES.values()) - declared)
    installed = importlib.metadata.packages_distributions()
    for module, distribution in IMPORT_NAMES.items():
        # `import tensorflow` may come from tensorflow-cpu or tensorflow-tpu, which the commands accept too.
        accepted = {_normalize(d) for d in cli.TENSORFLOW_DISTRIBUTIONS} if module == "tensorflow" else {distribution}
        if module in installed:
            assert accepted & {_normalize(d) for d in installed[module]}, (module, installed[module])


def test_unknown_import_name_fails_with_the_table_to_extend():
    with pytest.raises(AssertionError, match=r"x\.py imports 'nonexistent_pkg', which .*IMPORT_NAMES"):
        _distributions({"nonexistent_pkg", "numpy"}, "x.py")
    assert _distributions({"numpy", "os", "torch"}, "x.py") == {"numpy", "torch"}  # the same with or without torch
