"""The main job: builds a ViT, runs it on a real photograph and prints the result.

Run with `python demo.py` (no download needed).
"""

import numpy as np

import keras_vit


def main() -> None:
    from sklearn.datasets import load_sample_image

    image = load_sample_image("china.jpg")[:416, :608]  # (427, 640, 3) uint8, cropped to a multiple of 16.
    model = keras_vit.ViTB16(weights=None, input_shape=image.shape, classes=10)
    probabilities = model.predict(image[None].astype("float32"), verbose=0)[0]
    print(f"{model.name}: {model.count_params():,} parameters, input {image.shape}, "
          f"{model.get_layer('posembed_input').num_tokens} tokens")
    print("class probabilities (random weights):", np.round(probabilities, 4))


if __name__ == "__main__":
    main()
