"""keras-vit-train on NaFlex patch sequences (`max_num_patches`): each image (or training crop) at its own aspect
ratio, resized to the largest grid within the budget and padded to it with a mask, for a `keras_vit.naflex.NaFlexViT`
with a classification head: from scratch on the digits, and fine-tuning a SigLIP 2 NaFlex folder
(tests/data/families/hf_siglip2_naflex_p8) on a folder of images from 1:3 to 16:5. The model's own numerics
against transformers are in tests/checkpoints/test_naflex.py."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
from PIL import Image

import keras_vit
from keras_vit import naflex
from keras_vit.cli import export as export_cli
from keras_vit.cli import tflite as tflite_cli
from keras_vit.layers.naflex import NaFlexPositionEmbedding
from keras_vit.training import configs, data, recipe, trainer
from tests.data.make_family_files import FOLDER, NAFLEX
from tests.testing import TRAIN_TINY, run_train_cli

NAFLEX_TINY = [*TRAIN_TINY, "patch_size=4", "max_num_patches=16", "classifier=map"]  # a 4x4 table at 16 px


def _digits_config(*overrides: str) -> configs.Config:
    return configs.apply_overrides(configs.get_config("digits"), [*NAFLEX_TINY, *overrides])


def test_batches_hold_each_crop_at_its_own_grid_and_eval_images_by_the_processors_rule():
    """Training crops (aspect ratios 3/4 to 4/3) reach the model at grids of their own within the budget, their
    patches then zero padding, the mask marking them; eval images at the grid and pixels of the NumPy rule
    (`keras_vit.naflex`, transformers' processor recomputed), which the code under test does not call."""
    config = _digits_config("max_num_patches=12")
    datasets = data.make_datasets(config, patch_size=4)
    inputs, labels = next(iter(datasets.train))
    patches, mask, grids = (inputs[name].numpy() for name in ("patches", "patch_mask", "spatial_shapes"))
    assert patches.shape == (16, 12, 48) and mask.shape == (16, 12) and labels.shape == (16, 10)
    counts = grids.prod(axis=1)
    assert (counts <= 12).all() and (mask.sum(axis=1) == counts).all()
    assert len({tuple(grid) for grid in grids}) > 1, grids  # crops of several aspect ratios in one batch
    for row, count in zip(patches, counts):
        assert not row[count:].any() and row[:count].any()

    images = [image.numpy() for image, _ in data.digits_source("test").dataset.take(3)]
    eval_inputs, _ = next(iter(datasets.eval))
    for index, image in enumerate(images):
        expected = naflex.naflex_inputs([np.round(image).astype(np.uint8)], 4, 12)
        np.testing.assert_array_equal(eval_inputs["spatial_shapes"][index], expected["spatial_shapes"][0])
        np.testing.assert_array_equal(eval_inputs["patch_mask"][index], expected["patch_mask"][0])
        np.testing.assert_allclose(eval_inputs["patches"][index], expected["patches"][0], atol=1.5)  # PIL's rounding


def test_digits_from_scratch_trains_saves_and_counts_each_eval_image_once(tmp_path, capsys):
    """A tiny NaFlex ViT trained from scratch on the digits: its `model.keras` (patch sequences in, logits out) loads
    and predicts as the run's model, and the summary's top-1 is the loaded model's on the 360 test digits, each once
    (the last eval batch is padded with a one-patch image of weight 0, not with NaN-making empty sequences).
    keras-vit-export and keras-vit-tflite refuse the file by name (a NaFlex classifier's files are not built)."""
    config = _digits_config()
    summary = trainer.train_and_evaluate(config, str(tmp_path), verbose=0)
    assert summary["num_eval_examples"] == 360 and np.isfinite(summary["loss"]), summary
    model = keras.saving.load_model(summary["model_path"], compile=False)
    assert isinstance(model, keras_vit.ViTModel)
    assert set(model.input) == {"patches", "patch_mask", "spatial_shapes"}
    table = next(layer for layer in model.layers if isinstance(layer, NaFlexPositionEmbedding))
    assert table.grid_size == (4, 4)  # image_size 16 / patch 4
    datasets = data.make_datasets(config, patch_size=4)
    correct, seen = 0, 0
    for inputs, labels in datasets.eval:
        logits = model.predict_on_batch(inputs)
        assert logits.shape == (len(labels), 10)
        correct += int((logits.argmax(-1) == labels.numpy().argmax(-1)).sum())
        seen += len(labels)
    assert seen == 360
    assert correct / seen == pytest.approx(summary["top1"], abs=1e-6)
    capsys.readouterr()
    for command, main in (("keras-vit-export", export_cli.main), ("keras-vit-tflite", tflite_cli.main)):
        with pytest.raises(SystemExit) as stop:  # not served yet: said in one line, nothing written
            main(["--model", summary["model_path"], "--out", str(tmp_path / "served")])
        assert stop.value.code == 1 and not (tmp_path / "served").exists()
        assert capsys.readouterr().err.strip() == (
            f"{command}: error: Model {model.name!r} is a NaFlex ViT (it takes patch sequences, as keras-vit-train "
            "with max_num_patches writes one): its SavedModel, LiteRT, ONNX and OpenVINO files are not built yet. "
            "keras-vit-export serves SigLIP 2 NaFlex folders (--weights FOLDER --max-num-patches N).")


def test_naflex_runs_refuse_what_does_not_apply():
    """Square-image options, a pooling other than the MAP head's, and a NaFlex file without a budget: each refused
    by name, before anything trains."""
    for override, named in (("randaugment=true", "randaugment"), ("mixup_alpha=0.2", "mixup_alpha")):
        with pytest.raises(ValueError, match=f"max_num_patches=16 .NaFlex patch sequences. does not go with {named}"):
            _digits_config(override)
    with pytest.raises(ValueError, match="recipe='masked_patches'"):
        configs.apply_overrides(configs.get_config("masked_patches"), ["max_num_patches=64"])
    with pytest.raises(ValueError, match="pools its patch sequence with the MAP head .*classifier='token'"):
        _digits_config("classifier=token")
    with pytest.raises(ValueError, match="no pre-logits .*representation_size=768"):
        configs.apply_overrides(configs.get_config("pretrain"), ["max_num_patches=256", "classifier=map"])
    folder = os.path.join(FOLDER, NAFLEX)
    finetune = configs.apply_overrides(configs.get_config("digits"), ["recipe=finetune", f"weights={folder}"])
    with pytest.raises(ValueError, match="is a SigLIP 2 NaFlex checkpoint: .* Set max_num_patches"):
        recipe.build_backbone(finetune, include_top=False, pooling=recipe.pooling(finetune))
    contradicting = configs.apply_overrides(finetune, ["max_num_patches=64", "hidden_dim=64"])
    with pytest.raises(ValueError, match="hidden_dim=64 contradicts .*hidden_dim=16"):
        recipe.architecture(contradicting)


def _mixed_aspect_folder(root) -> list[tuple[int, int]]:
    """train/ and test/ of two classes (reddish and bluish noise) at aspect ratios 1:3 to 16:5."""
    sizes = [(72, 24), (24, 72), (40, 40), (20, 64), (64, 20), (30, 50)]
    rng = np.random.default_rng(0)
    for split, copies in (("train", 2), ("test", 1)):
        for label, channel in (("blue", 2), ("red", 0)):
            os.makedirs(root / split / label)
            for index, (height, width) in enumerate(sizes * copies):
                pixels = rng.integers(0, 120, (height, width, 3))
                pixels[..., channel] += 120
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / label / f"{index}.png")
    return sizes


def test_cli_finetunes_a_naflex_file_on_a_folder_of_mixed_aspect_ratios(tmp_path, capsys):
    """`keras-vit-train` fine-tuning the SigLIP 2 NaFlex folder (patch 8, width 16, its 4x4 table) on images of
    aspect ratios 1:3 to 16:5 at a budget of 64: the file's encoder loads (before training, the run's model pools as
    `NaFlexViT(weights=folder)`), each image reaches it at its own grid, and it learns the two colours."""
    sizes = _mixed_aspect_folder(tmp_path / "images")
    folder = os.path.join(FOLDER, NAFLEX)
    overrides = ["recipe=finetune", f"weights={folder}", "dataset=folder", f"data_dir={tmp_path / 'images'}",
                 "train_split=train", "eval_split=test", "max_num_patches=64", "batch_size=8", "epochs=4",
                 "steps_per_epoch=3", "warmup_steps=2", "lr=0.05", "weight_decay=0", "shuffle_buffer=32"]
    config = configs.apply_overrides(configs.get_config("digits"), overrides)
    eval_inputs, _ = next(iter(data.make_datasets(config, patch_size=8).eval))
    expected = [naflex.naflex_image_size(height, width, 8, 64) for height, width in sizes]
    np.testing.assert_array_equal(eval_inputs["spatial_shapes"][:6], np.asarray(expected) // 8)
    backbone = recipe.build_backbone(config, include_top=False, pooling=recipe.pooling(config))
    reference = naflex.NaFlexViT(weights=folder)
    np.testing.assert_allclose(backbone.predict_on_batch(eval_inputs),
                               reference.predict_on_batch(eval_inputs)["embedding"], atol=1e-5)

    workdir = tmp_path / "run"
    status, out, err = run_train_cli(capsys, "--config=digits", f"--workdir={workdir}", "--verbose=0",
                                     *[f"--override={item}" for item in overrides])
    assert status == 0, err[-3000:]
    assert f"model saved to {workdir / 'model.keras'}" in out, out[-3000:]
    summary = json.loads((workdir / "model.eval.json").read_text())
    assert summary["num_eval_examples"] == 12 and summary["top1"] >= 0.9, summary
    model = keras.saving.load_model(workdir / "model.keras", compile=False)
    assert tuple(model.get_layer("embedding").kernel.shape) == (8 * 8 * 3, 16)
    logits = model.predict_on_batch(eval_inputs)
    assert logits.shape == (8, 2) and np.isfinite(logits).all()
