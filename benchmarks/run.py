"""Times keras_vit against keras-hub's ViT and timm's ViT on this machine.

    python -m benchmarks.run [--quick] [--out DIR] [--rounds N] [--threads N]
                             [--impls keras_vit,keras_hub,timm] [--cases infer_fp32_bs16,...]

Each (implementation, case) runs in a fresh subprocess (clean peak RSS, no thread-pool
fights between TensorFlow and PyTorch, same thread count for all), and the
implementations alternate within every case and round, so machine noise hits all of
them alike. keras-hub and timm are optional: missing ones are skipped with a note.
Writes DIR/benchmark.json and DIR/benchmark.md (default DIR: benchmarks/results).

Throughput is batch / median step latency. `peak` is the fraction of this machine's
matmul peak that the case's model FLOPs reach: the best rate of TensorFlow and PyTorch
square matmuls over several sizes, float32 or bfloat16. Every framework runs as its users
get it by default for the thread budget (benchmarks/worker.py). Ratios are keras_vit speed / peer speed
(> 1: keras_vit is faster); for start-up they are peer seconds / keras_vit seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cases as cases_lib
from benchmarks.worker import RESULT_PREFIX

IMPLS = ("keras_vit", "keras_hub", "timm")
# opt-in with --impls: keras_vit on portable ops only (KERAS_VIT_KERNELS=portable); keras_vit training with
# model.compile(jit_compile=True) (Keras leaves XLA off on CPU by default)
EXTRA_IMPLS = ("keras_vit_portable", "keras_vit_xla")
REQUIREMENTS = {"keras_vit": ("keras_vit",), "keras_vit_portable": ("keras_vit",), "keras_vit_xla": ("keras_vit",),
                "keras_hub": ("keras_hub",),
                "timm": ("torch", "timm")}
INSTALL_HINT = {"keras_hub": "pip install keras-hub (see README, Benchmarks)",
                "timm": "pip install torch timm (see README, Benchmarks)"}


def available(impl: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in REQUIREMENTS[impl])


def _spawn(args: list[str], threads: int, timeout: float):
    # OMP_WAIT_POLICY=PASSIVE: on a shared, loaded machine PyTorch's OpenMP threads spin in
    # barriers and timm ran ~7x slower (ViT-Ti bs8: 1375 ms vs 207 ms); TF does not use OpenMP.
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
                   filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])))
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return start, json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"worker {args[:2]} exited {proc.returncode}: {proc.stderr[-1500:]}")


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of the ISA flags that matter here it has."""
    name, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, [flag for flag in ISA_FLAGS if flag in flags]


def _matmul_peak(threads: int, sizes: list[int], timeout: float) -> tuple[dict, dict]:
    """Best matmul GFLOP/s per dtype over TensorFlow and (if installed) PyTorch, and TF's CPU setup."""
    peak, by_framework, setup = {}, {}, {}
    workers = ["matmul"] + (["matmul_torch"] if available("timm") else [])
    for worker in workers:
        try:
            _, result = _spawn([worker, str(threads), *map(str, sizes)], threads, timeout)
        except Exception as error:  # noqa: BLE001
            by_framework[worker] = {"error": str(error)[:300]}
            continue
        by_framework[worker] = result["matmul_gflops"]
        setup = result.get("tensorflow_cpu", setup)
        for dtype, value in result["matmul_gflops"].items():
            peak[dtype] = max(peak.get(dtype, 0.0), value)
    return peak or {"error": "not measured"}, {"matmul_by_framework": by_framework, "tensorflow_cpu": setup}


def _machine(threads: int, quick: bool, timeout: float, measure: bool = True, gpu: bool = False) -> dict:
    sizes = [256, 512] if quick else [4096, 8192] if gpu else [1024, 2048, 4096]
    gflops, details = ({"error": "not measured"}, {}) if not measure else _matmul_peak(threads, sizes, timeout)
    versions = {}
    for package in ("tensorflow", "keras", "keras-hub", "torch", "timm", "numpy"):
        try:
            from importlib.metadata import version
            versions[package] = version(package)
        except Exception:  # noqa: BLE001
            versions[package] = None
    cpu, isa = _cpu()
    return {"cpu": cpu, "isa_flags": isa, "cpu_count": os.cpu_count(), "threads": threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "matmul_sizes": sizes,
            "matmul_gflops": gflops, **details, "versions": versions, "python": platform.python_version()}


def run(quick: bool, rounds: int, threads: int, impls: list[str], case_names: list[str] | None,
        gpu: bool = False) -> dict:
    timeout = 180 if quick else 1200
    unknown = sorted(set(case_names or ()) - set(cases_lib.case_names(gpu)))
    if unknown:
        raise SystemExit(f"benchmarks.run: unknown case(s) {', '.join(unknown)}. Expected some of "
                         f"{', '.join(cases_lib.case_names(gpu))}{' (with --gpu)' if gpu else ''}.")
    selected = [c for c in cases_lib.cases(quick, gpu, tuple(case_names or ())) if not case_names
                or c.name in case_names]
    present = [i for i in impls if available(i)]
    skipped = {i: f"not installed: {INSTALL_HINT.get(i, '')}" for i in impls if i not in present}
    samples: dict[tuple[str, str], dict] = {}

    def record(impl, case, result):
        entry = samples.setdefault((case.name, impl), {"latencies": [], "rss": [], "notes": set(), "errors": []})
        if result.get("status") == "skipped":
            entry["skipped"] = result.get("note", "skipped")
            return
        if result.get("status") != "ok":
            entry["errors"].append(result.get("note", "error"))
            return
        entry["latencies"].extend(result.get("latencies", []))
        entry["rss"].append(result["peak_rss_mib"])
        if result.get("note"):
            entry["notes"].add(result["note"])

    if quick:
        machine = _machine(threads, quick, timeout, measure=False)
        _quick(selected, present, threads, timeout, record, machine)
    else:
        machine = _machine(threads, quick, timeout, gpu=gpu)
    for round_index in range(0 if quick else rounds):
        for case_index, case in enumerate(selected):
            # rotate the order so no implementation always runs first
            shift = (round_index + case_index) % max(len(present), 1)
            for impl in present[shift:] + present[:shift]:
                spec = json.dumps(case.to_dict())
                try:
                    start, results = _spawn([impl, str(threads), spec], threads, timeout)
                    result = results[0]
                    if case.kind == "startup" and result.get("status") == "ok":
                        result["latencies"] = [result["t_first_prediction"] - start]
                except Exception as error:  # noqa: BLE001
                    result = {"status": "error", "note": str(error)[-500:]}
                record(impl, case, result)
                print(f"[round {round_index + 1}/{rounds}] {case.name:16s} {impl:10s} "
                      f"{_summary(case, samples[(case.name, impl)])}", flush=True)
    if not quick:  # the machine is shared: measure the peak again at the end and keep the best
        again, _ = _matmul_peak(threads, machine["matmul_sizes"], timeout)
        for dtype, value in again.items():
            if isinstance(value, float):
                before = machine["matmul_gflops"].get(dtype)
                machine["matmul_gflops"][dtype] = max(value, before) if isinstance(before, float) else value
    rows = _rows(selected, present, samples, machine)
    return {"quick": quick, "rounds": rounds, "threads": threads, "machine": machine,
            "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
            "skipped": skipped, "cases": [c.to_dict() for c in selected], "results": rows}


def _quick(selected, present, threads, timeout, record, machine) -> None:
    """--quick: one subprocess per implementation runs every case, start-up first (the
    process is fresh then); the first TensorFlow one also measures a small matmul peak."""
    ordered = sorted(selected, key=lambda c: c.kind != "startup")
    for impl in present:
        specs = [json.dumps(c.to_dict()) for c in ordered]
        if impl != "timm" and "error" in machine["matmul_gflops"]:
            specs.append(json.dumps({"matmul": machine["matmul_sizes"]}))
        try:
            start, results = _spawn([impl, str(threads), *specs], threads, timeout)
        except Exception as error:  # noqa: BLE001
            results = [{"status": "error", "note": str(error)[-500:], "case": c.name} for c in ordered]
            start = 0.0
        by_name = {c.name: c for c in ordered}
        for result in results:
            if "matmul_gflops" in result:
                machine["matmul_gflops"] = result["matmul_gflops"]
                machine["tensorflow_cpu"] = result["tensorflow_cpu"]
                continue
            case = by_name[result["case"]]
            if case.kind == "startup" and result.get("status") == "ok":
                result["latencies"] = [result["t_first_prediction"] - start]
            record(impl, case, result)
        print(f"[quick] {impl}: done", flush=True)


def _summary(case, entry) -> str:
    if entry.get("skipped"):
        return "skipped: " + entry["skipped"]
    if not entry["latencies"]:
        return "error: " + "; ".join(entry["errors"])[:200]
    p50 = statistics.median(entry["latencies"])
    if case.kind == "startup":
        return f"{p50:.2f} s to first prediction"
    return f"{case.batch / p50:8.2f} img/s  p50 {p50 * 1e3:8.1f} ms"


def _percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    low, high = int(k), min(int(k) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (k - low)


def _rows(selected, present, samples, machine) -> list[dict]:
    rows = []
    for case in selected:
        by_impl = {}
        for impl in present:
            entry = samples.get((case.name, impl))
            row = {"case": case.name, "kind": case.kind, "arch": case.arch, "batch": case.batch,
                   "dtype": case.dtype, "impl": impl}
            if entry and entry.get("skipped"):
                continue
            if not entry or not entry["latencies"]:
                row.update(status="error", note="; ".join(entry["errors"]) if entry else "not run")
                rows.append(row)
                continue
            lat = entry["latencies"]
            p50 = statistics.median(lat)
            row.update(status="ok", samples=len(lat), latency_p50_ms=p50 * 1e3,
                       latency_p90_ms=_percentile(lat, 0.9) * 1e3, peak_rss_mib=max(entry["rss"]),
                       note="; ".join(sorted(entry["notes"])))
            if case.kind == "startup":
                row.update(startup_s=p50, img_per_s=None, achieved_gflops=None, peak_fraction=None)
            else:
                gflops = cases_lib.case_flops(case) / p50 / 1e9
                peak = machine["matmul_gflops"].get(case.dtype) if isinstance(machine["matmul_gflops"], dict) else None
                row.update(img_per_s=case.batch / p50, achieved_gflops=gflops,
                           peak_fraction=(gflops / peak) if isinstance(peak, float) else None)
            by_impl[impl] = row
            rows.append(row)
        for impl, row in by_impl.items():
            ratios = {}
            for peer, other in by_impl.items():
                if peer == impl:
                    continue
                if case.kind == "startup":
                    ratios[peer] = other["startup_s"] / row["startup_s"]
                else:
                    ratios[peer] = row["img_per_s"] / other["img_per_s"]
            row["ratio_to"] = ratios
    return rows


def markdown(report: dict) -> str:
    m = report["machine"]
    peak = m["matmul_gflops"]
    peak_text = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items() if isinstance(v, float))
    lines = [
        "# keras_vit benchmark", "",
        f"`{report['command']}`{' (quick: tiny configs, not representative)' if report['quick'] else ''}", "",
        f"- CPU: {m['cpu']} ({m['cpu_count']} logical CPUs); ISA: {', '.join(m['isa_flags']) or 'none of note'}; "
        f"{m['threads']} threads per framework"
        f"{' (all CPUs: every framework at its defaults)' if m['threads'] == m['cpu_count'] else ''}, "
        f"{report['rounds']} round(s), implementations interleaved, OMP_WAIT_POLICY={m['omp_wait_policy']}",
        f"- TensorFlow CPU setup: {json.dumps(m.get('tensorflow_cpu', {}))}",
        f"- Matmul peak (best of TensorFlow and PyTorch, square sizes {m['matmul_sizes']}): {peak_text or peak}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
        "- img/s = batch / median step latency; ratio = keras_vit speed / peer speed (> 1: keras_vit faster); "
        "start-up ratio = peer seconds / keras_vit seconds", "",
    ]
    for impl, why in report["skipped"].items():
        lines.append(f"- **{impl} skipped**: {why}")
    lines += ["",
              "| case | impl | img/s | p50 ms | p90 ms | peak RSS MiB | % of matmul peak | keras_vit ratio | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        if row["status"] != "ok":
            lines.append(f"| {row['case']} | {row['impl']} | error | | | | | | {row['note'][:150]} |")
            continue
        ratio = ""
        if row["impl"].startswith("keras_vit"):
            ratio = ", ".join(f"{v:.2f}x vs {k}" for k, v in row["ratio_to"].items())
        if row["kind"] == "startup":
            speed = f"{row['startup_s']:.2f} s"
        else:
            speed = f"{row['img_per_s']:.2f}"
        frac = f"{100 * row['peak_fraction']:.0f}%" if row.get("peak_fraction") else ""
        lines.append(f"| {row['case']} ({row['arch']}, bs{row['batch']}, {row['dtype']}) | {row['impl']} | {speed} | "
                     f"{row['latency_p50_ms']:.1f} | {row['latency_p90_ms']:.1f} | {row['peak_rss_mib']:.0f} | "
                     f"{frac} | {ratio} | {row['note']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny configs, one round, well under a minute")
    parser.add_argument("--gpu", action="store_true", help="the GPU cases (batch 64; Keras on its configured backend)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output folder")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads per framework")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help="comma-separated subset of " + ",".join(IMPLS + EXTRA_IMPLS))
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS) - set(EXTRA_IMPLS)
    if unknown:
        parser.error(f"unknown implementations {sorted(unknown)}; expected some of {IMPLS}")
    report = run(args.quick, args.rounds or 1, args.threads, impls, [c for c in args.cases.split(",") if c], args.gpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(report, indent=2))
    (out / "benchmark.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'benchmark.json'} and {out / 'benchmark.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
