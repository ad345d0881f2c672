"""keras_vit.datasets: the one loader of the embedded digits, and its resize."""

import re

import numpy as np
import pytest
from sklearn.datasets import load_digits

from keras_vit import datasets


def test_digits_splits_are_stratified_disjoint_and_scaled():
    every, labels = datasets.digits()
    original = load_digits()
    assert every.shape == (1797, 8, 8, 3) and every.dtype == np.float32
    np.testing.assert_array_equal(every[..., 1], original.images * (255.0 / 16.0))
    np.testing.assert_array_equal(labels, original.target)
    train_x, train_y = datasets.digits("train")
    test_x, test_y = datasets.digits("test")
    assert (len(train_x), len(test_x)) == (1437, 360)
    np.testing.assert_array_equal(np.bincount(test_y), np.bincount(original.target) - np.bincount(train_y))
    assert np.abs(np.bincount(test_y) / 360 - np.bincount(labels) / 1797).max() < 0.01  # stratified
    train_rows = {row.tobytes() for row in train_x[..., 0]}
    assert sum(row.tobytes() in train_rows for row in test_x[..., 0]) <= 5  # a few digits repeat exactly
    few_x, few_y = datasets.digits("train[:10%]")
    assert len(few_x) == 143 and set(few_y) == set(range(10))
    half, _ = datasets.digits("test", test_fraction=0.5)
    assert len(half) == 899
    np.testing.assert_array_equal(datasets.digits("test")[0], test_x)  # the same split every time


@pytest.mark.parametrize("split", ["validation", "train[:0%]", "train[:150%]", "all[:10%]"])
def test_unknown_splits_are_errors(split):
    with pytest.raises(ValueError, match=rf"Unknown digits split '{re.escape(split)}'.*'all', 'train', 'test'"):
        datasets.digits(split)


def test_resize_converts_channels_and_keeps_the_range():
    images, _ = datasets.digits("test")
    big = datasets.resize(images[:4], (32, 24))
    assert big.shape == (4, 32, 24, 3) and big.min() >= 0 and big.max() <= 255
    gray = datasets.resize(images[:4], (16, 16), channels=1)
    assert gray.shape == (4, 16, 16, 1)
    np.testing.assert_allclose(datasets.resize(images[:4], (8, 8)), images[:4], atol=1e-4)  # same size: unchanged
