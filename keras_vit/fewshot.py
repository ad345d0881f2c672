"""Linear few-shot evaluation of frozen features (arXiv:2010.11929, Sec. 4, Fig. 4).

The paper's few-shot accuracies fit a linear map from frozen pre-logit features of k
examples per class onto {-1, 1}^K targets by regularized least squares, in closed form,
and report the accuracy of its argmax on a test split. `digits_accuracy` runs it on the
embedded digits; the command line is `keras-vit-fewshot`.
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np

from keras_vit import datasets
from keras_vit.geometry import model_geometry
from keras_vit.vit_model import ViTModel

SHOTS = (1, 5, 10, 25)


def feature_extractor(model: keras.Model) -> keras.Model:
    """A model (sharing `model`'s weights) that returns its pre-logit features (`model_geometry(model).pooled`):
    the head's input, the features `include_top=False` with pooling would give."""
    pooled = model_geometry(model).pooled
    if pooled is None:
        raise ValueError(f"Model {model.name!r} outputs tokens, not pooled features to take: build it with "
                         "include_top=True, or include_top=False and pooling='token', 'avg' or 'map'.")
    return ViTModel(model.input, pooled, name=f"{model.name}_features")


def sample_few_shot(labels: np.ndarray, shots: int, seed: int = 0) -> np.ndarray:
    """Indices of `shots` randomly chosen examples of every class in `labels`."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    chosen = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        if len(members) < shots:
            raise ValueError(f"Class {label} has {len(members)} examples; expected at least shots={shots}.")
        chosen.append(rng.choice(members, shots, replace=False))
    return np.concatenate(chosen)


def fit_least_squares(features: np.ndarray, labels: np.ndarray, num_classes: int,
                      l2_reg: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form ridge regression of features onto {-1, 1}^K one-vs-rest targets.

    Solves `W = (X^T X + l2_reg I)^-1 X^T Y` on centred features X, with an unregularized
    bias. Returns `(W, b)`, shapes (D, K) and (K,); predict with `argmax(x @ W + b)`.
    """
    features = np.asarray(features, dtype="float64")
    if features.ndim != 2 or len(features) != len(labels):
        raise ValueError(f"Expected features (examples, dims) with one row per label. Received features "
                         f"{features.shape} and {len(labels)} labels.")
    targets = 2.0 * np.eye(num_classes)[np.asarray(labels)] - 1.0
    mean = features.mean(axis=0)
    centred = features - mean
    gram = centred.T @ centred + l2_reg * np.eye(features.shape[1])
    weights = np.linalg.solve(gram, centred.T @ targets)
    return weights, targets.mean(axis=0) - mean @ weights


def few_shot_accuracy(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
                      test_labels: np.ndarray, shots: int, l2_reg: float = 1.0, seed: int = 0) -> float:
    """Test accuracy of a least-squares linear classifier fit on `shots` examples per class.

    Args:
        train_features, train_labels: pool to draw the k-shot training set from.
        test_features, test_labels: evaluation split.
        shots: int. Examples per class (k).
        l2_reg: float. Ridge penalty. Defaults to `1.0`.
        seed: int. Seed of the k-shot draw. Defaults to `0`.
    """
    train_labels, test_labels = np.asarray(train_labels), np.asarray(test_labels)
    chosen = sample_few_shot(train_labels, shots, seed)
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    weights, bias = fit_least_squares(np.asarray(train_features)[chosen], train_labels[chosen], num_classes, l2_reg)
    predictions = np.argmax(np.asarray(test_features, dtype="float64") @ weights + bias, axis=1)
    return float(np.mean(predictions == test_labels))


def digits_accuracy(model: keras.Model, shots: Sequence[int] = SHOTS, l2_reg: float = 1.0, seeds: int = 3,
                    test_fraction: float = 0.5) -> dict[int, tuple[float, float]]:
    """Few-shot accuracy on the embedded digits for each k: `{k: (mean, std over seeds)}`.

    The `"train"` split of `keras_vit.datasets.digits` (by default half of each class) is the
    pool the k-shot sets are drawn from, `"test"` the test split; digits are resized to the
    model's input and gray is repeated over its channels.
    """
    extractor = feature_extractor(model)
    height, width, channels = model.inputs[0].shape[1:]
    features, labels = {}, {}
    for split in ("train", "test"):
        images, labels[split] = datasets.digits(split, test_fraction=test_fraction)
        resized = datasets.resize(images, (height, width), channels)
        features[split] = extractor.predict(resized, batch_size=64, verbose=0)
    results = {}
    for k in shots:
        accuracies = [few_shot_accuracy(features["train"], labels["train"], features["test"], labels["test"], k,
                                        l2_reg, seed) for seed in range(seeds)]
        results[k] = (float(np.mean(accuracies)), float(np.std(accuracies)))
    return results
