"""Runs benchmark cases for one implementation in this process; prints one JSON line.

Called by `benchmarks.run` in a fresh subprocess per (implementation, case), so each
measurement gets its own peak RSS and its own thread pools:

    python -m benchmarks.worker IMPL THREADS CASE_JSON [CASE_JSON ...]
    python -m benchmarks.worker matmul THREADS SIZE
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

from benchmarks.cases import ARCHS, TIMM_NAMES, Case

RESULT_PREFIX = "BENCHMARK_RESULT "


def _tf(threads: int):
    import tensorflow as tf
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # already initialised: keep what it has
        pass
    return tf


# ----------------------------------------------------------------------------- Keras models
def _keras_vit_model(arch: str, train: bool):
    import keras_vit
    a = ARCHS[arch]
    return keras_vit.VisionTransformer(
        patch_size=a["patch"], hidden_dim=a["hidden"], mlp_dim=a["mlp"], num_heads=a["heads"],
        num_layers=a["layers"], input_shape=(a["image"], a["image"], 3), classes=a["classes"],
        classifier_activation=None, include_preprocessing=False, weights=None)


def _keras_hub_model(arch: str, train: bool):
    import keras
    import keras_hub
    a = ARCHS[arch]
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(a["image"], a["image"], 3), patch_size=a["patch"], num_layers=a["layers"],
        num_heads=a["heads"], hidden_dim=a["hidden"], mlp_dim=a["mlp"])
    image = keras.Input((a["image"], a["image"], 3))
    tokens = backbone(image)
    logits = keras.layers.Dense(a["classes"], dtype="float32", name="head")(tokens[:, 0])
    return keras.Model(image, logits)


def _keras_vit_unfused_model(arch: str, train: bool):
    """keras_vit on the plain Keras-layer path (no fused call): shows what the fused path gains."""
    from keras_vit import layers
    layers.FUSED_CALL = False
    return _keras_vit_model(arch, train)


KERAS_BUILDERS = {"keras_vit": _keras_vit_model, "keras_hub": _keras_hub_model,
                  "keras_vit_unfused": _keras_vit_unfused_model, "keras_vit_xla": _keras_vit_model}


def _keras_case(impl: str, case: Case, threads: int):
    if impl == "keras_vit_xla" and case.kind != "train":
        return {"status": "skipped", "note": "keras_vit_xla is a training-only variant"}
    _tf(threads)
    import keras
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if case.dtype == "bfloat16" else "float32")
    try:
        a = ARCHS[case.arch]
        rng = np.random.default_rng(0)
        x = rng.uniform(-1, 1, (case.batch, a["image"], a["image"], 3)).astype("float32")
        model = KERAS_BUILDERS[impl](case.arch, case.kind == "train")
        if case.kind == "startup":
            model.predict_on_batch(x)
            return {"t_first_prediction": time.time()}
        if case.kind == "inference":
            def step():
                return model.predict_on_batch(x)
            return _time_loop(step, case)
        # training: model.fit over an in-memory array, one step per batch, timed by a callback
        steps = case.warmup + case.iters
        xs = np.tile(x, (steps, 1, 1, 1))
        ys = rng.integers(0, a["classes"], (steps * case.batch,))
        xla = impl == "keras_vit_xla"
        ours = impl.startswith("keras_vit")
        if ours:  # the AdamW of keras_vit's training recipes: Keras' AdamW with a fused update kernel
            from training.trainer import AdamW
        else:
            AdamW = keras.optimizers.AdamW
        model.compile(optimizer=AdamW(1e-3), jit_compile=xla,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        times = []

        class _StepTimer(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.start)

        start = time.perf_counter()
        model.fit(xs, ys, batch_size=case.batch, epochs=1, shuffle=False, verbose=0, callbacks=[_StepTimer()])
        total = time.perf_counter() - start
        return {"latencies": times[case.warmup:], "fit_wall_s": total,
                "note": ("model.fit, training.trainer.AdamW (fused update)" if ours else "model.fit, keras AdamW")
                + (", jit_compile=True" if xla else "")}
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ----------------------------------------------------------------------------- timm
def _timm_case(case: Case, threads: int):
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    from benchmarks.torchvision_stub import import_timm
    timm, stubbed = import_timm()
    a = ARCHS[case.arch]
    if case.arch in TIMM_NAMES:
        model = timm.create_model(TIMM_NAMES[case.arch], pretrained=False)
    else:
        model = timm.models.vision_transformer.VisionTransformer(
            img_size=a["image"], patch_size=a["patch"], embed_dim=a["hidden"], depth=a["layers"],
            num_heads=a["heads"], mlp_ratio=a["mlp"] / a["hidden"], num_classes=a["classes"])
    x = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (case.batch, 3, a["image"], a["image"]))
                         .astype("float32"))
    note = "torchvision stub (no CPU torchvision)" if stubbed else ""
    if case.kind in ("inference", "startup"):
        model.eval()
        autocast = case.dtype == "bfloat16"

        def step():
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return model(x)
        if case.kind == "startup":
            step()
            return {"t_first_prediction": time.time(), "note": note}
        result = _time_loop(step, case)
        result["note"] = "; ".join(filter(None, [note, "eager" + (", autocast bf16" if autocast else "")]))
        return result
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    y = torch.randint(0, a["classes"], (case.batch,))

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    result = _time_loop(train_step, case)
    result["note"] = "; ".join(filter(None, [note, "plain loop, AdamW"]))
    return result


# ----------------------------------------------------------------------------- common
def _time_loop(step, case: Case) -> dict:
    for _ in range(case.warmup):
        step()
    times = []
    for _ in range(case.iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"latencies": times}


def matmul_peak(size: int, threads: int) -> dict:
    """GFLOP/s of a size x size matmul in TensorFlow, float32 and bfloat16 (best of a few)."""
    tf = _tf(threads)
    out = {}
    for dtype in ("float32", "bfloat16"):
        a = tf.random.normal((size, size), dtype="float32")
        a = tf.cast(a, dtype)
        b = tf.identity(a)
        matmul = tf.function(lambda p, q: tf.linalg.matmul(p, q))
        matmul(a, b).numpy()
        best = float("inf")
        reps = 5 if size >= 2048 else 20
        for _ in range(reps):
            start = time.perf_counter()
            matmul(a, b)[0, 0].numpy()
            best = min(best, time.perf_counter() - start)
        out[dtype] = 2.0 * size ** 3 / best / 1e9
    return out


def main(argv: list[str]) -> None:
    impl, threads = argv[0], int(argv[1])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if impl == "matmul":
        print(RESULT_PREFIX + json.dumps({"matmul_gflops": matmul_peak(int(argv[2]), threads)}), flush=True)
        return
    results = []
    for spec in argv[2:]:
        fields = json.loads(spec)
        if "matmul" in fields:  # --quick folds the peak measurement into a worker it already starts
            results.append({"matmul_gflops": matmul_peak(fields["matmul"], threads)})
            continue
        case = Case(**fields)
        try:
            if impl == "timm":
                result = _timm_case(case, threads)
            else:
                result = _keras_case(impl, case, threads)
            result.setdefault("status", "ok")
        except Exception as error:  # reported in the table, never hidden
            result = {"status": "error", "note": f"{type(error).__name__}: {error}"[:500]}
        result["case"] = case.name
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results.append(result)
    print(RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
