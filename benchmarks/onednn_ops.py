"""Where keras_vit's CPU forward spends its time inside oneDNN, read from ONEDNN_VERBOSE.

    python -m benchmarks.onednn_ops [--arch B/16] [--batch 1] [--dtype bfloat16] [--calls 5] [--threads 2]

Builds the model as `benchmarks.worker` does (random weights, logits of preprocessed images), runs it a few times
to warm up, then `--calls` timed `predict_on_batch` calls in a child process with `ONEDNN_VERBOSE=1`, and sums
oneDNN's own per-primitive times over the timed calls by primitive, implementation (its ISA: `avx512_core_amx`
means AMX tiles ran it) and source dtype. What is left of the wall time ran outside oneDNN (Eigen, casts, the
graph executor), where ops did not overlap: TensorFlow runs independent ops at once, and then oneDNN's times can sum
past the wall time (the table says so). TensorFlow only, with oneDNN on (its default on x86).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

BEGIN, END = "KERAS_VIT_TIMED_BEGIN", "KERAS_VIT_TIMED_END"


def _child(arch: str, batch: int, dtype: str, calls: int, threads: int) -> None:
    """Runs in the verbose process: warm-up, then the timed calls between the two markers."""
    import keras
    import numpy as np

    from benchmarks.cases import ARCHS
    from benchmarks.worker import _keras_vit_model, _tf
    _tf(threads)
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if dtype == "bfloat16" else "float32")
    model = _keras_vit_model(arch, train=False)
    size = ARCHS[arch]["image"]
    x = np.random.default_rng(0).uniform(-1, 1, (batch, size, size, 3)).astype("float32")
    for _ in range(3):
        model.predict_on_batch(x)
    sys.stdout.flush()
    print(BEGIN, flush=True)
    start = time.perf_counter()
    for _ in range(calls):
        model.predict_on_batch(x)
    wall_ms = (time.perf_counter() - start) * 1e3 / calls
    sys.stdout.flush()
    print(f"{END} {wall_ms:.3f}", flush=True)


def parse(lines: list[str]) -> tuple[dict[tuple[str, str, str], list[float]], float]:
    """oneDNN's exec lines between the markers, as {(primitive, implementation, source dtype): [ms, ...]}, and the
    wall milliseconds per call that the child printed."""
    by_kind: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    timed, wall_ms = False, float("nan")
    for line in lines:
        if line.startswith(BEGIN):
            timed = True
        elif line.startswith(END):
            wall_ms, timed = float(line.split()[1]), False
        elif timed and line.startswith(("onednn_verbose", "dnnl_verbose")):
            fields = line.strip().split(",")
            if "exec" not in fields:
                continue
            at = fields.index("exec")
            try:
                kind, implementation, memory = fields[at + 2], fields[at + 3], fields[at + 5]
                milliseconds = float(fields[-1])
            except (IndexError, ValueError):
                continue
            source = next((part.split(":")[1] for part in memory.split() if part.startswith("src")), "?")
            by_kind[(kind, implementation, source)].append(milliseconds)
    return by_kind, wall_ms


def table(by_kind: dict[tuple[str, str, str], list[float]], wall_ms: float, calls: int) -> str:
    """A Markdown table of the primitives, the largest total first, per call."""
    total = sum(sum(times) for times in by_kind.values()) / calls
    rows = ["| primitive | implementation | src dtype | runs per call | ms per call | share of wall |",
            "|---|---|---|---:|---:|---:|"]
    for (kind, implementation, source), times in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        per_call = sum(times) / calls
        rows.append(f"| {kind} | {implementation} | {source} | {len(times) / calls:.0f} | {per_call:.2f} | "
                    f"{per_call / wall_ms:.1%} |")
    rows.append(f"| (all oneDNN) | | | | {total:.2f} | {total / wall_ms:.1%} |")
    rows.append(f"| (outside oneDNN) | | | | {wall_ms - total:.2f} | {(wall_ms - total) / wall_ms:.1%} |")
    overlap = (" oneDNN's times sum past it: TensorFlow ran independent ops at once, so `outside oneDNN` is not "
               "a time here.") if total > wall_ms else ""
    return "\n".join(rows) + f"\n\nWall time per call: {wall_ms:.2f} ms (with verbose logging on).{overlap}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="B/16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.arch, args.batch, args.dtype, args.calls, args.threads)
        return 0
    env = dict(os.environ, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1", TF_ENABLE_ONEDNN_OPTS="1",
               TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, "-m", "benchmarks.onednn_ops", "--child", "--arch", args.arch, "--batch",
               str(args.batch), "--dtype", args.dtype, "--calls", str(args.calls), "--threads", str(args.threads)]
    child = subprocess.run(command, capture_output=True, text=True, env=env)
    if child.returncode:
        sys.exit(f"benchmarks.onednn_ops: the model's process exited {child.returncode}: {child.stderr[-1500:]}")
    by_kind, wall_ms = parse(child.stdout.splitlines())
    if not by_kind:
        sys.exit("benchmarks.onednn_ops: oneDNN logged no primitive: is TensorFlow's oneDNN on "
                 "(TF_ENABLE_ONEDNN_OPTS) on this CPU?")
    print(f"## {args.arch}, batch {args.batch}, {args.dtype}, {args.threads} threads, {args.calls} timed calls\n")
    print(table(by_kind, wall_ms, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
