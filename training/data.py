"""tf.data input pipelines: TFDS by name, image folders and the embedded scikit-learn digits.

Every source yields (image float32 in [0, 255], integer label). `make_datasets(config)` adds the
paper's preprocessing (train: Inception crop + resize + random flip; eval: resize), optional
RandAugment / MixUp, one-hot labels, batching by the global batch, per-worker sharding and prefetch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent import futures

import numpy as np
import tensorflow as tf

from keras_vit import datasets, image_io
from .configs import Config

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
AUTOTUNE = tf.data.AUTOTUNE


@dataclasses.dataclass
class Source:
    """One split of a dataset before preprocessing."""

    dataset: tf.data.Dataset  # (image uint8/float (H, W, C), int label)
    num_examples: int | None  # None if the dataset does not say.
    num_classes: int
    shard_policy: tf.data.experimental.AutoShardPolicy
    skipped: int = 0  # Unreadable files left out (corrupt, truncated, empty, oversized, not a file).
    class_names: list[str] | None = None  # Image folders: label i is class_names[i].


# === Sources ===


def digits_source(split: str, test_fraction: float = datasets.TEST_FRACTION) -> Source:
    """The embedded digits (`keras_vit.datasets.digits`: 8x8, RGB, [0, 255]): `"train"` (80%), `"test"`
    (20%), or `"train[:N%]"`, a stratified N% of the training split, e.g. for fine-tuning with few labels."""
    images, labels = datasets.digits(split, test_fraction=test_fraction)
    return Source(tf.data.Dataset.from_tensor_slices((images, labels)), len(images), datasets.NUM_CLASSES,
                  tf.data.experimental.AutoShardPolicy.DATA)


def _decodable(path: str, max_pixels: int) -> bool:
    """True if `path` is a regular file that the pipeline's decoder reads as an image of at most
    `max_pixels` pixels (checked from the header first, so oversized files are never decoded).
    FIFOs, devices and folders named like images are refused without being opened."""
    if not os.path.isfile(path):
        return False
    try:
        image_io.decode_rgb(tf.io.read_file(path), max_pixels)
        return True
    except (tf.errors.OpError, OSError):
        return False


def folder_source(root: str, split: str, class_names: list[str] | None = None,
                  max_pixels: int = image_io.DEFAULT_MAX_PIXELS) -> Source:
    """Images in `root/<split>/<class>/*.jpg` (also png, bmp, gif); classes sorted by name.

    Every file is decoded once up front with the pipeline's decoder (`keras_vit.image_io`: RGB,
    alpha dropped, gray repeated, CMYK converted). Empty, corrupt, truncated and unsupported
    files, images over `max_pixels` pixels and non-regular files are skipped, counted in
    `Source.skipped` and logged. `class_names` (the training split's) fixes the label order of
    an evaluation split.
    """
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"Image folder {split_dir!r} does not exist. Expected {root}/{split}/<class>/*.jpg.")
    try:
        found = sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())
    except OSError as error:
        raise OSError(f"Image folder {split_dir!r} is unreadable: {error}") from error
    class_names = class_names or found
    paths, labels = [], []
    for label, name in enumerate(class_names):
        class_dir = os.path.join(split_dir, name)
        files = sorted(f for f in os.listdir(class_dir) if f.lower().endswith(IMAGE_EXTENSIONS)) \
            if os.path.isdir(class_dir) else []
        paths += [os.path.join(class_dir, f) for f in files]
        labels += [label] * len(files)
    if not paths:
        extensions = ",".join(IMAGE_EXTENSIONS)
        raise ValueError(f"Image folder {split_dir!r} has no images: expected <class>/*{{{extensions}}} in class "
                         f"subfolders, found subfolders {found}.")
    with futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        readable = list(pool.map(lambda path: _decodable(path, max_pixels), paths))
    bad = [path for path, ok in zip(paths, readable) if not ok]
    if bad:
        logging.warning("Skipping %d unreadable image(s) (corrupt, truncated, empty, unsupported or over "
                        "max_pixels=%d) in %s, e.g. %s", len(bad), max_pixels, split_dir, bad[:3])
    if len(bad) == len(paths):
        raise ValueError(f"Image folder {split_dir!r}: all {len(bad)} images are unreadable.")
    paths, labels = zip(*[(path, label) for path, label, ok in zip(paths, labels, readable) if ok])

    def decode(path, label):
        return image_io.decode_rgb(tf.io.read_file(path), max_pixels), label

    dataset = tf.data.Dataset.from_tensor_slices((list(paths), np.array(labels, "int32")))
    # ignore_errors drops files that changed on disk after the check above (they are not counted).
    dataset = dataset.map(decode, num_parallel_calls=AUTOTUNE).ignore_errors(log_warning=True)
    return Source(dataset, len(paths), len(class_names), tf.data.experimental.AutoShardPolicy.DATA, len(bad),
                  class_names)


def tfds_source(name: str, split: str, data_dir: str | None, download: bool, shuffle_files: bool) -> Source:
    """A TFDS dataset by name. Unknown names, and missing data with `download=False`, fail fast."""
    import tensorflow_datasets as tfds

    if name.split(":")[0].split("/")[0] not in tfds.list_builders():
        raise ValueError(f"Unknown dataset {name!r}: not 'digits', 'folder' or a TFDS dataset name "
                         f"(tfds.list_builders()).")
    builder = tfds.builder(name, data_dir=data_dir or None)
    if download:
        builder.download_and_prepare()
    try:
        dataset = builder.as_dataset(split=split, shuffle_files=shuffle_files, as_supervised=True)
    except AssertionError as error:  # TFDS raises AssertionError("Dataset ... not found ...").
        raise FileNotFoundError(f"TFDS dataset {name!r} is not prepared in {builder.data_dir!r} and download=False. "
                                f"Prepare it there or set download=True. ({error})") from None
    try:
        num_examples = builder.info.splits[split].num_examples
    except KeyError:  # No split metadata (e.g. under tfds.testing.mock_data): size unknown.
        num_examples = None
    return Source(dataset, num_examples, builder.info.features["label"].num_classes,
                  tf.data.experimental.AutoShardPolicy.AUTO)


def get_source(config: Config, split: str, training: bool, class_names: list[str] | None = None) -> Source:
    """The source named by `config.dataset` for `split`."""
    if config.dataset == "digits":
        return digits_source(split)
    if config.dataset == "folder":
        if not config.data_dir:
            raise ValueError("dataset='folder' needs data_dir=<root with <split>/<class>/*.jpg>.")
        return folder_source(config.data_dir, split, class_names, config.max_image_pixels)
    return tfds_source(config.dataset, split, config.data_dir, config.download, shuffle_files=training)


# === Preprocessing ===


def inception_crop(image: tf.Tensor, size: int, min_area: float) -> tf.Tensor:
    """A random box covering `min_area`-100% of the image, aspect ratio 3/4-4/3, resized to `size`."""
    begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(min_area, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    crop = tf.slice(image, begin, crop_size)
    crop.set_shape([None, None, image.shape[-1]])  # tf.slice loses the static channel count.
    return tf.image.resize(crop, (size, size))


def _train_map(config: Config, num_classes: int):
    def preprocess(image, label):
        image = tf.cast(image, tf.float32)
        if config.inception_crop:
            image = inception_crop(image, config.image_size, config.crop_min_area)
        else:
            image = tf.image.resize(image, (config.image_size, config.image_size))
        if config.random_flip:
            image = tf.image.random_flip_left_right(image)
        return image, tf.one_hot(label, num_classes)

    return preprocess


def _eval_map(config: Config, num_classes: int):
    def preprocess(image, label):
        image = tf.image.resize(tf.cast(image, tf.float32), (config.image_size, config.image_size))
        return image, tf.one_hot(label, num_classes)

    return preprocess


def _batch_augment(config: Config):
    """RandAugment and/or MixUp (core Keras layers) on a batch, or None."""
    import keras

    layers = []
    if config.randaugment:
        layers.append(keras.layers.RandAugment(value_range=(0, 255), seed=config.seed))
    mixup = keras.layers.MixUp(alpha=config.mixup_alpha, seed=config.seed) if config.mixup_alpha > 0 else None
    if not layers and mixup is None:
        return None

    def augment(images, labels):
        for layer in layers:
            images = layer(images, training=True)
        if mixup is not None:
            mixed = mixup({"images": images, "labels": labels}, training=True)
            images, labels = mixed["images"], mixed["labels"]
        return images, labels

    return augment


def _finish(dataset: tf.data.Dataset, policy) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    options.deterministic = True
    return dataset.with_options(options).prefetch(AUTOTUNE)


def exact_batches(dataset: tf.data.Dataset, batch_size: int, num_examples: int | None = None) -> tf.data.Dataset:
    """(images, labels, weights) batches of an (images, labels) dataset in which every example counts once.

    Every batch has `batch_size` rows, so that it splits evenly over any number of devices that divides the global
    batch (keras.distribution shards every batch evenly; tf.distribute too, then): the last, partial batch is
    filled with zero images of weight 0, which weighted metrics leave out. No batch is padding only. (big_vision and
    flax evaluate the same way; Keras itself neither pads nor drops a partial batch: keras#21167.) With
    `num_examples`, the batch count is declared (Keras then knows the evaluation's steps).
    """
    examples = dataset.unbatch().map(lambda images, labels: (images, labels, tf.constant(1.0)))
    padding = tuple(tf.zeros(spec.shape, spec.dtype) for spec in examples.element_spec)
    padded = examples.concatenate(tf.data.Dataset.from_tensors(padding).repeat(batch_size - 1))
    batches = padded.batch(batch_size, drop_remainder=True)
    batches = batches.filter(lambda images, labels, weights: tf.reduce_any(weights > 0))
    if num_examples is not None:
        batches = batches.apply(tf.data.experimental.assert_cardinality(-(-num_examples // batch_size)))
    return batches.prefetch(AUTOTUNE)


@dataclasses.dataclass
class Datasets:
    train: tf.data.Dataset  # Repeats forever: `model.fit` needs `steps_per_epoch`.
    eval: tf.data.Dataset
    num_classes: int
    num_train_examples: int | None
    num_eval_examples: int | None
    skipped: int  # Unreadable files left out of both splits.


def make_datasets(config: Config) -> Datasets:
    """Training and evaluation datasets batched by `config.batch_size` (the global batch)."""
    train = get_source(config, config.train_split, training=True)
    evaluation = get_source(config, config.eval_split, training=False, class_names=train.class_names)
    train_ds = train.dataset.repeat()
    if config.shuffle_buffer > 1:
        train_ds = train_ds.shuffle(config.shuffle_buffer, seed=config.seed)
    train_ds = train_ds.map(_train_map(config, train.num_classes), num_parallel_calls=AUTOTUNE)
    train_ds = train_ds.batch(config.batch_size, drop_remainder=True)
    augment = _batch_augment(config)
    if augment is not None:
        train_ds = train_ds.map(augment, num_parallel_calls=AUTOTUNE)
    eval_ds = evaluation.dataset.map(_eval_map(config, train.num_classes), num_parallel_calls=AUTOTUNE)
    eval_ds = eval_ds.batch(config.batch_size)
    # Evaluation is not sharded: every worker runs the same number of steps over all of it (uneven
    # shards would leave one worker waiting in a collective), and the replica means agree.
    return Datasets(_finish(train_ds, train.shard_policy), _finish(eval_ds, tf.data.experimental.AutoShardPolicy.OFF),
                    train.num_classes, train.num_examples, evaluation.num_examples,
                    train.skipped + evaluation.skipped)
