"""Decoding untrusted encoded images (JPEG, PNG, GIF, BMP) in TensorFlow, size checked first.

`decode_rgb(data, max_pixels)` reads the image's height and width from its header, fails with
`InvalidArgumentError` when the image has more than `max_pixels` pixels, and only then decodes.
A small file can declare a huge image (a 20000x20000 grayscale PNG compresses to a few hundred
KB and decodes to 400 MB, 4.8 GB as float32 RGB), so the size must be known before decoding.

The headers are read with graph ops only, so the checks run inside exported SavedModels:
`tf.io.extract_jpeg_shape` for JPEG (it parses markers, it does not decode), and fixed header
fields for PNG (IHDR, big-endian uint32), GIF (logical screen, little-endian uint16) and BMP
(BITMAPINFOHEADER int32, or the old uint16 BITMAPCOREHEADER).

Decoded images are RGB uint8 (JPEG with the accurate integer DCT, as PIL): grayscale is repeated
to three channels; alpha is dropped (the stored colour is kept, as PIL's `convert("RGB")` and
torchvision/timm folder loaders do, so served and trained images agree); CMYK and YCCK JPEGs are
converted to RGB by libjpeg; 16-bit PNGs are scaled to 8 bits; GIFs give their first frame.
"""

from __future__ import annotations

import math

import tensorflow as tf

DEFAULT_MAX_PIXELS = 40_000_000  # 40 megapixels: more than phone cameras' usual 12-24 MP.
FORMATS = ("JPEG", "PNG", "GIF", "BMP")
_HEADER_BYTES = 32
_PNG_SIGNATURE = (0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A)
NAFLEX_EPS = 1e-5  # transformers' `get_image_size_for_max_num_patches` default


def _header(data: tf.Tensor) -> tf.Tensor:
    """The first 32 bytes of `data` as int64, zero-padded when it is shorter."""
    head = tf.strings.join([tf.strings.substr(data, 0, _HEADER_BYTES), "\0" * _HEADER_BYTES])
    return tf.cast(tf.io.decode_raw(tf.strings.substr(head, 0, _HEADER_BYTES), tf.uint8), tf.int64)


def _starts_with(header: tf.Tensor, signature: tuple[int, ...]) -> tf.Tensor:
    return tf.reduce_all(tf.equal(header[:len(signature)], tf.constant(signature, tf.int64)))


def _unsigned(header: tf.Tensor, start: int, size: int, big_endian: bool) -> tf.Tensor:
    """The unsigned integer stored in `header[start:start + size]`."""
    weights = [256 ** i for i in range(size)]
    if big_endian:
        weights.reverse()
    return tf.reduce_sum(header[start:start + size] * tf.constant(weights, tf.int64))


def _signed32(header: tf.Tensor, start: int) -> tf.Tensor:
    """The little-endian int32 stored in `header[start:start + 4]`."""
    value = _unsigned(header, start, 4, big_endian=False)
    return tf.where(value >= 2 ** 31, value - 2 ** 32, value)


def _bmp_shape(header: tf.Tensor) -> tf.Tensor:
    """(height, width) of a BMP; its height is negative for top-down rows."""
    core = tf.equal(_unsigned(header, 14, 4, big_endian=False), 12)  # BITMAPCOREHEADER: uint16 fields.
    height = tf.where(core, _unsigned(header, 20, 2, big_endian=False), tf.abs(_signed32(header, 22)))
    width = tf.where(core, _unsigned(header, 18, 2, big_endian=False), tf.abs(_signed32(header, 18)))
    return tf.stack([height, width])


def image_shape(data: tf.Tensor) -> tf.Tensor:
    """(height, width) int64 of one encoded image, read from its header without decoding.

    Raises InvalidArgumentError for empty data and for data that is not JPEG, PNG, GIF or BMP.
    """
    header = _header(data)
    is_jpeg = _starts_with(header, (0xFF, 0xD8, 0xFF))
    is_png = _starts_with(header, _PNG_SIGNATURE)
    is_gif = _starts_with(header, (0x47, 0x49, 0x46, 0x38)) & tf.equal(header[5], 0x61)  # "GIF8?a"
    is_bmp = _starts_with(header, (0x42, 0x4D))  # "BM"
    length = tf.strings.length(data)
    checks = [
        tf.debugging.Assert(length > 0, ["Empty image: 0 bytes."]),
        tf.debugging.Assert(is_jpeg | is_png | is_gif | is_bmp, [tf.strings.format(
            "Unsupported or corrupt image ({} bytes): expected JPEG, PNG, GIF or BMP data.", length)]),
    ]
    with tf.control_dependencies(checks):
        png = tf.stack([_unsigned(header, 20, 4, True), _unsigned(header, 16, 4, True)])
        gif = tf.stack([_unsigned(header, 8, 2, False), _unsigned(header, 6, 2, False)])
        other = tf.where(is_png, png, tf.where(is_gif, gif, _bmp_shape(header)))
        return tf.cond(is_jpeg, lambda: tf.cast(tf.io.extract_jpeg_shape(data)[:2], tf.int64), lambda: other)


def check_size(height: tf.Tensor, width: tf.Tensor, max_pixels: int) -> tf.Operation:
    """An op failing with InvalidArgumentError unless 1 <= height * width <= `max_pixels`."""
    height, width = tf.cast(height, tf.int64), tf.cast(width, tf.int64)
    pixels = height * width
    message = tf.strings.format("Image of {}x{} pixels ({} pixels) is over the limit of max_pixels={} "
                                "pixels; send a smaller image.", (height, width, pixels, max_pixels))
    return tf.group(
        tf.debugging.Assert(pixels <= max_pixels, [message]),
        tf.debugging.Assert(pixels > 0, [tf.strings.format("Image of {}x{} pixels is empty.", (height, width))]))


def decode_rgb(data: tf.Tensor, max_pixels: int = DEFAULT_MAX_PIXELS) -> tf.Tensor:
    """One encoded image -> uint8 (height, width, 3), refused before decoding if over `max_pixels`.

    Args:
        data: scalar string tensor, the JPEG, PNG, GIF or BMP file's bytes.
        max_pixels: int. Largest height * width accepted. Defaults to `DEFAULT_MAX_PIXELS`.

    Raises:
        tf.errors.InvalidArgumentError: empty, unsupported, corrupt, truncated or oversized data.
    """
    shape = image_shape(data)
    with tf.control_dependencies([check_size(shape[0], shape[1], max_pixels)]):
        data = tf.identity(data)  # Nothing below runs before the check passed.
    # JPEG with the accurate integer DCT, as PIL (and so transformers' and timm's pipelines) decodes it; TensorFlow's
    # default, the fast one, is about a grey level off on average.
    image = tf.cond(tf.io.is_jpeg(data),
                    lambda: tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_ACCURATE"),
                    lambda: tf.io.decode_image(data, channels=3, expand_animations=False))
    image.set_shape([None, None, 3])
    return image


def resize_sides(size: tuple[int, int], crop_fraction: float = 1.0, resize_size: int | None = None) -> tuple[int, int]:
    """The (height, width) an image is resized to before the centre crop to `size` (for `"shortest_edge"`, the short
    side is the smaller one): `resize_size` as the checkpoint's processor declares it, for both sides; without one,
    `floor(side / crop_fraction)` per side in floating point, as timm computes it from `crop_pct`."""
    if resize_size is not None:
        return resize_size, resize_size
    return math.floor(size[0] / crop_fraction), math.floor(size[1] / crop_fraction)


def resized_shape(image_shapes, size: tuple[int, int], resize_mode: str = "squash", crop_fraction: float = 1.0,
                  resize_size: int | None = None) -> tf.Tensor:
    """int32 (..., 2): the (height, width) that images of shapes `image_shapes` (..., 2) are resized to before the
    centre crop to `size` (`fit_to_model`): `"squash"`, `resize_sides`; `"shortest_edge"`, the short side to the
    smaller of them and the long one to `int(short * long / short_in)` in float64, as transformers and torchvision
    compute it, neither below `size`."""
    sides = resize_sides(size, crop_fraction, resize_size)
    image_shapes = tf.convert_to_tensor(image_shapes, tf.int32)
    if resize_mode == "squash":
        return tf.broadcast_to(tf.constant(sides, tf.int32), tf.shape(image_shapes))
    short = min(sides)
    in_shape = tf.cast(image_shapes, tf.float64)
    in_short = tf.reduce_min(in_shape, axis=-1, keepdims=True)
    scaled = tf.cast(tf.cast(short, tf.float64) * in_shape / in_short, tf.int32)
    target = tf.where(in_shape == in_short, short, scaled)  # the short side exactly `short`
    return tf.maximum(target, tf.constant(size, tf.int32))


def fit_to_model(images: tf.Tensor, size: tuple[int, int], *, resize_mode: str = "squash",
                 crop_fraction: float = 1.0, resize_size: int | None = None, interpolation: str = "bilinear",
                 crop_offset: str = "floor") -> tf.Tensor:
    """Images (batch, height, width, 3) of one size -> float32 (batch, *size, 3): resized, then centre-cropped.

    The checkpoint's evaluation transform (`PreprocessingConfig.resize_arguments`): the resize size is
    `resize_sides` (the declared integer, else `floor(size / crop_fraction)`, timm's `crop_pct` rule); `"squash"`
    resizes both sides to it, `"shortest_edge"` the short side, the long one to `int(resize * long / short)` (as
    transformers and torchvision). The crop takes the centre, its top-left offset `(resized - size) // 2`
    (`crop_offset="floor"`, transformers) or that halved margin rounded half to even (`"round"`, torchvision,
    which timm uses). `interpolation` is a `tf.image.resize` method, antialiased when shrinking (as PIL, which
    transformers and timm resize with). An image already at the resize size passes the resize unchanged.
    """
    height, width = size
    target = resized_shape(tf.shape(images)[1:3], size, resize_mode, crop_fraction, resize_size)
    resized = tf.image.resize(images, target, method=interpolation, antialias=True)
    margins = tf.shape(resized)[1:3] - tf.constant([height, width])
    offsets = margins // 2 if crop_offset == "floor" else tf.cast(tf.round(tf.cast(margins, tf.float64) / 2), tf.int32)
    top, left = offsets[0], offsets[1]
    cropped = resized[:, top:top + height, left:left + width, :]
    return tf.ensure_shape(tf.cast(cropped, tf.float32), (None, height, width, 3))


def naflex_image_size(height, width, patch_size: int, max_num_patches, eps: float = NAFLEX_EPS) -> tf.Tensor:
    """int32 (..., 2): the (height, width) each image is resized to, elementwise over `height`, `width` (and
    `max_num_patches` where it is a tensor): `keras_vit.naflex.naflex_image_size` in graph ops, the same binary
    search on the scale in float64, each element stopping where the NumPy loop stops."""
    height, width = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
    budget = tf.cast(max_num_patches, tf.float64)
    patch = tf.constant(float(patch_size), tf.float64)
    zeros = tf.zeros_like(height + width + budget)  # the broadcast shape, static where the inputs' are

    def scaled(scale: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
        return tf.maximum(patch, tf.math.ceil(size * scale / patch) * patch)

    def searching(low: tf.Tensor, high: tf.Tensor) -> tf.Tensor:
        return high - low >= eps

    def step(low: tf.Tensor, high: tf.Tensor):
        scale = (low + high) / 2.0
        fits = (scaled(scale, height) / patch) * (scaled(scale, width) / patch) <= budget
        going = searching(low, high)
        return (tf.where(going & fits, scale, low), tf.where(going & ~fits, scale, high))

    start = (zeros + eps / 10, zeros + 100.0)
    low, _ = tf.while_loop(lambda low, high: tf.reduce_any(searching(low, high)), step, start)
    return tf.cast(tf.stack([scaled(low, height), scaled(low, width)], axis=-1), tf.int32)


def naflex_patches(image: tf.Tensor, patch_size: int, max_num_patches: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """One RGB image (height, width, 3) -> the model's inputs for it: `patches` (max_num_patches, patch * patch * 3)
    float32 in [0, 255] (row-major patches flattened as (row, column, channel), zeros after them), `patch_mask`
    (max_num_patches,) int32 and `spatial_shapes` (2,) int32, its (rows, columns) grid."""
    height, width = tf.unstack(naflex_image_size(tf.shape(image)[0], tf.shape(image)[1], patch_size, max_num_patches))
    size = tf.stack([height, width])  # axis 0: tf.image.resize reads a stacked size's static value only so
    resized = tf.image.resize(image[tf.newaxis], size, method="bilinear", antialias=True)[0]
    rows, columns = size[0] // patch_size, size[1] // patch_size
    grid = tf.reshape(resized, (rows, patch_size, columns, patch_size, 3))
    sequence = tf.reshape(tf.transpose(grid, (0, 2, 1, 3, 4)), (rows * columns, patch_size * patch_size * 3))
    count = rows * columns
    message = tf.strings.format("Image of {}x{} pixels needs {} patches of {} pixels at the smallest scale, over the "
                                "budget of max_num_patches={}: use a less elongated image.",
                                (tf.shape(image)[0], tf.shape(image)[1], count, patch_size, max_num_patches))
    with tf.control_dependencies([tf.debugging.Assert(count <= max_num_patches, [message])]):
        patches = tf.pad(sequence, [[0, max_num_patches - count], [0, 0]])
    mask = tf.cast(tf.range(max_num_patches) < count, tf.int32)
    return (tf.ensure_shape(patches, (max_num_patches, patch_size * patch_size * 3)), mask,
            tf.stack([rows, columns]))
