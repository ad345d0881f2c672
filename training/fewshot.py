"""`python -m training.fewshot` in a clone: the `keras-vit-fewshot` command (`keras_vit/cli/fewshot.py`)."""

if __name__ == "__main__":
    from keras_vit.cli.fewshot import main

    raise SystemExit(main())
