"""Pretrained weights: placeholder until the weights module lands."""

from __future__ import annotations

import os


def resolve(weights, *, variant, image_shape, include_top, classes):
    if weights is None:
        return None
    if isinstance(weights, str) and os.path.exists(weights):
        return weights
    raise ValueError(f"Unknown weights {weights!r}.")


def load(model, source, *, representation_size=None):
    model.load_weights(source)
