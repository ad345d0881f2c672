"""Training keras_vit models with `model.fit`: recipes, input pipelines, strategies, checkpoints.

`python -m training.train --help` is the command line; `train_and_evaluate(config, workdir)` the API.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from training.configs import Config, apply_overrides, get_config  # noqa: E402
from training.distribute import get_strategy  # noqa: E402
from training.trainer import NaNLossError, build_model, train_and_evaluate  # noqa: E402

__all__ = ["Config", "NaNLossError", "apply_overrides", "build_model", "get_config", "get_strategy",
           "train_and_evaluate"]
