"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3.

Keras needs a backend (TensorFlow, JAX or PyTorch). Without one, `import keras_vit` still works, so that
`keras_vit.__version__` and every command's `--help` do; any other name then raises an ImportError that says
what to install.
"""

from keras_vit._version import __version__

try:
    import keras as _keras  # noqa: F401  (fails when no backend is installed)
except ImportError as _error:
    _BACKEND_ERROR = _error

    def __getattr__(name: str):
        raise ImportError(f"keras_vit.{name} needs Keras with a backend, and Keras could not be imported "
                          f"({_BACKEND_ERROR}). Install one: pip install \"keras_vit[tensorflow]\" (or JAX or "
                          "PyTorch, with KERAS_BACKEND set).") from _BACKEND_ERROR
else:
    from keras_vit.checkpoints.loader import load as load_weights
    from keras_vit.checkpoints.npz import read_npz, resample_position_embedding
    from keras_vit.checkpoints.registry import Checkpoint, list_weights
    from keras_vit.features import TokenGrid, attention_model, features_model
    from keras_vit.head_rows import head_rows_model
    from keras_vit.imagenet import decode_predictions, preprocess_input
    from keras_vit.layers import (ClassToken, LayerNorm, LayerScale, MAPHead, MlpBlock, MultiHeadDotProductAttention,
                                  PatchEncoder, Patches, PositionEmbedding, RegisterTokens, StochasticDepth,
                                  TokenPooling, TransformerBlock)
    from keras_vit.masked import (MaskedPatchHead, MaskedPatchModel, PatchCorruption, PatchTargets,
                                  PatchTokens, masked_patch_loss, masked_patch_model, patch_targets,
                                  transfer_encoder_weights)
    from keras_vit.models import (BUILDERS, R26ViTS32, R50ViTB16, R50ViTL32, ViTB8, ViTB16, ViTB32,
                                  ViTH14, ViTL16, ViTL32, ViTS16, ViTS32, ViTTi16, VisionTransformer,
                                  ViTModel)
    from keras_vit.resnet import BottleneckUnit, StdConv2D
    from keras_vit.variants import VARIANTS, ViTConfig, decode_variant

    def __getattr__(name: str):
        """`keras_vit.inspect`, the 0.2 name of `keras_vit.inspection` (it shadowed the standard library's
        `inspect`): `from keras_vit import inspect` still works, with a DeprecationWarning."""
        if name == "inspect":
            import importlib
            import warnings

            warnings.warn("keras_vit.inspect is now keras_vit.inspection: import that (from keras_vit import "
                          "inspection); 0.4 removes the old name.", DeprecationWarning, stacklevel=2)
            return importlib.import_module("keras_vit.inspection")
        raise AttributeError(f"module 'keras_vit' has no attribute {name!r}")
