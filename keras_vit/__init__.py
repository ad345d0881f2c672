"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3.

`import keras_vit` imports no Keras: each name below imports its module at first use (PEP 562), so that
`keras_vit.__version__` and every command's `--help` are instant, and work without a Keras backend (with none, a
name raises an ImportError that says what to install).

A `.keras` file names keras_vit's layers and models by their registered names, which exist once their modules
are imported. So as soon as Keras is imported, before or after keras_vit, keras_vit imports them (`_register`):
`keras.saving.load_model` reads a keras_vit model after a bare `import keras_vit`, as it did when this file
imported everything.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys

from keras_vit import _version

__version__ = _version.__version__

# The public names, by the module that defines them (`load_weights` is `keras_vit.checkpoints.loader.load`).
_MODULES = {
    "keras_vit.checkpoints.loader": ("load_weights",),
    "keras_vit.checkpoints.npz": ("read_npz", "resample_position_embedding"),
    "keras_vit.checkpoints.registry": ("Checkpoint", "list_weights"),
    "keras_vit.features": ("TokenGrid", "attention_model", "features_model"),
    "keras_vit.head_rows": ("head_rows_model",),
    "keras_vit.imagenet": ("decode_predictions", "preprocess_input"),
    "keras_vit.layers": ("ClassToken", "LayerNorm", "LayerScale", "MAPHead", "MlpBlock",
                         "MultiHeadDotProductAttention", "PatchEncoder", "Patches", "PositionEmbedding",
                         "RegisterTokens", "RotaryPositionEmbedding", "StochasticDepth", "TokenPooling",
                         "TransformerBlock"),
    "keras_vit.masked": ("MaskedPatchHead", "MaskedPatchModel", "PatchCorruption", "PatchTargets", "PatchTokens",
                         "masked_patch_loss", "masked_patch_model", "patch_targets", "transfer_encoder_weights"),
    "keras_vit.models": ("BUILDERS", "R26ViTS32", "R50ViTB16", "R50ViTL32", "ViTB8", "ViTB16", "ViTB32", "ViTH14",
                         "ViTL16", "ViTL32", "ViTS16", "ViTS32", "ViTTi16", "VisionTransformer", "ViTModel"),
    "keras_vit.resnet": ("BottleneckUnit", "StdConv2D"),
    "keras_vit.variants": ("VARIANTS", "PreprocessingConfig", "ViTConfig", "decode_variant"),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}
_ALIASES = {"load_weights": "load"}
# The submodules that `import keras_vit` made attributes of the package when it imported everything.
_SUBMODULES = ("checkpoints", "features", "head_rows", "imagenet", "kernels", "layers", "masked", "models", "resnet",
               "variants", "vit_model")
# What `from keras_vit import *` gives: the names it gave when this file imported them (no `__all__` then).
__all__ = sorted([*_MODULE_OF, *_SUBMODULES])
# The modules whose import registers every Keras class of keras_vit (`register_keras_serializable`; tests/
# test_package.py checks that no class is left out).
_REGISTERING = ("keras_vit.layers", "keras_vit.kernels.routed_layers", "keras_vit.vit_model", "keras_vit.features",
                "keras_vit.masked", "keras_vit.resnet", "keras_vit.models")


def __getattr__(name: str):
    if name == "inspect":  # The 0.2 name of keras_vit.inspection (it shadowed the standard library's `inspect`).
        import warnings

        warnings.warn("keras_vit.inspect is now keras_vit.inspection: import that (from keras_vit import "
                      "inspection); 0.4 removes the old name.", DeprecationWarning, stacklevel=2)
        return importlib.import_module("keras_vit.inspection")
    if name not in _MODULE_OF and name not in _SUBMODULES:
        raise AttributeError(f"module 'keras_vit' has no attribute {name!r}")
    try:
        module = importlib.import_module(_MODULE_OF.get(name, f"{__name__}.{name}"))
    except ImportError as error:
        try:
            importlib.import_module("keras")
        except ImportError as no_backend:
            raise ImportError(f"keras_vit.{name} needs Keras with a backend, and Keras could not be imported "
                              f"({no_backend}). Install one: pip install \"keras_vit[tensorflow]\" (or JAX or "
                              "PyTorch, with KERAS_BACKEND set).") from no_backend
        raise error
    value = getattr(module, _ALIASES.get(name, name)) if name in _MODULE_OF else module
    globals()[name] = value
    _register()
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_registered = False
_importing: set[str] = set()  # keras and keras_vit modules whose import has started and not yet ended


def _register() -> None:
    """Imports `_REGISTERING` once Keras is imported and no import of keras or of a keras_vit module is half-way
    (`_importing`, kept by `_RegisterAfterImport`), so that no import cycle meets a half-defined module."""
    global _registered
    if _registered or sys.modules.get("keras") is None or _importing:
        return
    _registered = True
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterAfterImport)]
    for module in _REGISTERING:
        importlib.import_module(module)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Calls `_register` after the import of `keras` or of one of keras_vit's modules runs to its end, until it
    has registered; sees no other import. It finds nothing itself: it wraps the `exec_module` of the file loader
    that the other finders give for these modules (one loader per module)."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras" and not name.startswith(f"{__name__}."):
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find_spec(name, path, target) if find_spec else None
            if spec is not None:
                break
        else:
            return None
        if isinstance(spec.loader, (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)):
            run = spec.loader.exec_module

            def exec_module(module):
                _importing.add(module.__name__)
                try:
                    run(module)
                finally:
                    _importing.discard(module.__name__)
                _register()

            spec.loader.exec_module = exec_module
        return spec


if sys.modules.get("keras") is not None:
    _register()
else:
    sys.meta_path.insert(0, _RegisterAfterImport())
