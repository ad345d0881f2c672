"""The benchmark harness runs in --quick mode and writes the fields its reports promise.

The benchmark itself is not a test: this checks only that `python -m benchmarks.run
--quick` runs end to end (peers skipped when not installed) and that its JSON is whole.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW_FIELDS = {"case", "kind", "arch", "batch", "dtype", "impl", "status", "samples", "img_per_s",
              "latency_p50_ms", "latency_p90_ms", "peak_rss_mib", "peak_fraction", "ratio_to"}


def test_quick_benchmark_writes_json_and_markdown(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert (tmp_path / "benchmark.md").read_text().startswith("# keras_vit benchmark")
    assert report["quick"] is True
    assert {"cpu", "isa_flags", "threads", "matmul_gflops", "tensorflow_cpu", "versions"} <= report["machine"].keys()
    assert set(report["machine"]["matmul_gflops"]) == {"float32", "bfloat16"}
    case_names = {case["name"] for case in report["cases"]}
    assert case_names == {"infer_fp32_bs1", "infer_fp32_bs16", "infer_bf16_bs1", "infer_bf16_bs16",
                          "train_fp32_bs32", "startup"}
    ours = [row for row in report["results"] if row["impl"] == "keras_vit"]
    assert {row["case"] for row in ours} == case_names
    for row in ours:
        assert row["status"] == "ok", row
        assert ROW_FIELDS <= row.keys(), ROW_FIELDS - row.keys()
        assert row["latency_p50_ms"] > 0 and row["peak_rss_mib"] > 0
        if row["kind"] == "startup":
            assert row["startup_s"] > 0
        else:
            assert row["img_per_s"] > 0 and 0 < row["peak_fraction"]
    peers = {row["impl"] for row in report["results"]} - {"keras_vit"}
    for row in ours:
        assert set(row["ratio_to"]) == peers & {r["impl"] for r in report["results"]
                                                   if r["case"] == row["case"] and r["status"] == "ok"}
    for impl, why in report["skipped"].items():
        assert "not installed" in why
