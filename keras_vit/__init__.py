"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3 on TensorFlow."""

import logging
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def _configure_logging() -> None:
    """Shows keras_vit's one-line INFO messages (resized position embeddings, replaced heads)
    on stderr. Silence with `logging.getLogger("keras_vit").setLevel(logging.WARNING)`."""
    logger = logging.getLogger("keras_vit")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("keras_vit: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


_configure_logging()

from keras_vit.imagenet import decode_predictions, preprocess_input  # noqa: E402
from keras_vit.layers import (ClassToken, LayerNorm, MlpBlock, MultiHeadDotProductAttention,  # noqa: E402
                              PatchEncoder, Patches, PositionEmbedding, StochasticDepth, TokenPooling,
                              TransformerBlock)
from keras_vit.masked import (MaskedPatchHead, MaskedPatchModel, PatchCorruption, PatchTargets,  # noqa: E402
                               PatchTokens, masked_patch_loss, masked_patch_model, patch_targets,
                               transfer_encoder_weights)
from keras_vit.models import (BUILDERS, R26ViTS32, R50ViTB16, R50ViTL32, ViTB8, ViTB16, ViTB32,  # noqa: E402
                              ViTH14, ViTL16, ViTL32, ViTS16, ViTS32, ViTTi16, VisionTransformer,
                              ViTModel, attention_model)
from keras_vit.resnet import BottleneckUnit, StdConv2D  # noqa: E402
from keras_vit.variants import VARIANTS, decode_variant  # noqa: E402
from keras_vit.weights import (Checkpoint, list_weights, read_npz, resample_position_embedding,  # noqa: E402
                               load as load_weights)

__version__ = "0.1.0"
