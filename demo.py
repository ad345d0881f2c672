"""The main job: trains a small ViT from scratch on real handwritten digits, evaluates it, exports
it for TF Serving and TFLite (each export checked against the Keras model) and draws the paper's
inspection figures.

Run with `python demo.py [workdir]` (no download: the 1,797 8x8 digits ship inside scikit-learn).
Training reaches >= 95% top-1 on the 360 held-out digits in a few minutes on 2 CPU cores. The same
steps from the command line: `keras-vit-train --config=digits --workdir=DIR`, then `keras-vit-export`,
`keras-vit-tflite` and `keras-vit-inspect`.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from keras_vit import datasets  # noqa: E402
from keras_vit import inspection as vit_inspect  # noqa: E402
from keras_vit.export import export_all  # noqa: E402
from keras_vit.training import get_config, train_and_evaluate  # noqa: E402


def train_demo(workdir: str) -> str:
    """Trains the `digits` recipe in `workdir` and returns the path of the saved `.keras` model.

    The model takes (batch, 32, 32, 3) pixels in [0, 255] and returns 10 logits; its evaluation
    (top-1, top-5 on the test split) is in `model.eval.json` next to it.
    """
    summary = train_and_evaluate(get_config("digits"), workdir, verbose=2)
    return summary["model_path"]


def export_and_inspect(model_path: str, workdir: str) -> None:
    """Exports the trained model (SavedModel + every TFLite mode, with the report) and writes the
    four inspection figures for held-out digits."""
    model = keras.saving.load_model(model_path, compile=False)
    exports = export_all(model, os.path.join(workdir, "exports"), dataset="digits",
                         class_names=[str(digit) for digit in range(10)])
    print(f"SavedModel (TF Serving layout) written to {exports['saved_model']}")
    print("TFLite exports, checked with the LiteRT interpreter against the Keras model:")
    print(exports["tflite_markdown"])
    test_digits, _ = datasets.digits("test")
    images = datasets.resize(test_digits[:16], model.input_shape[1:3])
    figures = vit_inspect.write_figures(model, images, os.path.join(workdir, "inspect"))
    print("Inspection figures:", ", ".join(figures))


def main() -> None:
    workdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "keras_vit_demo")
    start = time.time()
    model_path = train_demo(workdir)
    with open(os.path.join(os.path.dirname(model_path), "model.eval.json"), encoding="utf-8") as f:
        evaluation = json.load(f)
    print(f"Digits test accuracy: top-1 {evaluation['top1']:.2%}, top-5 {evaluation['top5']:.2%} "
          f"on {evaluation['num_eval_examples']} images, trained in {time.time() - start:.0f} s.")
    print(f"Model saved to {model_path} (evaluation: {evaluation['eval_path']}).")
    export_and_inspect(model_path, workdir)
    print(f"Done in {time.time() - start:.0f} s.")


if __name__ == "__main__":
    main()
