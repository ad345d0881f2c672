"""The benchmark harness runs in --quick mode and writes the fields its reports promise.

The benchmark itself is not a test: this checks that `python -m benchmarks.run --quick` runs
end to end (peers skipped when not installed) and that its JSON is whole; the fast tests run
one quick case in this process and check the harness' arithmetic.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import ab, cases, matmul_floor, run, serving, torchvision_stub, worker
from keras_vit.export import saved_model
from tests.testing import needs

ROOT = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"case", "kind", "arch", "batch", "dtype", "impl", "status", "samples", "img_per_s",
              "latency_p50_ms", "latency_p90_ms", "peak_rss_mib", "peak_fraction", "ratio_to"}


def _rounding_bounds(cell: str) -> tuple[float, float]:
    """The values a number printed as `cell` can have been: +- half its last printed digit."""
    half = 0.5 * 10.0 ** -len(cell.partition(".")[2])
    return float(cell) - half, float(cell) + half


def assert_ratio_of_cells(ratio: str, numerator: str, denominator: str) -> None:
    """A table's ratio ("1.234x") is the quotient of the unrounded times printed in two of its cells: it lies
    within the quotients that rounding those cells allows (a tiny model's 1.9 ms can have been 1.949)."""
    low_ratio, high_ratio = _rounding_bounds(ratio.rstrip("x"))
    (low_n, high_n), (low_d, high_d) = _rounding_bounds(numerator), _rounding_bounds(denominator)
    assert low_n / high_d <= high_ratio and low_ratio <= high_n / low_d, (ratio, numerator, denominator)


def test_a_ratio_is_checked_against_the_rounding_of_its_cells():
    assert_ratio_of_cells("16.264x", "31.7", "1.9")  # a run's row: 1.9 ms was about 1.949, 2.6% off the cells' 16.68
    assert_ratio_of_cells("1.100x", "2.20", "2.00")
    for wrong in ("16.000x", "17.200x"):
        with pytest.raises(AssertionError):
            assert_ratio_of_cells(wrong, "31.7", "1.9")


@pytest.mark.slow
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


@pytest.mark.slow
def test_worker_times_a_quick_case_in_this_process(capsys):
    case = next(case for case in cases.cases(quick=True) if case.name == "infer_fp32_bs16")
    worker.main(["keras_vit", "2", json.dumps(case.to_dict())])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(worker.RESULT_PREFIX)]
    (result,) = json.loads(lines[0][len(worker.RESULT_PREFIX):])
    assert result["status"] == "ok" and result["case"] == case.name, result
    assert len(result["latencies"]) == case.iters and min(result["latencies"]) > 0


def test_dinov3_cases_time_keras_vit_rotary_model_and_no_other(monkeypatch, capsys):
    built = []
    build = worker._keras_vit_model
    monkeypatch.setattr(worker, "KERAS_BUILDERS", dict(worker.KERAS_BUILDERS, keras_vit=lambda *args: built.append(
        build(*args)) or built[-1]))
    (case,) = cases.cases(quick=True, named=("infer_dinov3_bs8",))[-1:]
    assert (case.name, case.arch, case.batch) == ("infer_dinov3_bs8", "DINOv3-tiny", 8)
    for impl in ("keras_vit", "keras_hub", "timm"):
        worker.main([impl, "2", json.dumps(case.to_dict())])
    results = [json.loads(line[len(worker.RESULT_PREFIX):])[0] for line in capsys.readouterr().out.splitlines()
               if line.startswith(worker.RESULT_PREFIX)]
    assert [result["status"] for result in results] == ["ok", "skipped", "skipped"], results
    assert "DINOv3-tiny is built by keras_vit only" in results[2]["note"]
    config = built[0].vit_config
    assert (config.rope, config.num_register_tokens, config.position_embedding) == ("dinov3", 4, "none")
    assert cases.forward_flops("DINOv3-tiny") > cases.forward_flops("tiny")  # its 4 register tokens count


@pytest.mark.parametrize("kind, result, expected", [
    ("startup", {"t_first_prediction": 112.5}, [12.5]),  # process start (100.0) to the first prediction
    ("inference", {"latencies": [0.25, 0.5]}, [0.25, 0.5]),
])
def test_ab_reads_each_case_kind_from_the_worker(monkeypatch, kind, result, expected):
    case = next(case for case in cases.FULL_CASES if case.kind == kind)
    line = worker.RESULT_PREFIX + json.dumps([{"status": "ok", **result}])
    monkeypatch.setattr(ab.time, "time", lambda: 100.0)
    monkeypatch.setattr(ab.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 0, stdout=f"log line\n{line}\n", stderr=""))
    assert ab._latencies(str(ROOT), case, 2) == expected


def test_ab_worker_reads_the_training_and_export_packages_of_its_tree(tmp_path):
    """keras_vit.training and keras_vit.export are a tree's training/ and export/ (setup.py's package_dir): the
    worker of a before-tree gets that tree's, not those of the keras_vit installed here."""
    for folder in ("keras_vit", "training", "export", "training/recipes", "benchmarks"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text(f"TREE = {folder!r}\n")
    (tmp_path / "benchmarks" / "worker.py").write_text(
        "import sys\nimport keras_vit.export, keras_vit.training.recipes\n"
        "print(sys.argv[1:], keras_vit.training.recipes.__file__, keras_vit.export.__file__)\n")
    done = subprocess.run([sys.executable, "-c", ab.TREE_WORKER, "keras_vit", "2"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['keras_vit',", "'2']", str(tmp_path / "training" / "recipes" / "__init__.py"),
                                   str(tmp_path / "export" / "__init__.py")]


def test_ab_prints_each_round_beside_all_rounds_so_far(monkeypatch, capsys):
    timings = iter([[0.3], [0.2], [0.1], [0.4]])  # round 1: before, after; round 2: after, before
    monkeypatch.setattr(ab, "_latencies", lambda tree, case, threads: next(timings))
    ab.main(["/before", "/after", "--cases", "infer_fp32_bs1", "--rounds", "2"])
    out = capsys.readouterr().out
    assert ("[round 1/2] infer_fp32_bs1: this round before 300.0 ms, after 200.0 ms; all rounds so far before "
            "300.0 ms, after 200.0 ms") in out
    assert ("[round 2/2] infer_fp32_bs1: this round before 400.0 ms, after 100.0 ms; all rounds so far before "
            "350.0 ms, after 150.0 ms") in out
    assert "| infer_fp32_bs1 | 350.0 | 150.0 | 2.333x |" in out


@pytest.mark.slow
@pytest.mark.parametrize("accelerator", [False, True])
def test_worker_gives_keras_its_input_on_the_device_as_timm_has_it(accelerator, monkeypatch, capsys):
    # On a GPU the Keras models took a host array, copied to the device in every timed step, and timm a CUDA
    # tensor (RESULTS.md run R): the inference input is now converted once where Keras computes on an accelerator.
    import keras
    monkeypatch.setattr(worker, "_keras_on_accelerator", lambda keras: accelerator)
    seen = []
    predict = keras.Model.predict_on_batch
    monkeypatch.setattr(keras.Model, "predict_on_batch", lambda self, x: seen.append(type(x)) or predict(self, x))
    case = next(case for case in cases.cases(quick=True) if case.name == "infer_fp32_bs16")
    worker.main(["keras_vit", "2", json.dumps(case.to_dict())])
    assert worker.RESULT_PREFIX in capsys.readouterr().out
    assert len(seen) == case.warmup + case.iters and len(set(seen)) == 1
    assert (seen[0] is np.ndarray) is not accelerator, seen[0]


def test_forward_flops_count_every_matmul_of_the_tiny_model():
    # 32 px at patch 8: 16 patches + the class token; width 32, MLP 64, 2 blocks, 10 classes.
    tokens, d, m = 17, 32, 64
    attention = tokens * 3 * d * d + 2 * tokens * tokens * d + tokens * d * d  # QKV, scores and mix, output
    per_block = attention + tokens * 2 * d * m
    macs = 2 * per_block + 16 * 8 * 8 * 3 * d + d * 10  # blocks, patch embedding, head
    assert cases.forward_flops("tiny") == 2 * macs
    train = next(case for case in cases.cases(quick=True) if case.kind == "train")
    assert cases.case_flops(train) == 3 * train.batch * 2 * macs


def test_training_cases_run_when_named_and_an_unknown_case_is_named_with_the_choices(capsys):
    assert not {case.name for case in cases.TRAINING_CASES} & {case.name for case in cases.cases(quick=False)}
    named = cases.cases(quick=True, named=("train_b16_bf16_bs8",))
    assert [case.name for case in named[-1:]] == ["train_b16_bf16_bs8"] and named[-1].arch == "tiny"
    assert (named[-1].kind, named[-1].dtype) == ("train", "bfloat16")
    with pytest.raises(SystemExit, match=r"benchmarks.run: unknown case\(s\) train_bf16. Expected some of "
                       r"infer_fp32_bs1, .*train_bf16_bs32, train_b16_fp32_bs8, train_b16_bf16_bs8, infer_dinov3_bs1, "
                       r"infer_dinov3_bs8\."):
        run.run(True, 1, 1, ["keras_vit"], ["train_bf16"])
    with pytest.raises(SystemExit):
        ab.main(["/nowhere", "/nowhere", "--cases", "infer_fp32_bs1,nope"])
    assert "unknown case(s) nope. Expected some of infer_fp32_bs1" in capsys.readouterr().err


@pytest.mark.parametrize("arch", sorted(cases.ARCHS))
def test_forward_matmuls_are_every_flop_of_the_forward(arch):
    for batch in (1, 3):
        shapes = cases.forward_matmuls(arch, batch)
        assert sum(2 * count * batched * m * k * n for count, batched, m, k, n in shapes) == \
            cases.forward_flops(arch) * batch


def test_matmul_floor_products_are_computed_and_summed(monkeypatch, capsys):
    # One real timing of a small shape, then the floor's sum over the forward with a stand-in clock.
    assert 0 < matmul_floor.matmul_seconds(1, 16, 8, 4, chain=3) < 1
    monkeypatch.setattr(matmul_floor, "matmul_seconds", lambda batched, m, k, n: batched * m * k * n * 1e-9)
    matmul_floor.main(["--arch", "tiny", "--batches", "2"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny | 2 |")]
    expected_ms = sum(c * b * m * k * n for c, b, m, k, n in cases.forward_matmuls("tiny", 2)) * 1e-6
    assert row == [f"| tiny | 2 | {expected_ms:.1f} | 2 |"]


def test_litert_ops_times_each_op_and_says_where_it_ran(capsys):
    from benchmarks import litert_ops  # TensorFlow and LiteRT: imported here, so this module collects without them
    litert_ops.main(["--tokens", "5", "--width", "16", "--heads", "2", "--runs", "2"])
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[3:6]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    # Times in ms to 0.001: at these tiny shapes the fastest ops (LOGISTIC) can print as 0.000.
    times = [float(cell) for one, two, _ in list(rows.values())[1:] for cell in (one, two)]
    assert len(rows) == 1 + 14 and min(times) >= 0 and max(times) > 0, rows
    outside = {case: where.strip() for case, (_, _, where) in rows.items()}
    # The interpreter's own kernel takes an int8 BATCH_MATMUL whose right operand has a zero point; XNNPACK
    # takes it on keras_vit's symmetric range. The squared LayerNorm brings SQUARED_DIFFERENCE, the product not.
    for product in ("q k^T (BATCH_MATMUL)", "A V (BATCH_MATMUL)"):
        assert outside[product, "plain"] == "BATCH_MATMUL 1" and outside[product, "keras_vit"] == "none"
    assert "SQUARED_DIFFERENCE 1" in outside["LayerNorm, square(x - mean)", "plain"]
    assert "SQUARED_DIFFERENCE" not in outside["LayerNorm, (x - mean)(x - mean)", "plain"]
    assert outside["dense, width -> 4 x width (FULLY_CONNECTED)", "plain"] == "none"
    # int8_cpu's float32 softmax and GELU run on XNNPACK, the int8 ones in the interpreter.
    assert outside["softmax", "plain"] == "SOFTMAX 1" and outside["softmax", "int8_cpu"] == "none"
    assert outside["GELU (tanh)", "plain"] == "GELU 1" and outside["GELU (tanh)", "int8_cpu"] == "none"
    # XNNPACK has int8 LOGISTIC but no int8 EXP: a softmax of XNNPACK's int8 ops leaves EXP (and the reciprocal's
    # DIV) in the interpreter.
    assert outside["exp (softmax's numerator)", "plain"] == "EXP 1"
    assert outside["sigmoid (LOGISTIC)", "plain"] == "none"
    assert outside["softmax as exp(x - max) * (1 / sum)", "plain"] == "DIV 1, EXP 1"


def test_int8_softmax_forms_run_on_xnnpack_and_none_is_as_exact_as_softmax(capsys):
    from benchmarks import int8_softmax  # TensorFlow and LiteRT: imported here, as above
    int8_softmax.main(["--tokens", "24", "--heads", "2", "--runs", "2"])
    lines = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| ") and "---" not in line]
    rows = {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in lines[1:]}  # after the header
    assert list(rows) == [name for name, _, _ in int8_softmax.FORMS], rows
    assert all(float(row[0]) >= 0 and float(row[1]) >= 0 for row in rows.values()), rows
    softmax, by_reciprocal, by_log, ranges_set, two_passes = rows.values()
    # XNNPACK runs ELU: of the ELU forms only the reciprocals' DIVs (or the LOG) stay in the interpreter. But the
    # converter leaves ELU in float32, so no ELU form is integer-only.
    assert [row[2] for row in rows.values()] == ["SOFTMAX 1", "DIV 1", "LOG 1", "DIV 1", "DIV 2"]
    assert [row[5] for row in rows.values()] == ["none", "ELU", "ELU", "ELU", "ELU"]
    # The built-in is within a step or two of its output (1/256; one here) on rows of mixed temperature. Each
    # ELU form is less exact; setting the ranges (an exact x - max, an ELU that reaches -1) and a second pass
    # (the sums near 1, held finely) each make it more exact.
    assert float(softmax[3]) <= 2 / 256
    errors = [float(row[3]) for row in (two_passes, ranges_set, by_reciprocal)]
    assert float(softmax[3]) < errors[0] < errors[1] < errors[2], rows


def test_serving_benchmark_loads_keras_vit_savedmodel_as_tf_serving_does(tmp_path):
    path = serving.export("keras_vit", "tiny", str(tmp_path))
    result = serving.serve(path, [1, 2], runs=1, profile=True)
    assert sorted(result) == ["1", "2", "profile_ms"] and result["1"] > 0 and result["2"] > 0
    assert any("MatMul" in op for op in result["profile_ms"]), result["profile_ms"]


def test_serving_benchmark_exports_the_bfloat16_model_checked_against_float32(tmp_path, capsys):
    path = serving.export(serving.BFLOAT16, "tiny", str(tmp_path))
    metadata = saved_model.read_metadata(path)
    assert metadata["precision"] == "bfloat16" and metadata["precision_check"]["min_cosine"] > 0.99
    assert f"{serving.BFLOAT16}: against float32 on 128 photographs, top-1 agreement" in capsys.readouterr().out
    assert serving.serve(path, [1], runs=1, profile=False)["1"] > 0


def test_runtimes_benchmark_writes_each_form_and_measures_its_agreement(tmp_path, capsys):
    from benchmarks import runtimes

    forms = ["savedmodel_bf16", "onnx_int8", "onnx_int8_static", "openvino_default", "openvino_int8",
             "litert_dynamic_int8", "savedmodel_int8"]
    paths, checks = runtimes.write_files("tiny", str(tmp_path), forms)
    for form in forms:
        result = runtimes.run_form(form, paths[form], checks, [1, 3], runs=1, threads=1)
        assert 0.8 <= result["top1_agreement"] <= 1 and 0 < result["max_abs_diff"] < 0.01, (form, result)
        assert result["bs1"] > 0 and result["bs3"] > 0 and result["classes_predicted"] > 1
    with pytest.raises(SystemExit):
        runtimes.main(["--forms", "onnx_fp32,tensorrt"])
    assert "unknown form(s) tensorrt. Expected some of savedmodel_fp32" in capsys.readouterr().err


@pytest.mark.slow
@needs("keras_hub", "keras-hub's ViT, the runtimes benchmark's keras_hub_onnx_fp32 form")
def test_runtimes_benchmark_reports_keras_hubs_onnx_file_as_onnx_runtime_takes_it(tmp_path, capsys):
    """keras-hub's ViT through Keras' own `model.export(format="onnx")`: with keras-hub 0.32, tf2onnx 1.17 and ONNX
    Runtime 1.32 (benchmarks/RESULTS.md, run AZ) Keras writes the file, ONNX Runtime refuses it (its exact GELU
    became an `Erfc` node, an op ONNX does not have), and the table says so in that form's row while the other forms
    run. If a newer keras-hub or tf2onnx fixes the file, this test fails: measure the row and update run AZ."""
    import onnx
    from benchmarks import runtimes

    paths, checks = runtimes.write_files("tiny", str(tmp_path), ["keras_hub_onnx_fp32"])
    assert "Erfc" in {node.op_type for node in onnx.load(paths["keras_hub_onnx_fp32"]).graph.node}
    with np.load(checks) as arrays:  # keras-hub's own reference, beside keras_vit's
        assert arrays["keras_hub"].shape == arrays["keras_vit"].shape
        assert not np.allclose(arrays["keras_hub"], arrays["keras_vit"], atol=1e-3)
    capsys.readouterr()
    runtimes.main(["--arch", "tiny", "--forms", "keras_hub_onnx_fp32,onnx_fp32", "--rounds", "1", "--runs", "1",
                   "--batches", "1", "--threads", "1"])
    rows = {line.split(" | ")[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "| keras_hub_onnx_fp32 | failed |" in rows["| keras_hub_onnx_fp32"], rows
    assert "No Op registered for Erfc" in rows["| keras_hub_onnx_fp32"], rows
    assert "100.0%" in rows["| onnx_fp32"], rows


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 1.0])
def test_percentile_interpolates_like_numpy(q):
    values = [5.0, 1.0, 4.0, 2.5, 9.0]
    assert run._percentile(values, q) == pytest.approx(np.percentile(values, 100 * q))


@pytest.mark.slow
@needs("torch", "the torchvision stub of the timm benchmark")
def test_torchvision_stub_frozen_batch_norm_is_the_affine_batch_norm():
    import torch
    norm = torchvision_stub._frozen_batch_norm()(3)
    rng = np.random.default_rng(0)
    weight, bias, mean, var = rng.normal(size=3), rng.normal(size=3), rng.normal(size=3), rng.uniform(0.5, 2, 3)
    for name, value in (("weight", weight), ("bias", bias), ("running_mean", mean), ("running_var", var)):
        getattr(norm, name).copy_(torch.tensor(value, dtype=torch.float32))
    x = rng.normal(size=(2, 3, 4, 4))
    expected = ((x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-5) * weight[:, None, None]
                + bias[:, None, None])
    np.testing.assert_allclose(norm(torch.tensor(x, dtype=torch.float32)).numpy(), expected, atol=1e-5)


@pytest.mark.slow
def test_jax_predict_benchmark_reports_a_built_model_and_its_ratio():
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.jax_predict", "--impls", "keras_vit", "--archs", "tiny",
                           "--iters", "2", "--check", "100"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| keras_vit | tiny |"))
    unbuilt, predict_ms, jit_ms, ratio = [cell.strip() for cell in row.strip("|").split("|")[2:]]
    assert unbuilt == "0" and float(predict_ms) > 0 and float(jit_ms) > 0
    assert_ratio_of_cells(ratio, predict_ms, jit_ms)


@pytest.mark.slow
def test_kernel_choice_benchmark_times_both_on_the_same_weights_and_checks_the_ratio(capsys):
    from benchmarks import kernel_choice  # in this process: it restores the kernel switch it sets
    capsys.readouterr()
    status = kernel_choice.main(["--arch", "tiny", "--batches", "1,3", "--train-arch", "tiny", "--train-batch", "4",
                                 "--calls", "2", "--check", "1e9"])
    out = capsys.readouterr().out
    assert status == 1, out[-2000:]  # no kernel is a billion times faster: --check fails
    assert "keras_vit's choice here: KernelChoice(" in out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| tiny ")]
    assert [row[0] for row in rows] == ["tiny predict_on_batch, batch 1", "tiny predict_on_batch, batch 3",
                                        "tiny train_on_batch, batch 4"]
    for case, chosen, portable, ratio, check in rows:
        assert_ratio_of_cells(ratio, portable, chosen)
    for row in rows[:2]:  # the same weights and images: the logits agree
        assert float(row[4].split()[-1]) < 1e-4
    losses = [float(word) for word in rows[2][4].replace(",", "").split() if word[0].isdigit()]
    assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], abs=1e-4)


def test_paired_calls_alternate_and_each_pair_is_counted():
    from benchmarks import paired
    order = []
    times = paired.alternate({"keras_vit": lambda: order.append("keras_vit"),
                              "keras_hub": lambda: order.append("keras_hub")}, 4)
    assert order == ["keras_vit", "keras_hub", "keras_hub", "keras_vit"] * 2  # neither always goes first
    assert [len(samples) for samples in times.values()] == [4, 4]
    row = paired._row("case", {"keras_vit": [1.0, 5.0, 2.0], "keras_hub": [2.0, 4.0, 3.0]})
    assert row == {"case": "case", "keras_vit": 2.0, "keras_hub": 3.0, "faster": "2 of 3"}


def test_paired_without_keras_hub_says_how_to_install_it(monkeypatch, capsys):
    from benchmarks import paired
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # `import keras_hub` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        paired.main(["--arch", "tiny"])
    assert exit_info.value.code == 2
    assert "keras-hub is not installed: pip install keras-hub" in capsys.readouterr().err


def test_dinov3_benchmark_without_keras_hub_says_how_to_install_it(monkeypatch, capsys):
    from benchmarks import dinov3
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # `import keras_hub` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        dinov3.main(["--batches", "1"])
    assert exit_info.value.code == 2
    assert "keras-hub is not installed: pip install keras-hub" in capsys.readouterr().err


@pytest.mark.slow
def test_paired_benchmark_times_keras_vit_and_the_peer_in_one_process(monkeypatch, capsys):
    """keras-hub's place is taken by a stand-in (keras-hub is not a dependency): the timing, the compiled
    optimizers, the table and --check are paired's own."""
    import types

    import keras

    from benchmarks import paired
    from training.trainer import AdamW
    built = {}
    build = worker.KERAS_BUILDERS["keras_vit"]

    def recorded(impl):
        return lambda arch, train: built.setdefault((impl, train), build(arch, train))
    monkeypatch.setitem(worker.KERAS_BUILDERS, "keras_vit", recorded("keras_vit"))
    monkeypatch.setitem(worker.KERAS_BUILDERS, "keras_hub", recorded("keras_hub"))
    monkeypatch.setitem(sys.modules, "keras_hub", types.SimpleNamespace(__version__="stand-in"))
    code = paired.main(["--arch", "tiny", "--batches", "1,3", "--train-arch", "tiny", "--train-batch", "4",
                        "--calls", "3", "--check", "1e9"])
    out = capsys.readouterr().out
    assert code == 1  # no model is a billion times faster than another: --check fails
    assert "keras-hub stand-in; 3 alternating calls per case" in out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| tiny ")]
    assert [row[0] for row in rows] == ["tiny predict_on_batch, batch 1", "tiny predict_on_batch, batch 3",
                                        "tiny train_on_batch, batch 4"]
    for case, ours, theirs, ratio, faster in rows:
        assert_ratio_of_cells(ratio, theirs, ours)
        assert faster.endswith(" of 3 pairs") and 0 <= int(faster.split()[0]) <= 3
    # each trains with its own AdamW, as in benchmarks.run: keras_vit's fused one, the peer Keras' own
    assert isinstance(built["keras_vit", True].optimizer, AdamW)
    assert type(built["keras_hub", True].optimizer) is keras.optimizers.AdamW


@pytest.mark.slow  # two tiny models, 2 batch sizes, 3 calls each (about 5 s)
def test_naflex_speed_benchmark_times_both_models_on_the_same_token_count(monkeypatch, capsys):
    """SigLIP-B/16's place is taken by a one-block encoder of width 32: the inputs, the alternating calls, the table
    and --check are the benchmark's own."""
    from benchmarks import naflex_speed
    monkeypatch.setattr(naflex_speed, "B16", dict(naflex_speed.B16, hidden_dim=32, mlp_dim=64, num_heads=2,
                                                  num_layers=1))
    square, sequences = naflex_speed.inputs(3)
    assert square.shape == (3, 256, 256, 3)
    assert sequences["patches"].shape == (3, naflex_speed.BUDGET, 16 * 16 * 3)
    assert sequences["spatial_shapes"].tolist() == [[16, 16], [12, 21], [21, 12]]
    assert sequences["patch_mask"].sum(1).tolist() == [256, 252, 252]
    code = naflex_speed.main(["--batches", "1,3", "--calls", "3", "--check", "1e-9"])
    out = capsys.readouterr().out
    assert code == 1  # NaFlex is not a billion times faster than the fixed model: --check fails
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        fixed, flexible, ratio = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
        assert fixed > 0 and flexible > 0 and ratio == pytest.approx(flexible / fixed, rel=0.01, abs=2e-3)
        assert row[4].endswith(" of 3")


def test_exported_files_benchmark_measures_each_batch_against_keras():
    """`check` runs the runtime and the Keras model on each batch, 16 images at a time: the differences, top-1
    agreement for a classifier, 1 - cos for a tower; `markdown` prints a row per batch."""
    from benchmarks import exported_files
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(3, 5))
    images = {"20 at 2x2": rng.uniform(0, 255, (20, 2, 2, 3)), "3 at 2x2": rng.uniform(0, 255, (3, 2, 2, 3))}

    def keras_model(batch, training=False):
        assert len(batch) <= 16 and training is False
        return (batch.reshape(len(batch), -1, 3).mean(1) @ weights).astype("float32")  # as a Keras model's

    flipped = []

    def runtime(batch):  # Keras' outputs plus 1e-3, and the first image's top class moved to another
        outputs = keras_model(batch).astype(np.float64) + 1e-3
        if not flipped:
            outputs[0, outputs[0].argmax()] -= 1e3
            flipped.append(True)
        return outputs

    rows = exported_files.check(runtime, keras_model, images, classifier=True)
    assert [row["images"] for row in rows] == list(images)
    assert rows[0]["top1_agreement"] == pytest.approx(19 / 20) and rows[1]["top1_agreement"] == 1.0
    assert rows[1]["max_abs_diff"] == pytest.approx(1e-3)
    scale = max(1.0, np.abs(keras_model(images["3 at 2x2"])).max())
    assert rows[1]["max_relative_diff"] == pytest.approx(1e-3 / scale)
    (tower,) = exported_files.check(lambda batch: 2 * keras_model(batch), keras_model, {"3": images["3 at 2x2"]},
                                    classifier=False)
    assert tower["max_one_minus_cos"] == pytest.approx(0, abs=1e-12)  # the same direction, twice as long
    table = exported_files.markdown([{"model": "b16", "format": "onnx", "export_seconds": 1.5, "checks": rows}])
    assert "| b16 | onnx | 1.5 | 20 at 2x2 | " in table and table.count("\n") == 3 and "| 95.0% |" in table


def test_gpu_delegate_benchmark_covers_every_family_folder_and_prints_each_row():
    """Every image-model folder of the family harness is checked (the NaFlex one is not a LiteRT model); a row per
    file, the int8 file's float ops in their own column."""
    from benchmarks import gpu_delegate
    folders = {path.name for path in (ROOT / "tests" / "data" / "families").iterdir() if path.is_dir()}
    assert set(gpu_delegate.families()) == {*gpu_delegate.BUILT, *(name for name in folders if "naflex" not in name)}
    rows = [{"family": "f", "file": "float32", "form": "before", "pitfalls": {"transposed_batch_matmul": 2},
             "analyzer": "compatible"},
            {"family": "f", "file": "float16", "form": "as written", "pitfalls": {}, "analyzer": "compatible"},
            {"family": "f", "file": "int8", "form": "as written", "float_ops": []}]
    assert gpu_delegate.markdown(rows).splitlines()[2:] == [
        "| f | float32 | before | transposed_batch_matmul 2 | compatible | |",
        "| f | float16 | as written | none | compatible | |",
        "| f | int8 | as written | | | none |"]


def test_onednn_ops_sums_the_timed_primitives_of_the_verbose_log():
    """Only `exec` lines between the markers count, grouped by primitive, implementation and source dtype; what
    oneDNN did not log is the wall time left over."""
    from benchmarks import onednn_ops
    exec_line = "onednn_verbose,v1,primitive,exec,cpu,{},{},forward_inference,src:{}::blocked:ab::f0 wei:bf16,,,4x8,{}"
    lines = [exec_line.format("convolution", "brgconv_1x1:avx10_1_512_amx", "bf16", 9.0),  # warm-up: left out
             onednn_ops.BEGIN,
             "onednn_verbose,v1,primitive,create:cache_hit,cpu,reorder,jit:uni,undef,src:f32,,,4x8,0.01",
             exec_line.format("convolution", "brgconv_1x1:avx10_1_512_amx", "bf16", 3.0),
             exec_line.format("reorder", "jit:uni", "bf16", 1.5),
             exec_line.format("convolution", "brgconv_1x1:avx10_1_512_amx", "bf16", 2.0),
             exec_line.format("inner_product", "x64:gemm:jit", "f32", 0.5),
             "some other output",
             f"{onednn_ops.END} 10.000",
             exec_line.format("reorder", "jit:uni", "bf16", 7.0)]  # after the timed calls: left out
    by_kind, wall_ms = onednn_ops.parse(lines)
    assert wall_ms == 10.0
    assert dict(by_kind) == {("convolution", "brgconv_1x1:avx10_1_512_amx", "bf16"): [3.0, 2.0],
                             ("reorder", "jit:uni", "bf16"): [1.5], ("inner_product", "x64:gemm:jit", "f32"): [0.5]}
    table = onednn_ops.table(by_kind, wall_ms, calls=1)
    assert table.index("convolution") < table.index("reorder") < table.index("inner_product")  # largest first
    assert "| convolution | brgconv_1x1:avx10_1_512_amx | bf16 | 2 | 5.00 | 50.0% |" in table
    assert "| (all oneDNN) | | | | 7.00 | 70.0% |" in table and "| (outside oneDNN) | | | | 3.00 | 30.0% |" in table
    assert "sum past it" not in table
    assert "oneDNN's times sum past it" in onednn_ops.table(by_kind, 6.0, calls=1)  # ops that ran at once
