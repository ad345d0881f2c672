"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3 on TensorFlow."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_vit.imagenet import decode_predictions, preprocess_input  # noqa: E402
from keras_vit.layers import (ClassToken, MlpBlock, PatchEncoder, Patches, PositionEmbedding,  # noqa: E402
                              StochasticDepth, TokenPooling, TransformerBlock)
from keras_vit.models import (BUILDERS, R26ViTS32, R50ViTB16, R50ViTL32, ViTB8, ViTB16, ViTB32,  # noqa: E402
                              ViTH14, ViTL16, ViTL32, ViTS16, ViTS32, ViTTi16, VisionTransformer,
                              attention_model)
from keras_vit.resnet import BottleneckUnit, StdConv2D  # noqa: E402
from keras_vit.variants import VARIANTS, decode_variant  # noqa: E402
from keras_vit.weights import (Checkpoint, list_weights, read_npz, resample_position_embedding,  # noqa: E402
                               load as load_weights)

__version__ = "0.1.0"
