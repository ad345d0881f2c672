"""The command lines of keras_vit, one module per console script (installed with the package):

    keras-vit-train          training/ recipes under tf.distribute (`keras_vit.cli.train`)
    keras-vit-export         a TF Serving SavedModel (`keras_vit.cli.export`)
    keras-vit-tflite         verified LiteRT files (`keras_vit.cli.tflite`)
    keras-vit-inspect        the paper's inspection figures (`keras_vit.cli.inspect`)
    keras-vit-convert        checkpoints to Keras weights files (`keras_vit.cli.convert`)
    keras-vit-fewshot        linear few-shot accuracy on the embedded digits (`keras_vit.cli.fewshot`)
    keras-vit-masked-digits  does masked patch pre-training help? (`keras_vit.cli.masked_digits`)

`python -m keras_vit.cli.<name>` runs the same. The flags that pick a model are the same everywhere
(`common.add_model_arguments`). Nothing here is imported by `import keras_vit`.
"""
