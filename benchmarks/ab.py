"""Before/after timing of keras_vit from two source trees, interleaved on the same machine.

    git worktree add /tmp/before main
    python -m benchmarks.ab /tmp/before . [--cases infer_fp32_bs1,infer_fp32_bs16,train_fp32_bs32] [--rounds 3]
    python -m benchmarks.ab /tmp/before . --cases startup --rounds 6   # process start to the first prediction

Each (tree, case) runs `benchmarks.worker keras_vit` of that tree in a fresh subprocess with the tree first on
`PYTHONPATH` and `keras_vit.training` / `keras_vit.export` read from the tree's `training/` and `export/` (an
installed keras_vit, editable or not, would map them to its own copy); the trees alternate within every case and
round (the order rotates), so machine noise hits both alike. Prints each round's medians and those of all rounds
so far (one round's process can drift: compare the rounds too), then the median step latency of each and the speed
ratio after / before (> 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

from benchmarks import cases as cases_lib
from benchmarks.run import _cpu
from benchmarks.worker import RESULT_PREFIX

DEFAULT_CASES = "infer_fp32_bs1,infer_fp32_bs16,train_fp32_bs32"


# `python -m benchmarks.worker`, run in a tree (the working directory), with setup.py's `package_dir` packages
# read from the tree's folders: the before-tree of an A/B of the training or export code is that tree's code.
TREE_WORKER = textwrap.dedent("""
    import importlib.abc, importlib.util, os, runpy, sys

    FOLDERS = {"keras_vit.training": "training", "keras_vit.export": "export"}

    class TreeFolders(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in FOLDERS:
                return None
            folder = os.path.join(os.getcwd(), FOLDERS[name])
            return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])

    sys.meta_path.insert(0, TreeFolders())
    runpy.run_module("benchmarks.worker", run_name="__main__", alter_sys=True)
""")


def _latencies(tree: str, case: cases_lib.Case, threads: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TF_CPP_MIN_LOG_LEVEL="2",
               OMP_NUM_THREADS=str(threads))
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", TREE_WORKER, "keras_vit", str(threads), json.dumps(case.to_dict())],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])[0]
            if result.get("status") != "ok":
                raise RuntimeError(f"{tree} {case.name}: {result.get('note')}")
            if case.kind == "startup":  # process start to the first prediction, as benchmarks.run times it
                return [result["t_first_prediction"] - start]
            return result["latencies"]
    raise RuntimeError(f"{tree} {case.name}: worker exited {proc.returncode}: {proc.stderr[-1500:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="source tree of the baseline (e.g. a git worktree of main)")
    parser.add_argument("after", help="source tree to compare")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated (default: {DEFAULT_CASES})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    names = tuple(args.cases.split(","))
    unknown = sorted(set(names) - set(cases_lib.case_names()))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}. Expected some of {', '.join(cases_lib.case_names())}")
    selected = [case for case in cases_lib.cases(False, named=names) if case.name in names]
    cpu, isa = _cpu()
    print(f"CPU: {cpu}; ISA: {', '.join(isa)}; {args.threads} threads; {args.rounds} rounds, trees interleaved")
    samples = {(case.name, tree): [] for case in selected for tree in (args.before, args.after)}
    for round_index in range(args.rounds):
        for case in selected:
            order = (args.before, args.after) if round_index % 2 == 0 else (args.after, args.before)
            this_round = {}
            for tree in order:
                this_round[tree] = _latencies(tree, case, args.threads)
                samples[(case.name, tree)].extend(this_round[tree])
            print(f"[round {round_index + 1}/{args.rounds}] {case.name}: this round before "
                  f"{statistics.median(this_round[args.before]) * 1e3:.1f} ms, after "
                  f"{statistics.median(this_round[args.after]) * 1e3:.1f} ms; all rounds so far before "
                  f"{statistics.median(samples[(case.name, args.before)]) * 1e3:.1f} ms, after "
                  f"{statistics.median(samples[(case.name, args.after)]) * 1e3:.1f} ms", flush=True)
    print("\n| case | before (ms) | after (ms) | after / before speed |\n|---|---:|---:|---:|")
    for case in selected:
        before = statistics.median(samples[(case.name, args.before)])
        after = statistics.median(samples[(case.name, args.after)])
        print(f"| {case.name} | {before * 1e3:.1f} | {after * 1e3:.1f} | {before / after:.3f}x |")


if __name__ == "__main__":
    main()
