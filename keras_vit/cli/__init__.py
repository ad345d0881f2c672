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

Each command's `--help` works on the base install (`pip install keras_vit`, no backend): the parsers import
nothing heavy. `main` first calls `require(command, extra)`, which ends the run with one line naming the extra
to install when a distribution of that extra (as the installed package declares it) or a Keras backend is
missing, instead of an ImportError traceback.
"""

from __future__ import annotations

import importlib.metadata
import re


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


def require(command: str, extra: str | None) -> None:
    """Exits with one line saying what to install if `extra` or a Keras backend is missing."""
    missing = missing_distributions(extra) if extra else []
    if missing:
        raise SystemExit(f"{command} needs keras_vit[{extra}], which is not fully installed (missing: "
                         f"{', '.join(missing)}): pip install \"keras_vit[{extra}]\"")
    try:
        import keras  # noqa: F401  (needs a backend)
    except ImportError as error:
        raise SystemExit(f"{command} needs Keras with a backend ({error}): pip install \"keras_vit[tensorflow]\" "
                         "(or JAX or PyTorch, with KERAS_BACKEND set)") from None

