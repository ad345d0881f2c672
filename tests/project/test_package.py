"""The package as an application meets it: importing it changes nothing of the process's."""

import importlib
import json
import subprocess
import sys
import zipfile

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


SHIMS = [("keras_vit.weights", "keras_vit.checkpoints.loader"),
         ("keras_vit.torch_checkpoints", "keras_vit.checkpoints.safetensors_file")]


@pytest.fixture(scope="module")
def first_import_warnings() -> dict[str, str]:
    """What the first import of each 0.2 module path warns, in one fresh interpreter (neither imports the other)."""
    script = "import warnings\nwarnings.simplefilter('error', DeprecationWarning)\n" + "".join(
        f"try:\n    import {module}\nexcept DeprecationWarning as warning:\n    print({module!r}, '|', warning)\n"
        for module, _ in SHIMS)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path),
                               "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)


@pytest.mark.parametrize("module, new", SHIMS)
def test_the_0_2_checkpoint_module_paths_warn_and_re_export_keras_vit_checkpoints(module, new, first_import_warnings):
    """`keras_vit.weights` and `keras_vit.torch_checkpoints` stay importable for 0.2 users, with a warning naming
    the new import (a fresh interpreter: the warning comes at the first import)."""
    warning = first_import_warnings[module]
    assert f"{module} is deprecated: import from {new}" in warning
    assert "0.4 removes it." in warning
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
# `import keras_vit` is lazy: the names of 0.2, no Keras until one is used, `.keras` files load as before
# ---------------------------------------------------------------------------------------

# What `from keras_vit import *` gave in 0.2, when `keras_vit/__init__.py` imported them all (and no `__all__`).
PUBLIC_NAMES = [
    "BUILDERS", "BottleneckUnit", "Checkpoint", "ClassToken", "LayerNorm", "LayerScale", "MAPHead", "MaskedPatchHead",
    "MaskedPatchModel", "MlpBlock", "MultiHeadDotProductAttention", "PatchCorruption", "PatchEncoder", "PatchTargets",
    "PatchTokens", "Patches", "PositionEmbedding", "R26ViTS32", "R50ViTB16", "R50ViTL32", "RegisterTokens",
    "StdConv2D", "StochasticDepth", "TokenGrid", "TokenPooling", "TransformerBlock", "VARIANTS", "ViTB16", "ViTB32",
    "ViTB8", "ViTConfig", "ViTH14", "ViTL16", "ViTL32", "ViTModel", "ViTS16", "ViTS32", "ViTTi16",
    "VisionTransformer", "attention_model", "checkpoints", "decode_predictions", "decode_variant", "features",
    "features_model", "head_rows", "head_rows_model", "imagenet", "kernels", "layers", "list_weights", "load_weights",
    "masked", "masked_patch_loss", "masked_patch_model", "models", "patch_targets", "preprocess_input", "read_npz",
    "resample_position_embedding", "resnet", "transfer_encoder_weights", "variants", "vit_model"]
ADDED_IN_0_3 = ["PreprocessingConfig", "RotaryPositionEmbedding"]


def test_the_public_names_are_those_of_0_2_and_each_is_what_its_module_defines():
    import keras_vit
    from keras_vit import checkpoints, layers, models, vit_model
    assert keras_vit.__all__ == sorted(PUBLIC_NAMES + ADDED_IN_0_3)
    namespace = {}
    exec("from keras_vit import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(PUBLIC_NAMES + ADDED_IN_0_3)
    assert set(PUBLIC_NAMES + ADDED_IN_0_3) | {"__version__"} <= set(dir(keras_vit))
    assert keras_vit.load_weights is checkpoints.loader.load and keras_vit.layers is layers
    assert keras_vit.ViTB16 is models.ViTB16 and keras_vit.ViTModel is vit_model.ViTModel
    assert keras_vit.PatchEncoder is keras_vit.layers.PatchEncoder
    with pytest.raises(AttributeError, match="has no attribute 'ViTB99'"):
        keras_vit.ViTB99
    with pytest.warns(DeprecationWarning, match="keras_vit.inspect is now keras_vit.inspection.*0.4 removes"):
        assert keras_vit.inspect is importlib.import_module("keras_vit.inspection")


def test_import_keras_vit_imports_no_keras():
    script = ("import sys\nimport keras_vit\nprint(keras_vit.__version__, sorted({name.split('.')[0] for name in "
              "sys.modules} & {'keras', 'tensorflow', 'jax', 'torch'}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path)})
    import keras_vit
    assert done.stdout.split() == [keras_vit.__version__, "[]"]


# Each loads tests/data/vit_0_2_0.keras with nothing but `keras.saving.load_model` after these imports.
_LOAD_AFTER = """
import importlib, json, pkgutil, sys, warnings
{imports}
import numpy as np
path, io = sys.argv[1], np.load(sys.argv[2])
registered = sorted(name for name in keras.saving.get_custom_objects() if name.startswith("keras_vit>"))
loaded = keras.saving.load_model(path)
assert type(loaded).__name__ == "ViTModel", type(loaded)
np.testing.assert_allclose(loaded.predict(io["images"], verbose=0), io["embeddings"], rtol=0, atol=1e-5)
import keras_vit
warnings.simplefilter("ignore", DeprecationWarning)
for module in pkgutil.walk_packages(keras_vit.__path__, "keras_vit."):  # every Keras class of the library
    if module.name.split(".")[1] not in ("cli", "training", "export"):
        importlib.import_module(module.name)
every = sorted(name for name in keras.saving.get_custom_objects() if name.startswith("keras_vit>"))
print(json.dumps({{"registered": registered, "every": every}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("imports", ["import keras_vit\nimport keras", "import keras\nimport keras_vit",
                                     "from keras_vit.layers import PatchEncoder\nimport keras"],
                         ids=["keras_vit_then_keras", "keras_then_keras_vit", "a_submodule_first"])
def test_a_keras_file_loads_after_a_bare_import_keras_vit(imports):
    """`import keras_vit` imports no Keras, yet registers every Keras class of keras_vit as soon as Keras is imported
    (before or after it), as 0.2 did by importing everything: a `.keras` file then loads without `custom_objects`."""
    import keras
    from pathlib import Path
    data = Path(__file__).parents[1] / "data"
    with zipfile.ZipFile(data / "vit_0_2_0.keras") as archive:
        written_by = json.loads(archive.read("metadata.json"))["keras_version"]
    if tuple(map(int, keras.__version__.split(".")[:3])) < tuple(map(int, written_by.split(".")[:3])):
        pytest.skip(f"written by Keras {written_by}, whose configs Keras {keras.__version__} cannot read")
    done = subprocess.run([sys.executable, "-c", _LOAD_AFTER.format(imports=imports), str(data / "vit_0_2_0.keras"),
                           str(data / "vit_0_2_0_io.npz")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(sys.path),
                               "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert names["registered"] == names["every"] and len(names["every"]) > 20


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
