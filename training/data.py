"""tf.data input pipelines: TFDS by name, image folders and the embedded scikit-learn digits.

Every source yields (image float32 in [0, 255], integer label). `make_datasets(config)` adds the
paper's preprocessing (train: Inception crop + resize + random flip; eval: resize; with `max_num_patches`, NaFlex
patch sequences of each crop or image at its own aspect ratio instead of the resize), optional
RandAugment / MixUp, one-hot labels, batching, per-worker (tf.distribute) or per-process (JAX) sharding and
prefetch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from keras_vit import datasets, image_io
from . import multihost
from .configs import Config

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
AUTOTUNE = tf.data.AUTOTUNE
PROGRESS_FROM = 10_000  # Folders of this many images or more show a progress bar while they are checked.


@dataclasses.dataclass
class Source:
    """One split of a dataset before preprocessing."""

    dataset: tf.data.Dataset  # (image uint8/float (H, W, C), int label): this process's shard of the split
    num_examples: int | None  # In this process's shard; None if the dataset does not say.
    num_classes: int
    shard_policy: tf.data.experimental.AutoShardPolicy
    skipped: int = 0  # Unreadable files left out (corrupt, truncated, empty, oversized, not a file).
    class_names: list[str] | None = None  # Image folders: label i is class_names[i].


# === Sources ===


def digits_source(split: str, test_fraction: float = datasets.TEST_FRACTION,
                  shard: multihost.Shard = multihost.Shard()) -> Source:
    """The embedded digits (`keras_vit.datasets.digits`: 8x8, RGB, [0, 255]): `"train"` (80%), `"test"`
    (20%), or `"train[:N%]"`, a stratified N% of the training split, e.g. for fine-tuning with few labels."""
    images, labels = datasets.digits(split, test_fraction=test_fraction)
    images, labels = images[shard.index::shard.count], labels[shard.index::shard.count]
    return Source(tf.data.Dataset.from_tensor_slices((images, labels)), len(images), datasets.NUM_CLASSES,
                  tf.data.experimental.AutoShardPolicy.DATA)


def _readable(paths: list[str], max_pixels: int) -> list[bool]:
    """Which of `paths` are regular files that the pipeline's decoder reads as images of at most `max_pixels` pixels
    (the header is checked first, so oversized files are never decoded). FIFOs, devices and folders named like
    images are refused without being opened. The files are decoded in parallel by tf.data, with a progress bar
    for large folders."""
    regular = [index for index, path in enumerate(paths) if os.path.isfile(path)]
    if not regular:
        return [False] * len(paths)

    def check(index, path):
        image = image_io.decode_rgb(tf.io.read_file(path), max_pixels)
        with tf.control_dependencies([image]):
            return tf.identity(index)

    candidates = tf.data.Dataset.from_tensor_slices((np.array(regular, "int64"), [paths[i] for i in regular]))
    decoded = candidates.map(check, num_parallel_calls=AUTOTUNE, deterministic=False).ignore_errors()
    progress = keras.utils.Progbar(len(regular), unit_name="image", verbose=int(len(regular) >= PROGRESS_FROM))
    readable = set()
    for indices in decoded.batch(1024).as_numpy_iterator():
        readable.update(indices.tolist())
        progress.update(len(readable))
    progress.update(len(regular), finalize=True)  # Every file is checked: the unreadable ones too.
    return [index in readable for index in range(len(paths))]


def folder_source(root: str, split: str, class_names: list[str] | None = None,
                  max_pixels: int = image_io.DEFAULT_MAX_PIXELS, shard: multihost.Shard = multihost.Shard()) -> Source:
    """Images in `root/<split>/<class>/*.jpg` (also png, bmp, gif); classes sorted by name; of them, every
    `shard.count`-th file from `shard.index` (in class, then file name order).

    Every file of the shard is decoded once up front with the pipeline's decoder (`keras_vit.image_io`: RGB,
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
    paths, labels = paths[shard.index::shard.count], labels[shard.index::shard.count]
    if not paths:
        raise ValueError(f"Image folder {split_dir!r} has fewer images than the run's {shard.count} processes. "
                         "Expected at least one image per process.")
    logging.info("Checking the %d image(s) of %s", len(paths), split_dir)
    readable = _readable(paths, max_pixels)
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


def tfds_source(name: str, split: str, data_dir: str | None, download: bool, shuffle_files: bool,
                shard: multihost.Shard = multihost.Shard()) -> Source:
    """A TFDS dataset by name; of the split, this process's part (`tfds.even_splits`), which is all that it
    reads. Unknown names, and missing data with `download=False`, fail fast."""
    import tensorflow_datasets as tfds

    if name.split(":")[0].split("/")[0] not in tfds.list_builders():
        raise ValueError(f"Unknown dataset {name!r}: not 'digits', 'folder' or a TFDS dataset name "
                         f"(tfds.list_builders()).")
    builder = tfds.builder(name, data_dir=data_dir or None)
    if download:
        builder.download_and_prepare()
    if shard.count > 1:
        split = tfds.even_splits(split, n=shard.count, drop_remainder=False)[shard.index]
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


def get_source(config: Config, split: str, training: bool, class_names: list[str] | None = None,
               shard: multihost.Shard = multihost.Shard()) -> Source:
    """This process's shard of the source named by `config.dataset` for `split`."""
    if config.dataset == "digits":
        return digits_source(split, shard=shard)
    if config.dataset == "folder":
        if not config.data_dir:
            raise ValueError("dataset='folder' needs data_dir=<root with <split>/<class>/*.jpg>.")
        return folder_source(config.data_dir, split, class_names, config.max_image_pixels, shard)
    return tfds_source(config.dataset, split, config.data_dir, config.download, shuffle_files=training, shard=shard)


# === Preprocessing ===


def random_box(image: tf.Tensor, min_area: float, seed: tf.Tensor) -> tf.Tensor:
    """A random box of the image covering `min_area`-100% of it, aspect ratio 3/4-4/3, at its own size; the box is
    a function of `seed` (a stateless op's shape-[2] seed)."""
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(min_area, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    crop = tf.slice(image, begin, crop_size)
    crop.set_shape([None, None, image.shape[-1]])  # tf.slice loses the static channel count.
    return crop


def _naflex_inputs(config: Config, patch_size: int | None):
    """image (height, width, 3) float32 -> the inputs of a NaFlex ViT for it (`image_io.naflex_patches`: its aspect
    ratio kept, its patches padded to `config.max_num_patches`)."""
    if patch_size is None:
        raise ValueError("max_num_patches needs the model's patch size (make_datasets(config, patch_size=...)).")

    def naflex_inputs(image):
        patches, mask, grid = image_io.naflex_patches(image, patch_size, config.max_num_patches)
        return {"patches": patches, "patch_mask": mask, "spatial_shapes": grid}

    return naflex_inputs


def _train_map(config: Config, num_classes: int, patch_size: int | None = None):
    """The training preprocessing of one (image, label) example, its randomness drawn from `seed` (stateless ops:
    the same seeds give the same crops and flips whatever order the parallel map's threads run in). With
    `max_num_patches` the crop (or image) keeps its own aspect ratio, into the NaFlex inputs (`_naflex_inputs`)."""
    naflex_inputs = _naflex_inputs(config, patch_size) if config.max_num_patches else None

    def preprocess(example, seed):
        image, label = example
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        image = tf.cast(image, tf.float32)
        if config.inception_crop:
            image = random_box(image, config.crop_min_area, crop_seed)
        if naflex_inputs is None:
            image = tf.image.resize(image, (config.image_size, config.image_size))
        if config.random_flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return image if naflex_inputs is None else naflex_inputs(image), tf.one_hot(label, num_classes)

    return preprocess


def _example_seeds(seed: int, shard: multihost.Shard) -> tf.data.Dataset:
    """One shape-[2] stateless seed per training example, a fixed stream for `seed` and this process."""
    # One stream per (seed, process index) while the index stays below the prime 1000003.
    return tf.data.Dataset.random(seed=seed * 1000003 + shard.index).batch(2)


def _eval_map(config: Config, num_classes: int, patch_size: int | None = None):
    naflex_inputs = _naflex_inputs(config, patch_size) if config.max_num_patches else None

    def preprocess(image, label):
        image = tf.cast(image, tf.float32)
        if naflex_inputs is None:
            image = tf.image.resize(image, (config.image_size, config.image_size))
        return image if naflex_inputs is None else naflex_inputs(image), tf.one_hot(label, num_classes)

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


def exact_batches(dataset: tf.data.Dataset, batch_size: int, num_batches: int | None = None,
                  padding_inputs=None) -> tf.data.Dataset:
    """(images, labels, weights) batches of an (images, labels) dataset in which every example counts once.

    Every batch has `batch_size` rows, so that it splits evenly over any number of devices that divides the global
    batch (keras.distribution shards every batch evenly; tf.distribute too, then): the last, partial batch is
    filled with zero images of weight 0, which weighted metrics leave out. (big_vision and flax evaluate the same
    way; Keras itself neither pads nor drops a partial batch: keras#21167.) With `num_batches`, exactly that many
    batches, padding only where the examples run out (so that every process of a run steps as often as the
    others); without, no batch is padding only. `padding_inputs`: the model inputs of a padding row where zeros are
    not one the model computes finite outputs for (a NaFlex sequence needs a patch: `Datasets.eval_padding`).
    """
    examples = dataset.unbatch().map(lambda images, labels: (images, labels, tf.constant(1.0)))
    zeros = tf.nest.map_structure(lambda spec: tf.zeros(spec.shape, spec.dtype), examples.element_spec)
    padding = tf.data.Dataset.from_tensors(zeros if padding_inputs is None else (padding_inputs, *zeros[1:]))
    if num_batches is not None:
        batches = examples.concatenate(padding.repeat()).take(num_batches * batch_size).batch(batch_size)
        return batches.apply(tf.data.experimental.assert_cardinality(num_batches)).prefetch(AUTOTUNE)
    batches = examples.concatenate(padding.repeat(batch_size - 1)).batch(batch_size, drop_remainder=True)
    return batches.filter(lambda images, labels, weights: tf.reduce_any(weights > 0)).prefetch(AUTOTUNE)


@dataclasses.dataclass
class Datasets:
    """This process's training and evaluation datasets, batched by its share of the global batch."""

    eval: tf.data.Dataset
    # The training stream after its first n batches (a resumed run's); exact but for RandAugment and MixUp, whose
    # random state is the process's. It repeats forever: `model.fit` needs `steps_per_epoch`.
    train_after: Callable[[int], tf.data.Dataset]
    num_classes: int
    num_train_examples: int | None  # Of all processes.
    num_eval_examples: int | None  # Of all processes.
    skipped: int  # Unreadable files left out of both splits (of all processes).
    batch_size: int  # This process's rows of each global batch.
    eval_shard_sizes: list[int] | None = None  # Eval examples of each process; None if unknown.
    eval_padding: dict | None = None  # The inputs of `exact_batches`' padding rows where zeros are not (NaFlex's).

    @property
    def train(self) -> tf.data.Dataset:
        """The training stream from its first batch."""
        return self.train_after(0)

    @property
    def eval_batches(self) -> int | None:
        """The eval steps of every process: enough batches for the largest shard (None if unknown)."""
        return None if self.eval_shard_sizes is None else -(-max(self.eval_shard_sizes) // self.batch_size)


def make_datasets(config: Config, patch_size: int | None = None) -> Datasets:
    """This process's training and evaluation datasets: its shard of each split (`multihost.shard()`; all of it
    in a one-process run), batched by its share of `config.batch_size` (the global batch). With
    `config.max_num_patches`, the examples are NaFlex inputs of patches of `patch_size` (the model's)."""
    shard = multihost.shard()
    batch_size = shard.per_process_batch(config.batch_size)
    train = get_source(config, config.train_split, training=True, shard=shard)
    evaluation = get_source(config, config.eval_split, training=False, class_names=train.class_names, shard=shard)
    def train_after(batches: int) -> tf.data.Dataset:
        examples = train.dataset.repeat()
        if config.shuffle_buffer > 1:
            examples = examples.shuffle(config.shuffle_buffer, seed=config.seed)
        # The examples of the first `batches` batches and their seeds are left out before any decoding map: the
        # stream goes on as if they had been trained on (a resumed run's).
        examples = tf.data.Dataset.zip(examples, _example_seeds(config.seed, shard)).skip(batches * batch_size)
        train_ds = examples.map(_train_map(config, train.num_classes, patch_size), num_parallel_calls=AUTOTUNE)
        train_ds = train_ds.batch(batch_size, drop_remainder=True)
        augment = _batch_augment(config)
        if augment is not None:
            train_ds = train_ds.map(augment, num_parallel_calls=AUTOTUNE)
        return _finish(train_ds, train.shard_policy)

    eval_map = _eval_map(config, train.num_classes, patch_size)
    eval_ds = evaluation.dataset.map(eval_map, num_parallel_calls=AUTOTUNE)
    eval_ds = eval_ds.batch(batch_size)
    train_sizes = multihost.gather_counts(train.num_examples)
    eval_sizes = multihost.gather_counts(evaluation.num_examples)
    # tf.distribute does not shard the evaluation: every worker runs the same number of steps over all of it
    # (uneven shards would leave one worker waiting in a collective), and the replica means agree.
    return Datasets(_finish(eval_ds, tf.data.experimental.AutoShardPolicy.OFF), train_after,
                    train.num_classes, None if train_sizes is None else sum(train_sizes),
                    None if eval_sizes is None else sum(eval_sizes),
                    sum(multihost.gather_counts(train.skipped + evaluation.skipped)), batch_size, eval_sizes,
                    eval_map(tf.zeros((patch_size, patch_size, 3)), 0)[0] if config.max_num_patches else None)
