"""The command lines of keras_vit, one module per console script (installed with the package):

    keras-vit-train          training/ recipes: tf.distribute, or keras.distribution on JAX (`keras_vit.cli.train`)
    keras-vit-export         a TF Serving SavedModel (`keras_vit.cli.export`)
    keras-vit-tflite         verified LiteRT files (`keras_vit.cli.tflite`)
    keras-vit-inspect        the paper's inspection figures (`keras_vit.cli.inspect`)
    keras-vit-convert        checkpoints to Keras weights files (`keras_vit.cli.convert`)
    keras-vit-fewshot        linear few-shot accuracy on the embedded digits (`keras_vit.cli.fewshot`)
    keras-vit-masked-digits  does masked patch pre-training help? (`keras_vit.cli.masked_digits`)

`python -m keras_vit.cli.<name>` runs the same. The flags that pick a model are the same everywhere
(`common.add_model_arguments`). Nothing here is imported by `import keras_vit`.

Each command's `--help` is instant and works on the base install (`pip install keras_vit`, no backend): `import
keras_vit` imports no Keras, and the parsers import nothing heavy (tests/tools/test_cli.py checks that no Keras,
TensorFlow or JAX is imported). `main` first calls `require(command, extra)`, which ends the run with one line
naming the extra to install when a distribution of that extra (as the installed package declares it) or a Keras
backend is missing, instead of an ImportError traceback. Bad input (a ValueError or OSError: an unknown variant, a
missing file) ends a command with `<command>: error: <message>` (`error_line`) and exit status 1, and Ctrl-C with
one line and exit status 130 (`one_line_exits`; `keras-vit-train`'s own handlers end its errors with the same line,
and its Ctrl-C line says how to resume), not a traceback. `KERAS_VIT_TRACEBACK=1` shows the traceback of such an
error instead.

TensorFlow, which the `training` and `export` extras run on, is checked by import, not by distribution name:
those extras do not declare it (the `tensorflow` extra does), so that they install beside the TensorFlow an
image already has, whichever distribution provides it (`tensorflow`, `tensorflow-cpu` on JAX TPU images,
`tensorflow-tpu` on TPU VMs), instead of adding a second one over it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import sys
from typing import Callable, Sequence


def missing_distributions(extra: str) -> list[str]:
    """The distributions that the installed keras_vit declares for `extra` and that are not installed.

    Empty for a source tree that was never installed (no metadata to read).
    """
    try:
        requirements = importlib.metadata.requires("keras_vit") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    in_extra = re.compile(rf"""extra\s*==\s*['"]{re.escape(extra)}['"]""")
    names = [re.match(r"[A-Za-z0-9._-]+", req).group(0) for req in requirements if in_extra.search(req)]
    missing = []
    for name in names:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


# The extras whose commands run on TensorFlow, which they leave to the environment (or to `[tensorflow]`).
TENSORFLOW_EXTRAS = ("training", "export")
# The distributions that provide `import tensorflow`, and the range of setup.py's `tensorflow` extra.
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu")
TENSORFLOW_RANGE = ((2, 19), (3, 0))
_TENSORFLOW = "TensorFlow (tensorflow, tensorflow-cpu or tensorflow-tpu >= 2.19)"


def tensorflow_problem() -> tuple[str, str | None] | None:
    """None when `import tensorflow` works and its version is in range; else (what is wrong, what to run), with
    None to run when no TensorFlow is installed (the `tensorflow` extra brings one). One out of range is upgraded
    as the distribution that provides it, never joined by a second one."""
    try:
        import tensorflow as tf
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name == "tensorflow":
            return "which is not installed", None
        return f"which does not import ({(str(error).splitlines() or [''])[0]})", "reinstall it"
    version = getattr(tf, "__version__", "")
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and TENSORFLOW_RANGE[0] <= (int(match.group(1)), int(match.group(2))) < TENSORFLOW_RANGE[1]:
        return None
    provider = (importlib.metadata.packages_distributions().get("tensorflow") or ["tensorflow"])[0]
    return f"and {provider} {version} is installed", f'pip install -U "{provider}>=2.19,<3"'


def require(command: str, extra: str | None) -> None:
    """Exits with one line saying what to install if `extra`, its TensorFlow, or a Keras backend is missing."""
    missing = missing_distributions(extra) if extra else []
    problem = tensorflow_problem() if extra in TENSORFLOW_EXTRAS else None
    if problem and problem[1] is None:
        what = f"{_TENSORFLOW}, which is not installed"
        if missing:
            what = f"{_TENSORFLOW} and keras_vit[{extra}], which are not installed (missing: {', '.join(missing)})"
        raise SystemExit(f"{command} needs {what}: pip install \"keras_vit[{extra},tensorflow]\"")
    if missing:
        raise SystemExit(f"{command} needs keras_vit[{extra}], which is not fully installed (missing: "
                         f"{', '.join(missing)}): pip install \"keras_vit[{extra}]\"")
    if problem:
        raise SystemExit(f"{command} needs {_TENSORFLOW}, {problem[0]}: {problem[1]}")
    try:
        importlib.import_module("keras")  # needs a backend
    except ImportError as error:
        raise SystemExit(f"{command} needs Keras with a backend ({error}): pip install \"keras_vit[tensorflow]\" "
                         "(or JAX or PyTorch, with KERAS_BACKEND set)") from None


# The errors of bad input (a value out of range, an unknown name, a file that is missing or does not fit), whose
# messages say what was wrong and what was expected: one line is more use than a traceback.
INPUT_ERRORS = (ValueError, OSError)
# Set (to anything but "" or "0") for the traceback of an input error instead of its one line.
TRACEBACK_VARIABLE = "KERAS_VIT_TRACEBACK"


def wants_traceback() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")


def error_line(command: str, error: BaseException) -> str:
    """The one line that ends `command` on `error`: `"<command>: error: <message>"`, argparse's own form."""
    return f"{command}: error: {error}"


def one_line_exits(command: str, interrupt_note: str = "") -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorates a command's `main`: an input error (`INPUT_ERRORS`) ends it with `"<command>: error: <message>"`
    and exit status 1; Ctrl-C (KeyboardInterrupt) with `"<command>: interrupted."` and `interrupt_note`, and exit
    status 130, as a shell reports SIGINT."""
    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> int:
            try:
                return main(argv)
            except KeyboardInterrupt:
                print(" ".join(filter(None, [f"{command}: interrupted.", interrupt_note])), file=sys.stderr)
                raise SystemExit(130) from None
            except INPUT_ERRORS as error:
                if wants_traceback():
                    raise
                print(error_line(command, error), file=sys.stderr)
                raise SystemExit(1) from None
        return run
    return decorate


# The note of the commands that write their files atomically (moved into place once whole).
NOTHING_HALF_WRITTEN = "No file is left half-written."
