"""TF Serving SavedModels of keras_vit and keras-hub, timed as TF Serving runs them, on oneDNN and on Eigen.

    python -m benchmarks.serving [--arch B/16] [--batches 1,16] [--rounds 3] [--runs 5] [--profile] [--bfloat16]

keras_vit's is `keras_vit.export.saved_model.export_saved_model` (its `serving_default`: float pixels in, the
resize, preprocessing, model and top-k out), written twice: for oneDNN (`serving_kernels="onednn"`, the default)
and for Eigen (`serving_kernels="eigen"`, `keras_vit_eigen`); each backend is compared with keras-hub through the
export made for it, and the other export is timed too. keras-hub's is `Model.export()` of its `ViTBackbone` with a
Dense head on the class token (preprocessed images in, logits out), all with random weights. Each is loaded
through TF1's loader (`tf.compat.v1.saved_model.loader.load` in a Session, as TF Serving loads it) in a fresh
process, with `TF_ENABLE_ONEDNN_OPTS=1` (oneDNN) or `=0` (Eigen, the default of AVX2 builds); the processes are
interleaved over `--rounds` rounds and each times `--runs` requests per batch size after one warm-up. Prints the median
milliseconds per request and keras_vit's speed over keras-hub's. `--profile` also prints the op types that take
the most time in one traced bs16 request of each (TF1's RunMetadata step stats). `--bfloat16` adds keras_vit's
bfloat16 export (`precision="bfloat16"`, `keras_vit_bf16`), timed on oneDNN (TensorFlow's bfloat16 kernels), against
its float32 export and keras-hub's; its agreement with float32 on photographs, the export's own check, is printed
(random weights, whose 1000 logits nearly tie: not gated).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_PREFIX = "SERVING_RESULT "
BACKENDS = {"oneDNN": "1", "Eigen": "0"}
IMPLS = {"keras_vit": "onednn", "keras_vit_eigen": "eigen", "keras_hub": None}  # keras_vit's serving_kernels
BFLOAT16 = "keras_vit_bf16"  # with --bfloat16: the oneDNN export in bfloat16, timed on oneDNN
MATCHING = {"oneDNN": "keras_vit", "Eigen": "keras_vit_eigen"}  # the export a user makes for each server


def export(impl: str, arch: str, out_dir: str) -> str:
    """Writes `impl`'s SavedModel of `arch` (random weights) to `out_dir`; returns its path."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from benchmarks import worker
    keras.utils.set_random_seed(0)
    if impl == BFLOAT16 or IMPLS[impl]:
        from keras_vit.export import saved_model
        # A random head, as the encoder: the bfloat16 check then compares distinct logits.
        model = worker.randomize_head(worker._keras_vit_model(arch, train=False, served=True))
        path = saved_model.export_saved_model(model, os.path.join(out_dir, impl), version=1,
                                              serving_kernels=IMPLS.get(impl, "onednn"),
                                              precision="bfloat16" if impl == BFLOAT16 else "float32",
                                              max_top1_drop=100.0)  # random weights: reported, not gated
        check = saved_model.read_metadata(path)["precision_check"]
        if check:
            print(f"{impl}: against float32 on {check['images']} photographs, top-1 agreement "
                  f"{100 * check['top1_agreement']:.1f}%, max relative difference {check['max_relative_diff']:.1e}")
        return str(path)
    model = worker.KERAS_BUILDERS["keras_hub"](arch, train=False)
    path = os.path.join(out_dir, impl, "1")
    model.export(path, verbose=False)
    return path


def serve(path: str, batches: list[int], runs: int, profile: bool) -> dict:
    """Loads `path` with TF1's loader and times `runs` requests of each batch size (one warm-up first)."""
    import numpy as np
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], path)
        signature = meta.signature_def["serving_default"]
        (given,) = signature.inputs.values()
        fetches = {name: info.name for name, info in signature.outputs.items()}
        shape = [d.size for d in given.tensor_shape.dim]
        height, width = (224, 224) if shape[1] < 0 else shape[1:3]
        result = {}
        for batch in batches:
            images = np.random.default_rng(0).uniform(0, 255, (batch, height, width, 3)).astype("float32")
            feed = {given.name: images}
            session.run(fetches, feed)
            seconds = []
            for _ in range(runs):
                start = time.perf_counter()
                session.run(fetches, feed)
                seconds.append(time.perf_counter() - start)
            result[str(batch)] = 1000 * statistics.median(seconds)
        if profile:
            options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            metadata = tf.compat.v1.RunMetadata()
            session.run(fetches, feed, options=options, run_metadata=metadata)
            by_type = collections.Counter()
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    kind = node.timeline_label.split("(")[0].split(" = ")[-1].strip() or node.node_name
                    by_type[kind] += node.all_end_rel_micros / 1000
            result["profile_ms"] = dict(by_type.most_common(12))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="B/16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--bfloat16", action="store_true", help="also keras_vit's bfloat16 export, on oneDNN")
    parser.add_argument("--serve", nargs=2, metavar=("PATH", "BATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        result = serve(args.serve[0], [int(b) for b in args.serve[1].split(",")], args.runs, args.profile)
        print(RESULT_PREFIX + json.dumps(result))
        return
    from benchmarks.run import _cpu
    print(f"CPU: {_cpu()}")
    out = tempfile.mkdtemp(prefix="serving_bench_")
    paths = {impl: export(impl, args.arch, out) for impl in [*IMPLS, *([BFLOAT16] if args.bfloat16 else [])]}
    times = collections.defaultdict(list)
    for round_index in range(args.rounds):
        for backend, flag in BACKENDS.items():
            for impl, path in paths.items():
                if impl == BFLOAT16 and backend != "oneDNN":
                    continue
                env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=flag, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
                command = [sys.executable, "-m", "benchmarks.serving", "--serve", path, args.batches,
                           "--runs", str(args.runs)] + (["--profile"] if args.profile and round_index == 0 else [])
                proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
                lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
                if not lines:
                    raise RuntimeError(f"{impl} on {backend}: exited {proc.returncode}: {proc.stderr[-1500:]}")
                result = json.loads(lines[0][len(RESULT_PREFIX):])
                if "profile_ms" in result:
                    print(f"profile, {impl} on {backend}, one bs{args.batches.split(',')[-1]} request (ms by op):",
                          json.dumps({k: round(v, 1) for k, v in result.pop("profile_ms").items()}))
                for batch, ms in result.items():
                    times[backend, impl, batch].append(ms)
                print(f"[round {round_index + 1}/{args.rounds}] {backend} {impl}: "
                      + ", ".join(f"bs{b} {ms:.1f} ms" for b, ms in result.items()), flush=True)
    print("\n| backend | batch | keras_vit (ms) | keras_vit_eigen (ms) | keras-hub (ms) | export for this backend "
          "/ keras-hub | the other export / keras-hub |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for backend in BACKENDS:
        for batch in args.batches.split(","):
            ms = {impl: statistics.median(times[backend, impl, batch]) for impl in IMPLS}
            other = next(impl for impl in ("keras_vit", "keras_vit_eigen") if impl != MATCHING[backend])
            print(f"| {backend} | {batch} | {ms['keras_vit']:.1f} | {ms['keras_vit_eigen']:.1f} | "
                  f"{ms['keras_hub']:.1f} | {ms['keras_hub'] / ms[MATCHING[backend]]:.3f}x | "
                  f"{ms['keras_hub'] / ms[other]:.3f}x |")
    if args.bfloat16:
        print("\n| backend | batch | keras_vit bfloat16 (ms) | keras_vit float32 (ms) | keras-hub (ms) | "
              "bfloat16 / float32 | bfloat16 / keras-hub |\n|---|---:|---:|---:|---:|---:|---:|")
        for batch in args.batches.split(","):
            ms = {impl: statistics.median(times["oneDNN", impl, batch])
                  for impl in (BFLOAT16, "keras_vit", "keras_hub")}
            print(f"| oneDNN | {batch} | {ms[BFLOAT16]:.1f} | {ms['keras_vit']:.1f} | {ms['keras_hub']:.1f} | "
                  f"{ms['keras_vit'] / ms[BFLOAT16]:.3f}x | {ms['keras_hub'] / ms[BFLOAT16]:.3f}x |")


if __name__ == "__main__":
    main()
