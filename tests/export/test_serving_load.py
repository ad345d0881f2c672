"""Hostile input and concurrent load against an exported SavedModel, loaded as TF Serving loads it.

Decoding of every supported format is compared with PIL; the load test sends a bounded mix of
valid, corrupt, truncated, empty and oversized images from several threads through the TF1
`serve` loader and `tf.saved_model.load`; the memory test measures peak RSS in subprocesses.
Run with `-s` to see the figures (requests served, rejections by kind, peak RSS).
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from concurrent import futures

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from keras_vit import image_io
from keras_vit.cli import export as export_cli
from keras_vit.export import saved_model, serving
from tests import images as odd
from tests.testing import TF1Server, tiny_model
from tests.testing import REPO, python_path

MAX_BATCH = 16
REQUESTS = 240  # Sent once in order, then again from THREADS threads.
THREADS = 6


@pytest.fixture(scope="module")
def valid() -> dict[str, bytes]:
    return odd.valid_images()


@pytest.fixture(scope="module")
def bad() -> dict[str, tuple[str, bytes, str]]:
    return odd.bad_images()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return saved_model.export_saved_model(tiny_model("plain"), tmp_path_factory.mktemp("load"), max_batch=MAX_BATCH)


def pil_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decoded(data: bytes) -> np.ndarray:
    return image_io.decode_rgb(tf.constant(data)).numpy()


# === Decoding ===


def test_header_shapes_match_pil(valid):
    for name, data in valid.items():
        width, height = Image.open(io.BytesIO(data)).size
        assert list(image_io.image_shape(tf.constant(data)).numpy()) == [height, width], name


@pytest.mark.parametrize("name", ["png", "png_rgba", "png_gray", "png_gray_alpha", "png_palette", "gif",
                                  "gif_animated", "bmp", "png_1x1", "png_1x4000"])
def test_lossless_formats_decode_as_pil_rgb(valid, name):
    """Alpha dropped, gray repeated, palettes expanded, a GIF's first frame: exactly PIL's `convert("RGB")`."""
    np.testing.assert_array_equal(decoded(valid[name]), pil_rgb(valid[name]))


def test_png_16bit_keeps_the_high_byte(valid):
    np.testing.assert_array_equal(decoded(valid["png_16bit"]), decoded(valid["png_gray"]))


@pytest.mark.parametrize("name", ["jpeg", "jpeg_gray", "jpeg_progressive", "jpeg_1x1", "jpeg_4000x2", "jpeg_cmyk"])
def test_jpeg_colours_match_pil(valid, name):
    """CMYK JPEGs come out as RGB like PIL's. TensorFlow's default fast integer IDCT differs from
    PIL's accurate one by up to 12 levels here (mean 1.7 at most)."""
    ours, pil = decoded(valid[name]).astype(int), pil_rgb(valid[name]).astype(int)
    assert ours.shape == pil.shape
    assert np.abs(ours - pil).max() <= 16 and np.abs(ours - pil).mean() < 2.0


def test_cmyk_jpeg_looks_like_the_rgb_original(valid):
    np.testing.assert_allclose(decoded(valid["jpeg_cmyk"]).mean((0, 1)), odd.photo().mean((0, 1)), atol=3)


@pytest.mark.slow
def test_bad_images_fail_with_clear_invalid_argument(bad):
    for name, (_, data, pattern) in bad.items():
        with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
            image_io.decode_rgb(tf.constant(data))


def test_calibration_folder_decodes_like_serving(valid, bad, tmp_path):
    from keras_vit.export import data

    for name in ("jpeg_cmyk", "png_rgba", "png_gray", "gif", "bmp"):
        (tmp_path / f"{name}.{name.split('_')[0]}").write_bytes(valid[name])
    images = data.directory(tmp_path, (32, 32))
    assert images.shape == (5, 32, 32, 3)
    np.testing.assert_allclose(images[0], image_io.fit_to_model(decoded(valid["bmp"])[None].astype("float32"),
                                                         (32, 32))[0], atol=1e-3)
    (tmp_path / "z.png").write_bytes(bad["oversized_png_20000x20000"][1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="over the limit of max_pixels=40000000"):
        data.directory(tmp_path, (32, 32))


# === Export limits ===


@pytest.mark.slow
def test_limits_are_set_by_cli_recorded_and_enforced_on_both_signatures(tmp_path, valid):
    model_file = tmp_path / "tiny.keras"
    tiny_model("plain").save(model_file)
    assert export_cli.main(["--model", str(model_file), "--out", str(tmp_path / "serving"),
                            "--max-pixels", "2048", "--max-batch", "4"]) == 0
    path = tmp_path / "serving" / "1"
    metadata = saved_model.read_metadata(path)
    assert (metadata["max_pixels"], metadata["max_batch"], metadata["image_size"]) == (2048, 4, [32, 32])
    assert metadata["image_formats"] == ["JPEG", "PNG", "GIF", "BMP"]
    loaded = tf.saved_model.load(str(path))
    serve_images, serve_bytes = loaded.signatures["serving_default"], loaded.signatures[serving.BYTES_SIGNATURE]
    assert serve_images(images=tf.zeros((4, 32, 64, 3)))["probabilities"].shape == (4, 10)  # 2048 pixels.
    for images, pattern in (((1, 64, 33, 3), r"64x33 pixels \(2112 pixels\) is over the limit of max_pixels=2048"),
                            ((5, 8, 8, 3), r"Request of 5 images is over the limit of max_batch=4"),
                            ((1, 0, 8, 3), r"Image of 0x8 pixels is empty")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
            serve_images(images=tf.zeros(images))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Request of 5 images .* max_batch=4"):
        serve_bytes(image_bytes=tf.constant([valid["png_1x1"]] * 5))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"60x80 pixels \(4800 pixels\) .* max_pixels=2048"):
        serve_bytes(image_bytes=tf.constant([valid["png"]]))
    assert serve_bytes(image_bytes=tf.constant([valid["png_1x1"]] * 4))["classes"].shape == (4, 5)
    assert serve_bytes(image_bytes=tf.constant([], tf.string))["probabilities"].shape == (0, 10)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="`max_pixels` must be a positive int. Received: max_pixels=0"):
        serving.serving_archive(tiny_model("plain"), max_pixels=0)


# === Load ===


def _request_mix(valid: dict, bad: dict, seed: int = 0) -> list[tuple[str, list[str], str | None]]:
    """(loader, image names, bad kind or None): singles, batches, bad images alone or inside a batch."""
    rng = np.random.default_rng(seed)
    valid_names, bad_names = sorted(valid), sorted(bad)
    requests = []
    for i in range(REQUESTS):
        loader = ("tf1", "tf2")[i % 2]
        draw = rng.random()
        if draw < 0.55:
            requests.append((loader, [str(rng.choice(valid_names))], None))
        elif draw < 0.70:
            requests.append((loader, [str(name) for name in rng.choice(valid_names, 3)], None))
        else:
            name = str(bad_names[i % len(bad_names)])
            names = [name] if draw < 0.9 else [valid_names[0], name, valid_names[1]]
            requests.append((loader, names, name))
    requests.append(("tf1", [valid_names[0]] * (MAX_BATCH + 1), "batch"))
    requests.append(("tf2", [valid_names[0]] * (MAX_BATCH + 1), "batch"))
    return requests


class Servers:
    """The same SavedModel behind TF Serving's TF1 loader and behind `tf.saved_model.load`."""

    def __init__(self, path):
        self.tf1 = TF1Server(path)
        self.tf2 = tf.saved_model.load(str(path)).signatures[serving.BYTES_SIGNATURE]

    def predict(self, loader: str, batch: list[bytes]) -> dict[str, np.ndarray]:
        if loader == "tf1":
            return self.tf1.predict(serving.BYTES_SIGNATURE, {serving.BYTES_KEY: np.array(batch, dtype=object)})
        return {key: value.numpy() for key, value in self.tf2(image_bytes=tf.constant(batch)).items()}


def _send(servers: Servers, request, payload: dict[str, bytes]):
    loader, names, _ = request
    try:
        return servers.predict(loader, [payload[name] for name in names])
    except tf.errors.InvalidArgumentError as error:
        return error


@pytest.mark.slow
def test_concurrent_mixed_requests_match_single_threaded_answers(export_dir, valid, bad):
    servers = Servers(export_dir)
    payload = {**valid, **{name: data for name, (_, data, _) in bad.items()}}
    requests = _request_mix(valid, bad)
    start = time.time()
    sequential = [_send(servers, request, payload) for request in requests]
    sequential_s = time.time() - start
    start = time.time()
    with futures.ThreadPoolExecutor(THREADS) as pool:
        concurrent = list(pool.map(lambda request: _send(servers, request, payload), requests))
    concurrent_s = time.time() - start

    rejected, served, max_diff = collections.Counter(), 0, 0.0
    for request, first, second in zip(requests, sequential, concurrent):
        loader, names, bad_name = request
        if bad_name is None:
            assert not isinstance(second, Exception), (request, second)
            np.testing.assert_array_equal(second["classes"], first["classes"])
            np.testing.assert_allclose(second["probabilities"], first["probabilities"], rtol=0, atol=1e-6)
            max_diff = max(max_diff, float(np.abs(second["logits"] - first["logits"]).max()))
            served += len(names)
            continue
        kind, _, pattern = bad[bad_name] if bad_name != "batch" else ("batch", b"", r"max_batch=16")
        for result in (first, second):
            assert isinstance(result, tf.errors.InvalidArgumentError), (request[:2], type(result))
            assert re.search(pattern, result.message), (bad_name, result.message[-300:])
        rejected[kind] += 1
    # Batched answers equal the single-image answers of the same images.
    single = {name: servers.predict("tf1", [data]) for name, data in valid.items()}
    for request, result in zip(requests, concurrent):
        if request[2] is None and len(request[1]) > 1:
            np.testing.assert_allclose(result["probabilities"],
                                       np.concatenate([single[n]["probabilities"] for n in request[1]]), atol=1e-5)
    assert servers.predict("tf2", [valid["png"]])["probabilities"].shape == (1, 10)  # Still serving.
    assert set(rejected) == {"empty", "corrupt", "truncated", "oversized", "batch"} and concurrent_s < 60
    print("\nLOAD:", json.dumps({"requests": 2 * len(requests), "threads": THREADS, "images_served": 2 * served,
                                 "rejected_by_kind": {k: 2 * v for k, v in sorted(rejected.items())},
                                 "sequential_s": round(sequential_s, 2), "concurrent_s": round(concurrent_s, 2),
                                 "max_logit_diff_concurrent_vs_sequential": max_diff}))


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from concurrent import futures
    import numpy as np, tensorflow as tf

    path, images_file = sys.argv[1:]
    images = np.load(images_file, allow_pickle=True)
    session = tf.compat.v1.Session(graph=tf.Graph())
    with session.graph.as_default():
        signature = tf.compat.v1.saved_model.loader.load(session, ["serve"], path).signature_def["serving_bytes"]
    feed_name = signature.inputs["image_bytes"].name
    fetch = signature.outputs["probabilities"].name

    def predict(data):
        try:
            return session.run(fetch, {feed_name: np.array([data], dtype=object)}).shape
        except tf.errors.InvalidArgumentError as error:
            return "over the limit" in error.message

    def peak_mb():
        # VmHWM is this process's own peak: ru_maxrss would carry over the peak of the (large)
        # pytest process that spawned it, across fork and exec.
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

    valid = list(images["valid"])
    for _ in range(3):
        results = [predict(data) for data in valid]
    figures = {}
    # One phase after another: the peak only rises, so each phase's rise over the one before is its own.
    for mode in ("valid", "oversized", "large_valid"):
        warm = peak_mb()
        extra = list(images[mode]) * 4 if mode != "valid" else []
        with futures.ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(predict, extra))
        results = [predict(data) for data in valid]
        figures[mode] = {"warm_peak_mb": warm, "peak_mb": peak_mb(), "extra_requests": len(extra),
                         "rejected": sum(o is True for o in outcomes),
                         "served": sum(isinstance(o, tuple) for o in outcomes) + len(results)}
    print("MEMORY:", json.dumps(figures))
""")


@pytest.mark.slow
def test_oversized_images_do_not_raise_peak_memory(export_dir, valid, bad, tmp_path):
    """Peak RSS of a TF1-loaded server: valid requests only, plus 4x4 concurrent oversized images
    (20000x20000 PNG, forged JPEG/GIF/BMP headers), plus 4 concurrent valid 6000x6000 PNGs (which
    are decoded, to show the measurement sees decoding)."""
    images_file = tmp_path / "images.npz"
    oversized = [data for kind, data, _ in bad.values() if kind == "oversized"][:4]
    np.savez(images_file, valid=np.array(list(valid.values()), dtype=object),
             oversized=np.array(oversized, dtype=object),
             large_valid=np.array([odd.blank_gray_png(6000)], dtype=object))
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(export_dir), str(images_file)],
                            env={**os.environ, "PYTHONPATH": python_path(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"},
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.split("MEMORY:")[1])
    print("\nPEAK RSS:", json.dumps(figures))
    assert figures["oversized"]["rejected"] == 16
    assert figures["large_valid"]["served"] == 4 + len(valid)
    assert figures["oversized"]["peak_mb"] - figures["valid"]["peak_mb"] < 50, figures
    assert figures["large_valid"]["peak_mb"] - figures["oversized"]["peak_mb"] > 60, figures  # 6000^2 RGB: 108 MB
