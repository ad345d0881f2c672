"""The 0.2 module path of the timm / Hugging Face `.safetensors` support, kept for existing imports: it
re-exports from `keras_vit.checkpoints` (reading in `safetensors_file`, the layouts and their translation
in `torch_layout`); conversion is `keras_vit.convert`. New code imports those modules; importing this one warns
(DeprecationWarning), and 0.4 removes it."""

from __future__ import annotations

import warnings

from keras_vit.checkpoints.safetensors_file import (PICKLE_HINT, PICKLE_SUFFIXES, TensorInfo, read_header,
                                                    read_safetensors, refuse_pickle)
from keras_vit.checkpoints.torch_layout import (HUGGING_FACE, NUMERICS, TIMM, Translation, check_supported,
                                                detect_layout, hf_prefix, translate, weight_sources)

__all__ = ["HUGGING_FACE", "NUMERICS", "PICKLE_HINT", "PICKLE_SUFFIXES", "TIMM", "TensorInfo", "Translation",
           "check_supported", "convert_safetensors", "detect_layout", "hf_prefix", "read_header", "read_safetensors",
           "refuse_pickle", "translate", "weight_sources"]


def convert_safetensors(checkpoint: str, output: str, *, variant: str | None = None, num_heads: int | None = None,
                        image_size: tuple[int, int] | None = None) -> float:
    """`keras_vit.convert.convert_checkpoint` for a `.safetensors` file (the 0.2 name); returns the difference."""
    from keras_vit.convert import convert_checkpoint

    return convert_checkpoint(checkpoint, output, variant=variant, num_heads=num_heads, image_size=image_size)[1]


warnings.warn("keras_vit.torch_checkpoints is deprecated: import from keras_vit.checkpoints.safetensors_file and "
              "keras_vit.checkpoints.torch_layout instead, and convert with keras_vit.convert.convert_checkpoint; 0.4 "
              "removes it.",
              DeprecationWarning, stacklevel=2)
