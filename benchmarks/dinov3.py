"""DINOv3 ViT-B/16 inference: keras_vit against keras-hub's `DINOV3Backbone` (one process, calls interleaved) and
timm's `vit_base_patch16_dinov3` (PyTorch, in its own process, right after).

    python -m benchmarks.dinov3 [--batches 1,16] [--calls 10] [--image 224] [--timm-python PATH]

Each model has random weights and DINOv3 B/16's architecture (width 768, 12 blocks of 12 heads, MLP 3072, patch 16,
4 registers, layer scale, rotary positions of base 100, no key bias, LayerNorm eps 1e-5) and returns the tokens
after the final norm of [-1, 1] images at `--image` pixels (keras_vit: `include_top=False, pooling=None`;
keras-hub: the backbone's output; timm: `forward_features`). Keras models run `predict_on_batch`, alternately;
timm runs `torch.inference_mode()` forwards with `torch.set_num_threads(os.cpu_count())` in the interpreter
`--timm-python` names (one with torch and timm; timm through `benchmarks.torchvision_stub` where no CPU
torchvision installs), skipped without it. Prints the medians in ms and keras_vit's speed relative to each.
Needs keras-hub with `DINOV3Backbone` (0.32) on the TensorFlow backend.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.cases import DINOV3_OPTIONS  # noqa: E402
from benchmarks.paired import alternate, medians, require_keras_hub  # noqa: E402
from benchmarks.run import _cpu  # noqa: E402

B16 = dict(patch_size=16, hidden_dim=768, num_heads=12, num_layers=12, mlp_dim=3072, num_register_tokens=4)

# timm's forwards, timed in a PyTorch process: argv = batches (comma-separated), calls, image size; prints JSON.
TIMM_SCRIPT = """
import json, os, sys, time, statistics
from benchmarks.torchvision_stub import import_timm
timm, _ = import_timm()
import torch
torch.set_num_threads(os.cpu_count())
batches, calls, image = [int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
model = timm.create_model("vit_base_patch16_dinov3", pretrained=False, num_classes=0, img_size=image).eval()
result = {}
with torch.inference_mode():
    for batch in batches:
        x = torch.rand(batch, 3, image, image) * 2 - 1
        model.forward_features(x)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            model.forward_features(x)
            times.append((time.perf_counter() - start) * 1e3)
        result[str(batch)] = statistics.median(times)
print("TIMM:" + json.dumps({"timm": timm.__version__, "torch": torch.__version__, "ms": result}))
"""


def keras_vit_model(image: int) -> keras.Model:
    import keras_vit

    return keras_vit.VisionTransformer(
        **B16, **DINOV3_OPTIONS, input_shape=(image, image, 3), include_top=False, pooling=None,
        include_preprocessing=False, weights=None)


def keras_hub_model(image: int) -> keras.Model:
    import keras_hub

    return keras_hub.models.DINOV3Backbone(
        patch_size=16, num_layers=12, hidden_dim=768, num_heads=12, intermediate_dim=3072, num_register_tokens=4,
        layer_scale_init_value=1e-5, use_key_bias=False, layer_norm_eps=1e-5, image_shape=(image, image, 3),
        rope_theta=100.0)


def timm_times(python: str, batches: list[int], calls: int, image: int) -> dict | None:
    """timm's medians from `TIMM_SCRIPT` in `python`; None (and a note) where that process fails."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([python, "-c", TIMM_SCRIPT, ",".join(map(str, batches)), str(calls), str(image)],
                          cwd=repo, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONPATH": repo})
    if done.returncode != 0 or "TIMM:" not in done.stdout:
        print(f"note: timm's process failed ({python}): {done.stderr[-500:]}")
        return None
    return json.loads(done.stdout.split("TIMM:", 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dinov3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=10, help="calls of each model per batch size")
    parser.add_argument("--image", type=int, default=224, help="image side in pixels (a multiple of 16)")
    parser.add_argument("--timm-python", default=None, help="an interpreter with torch and timm (else no timm row)")
    args = parser.parse_args(argv)
    keras_hub = require_keras_hub(parser, needs="DINOV3Backbone")  # keras-hub 0.32 has it
    batches = [int(batch) for batch in args.batches.split(",")]
    cpu, isa = _cpu()
    print(f"CPU: {cpu}; ISA: {', '.join(isa)}; {os.cpu_count()} CPUs; keras {keras.__version__}, keras-hub "
          f"{keras_hub.__version__}; {args.calls} alternating calls per batch size, {args.image} px")
    keras.utils.set_random_seed(0)
    models = {"keras_vit": keras_vit_model(args.image), "keras_hub": keras_hub_model(args.image)}
    params = {name: model.count_params() for name, model in models.items()}
    print(f"parameters: {params}")
    rows = {}
    for batch in batches:
        x = np.random.default_rng(batch).uniform(-1, 1, (batch, args.image, args.image, 3)).astype("float32")
        for model in models.values():
            model.predict_on_batch(x)  # traced before the timing
        rows[batch] = medians(alternate({name: (lambda m=model: m.predict_on_batch(x))
                                         for name, model in models.items()}, args.calls))
    timm = timm_times(args.timm_python, batches, args.calls, args.image) if args.timm_python else None
    if timm is not None:
        print(f"timm {timm['timm']}, torch {timm['torch']} (its own process, after the Keras models)")
    print("\n| batch | keras_vit (ms) | keras-hub (ms) | timm (ms) | keras-hub / keras_vit | timm / keras_vit |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, row in rows.items():
        theirs = timm["ms"][str(batch)] if timm is not None else None
        timm_cells = ("n/a", "n/a") if theirs is None else (f"{theirs:.1f}", f"{theirs / row['keras_vit']:.2f}x")
        print(f"| {batch} | {row['keras_vit']:.1f} | {row['keras_hub']:.1f} | {timm_cells[0]} | "
              f"{row['keras_hub'] / row['keras_vit']:.2f}x | {timm_cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
