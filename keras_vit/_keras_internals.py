"""Every Keras internal keras_vit's models touch, each behind a guard.

Keras has no public API for these, and a release may move or change them. Where one is missing or is not what
this module expects, keras_vit does what Keras itself does: the guard hands the call back to Keras unchanged; it
never raises. `tests/models/test_models.py` forces that fallback.
"""

from __future__ import annotations

from typing import Any, Callable

import keras

# TensorFlowTrainer's tf.distribute strategy: None where the model was made outside any strategy's scope.
STRATEGY_ATTRIBUTE = "_distribute_strategy"
# TFEpochIterator's dataset, whose `element_spec` describes one batch.
DATASET_ATTRIBUTE = "_distributed_dataset"


def symbolic_build(model: keras.Model, keras_build: Callable[..., None], iterator: Any = None,
                   data_batch: Any = None) -> None:
    """Keras' `TensorFlowTrainer._maybe_symbolic_build` (`keras_build`), made to build `model`'s state before
    `fit` / `evaluate` / `train_on_batch` trace their step, as Keras' JAX and PyTorch trainers always do.

    That state is the optimizer's slots and the compiled loss's and metrics' variables. Keras' TensorFlow trainer
    builds it up front only where the model was made under a tf.distribute strategy. Otherwise the step's first
    trace creates those variables, and `tf.function` then traces the step a second time: twice the time to the
    first step. Here the trainer is lent the default strategy for the build, and Keras' own code runs
    (`_symbolic_build`: a symbolic forward, the metrics, the loss, `optimizer.build`). Given an epoch iterator,
    the build reads its dataset's `element_spec`, not a batch, so no input is read twice.

    Keras' call is passed on unchanged where a strategy is in scope, on other backends, where the trainer or the
    iterator lacks the attribute read here, or where a batch is not all dense tensors.
    """
    if keras.backend.backend() != "tensorflow" or getattr(model, STRATEGY_ATTRIBUTE, "missing") is not None:
        keras_build(iterator=iterator, data_batch=data_batch)
        return
    import tensorflow as tf

    batch = data_batch if data_batch is not None else getattr(getattr(iterator, DATASET_ATTRIBUTE, None),
                                                                "element_spec", None)
    if tf.distribute.has_strategy() or not _dense(batch):  # a model made outside the scope it fits in; ragged input
        keras_build(iterator=iterator, data_batch=data_batch)
        return
    setattr(model, STRATEGY_ATTRIBUTE, tf.distribute.get_strategy())
    try:
        keras_build(iterator=None, data_batch=batch)
    finally:
        setattr(model, STRATEGY_ATTRIBUTE, None)


def _dense(batch: Any) -> bool:
    """Whether `batch` (arrays, tensors or their specs, nested) is all dense: no ragged or sparse parts."""
    import tensorflow as tf

    return batch is not None and all(
        leaf is None or isinstance(leaf, (tf.TensorSpec, tf.Tensor, keras.KerasTensor)) or hasattr(leaf, "__array__")
        for leaf in tf.nest.flatten(batch))
