"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3."""

from keras_vit.imagenet import decode_predictions, preprocess_input
from keras_vit.layers import (ClassToken, LayerNorm, MlpBlock, MultiHeadDotProductAttention,
                              PatchEncoder, Patches, PositionEmbedding, StochasticDepth, TokenPooling,
                              TransformerBlock)
from keras_vit.masked import (MaskedPatchHead, MaskedPatchModel, PatchCorruption, PatchTargets,
                               PatchTokens, masked_patch_loss, masked_patch_model, patch_targets,
                               transfer_encoder_weights)
from keras_vit.models import (BUILDERS, R26ViTS32, R50ViTB16, R50ViTL32, ViTB8, ViTB16, ViTB32,
                              ViTH14, ViTL16, ViTL32, ViTS16, ViTS32, ViTTi16, VisionTransformer,
                              ViTModel, attention_model)
from keras_vit.resnet import BottleneckUnit, StdConv2D
from keras_vit.variants import VARIANTS, decode_variant
from keras_vit.weights import (Checkpoint, list_weights, read_npz, resample_position_embedding,
                               load as load_weights)

__version__ = "0.1.0"

