"""The package as an application meets it: importing it changes nothing of the process's."""

import json
import subprocess
import sys

import pytest

_SNAPSHOT = """
import json, logging, os, sys
import keras

def state():
    package = logging.getLogger("keras_vit")
    return {"environ": dict(os.environ), "root_handlers": [repr(h) for h in logging.root.handlers],
            "root_level": logging.root.level, "handlers": [repr(h) for h in package.handlers],
            "level": package.level, "propagate": package.propagate}

before = state()
import keras_vit
print(json.dumps({"before": before, "after": state()}))
"""


@pytest.mark.slow
def test_import_leaves_logging_and_environment_as_they_were():
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT], check=True, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": ":".join(sys.path)}).stdout
    states = json.loads(out.strip().splitlines()[-1])
    assert "KERAS_BACKEND" not in states["after"]["environ"]
    assert states["after"] == states["before"]


@pytest.mark.slow
def test_library_modules_import_without_plotting_image_or_dataset_packages():
    """matplotlib, Pillow and scikit-learn are needed only to draw, read image files or load the digits."""
    script = ("import sys\n"
              "for name in ('matplotlib', 'PIL', 'sklearn'):\n"
              "    sys.modules[name] = None  # any import of them raises ImportError\n"
              "import keras_vit, keras_vit.inspection, keras_vit.fewshot, keras_vit.convert, keras_vit.datasets\n"
              "import keras_vit.torch_checkpoints, keras_vit.weights\n"
              "try:\n"
              "    keras_vit.datasets.digits()\n"
              "except ImportError as error:\n"
              "    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "The digits ship with scikit-learn: `pip install scikit-learn`."


@pytest.mark.parametrize("module, new", [("keras_vit.weights", "keras_vit.checkpoints.loader"),
                                         ("keras_vit.torch_checkpoints", "keras_vit.checkpoints.safetensors_file")])
def test_the_0_2_checkpoint_module_paths_warn_and_re_export_keras_vit_checkpoints(module, new):
    """`keras_vit.weights` and `keras_vit.torch_checkpoints` stay importable for 0.2 users, with a warning naming
    the new import (a fresh interpreter: the warning comes at the first import)."""
    script = (f"import warnings\nwarnings.simplefilter('error', DeprecationWarning)\n"
              f"try:\n    import {module}\nexcept DeprecationWarning as warning:\n    print(warning)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path),
                               "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{module} is deprecated: import from {new}" in done.stdout
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module(module)
    import keras_vit.convert
    from keras_vit.checkpoints import loader, npz, registry, safetensors_file, torch_layout
    if module == "keras_vit.weights":
        assert (old.load, old.resolve, old.KEY_TABLE, old.fetch) == (loader.load, loader.resolve, npz.KEY_TABLE,
                                                                     registry.fetch)
    else:
        assert (old.read_safetensors, old.translate) == (safetensors_file.read_safetensors, torch_layout.translate)
        assert callable(old.convert_safetensors)
        with pytest.warns(DeprecationWarning, match="convert_npz is deprecated: call convert_checkpoint .*0.4 "
                                                    "removes"), pytest.raises(FileNotFoundError):
            keras_vit.convert.convert_npz("no_such.npz", "out.weights.h5")


# ---------------------------------------------------------------------------------------
# Names that are easy to confuse: the error says which one to use
# ---------------------------------------------------------------------------------------

def _tiny(**kwargs):
    import keras_vit
    from tests.testing import TINY_VIT
    return keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classes=3, **kwargs)


def test_gap_and_avg_errors_name_the_other_spelling():
    import pytest
    with pytest.raises(ValueError, match=r"Unknown classifier 'avg'.*spelled classifier='gap'"):
        _tiny(classifier="avg")
    with pytest.raises(ValueError, match=r"Unknown pooling 'gap'.*spelled pooling='avg'"):
        _tiny(include_top=False, pooling="gap")


def test_model_load_weights_of_a_checkpoint_points_to_keras_vit_load_weights(tmp_path):
    import numpy as np
    import pytest
    import keras_vit
    model = _tiny()
    checkpoint = tmp_path / "ViT-Ti_16.npz"
    np.savez(checkpoint, **{"embedding/bias": np.zeros(48, "float32")})
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match=r"use `keras_vit.load_weights\(model, path\)`"):
        model.load_weights(str(checkpoint))
    model.save(tmp_path / "model.keras")
    with pytest.raises(ValueError, match=r"is a whole Keras model.*keras.saving.load_model"):
        keras_vit.load_weights(model, str(tmp_path / "model.keras"))
    with pytest.raises(ValueError, match=r"is a whole Keras model"):
        _tiny(weights=str(tmp_path / "model.keras"))
    for old, new in zip(before, model.weights):
        np.testing.assert_array_equal(old, new.numpy())
