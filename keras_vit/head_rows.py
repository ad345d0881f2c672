"""A model's twin that computes, in its last encoder block, only the token rows its outputs read.

A classifier on the class token reads one row of the last block's output; the block's other rows (their
queries, attention output and MLP) are computed and dropped: for ViT-B/16 at 224 px, 196 of that block's 197
rows, 7% of the forward's FLOPs. `head_rows_model(model)` calls the same layers, with the same weights, in the
same order, the last block with `output_tokens=n` (`TransformerBlock`): the same maths for every row that is
read. `ViTModel.predict` and the SavedModel exports run it; the model itself keeps every row of every block (its
layers' outputs, `features_model`, attention maps).
"""

from __future__ import annotations

import keras

from keras_vit.layers import TokenPooling, transformer_blocks

# The consumers a row-restricted tensor may have: LayerNorms of the last axis (keras_vit's LayerNorm included:
# their output keeps the same rows) and poolings that read one prefix row.
_ROW_READ = {"token": 0, "distillation": 1}


class _ReadsOtherRows(Exception):
    """Raised while tracing the twin when a layer would read rows the last block no longer computes."""


def head_rows_model(model: keras.Model) -> keras.Model:
    """`model`'s functional twin (its layers, shared; same outputs) whose last `TransformerBlock` computes only the
    prefix rows that the model's outputs read: the class token, with DeiT's distillation token. Returns `model`
    itself where an output may read other rows of that block (`include_top=False` without pooling, `"avg"` or
    `"map"` pooling, `fc_norm`), where its blocks are not top-level layers, or for a model that is not functional.

    Example:

    ```python
    model = keras_vit.ViTB16(weights=None)
    twin = keras_vit.head_rows_model(model)  # same layers and weights, 0.93x the FLOPs of model(images)
    np.testing.assert_allclose(twin(images), model(images), atol=1e-5)
    ```
    """
    reads = {_ROW_READ[layer.method] for layer in model.layers
             if isinstance(layer, TokenPooling) and layer.method in _ROW_READ}
    if not reads:
        return model
    try:
        last = transformer_blocks(model)[-1]
    except ValueError:  # no top-level blocks
        return model
    rows = max(reads) + 1
    restricted = set()  # ids of the tensors that hold only the first `rows` tokens

    def call(layer, *args, **kwargs):
        reads_restricted = any(id(value) in restricted for value in keras.tree.flatten((args, kwargs)))
        if layer is last:
            output = layer(*args, **{**kwargs, "output_tokens": rows})
            restricted.add(id(output))
            return output
        output = layer(*args, **kwargs)
        if not reads_restricted:
            return output
        if isinstance(layer, keras.layers.LayerNormalization) and layer.axis in (-1, [-1]):
            restricted.add(id(output))
        elif not (isinstance(layer, TokenPooling) and _ROW_READ.get(layer.method, rows) < rows):
            raise _ReadsOtherRows(layer.name)
        return output

    try:
        twin = keras.models.clone_model(model, clone_function=lambda layer: layer, call_function=call)
    except (_ReadsOtherRows, ValueError):  # ValueError: Keras clones functional models only
        return model
    if any(id(output) in restricted for output in keras.tree.flatten(twin.outputs)):
        return model
    return twin
