"""`python -m training.train` in a clone: the `keras-vit-train` command (`keras_vit/cli/train.py`)."""

if __name__ == "__main__":
    from keras_vit.cli.train import run

    run()
