"""Linear few-shot evaluation of a keras_vit model (paper Fig. 4) on the embedded digits.

Frozen pre-logit features of k examples per class (k in {1, 5, 10, 25}), a closed-form
regularized least-squares fit onto {-1, 1}^K targets, accuracy on a held-out split
(`keras_vit.fewshot`). The default dataset is scikit-learn's 1,797 8x8 handwritten digits,
shipped in its wheel (no download): half of each class is the pool k-shot sets are drawn
from, the other half the test split. Digits are scaled to [0, 255] and resized to the
model's input; gray is repeated over the model's channels.

    python -m training.fewshot --model digits_vit.keras
    python -m training.fewshot --variant Ti/16 --image-size 32 32 --shots 1 5
"""

from __future__ import annotations

import argparse
from typing import Sequence

import keras
import numpy as np

from keras_vit import fewshot
from keras_vit.inspect import model_from_args

SHOTS = (1, 5, 10, 25)


def load_digits_split(image_shape: Sequence[int], seed: int = 0) -> tuple[np.ndarray, ...]:
    """Returns `(train_images, train_labels, test_images, test_labels)` of the sklearn digits.

    Images are float32 in [0, 255], resized to `image_shape` (height, width, channels).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    height, width, channels = image_shape
    digits = load_digits()
    images = digits.images[..., None].astype("float32") * (255.0 / 16.0)
    images = keras.ops.convert_to_numpy(keras.ops.image.resize(images, (height, width)))
    images = np.clip(np.repeat(images, channels, axis=-1), 0.0, 255.0)
    train_x, test_x, train_y, test_y = train_test_split(images, digits.target, test_size=0.5,
                                                        stratify=digits.target, random_state=seed)
    return train_x, train_y, test_x, test_y


def evaluate(model: keras.Model, shots: Sequence[int] = SHOTS, l2_reg: float = 1.0,
             seeds: int = 3) -> dict[int, tuple[float, float]]:
    """Few-shot accuracy on the digits for each k: `{k: (mean, std over seeds)}`."""
    extractor = fewshot.feature_extractor(model)
    train_x, train_y, test_x, test_y = load_digits_split(model.inputs[0].shape[1:])
    train_features = extractor.predict(train_x, batch_size=64, verbose=0)
    test_features = extractor.predict(test_x, batch_size=64, verbose=0)
    results = {}
    for k in shots:
        accuracies = [fewshot.few_shot_accuracy(train_features, train_y, test_features, test_y, k, l2_reg, seed)
                      for seed in range(seeds)]
        results[k] = (float(np.mean(accuracies)), float(np.std(accuracies)))
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.fewshot", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a saved keras_vit model (.keras)")
    source.add_argument("--variant", help='a variant name, e.g. "Ti/16"')
    parser.add_argument("--weights", help="weights for --variant (default: random initialization)")
    parser.add_argument("--image-size", type=int, nargs=2, default=(224, 224), metavar=("HEIGHT", "WIDTH"),
                        help="input size for --variant (default: 224 224)")
    parser.add_argument("--shots", type=int, nargs="+", default=SHOTS, help="k values (default: 1 5 10 25)")
    parser.add_argument("--l2-reg", type=float, default=1.0, help="ridge penalty (default: 1.0)")
    parser.add_argument("--seeds", type=int, default=3, help="k-shot draws averaged per k (default: 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[int, tuple[float, float]]:
    args = _parser().parse_args(argv)
    model = model_from_args(args.model, args.variant, args.weights, args.image_size)
    results = evaluate(model, args.shots, args.l2_reg, args.seeds)
    for k, (mean, std) in results.items():
        print(f"{k:>3}-shot digits accuracy: {mean:.4f} +- {std:.4f} ({args.seeds} draws)")
    return results


if __name__ == "__main__":
    main()
