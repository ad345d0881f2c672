"""Shared test helpers: layer checks, serialization round trips, tiny model configs."""

from __future__ import annotations

import json

import keras
import numpy as np

# Tiny configurations that run in seconds on a CPU.
TINY_VIT = dict(patch_size=8, hidden_dim=48, mlp_dim=96, num_heads=3, num_layers=2)
TINY_HYBRID = dict(patch_size=1, hidden_dim=48, mlp_dim=96, num_heads=3, num_layers=1, resnet_stages=(1, 1))


def randomize(model_or_layer, seed: int = 0, scale: float = 0.2) -> None:
    """Gives every weight non-trivial random values (zero-initialised heads and tokens too)."""
    rng = np.random.default_rng(seed)
    for weight in model_or_layer.weights:
        weight.assign(rng.normal(scale=scale, size=weight.shape).astype("float32"))


def graph_op_types(graph_def) -> set[str]:
    """Op types of a GraphDef's nodes and of the nodes of every function in its library."""
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types |= {node.op for node in function.node_def}
    return types


def run_serialization_test(layer: keras.layers.Layer) -> keras.layers.Layer:
    """`from_config(get_config())` rebuilds an equal config; also through Keras' serializer."""
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert json.dumps(clone.get_config(), sort_keys=True) == json.dumps(config, sort_keys=True)
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(revived) is type(layer)
    assert json.dumps(revived.get_config(), sort_keys=True) == json.dumps(config, sort_keys=True)
    return clone


def run_layer_test(layer: keras.layers.Layer, input_shape: tuple, expected_output_shape: tuple,
                   train: bool = True) -> np.ndarray:
    """Builds a layer, calls it eagerly and symbolically, checks shapes, round-trips its
    config, and runs one training step of a model around it. Returns the eager output."""
    run_serialization_test(layer)
    rng = np.random.default_rng(0)
    x = rng.normal(size=input_shape).astype("float32")
    eager = np.asarray(layer(x))
    assert eager.shape == expected_output_shape, (eager.shape, expected_output_shape)
    assert np.isfinite(eager).all()
    symbolic = layer(keras.Input(batch_shape=(None, *input_shape[1:])))
    assert tuple(symbolic.shape[1:]) == expected_output_shape[1:]
    assert tuple(layer.compute_output_shape((None, *input_shape[1:]))[1:]) == expected_output_shape[1:]
    if train and layer.trainable_weights:
        inputs = keras.Input(shape=input_shape[1:])
        model = keras.Model(inputs, layer(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        before = [np.array(w) for w in layer.trainable_weights]
        target = rng.normal(size=expected_output_shape).astype("float32")
        model.train_on_batch(x, target)
        assert any(not np.allclose(b, np.array(w)) for b, w in zip(before, layer.trainable_weights)), \
            "a training step changed no weight"
    return eager
