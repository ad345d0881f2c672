"""The TF Serving signatures: raw pixels or encoded images in, named predictions out.

`serving_default` takes float32 images of any size in [0, 255]; `serving_bytes` takes encoded
JPEG/PNG/GIF/BMP strings (what TF Serving's REST API receives as `{"b64": ...}`). Both resize
to the model's size inside and return `logits`, `probabilities`, top-k `classes` and `scores`,
and `class_names` when the exporter was given names.
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from export import model_io

IMAGES_KEY = "images"
BYTES_KEY = "image_bytes"
BYTES_SIGNATURE = "serving_bytes"


def resize(images: tf.Tensor, size: tuple[int, int]) -> tf.Tensor:
    """Bilinear (antialiased when shrinking) resize of float images; identity at `size`."""
    return tf.image.resize(images, size, method="bilinear", antialias=True)


def decode(image_bytes: tf.Tensor, size: tuple[int, int]) -> tf.Tensor:
    """A batch of encoded images -> float32 (batch, height, width, 3) in [0, 255] at `size`.

    Undecodable bytes raise InvalidArgumentError for the whole request.
    """
    def decode_one(data):
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        return resize(tf.cast(image, tf.float32)[tf.newaxis], size)[0]

    return tf.map_fn(decode_one, image_bytes, fn_output_signature=tf.TensorSpec((*size, 3), tf.float32))


def _predictions(logits: tf.Tensor, top_k: int, class_names: Sequence[str] | None) -> dict[str, tf.Tensor]:
    probabilities = tf.nn.softmax(logits)
    scores, classes = tf.math.top_k(probabilities, k=top_k)
    outputs = {"logits": logits, "probabilities": probabilities, "classes": classes, "scores": scores}
    if class_names is not None:
        outputs["class_names"] = tf.gather(tf.constant(list(class_names)), classes)
    return outputs


def serving_archive(model: keras.Model, *, top_k: int = 5,
                    class_names: Sequence[str] | None = None) -> keras.export.ExportArchive:
    """An ExportArchive with the `serving_default` and `serving_bytes` endpoints of `model`."""
    pixel_logits = model_io.pixel_logits_model(model)
    size = model_io.image_size(model)
    num_classes = int(pixel_logits.output_shape[-1])
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"Expected {num_classes} class names (one per model class). "
                         f"Received {len(class_names)}.")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"`top_k` must be a positive int. Received: top_k={top_k!r}")
    top_k = min(top_k, num_classes)

    def predict(images: tf.Tensor) -> dict[str, tf.Tensor]:
        return _predictions(pixel_logits(images, training=False), top_k, class_names)

    def serve_images(images: tf.Tensor) -> dict[str, tf.Tensor]:
        return predict(resize(images, size))

    def serve_bytes(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        return predict(decode(image_bytes, size))

    archive = keras.export.ExportArchive()
    archive.track(pixel_logits)
    archive.add_endpoint("serving_default", serve_images,
                         input_signature=[tf.TensorSpec((None, None, None, 3), tf.float32, IMAGES_KEY)])
    archive.add_endpoint(BYTES_SIGNATURE, serve_bytes, input_signature=[tf.TensorSpec((None,), tf.string, BYTES_KEY)])
    return archive
