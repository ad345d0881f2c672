"""Runs keras_vit on one Keras backend, in its own process (Keras fixes its backend at import):

    KERAS_BACKEND=jax python -m tests.backend_worker WORKDIR

Reads the checkpoints and images that `tests/models/test_backends.py` wrote to WORKDIR, writes the
logits of keras_vit's models, attention scores and rollout (`logits.npz`) and what it checked
(`report.json`): whether TensorFlow was imported, `.keras` and `.weights.h5` round trips of a whole
model, a digits few-shot accuracy, and the losses of a few `fit` steps.
"""

import json
import os
import sys

import numpy as np


def main(workdir: str) -> None:
    import keras

    import keras_vit
    import keras_vit.fewshot
    import keras_vit.inspection

    report = {"backend": keras.backend.backend(), "tensorflow_imported": "tensorflow" in sys.modules}
    spec = json.load(open(os.path.join(workdir, "spec.json")))
    images = dict(np.load(os.path.join(workdir, "images.npz")))
    logits, models = {}, []
    for case in spec["cases"]:
        models.append(keras_vit.VisionTransformer(**case["build"], weights=os.path.join(workdir, case["file"])))
        logits[case["name"]] = keras.ops.convert_to_numpy(models[-1](images[case["images"]], training=False))
    first, model = spec["cases"][0], models[0]  # The round trips, attention and few-shot use the first case.
    x = images[first["images"]]
    expected = keras.ops.convert_to_numpy(model(x))
    for name in ("model.keras", "model.weights.h5"):
        path = os.path.join(workdir, name)
        if name.endswith(".keras"):
            model.save(path)
            revived = keras.saving.load_model(path)
        else:
            model.save_weights(path)
            revived = keras_vit.VisionTransformer(**first["build"], weights=path)
        report[f"{name} max difference"] = float(np.abs(keras.ops.convert_to_numpy(revived(x)) - expected).max())
    attention = keras_vit.attention_model(model)(x)["attention"]
    logits["attention"] = np.stack([keras.ops.convert_to_numpy(scores) for scores in attention])
    logits["rollout"] = keras_vit.inspection.attention_rollout(model, x)
    report["fewshot"] = keras_vit.fewshot.digits_accuracy(model, shots=(2,), seeds=1)[2][0]
    keras.utils.set_random_seed(0)
    trainee = keras_vit.VisionTransformer(**spec["train"], weights=None)
    trainee.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    labels = np.arange(len(x)) % spec["train"]["classes"]
    report["losses"] = trainee.fit(x, labels, epochs=spec["epochs"], batch_size=len(x), verbose=0).history["loss"]
    for package in ("keras_vit.training", "keras_vit.export"):
        try:
            __import__(package)
            report[package] = "imported"
        except ImportError as error:
            report[package] = str(error)
    np.savez(os.path.join(workdir, "logits.npz"), **logits)
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
