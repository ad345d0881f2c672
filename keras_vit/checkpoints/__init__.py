"""Checkpoints: every format keras_vit reads, and how its arrays reach a model.

Layout code (data, NumPy, `keras.ops`; never imports `keras_vit.models` or `keras_vit.layers`):

    registry          the public checkpoints (`weights=` names) and their download
    npz               the original `.npz` layout: reading, `KEY_TABLE`, position-embedding resampling
    resample          a position table resized as its file's source does (`keras.ops`: the loader's and the layer's)
    safetensors_file  reading `.safetensors` files without torch; PyTorch pickle files refused
    torch_layout      timm and Hugging Face state dicts translated into the `.npz` layout
    architecture      one architecture reader for every format (on shapes: opens no file)
    locate            a `weights=` directory (`save_pretrained`) or `hf://` name (local hub cache) to its file
    reader            `read_checkpoint`: one read of a file's header and config.json, a `CheckpointFile`

Into a model:

    loader            `resolve` a `weights=` value, `load` it into a built model: all or nothing

The one converter for every format, `keras_vit.convert`, builds models, so it sits above them, outside
this package. The dependencies run one way: convert -> models -> loader -> layout code. `lint-imports`
(`.importlinter`, run by tests/project/test_architecture.py) checks it.
"""
