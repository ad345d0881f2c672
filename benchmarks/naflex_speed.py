"""A NaFlex ViT-B/16 request against the fixed-resolution model of the same token count: one process, interleaved.

    python -m benchmarks.naflex_speed [--batches 1,16] [--calls 10] [--threads 2] [--check 1.15]

Both models are SigLIP's B/16 encoder (random weights: 12 blocks of width 768, the MAP head, no prefix token), and
both compute 256 tokens an image: the fixed model at 256x256 pixels (`VisionTransformer(classifier="map",
include_top=False)`), the NaFlex model (`keras_vit.naflex.NaFlexViT`, its learned table 16x16) at a budget of
256 patches, on photographs of three aspect ratios through `naflex_inputs` (a 16x16 grid, 12x21 and 21x12: 252
patches, padded to 256 and masked). Each is called with `predict_on_batch` at each batch size, the calls
alternated (the order reversed every other time) so that a drifting machine slows both alike; medians are printed
with the ratio NaFlex / fixed, and `--check R` exits 1 where a ratio is over R. TensorFlow backend.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

B16 = dict(patch_size=16, hidden_dim=768, mlp_dim=3072, num_heads=12, num_layers=12, classifier="map")
BUDGET = 256  # patches: the fixed model's 16x16 grid at 256 px
GRIDS = ((256, 256), (192, 336), (336, 192))  # (height, width) of the photographs: 16x16, 12x21, 21x12 patches


def models():
    """(fixed, naflex): SigLIP-B/16 at 256 px and its NaFlex form, random weights (seed 0)."""
    import keras

    import keras_vit
    from keras_vit import naflex
    from keras_vit.variants import ViTConfig

    keras.utils.set_random_seed(0)
    fixed = keras_vit.VisionTransformer(weights=None, include_top=False, pooling="map", input_shape=(256, 256, 3),
                                        **B16)
    keras.utils.set_random_seed(0)
    flexible = naflex.NaFlexViT(ViTConfig(**B16), position_grid=16)
    return fixed, flexible


def inputs(batch: int) -> tuple[np.ndarray, dict]:
    """`batch` photographs at 256x256 for the fixed model, and at each of `GRIDS` in turn as NaFlex inputs."""
    from keras_vit.export import data
    from keras_vit.naflex import naflex_inputs

    square = data.photos((256, 256), count=batch)
    photos = [data.photos(GRIDS[i % len(GRIDS)], count=1, seed=i)[0].round().astype(np.uint8) for i in range(batch)]
    return square, naflex_inputs(photos, 16, BUDGET)


def measure(batches: list[int], calls: int) -> list[dict]:
    from benchmarks.paired import alternate, medians

    fixed, flexible = models()
    rows = []
    for batch in batches:
        square, sequences = inputs(batch)
        fixed.predict_on_batch(square)  # traced before the timing
        flexible.predict_on_batch(sequences)
        times = alternate({"fixed": lambda: fixed.predict_on_batch(square),
                           "naflex": lambda: flexible.predict_on_batch(sequences)}, calls)
        middle = medians(times)
        faster = sum(n < f for n, f in zip(times["naflex"], times["fixed"]))
        rows.append({"batch": batch, "fixed_ms": middle["fixed"], "naflex_ms": middle["naflex"],
                     "ratio": middle["naflex"] / middle["fixed"], "naflex_faster": f"{faster} of {calls}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.naflex_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--calls", type=int, default=10, help="timed calls of each model per batch size")
    parser.add_argument("--threads", type=int, default=2, help="TensorFlow's intra-op threads")
    parser.add_argument("--check", type=float, help="exit 1 where NaFlex / fixed is over this ratio")
    args = parser.parse_args(argv)
    from benchmarks.run import _cpu
    from benchmarks.worker import _tf

    _tf(args.threads)
    rows = measure([int(b) for b in args.batches.split(",")], args.calls)
    name, flags = _cpu()
    print(f"CPU: {name} ({', '.join(flags)}); {args.threads} threads; SigLIP-B/16, {BUDGET} tokens an image, "
          "random weights")
    print("| batch | fixed 256 px (ms) | NaFlex, 256 patches (ms) | NaFlex / fixed | NaFlex faster |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['batch']} | {row['fixed_ms']:.2f} | {row['naflex_ms']:.2f} | {row['ratio']:.3f}x | "
              f"{row['naflex_faster']} |")
    if args.check is not None and any(row["ratio"] > args.check for row in rows):
        print(f"NaFlex / fixed over {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
