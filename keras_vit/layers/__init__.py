"""Vision Transformer layers (Dosovitskiy et al., ICLR 2021, arXiv:2010.11929).

Ported from the original implementation, google-research/vision_transformer
(`vit_jax/models_vit.py`). Sublayers and weights are named after the modules of the
released checkpoints (`embedding`, `cls`, `pos_embedding`, `LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3/Dense_0`, ...), so that a
checkpoint maps onto a model by a table of names.

Numerics follow the original by default: LayerNorm epsilon 1e-6, tanh-approximate GELU (Flax
`nn.gelu`), attention scaled by 1/sqrt(head_dim), pre-norm residual blocks. The epsilon and the
GELU are options (`layer_norm_epsilon`, `gelu_approximate`) for checkpoints of PyTorch models
(timm, Hugging Face), which use the exact erf GELU.

Two modules: `tokens` (images to tokens, prefix tokens, position embeddings, among them the rotary one whose
angles a RoPE model's attention rotates q and k by, pooling) and `encoder` (the Transformer blocks and their parts,
the attention-pooling head); `naflex` holds NaFlex's position table resized per image (SigLIP 2). Every name is
importable from here.
"""

from keras_vit.layers.encoder import (ACTIVATIONS, LAYER_NORM_EPSILON, Dense, HeadProjection, LayerNorm, LayerScale,
                                      MAPHead, MlpBlock, MultiHeadDotProductAttention, StochasticDepth,
                                      TransformerBlock, transformer_blocks)
from keras_vit.layers.naflex import NaFlexPositionEmbedding, antialiased_bilinear_weights
from keras_vit.layers.tokens import (POOLINGS, POSITION_EMBEDDINGS, ClassToken, PatchEncoder, Patches,
                                     PositionEmbedding, RegisterTokens, RotaryPositionEmbedding, TokenPooling,
                                     apply_rotary, extract_patches, patch_grid, rotate_half,
                                     sincos_2d_position_embedding, to_pair)

__all__ = ["ACTIVATIONS", "LAYER_NORM_EPSILON", "POOLINGS", "POSITION_EMBEDDINGS", "ClassToken", "Dense",
           "HeadProjection", "LayerNorm", "LayerScale", "MAPHead", "MlpBlock", "MultiHeadDotProductAttention",
           "NaFlexPositionEmbedding", "PatchEncoder", "Patches", "PositionEmbedding", "RegisterTokens",
           "RotaryPositionEmbedding", "StochasticDepth", "TokenPooling", "TransformerBlock",
           "antialiased_bilinear_weights", "apply_rotary", "extract_patches", "patch_grid", "rotate_half",
           "sincos_2d_position_embedding", "to_pair", "transformer_blocks"]
