"""Runs benchmark cases for one implementation in this process; prints one JSON line.

Called by `benchmarks.run` in a fresh subprocess per (implementation, case), so each
measurement gets its own peak RSS and its own thread pools:

    python -m benchmarks.worker IMPL THREADS CASE_JSON [CASE_JSON ...]
    python -m benchmarks.worker matmul THREADS SIZE [SIZE ...]        (TensorFlow)
    python -m benchmarks.worker matmul_torch THREADS SIZE [SIZE ...]  (PyTorch)

Each framework runs as its users get it by default for the thread budget: with THREADS equal
to the machine's CPU count nothing is set (TensorFlow's intra- and inter-op pools and
PyTorch's pool are all as many threads as CPUs); with fewer, each framework's intra-op pool is
set to THREADS.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

from benchmarks.cases import ARCHS, DINOV3_OPTIONS, TIMM_NAMES, Case

RESULT_PREFIX = "BENCHMARK_RESULT "


def _tf(threads: int):
    import tensorflow as tf
    if threads != os.cpu_count():
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        except RuntimeError:  # already initialised: keep what it has
            pass
    return tf


# ----------------------------------------------------------------------------- Keras models
def _keras_vit_model(arch: str, train: bool, served: bool = False):
    """keras_vit's ViT of `arch` (random weights), logits of preprocessed images; with `served`, as a user exports
    it: its preprocessing and softmax included."""
    import keras_vit
    a = ARCHS[arch]
    ends = {} if served else dict(classifier_activation=None, include_preprocessing=False)
    family = dict(DINOV3_OPTIONS, num_register_tokens=a["registers"]) if a.get("family") == "dinov3" else {}
    return keras_vit.VisionTransformer(
        patch_size=a["patch"], hidden_dim=a["hidden"], mlp_dim=a["mlp"], num_heads=a["heads"],
        num_layers=a["layers"], input_shape=(a["image"], a["image"], 3), classes=a["classes"], weights=None, **ends,
        **family)


def randomize_head(model, seed: int = 0, stddev: float = 0.02):
    """`model` with its head's kernel drawn from N(0, `stddev`): keras_vit's head starts at zeros, which makes every
    logit 0 and any agreement between two forms of the model meaningless."""
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(seed).normal(0, stddev, head.kernel.shape).astype("float32"))
    return model


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


def _keras_vit_portable_model(arch: str, train: bool):
    """keras_vit on the portable ops only (no CPU-specific kernel): shows what those kernels gain."""
    os.environ["KERAS_VIT_KERNELS"] = "portable"
    return _keras_vit_model(arch, train)


KERAS_BUILDERS = {"keras_vit": _keras_vit_model, "keras_hub": _keras_hub_model,
                  "keras_vit_portable": _keras_vit_portable_model, "keras_vit_xla": _keras_vit_model}


def _keras_on_accelerator(keras) -> bool:
    """Whether Keras' backend computes on a GPU or TPU here."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        return jax.default_backend() != "cpu"
    if backend == "tensorflow":
        import tensorflow as tf
        return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))
    if backend == "torch":
        import torch
        return torch.cuda.is_available()
    return False


def _keras_case(impl: str, case: Case, threads: int):
    if impl == "keras_vit_xla" and case.kind != "train":
        return {"status": "skipped", "note": "keras_vit_xla is a training-only variant"}
    import keras
    if keras.backend.backend() == "tensorflow":
        _tf(threads)
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
            if _keras_on_accelerator(keras):  # resident on the device, as timm's input is: no copy timed per step
                x = keras.ops.convert_to_tensor(x)

            def step():
                return model.predict_on_batch(x)
            return _time_loop(step, case)
        # training: model.fit over an in-memory array, one step per batch, timed by a callback
        steps = case.warmup + case.iters
        xs = np.tile(x, (steps, 1, 1, 1))
        ys = rng.integers(0, a["classes"], (steps * case.batch,))
        tensorflow = keras.backend.backend() == "tensorflow"
        xla = impl == "keras_vit_xla" or not tensorflow  # JAX always compiles; "auto" on other backends
        ours = impl.startswith("keras_vit") and tensorflow
        if ours:  # the AdamW of keras_vit's training recipes: Keras' AdamW with a fused update kernel
            from training.trainer import AdamW
        else:
            AdamW = keras.optimizers.AdamW
        model.compile(optimizer=AdamW(1e-3), jit_compile=xla if tensorflow else "auto",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        times = []

        class _StepTimer(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                float(logs["loss"])  # waits for the step (JAX dispatches asynchronously)
                times.append(time.perf_counter() - self.start)

        start = time.perf_counter()
        model.fit(xs, ys, batch_size=case.batch, epochs=1, shuffle=False, verbose=0, callbacks=[_StepTimer()])
        total = time.perf_counter() - start
        return {"latencies": times[case.warmup:], "fit_wall_s": total,
                "note": ("model.fit, training.trainer.AdamW (fused update)" if ours else "model.fit, keras AdamW")
                + (", jit_compile=True" if xla and tensorflow else "") + f", {keras.backend.backend()} backend"}
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ----------------------------------------------------------------------------- timm
def _torch(threads: int):
    import torch
    if threads != os.cpu_count():
        torch.set_num_threads(threads)
    return torch


def _timm_case(case: Case, threads: int):
    torch = _torch(threads)
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, x = model.to(device), x.to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    note = "; ".join(filter(None, ["torchvision stub (no CPU torchvision)" if stubbed else "", device]))
    autocast = case.dtype == "bfloat16"
    if case.kind in ("inference", "startup"):
        model.eval()

        def step():
            with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            sync()
            return out
        if case.kind == "startup":
            step()
            return {"t_first_prediction": time.time(), "note": note}
        result = _time_loop(step, case)
        result["note"] = "; ".join(filter(None, [note, "eager" + (", autocast bf16" if autocast else "")]))
        return result
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    y = torch.randint(0, a["classes"], (case.batch,)).to(device)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        sync()
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


def matmul_peak(sizes: list[int], threads: int, framework: str = "tensorflow") -> dict:
    """Best GFLOP/s of square matmuls of `sizes` in one framework, float32 and bfloat16."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        best = 0.0
        for size in sizes:
            run = _tf_matmul(size, dtype, threads) if framework == "tensorflow" else _torch_matmul(size, dtype, threads)
            first = _seconds(run)
            slow = first > 1.0  # e.g. bfloat16 emulated on an AVX2 CPU: larger sizes only take longer
            fastest = min([first] + [_seconds(run) for _ in range(1 if slow else 5 if size >= 2048 else 20)])
            best = max(best, 2.0 * size ** 3 / fastest / 1e9)
            if slow:
                break
        out[dtype] = best
    return out


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _tf_matmul(size: int, dtype: str, threads: int):
    tf = _tf(threads)
    a = tf.cast(tf.random.normal((size, size)), dtype)
    b = tf.identity(a)
    matmul = tf.function(lambda p, q: tf.linalg.matmul(p, q))
    return lambda: matmul(a, b)[0, 0].numpy()


def _torch_matmul(size: int, dtype: str, threads: int):
    """On the GPU when there is one (then the peak is the GPU's)."""
    torch = _torch(threads)
    a = torch.randn(size, size).to(getattr(torch, dtype)).to("cuda" if torch.cuda.is_available() else "cpu")
    b = a.clone()
    return lambda: torch.mm(a, b)[0, 0].item()


def tensorflow_cpu_setup() -> dict:
    """Whether TensorFlow uses oneDNN here, and the CPU kernels keras_vit chose on this machine."""
    import dataclasses
    from keras_vit import kernels
    capabilities, choice = kernels.detect(), kernels.machine_choice()
    return {"onednn": capabilities.onednn,
            "keras_vit_kernels": {key: sorted(value) if isinstance(value, frozenset) else value
                                  for key, value in dataclasses.asdict(choice).items()}}


def main(argv: list[str]) -> None:
    impl, threads = argv[0], int(argv[1])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if impl in ("matmul", "matmul_torch"):
        framework = "tensorflow" if impl == "matmul" else "torch"
        result = {"matmul_gflops": matmul_peak([int(size) for size in argv[2:]], threads, framework)}
        if framework == "tensorflow":
            result["tensorflow_cpu"] = tensorflow_cpu_setup()
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    results = []
    for spec in argv[2:]:
        fields = json.loads(spec)
        if "matmul" in fields:  # --quick folds the peak measurement into a worker it already starts
            results.append({"matmul_gflops": matmul_peak(fields["matmul"], threads),
                            "tensorflow_cpu": tensorflow_cpu_setup()})
            continue
        case = Case(**fields)
        try:
            if ARCHS[case.arch].get("family") and impl != "keras_vit":
                result = {"status": "skipped",
                          "note": f"{case.arch} is built by keras_vit only (benchmarks.dinov3 compares)"}
            elif impl == "timm":
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
