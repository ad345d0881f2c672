"""The 0.2 module path of the pretrained-weights code, kept for existing imports: it re-exports from
`keras_vit.checkpoints` (registry and download in `registry`, the `.npz` layout in `npz`, loading in
`loader`). New code imports those modules; importing this one warns (DeprecationWarning), and 0.4 removes it."""

import warnings

from keras_vit.checkpoints.loader import WeightsSource, load, plan_assignments, resolve
from keras_vit.checkpoints.npz import KEY_TABLE, keras_path, read_npz, resample_position_embedding
from keras_vit.checkpoints.registry import (IMAGENET21K_CLASSES, IMAGENET_CLASSES, REGISTRY, Checkpoint, fetch,
                                            list_weights)

__all__ = ["Checkpoint", "IMAGENET21K_CLASSES", "IMAGENET_CLASSES", "KEY_TABLE", "REGISTRY", "WeightsSource", "fetch",
           "keras_path", "list_weights", "load", "plan_assignments", "read_npz", "resample_position_embedding",
           "resolve"]

warnings.warn("keras_vit.weights is deprecated: import from keras_vit.checkpoints.loader, keras_vit.checkpoints.npz "
              "and keras_vit.checkpoints.registry instead (or keras_vit.load_weights); 0.4 removes it.",
              DeprecationWarning, stacklevel=2)
