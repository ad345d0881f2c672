"""The TF Serving signatures: raw pixels or encoded images in, named predictions out.

`serving_default` takes float32 images of any size in [0, 255]; `serving_bytes` takes encoded
JPEG/PNG/GIF/BMP strings (what TF Serving's REST API receives as `{"b64": ...}`). Both resize
and crop to the model's size inside, as the checkpoint's own evaluation transform does
(`image_io.fit_to_model` with the model's `PreprocessingConfig`: e.g. DINOv2's shortest edge to 256,
bicubic, centre crop 224), normalize with its mean and std, and return `logits`, `probabilities`, top-k
`classes` and `scores`, and `class_names` when the exporter was given names (a model without a head: its
`embedding`). Optional signatures from encoded images serve more than class probabilities: `embed` (the
pooled embedding), `features` (chosen blocks' maps) and `explain` (the attention rollout). A model built for
any input size (`input_shape=(None, None, 3)`) is served at each image's own size on `serving_default`: no resize,
height and width must be multiples of its patch stride (else INVALID_ARGUMENT); `serving_bytes`
still resizes, to the size of its checkpoint (`model_io.image_size`), as a batch has one size.

Every signature is bounded: a request holds at most `max_batch` images of at most `max_pixels` pixels
each, or fails with INVALID_ARGUMENT naming the limit. Encoded images are checked from their
headers before anything is decoded (`keras_vit.image_io`), and decoded one at a time, so a
request never holds more than one decoded image.
"""

from __future__ import annotations

from typing import Callable, Sequence

import keras
import tensorflow as tf

from . import model_io
from keras_vit import features, image_io, kernels
from keras_vit.head_rows import head_rows_model

IMAGES_KEY = "images"
BYTES_KEY = "image_bytes"
BYTES_SIGNATURE = "serving_bytes"
EXTRA_SIGNATURES = ("embed", "features", "explain")
DEFAULT_MAX_PIXELS = image_io.DEFAULT_MAX_PIXELS
DEFAULT_MAX_BATCH = 256
# The eigen export runs the model on groups of images whose widest activation (`image_group_size`) fits in this
# many bytes. Eigen's TensorFlow (TF_ENABLE_ONEDNN_OPTS=0) takes each op's output from malloc, and glibc maps a
# buffer over its mmap threshold (32 MiB at most) fresh from the kernel and unmaps it when freed, so each request
# page-faults it in again: B/16's MLP activations at batch 16 (38.7 MB) cost about 10 ms apiece. oneDNN's builds
# take them from a pool (benchmarks/RESULTS.md, run T).
EIGEN_GROUP_BYTES = 8 * 2**20


def decode(image_bytes: tf.Tensor, size: tuple[int, int], max_pixels: int = DEFAULT_MAX_PIXELS,
           transform: dict | None = None) -> tf.Tensor:
    """A batch of encoded images -> float32 (batch, height, width, 3) in [0, 255] at `size`, each resized and
    cropped by `transform` (`PreprocessingConfig.resize_arguments`: the checkpoint's; default a bilinear squash).

    Empty, unsupported, corrupt, truncated or over-`max_pixels` images raise InvalidArgumentError
    for the whole request. Images are decoded one after another (`parallel_iterations=1`).
    """
    def decode_one(data):
        # uint8 goes straight into the resize (same values as casting first, without a float32 copy).
        return image_io.fit_to_model(image_io.decode_rgb(data, max_pixels)[tf.newaxis], size,
                                     **(transform or {}))[0]

    return tf.map_fn(decode_one, image_bytes, fn_output_signature=tf.TensorSpec((*size, 3), tf.float32),
                     parallel_iterations=1)


def check_batch(batch_size: tf.Tensor, max_batch: int) -> tf.Operation:
    """An op failing with InvalidArgumentError when a request holds more than `max_batch` images."""
    message = tf.strings.format("Request of {} images is over the limit of max_batch={} images set at export; "
                                "split it into smaller requests.", (batch_size, max_batch))
    return tf.debugging.Assert(batch_size <= max_batch, [message])


def check_images(images: tf.Tensor, max_pixels: int, max_batch: int) -> tf.Operation:
    """The float path's bounds: at most `max_batch` images of 1 to `max_pixels` pixels each."""
    shape = tf.shape(images)
    return tf.group(check_batch(shape[0], max_batch), image_io.check_size(shape[1], shape[2], max_pixels))


def check_stride(images: tf.Tensor, stride: int) -> tf.Operation:
    """An op failing with InvalidArgumentError unless the images' height and width are multiples of `stride`."""
    height, width = tf.shape(images)[1], tf.shape(images)[2]
    message = tf.strings.format("Image of {}x{} pixels is not a whole number of patches: height and width must be "
                                "multiples of the patch stride {} of this model; resize or crop it.",
                                (height, width, stride))
    return tf.debugging.Assert(tf.logical_and(height % stride == 0, width % stride == 0), [message])


def image_group_size(model: keras.Model, max_batch: int, serving_kernels: str = "eigen") -> int | None:
    """How many images an export for `serving_kernels` runs `model` on at a time. For Eigen: as many as keep its
    widest float32 activation (`model_io.widest_activation_per_image`) within `EIGEN_GROUP_BYTES`, at least one.
    None (the whole request at once) for oneDNN, when that is `max_batch` or more, or for a model without a
    `vit_config`."""
    numbers = model_io.widest_activation_per_image(model) if serving_kernels == "eigen" else None
    if numbers is None:
        return None
    group = max(1, EIGEN_GROUP_BYTES // (4 * numbers))
    return None if group >= max_batch else group


def in_image_groups(model: keras.Model, images: tf.Tensor, group: int | None):
    """`model(images)` computed on consecutive groups of at most `group` images, as even as can be, one after
    another (a `tf.while_loop`), each output concatenated in order: the same numbers, from ops whose buffers hold
    `group` images. `model(images)` itself when `group` is None."""
    if group is None:
        return model(images, training=False)
    count = tf.shape(images)[0]
    groups = tf.maximum((count + group - 1) // group, 1)  # one group of none for an empty request
    size = (count + groups - 1) // groups

    def empty(spec):
        return tf.TensorArray(spec.dtype, size=groups, infer_shape=False, element_shape=(None, *spec.shape[1:]))

    def run_group(index, arrays):
        outputs = model(images[index * size:(index + 1) * size], training=False)
        return index + 1, tf.nest.map_structure(lambda array, output: array.write(index, output), arrays, outputs)

    _, arrays = tf.while_loop(lambda index, _: index < groups, run_group,
                              (tf.constant(0), tf.nest.map_structure(empty, model.output)), parallel_iterations=1)
    return tf.nest.map_structure(lambda array: array.concat(), arrays)


def predictions(logits: tf.Tensor, top_k: int, class_names: Sequence[str] | None) -> dict[str, tf.Tensor]:
    """A classifier's outputs: `logits`, their softmax `probabilities`, the top-k `classes` and `scores`, and
    `class_names` where names were given."""
    probabilities = tf.nn.softmax(logits)
    scores, classes = tf.math.top_k(probabilities, k=top_k)
    outputs = {"logits": logits, "probabilities": probabilities, "classes": classes, "scores": scores}
    if class_names is not None:
        outputs["class_names"] = tf.gather(tf.constant(list(class_names)), classes)
    return outputs


def checked_top_k(top_k: int, num_classes: int, class_names: Sequence[str] | None) -> int:
    """`top_k` for a classifier of `num_classes` (at most that many), after checking it and the class names."""
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"Expected {num_classes} class names (one per model class). Received {len(class_names)}.")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"`top_k` must be a positive int. Received: top_k={top_k!r}")
    return min(top_k, num_classes)


def check_limits(max_pixels: int, max_batch: int) -> None:
    """Raises ValueError unless both limits are positive ints."""
    for name, value in (("max_pixels", max_pixels), ("max_batch", max_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")


def check_signatures(signatures: Sequence[str]) -> None:
    """Raises ValueError for a name that is not one of `EXTRA_SIGNATURES`."""
    unknown = [name for name in signatures if name not in EXTRA_SIGNATURES]
    if unknown or isinstance(signatures, str):
        raise ValueError(f"Unknown signature {(unknown or [signatures])[0]!r}. Expected a sequence of "
                         f"{', '.join(EXTRA_SIGNATURES)}.")


def _views(model: keras.Model, names: Sequence[str], preprocessing, has_head: bool, feature_blocks: Sequence[int],
           embedding: str, l2_normalize: bool) -> dict[str, keras.Model]:
    """Signature name -> a model of [0, 255] pixels (normalized with `preprocessing` first) with dict outputs."""
    views = {"embed": lambda: head_rows_model(features.embedding_model(model, embedding, l2_normalize)),
             "features": lambda: features.features_model(model, feature_blocks, output="nhwc"),
             "explain": lambda: features.explain_model(model_io.logits_model(model) if has_head else model)}
    return {name: model_io.with_pixel_input(views[name](), preprocessing) for name in names}


def _explanation(outputs: dict[str, tf.Tensor], has_head: bool) -> dict[str, tf.Tensor]:
    """The rollout map, with the top class and its probability when the model classifies."""
    if not has_head:
        return {"rollout": outputs["rollout"]}
    probabilities = tf.nn.softmax(outputs["output"])
    return {"rollout": outputs["rollout"], "classes": tf.argmax(probabilities, axis=-1, output_type=tf.int32),
            "scores": tf.reduce_max(probabilities, axis=-1)}


def serving_archive(model: keras.Model, *, top_k: int = 5, class_names: Sequence[str] | None = None,
                    max_pixels: int = DEFAULT_MAX_PIXELS, max_batch: int = DEFAULT_MAX_BATCH,
                    signatures: Sequence[str] = (), feature_blocks: Sequence[int] = (-1,),
                    embedding: str = "pooled", l2_normalize: bool = False,
                    serving_kernels: str = "onednn") -> keras.export.ExportArchive:
    """An ExportArchive with the `serving_default` and `serving_bytes` endpoints of `model`, and the `signatures`
    asked for (each from encoded images, resized as `serving_bytes`):

    - `embed`: `{"embedding": (batch, D)}`, `keras_vit.features.embedding_model(model, embedding, l2_normalize)`;
    - `features`: `{"block_<i>": (batch, rows, columns, D), "block_<i>_prefix": (batch, prefix, D)}` of the
      `feature_blocks`, `keras_vit.features.features_model`;
    - `explain`: `{"rollout": (batch, height, width)}`, the attention rollout at the model's input size, with
      the top class (`classes`) and its probability (`scores`) for a classifier.

    A model without a classification head (`include_top=False` with a `pooling`) serves its embedding on
    `serving_default` and `serving_bytes` too. `max_pixels` bounds each image's height * width and `max_batch` the
    images per request, on every endpoint. A model of any input size takes `serving_default`'s images at their own
    size. `serving_kernels` names the CPU kernels of the TensorFlow that will serve it (`kernels.served_on`):
    `"onednn"` or `"eigen"`, which writes the tanh GELU in 6 elementwise ops instead of 9 (oneDNN would no longer
    fuse it into its matmul), the attention's two products one head at a time (`kernels.fused_attention`) and
    runs the model on groups of images (`image_group_size`, `in_image_groups`).
    """
    check_limits(max_pixels, max_batch)
    kernels.check_serving_kernels(serving_kernels)
    check_signatures(signatures)
    preprocessing = model_io.preprocessing_config(model)
    transform = preprocessing.resize_arguments
    size, stride = model_io.image_size(model), model_io.patch_stride(model)
    if "explain" in signatures and stride:
        raise ValueError("The explain signature needs a model of a fixed input size (its rollout map has the "
                         "model's size): export a model built at one size, without --any-size.")
    has_head = features.classifier_head(model) is not None
    # A tower without a head serves its embedding on serving_default and serving_bytes: the `embed` view.
    views = _views(model, {*signatures, *(() if has_head else ("embed",))}, preprocessing, has_head, feature_blocks,
                   embedding, l2_normalize)
    if has_head:
        pixel_logits = model_io.pixel_logits_model(model)
        top_k = checked_top_k(top_k, int(pixel_logits.output_shape[-1]), class_names)
    else:
        if class_names is not None:
            raise ValueError(f"class_names need a classifier, but model {model.name!r} has no classification head "
                             "(it serves its embedding). Build it with include_top=True, or make a zero-shot "
                             "classifier: keras_vit.features.zero_shot_classifier(model, class_embeddings).")
        pixel_embedding = views["embed"]
    group = image_group_size(model, max_batch, serving_kernels)

    def predict(images: tf.Tensor) -> dict[str, tf.Tensor]:
        if not has_head:
            return in_image_groups(pixel_embedding, images, group)
        return predictions(in_image_groups(pixel_logits, images, group), top_k, class_names)

    def serve_images(images: tf.Tensor) -> dict[str, tf.Tensor]:
        checks = [check_images(images, max_pixels, max_batch)] + ([check_stride(images, stride)] if stride else [])
        with tf.control_dependencies(checks):
            images = tf.identity(images)
            return predict(images if stride else image_io.fit_to_model(images, size, **transform))

    def serve_bytes(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.control_dependencies([check_batch(tf.size(image_bytes), max_batch)]):
            return predict(decode(tf.identity(image_bytes), size, max_pixels, transform))

    def traced_for_the_server(endpoint: Callable[[tf.Tensor], dict]) -> Callable[[tf.Tensor], dict]:
        def traced(inputs: tf.Tensor) -> dict[str, tf.Tensor]:
            with kernels.served_on(serving_kernels):  # whenever TensorFlow traces it (at write_out)
                return _float32_outputs(endpoint(inputs))
        return traced

    archive = model_io.export_archive(pixel_logits if has_head else pixel_embedding,
                                      *(views[name] for name in signatures))
    archive.add_endpoint("serving_default", traced_for_the_server(serve_images),
                         input_signature=[tf.TensorSpec((None, None, None, 3), tf.float32, IMAGES_KEY)])
    bytes_spec = [tf.TensorSpec((None,), tf.string, BYTES_KEY)]
    archive.add_endpoint(BYTES_SIGNATURE, traced_for_the_server(serve_bytes), input_signature=bytes_spec)
    for name in signatures:
        finish = (lambda outputs: _explanation(outputs, has_head)) if name == "explain" else dict
        endpoint = _bytes_endpoint(views[name], finish, size, transform, max_pixels, max_batch, group)
        archive.add_endpoint(name, traced_for_the_server(endpoint), input_signature=bytes_spec)
    return archive


def _float32_outputs(outputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """A bfloat16 model's outputs (an embedding, feature maps, a rollout) as float32, as a float32 model's."""
    return {name: tf.cast(value, tf.float32) if value.dtype == tf.bfloat16 else value
            for name, value in outputs.items()}


def _bytes_endpoint(view: keras.Model, finish, size: tuple[int, int], transform: dict, max_pixels: int,
                    max_batch: int, group: int | None):
    """An endpoint function: encoded images -> `finish(view(images))`, bounded as `serving_bytes`."""
    def serve(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.control_dependencies([check_batch(tf.size(image_bytes), max_batch)]):
            images = decode(tf.identity(image_bytes), size, max_pixels, transform)
            return finish(in_image_groups(view, images, group))

    return serve
