"""Loaders on small files the tests write in the real formats."""

import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from petra_ds import data  # its vision loaders (and torchvision, 3 s) load at a test's first use, not at collection
from petra_ds.data.stream import resumable_loader


def write_pickle(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def test_cifar10_pickle_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        write_pickle(folder / name, {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                                     "labels": [(i + j) % 10 for j in range(4)]})
    write_pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    train = data.build_dataset("cifar10", str(tmp_path), train=True)
    test = data.build_dataset("cifar10", str(tmp_path), train=False)
    assert len(train) == 20 and len(test) == 4
    image, label = test[1]
    assert image.shape == (3, 32, 32) and label == 6
    assert train.classes[3] == "c3"


def test_imagenet32_batches_nested_like_the_download(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "Imagenet32_train").mkdir()
    (tmp_path / "Imagenet32_val").mkdir()
    for i in range(1, 3):
        write_pickle(tmp_path / "Imagenet32_train" / f"train_data_batch_{i}",
                     {"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8), "labels": [1, 2, 1000],
                      "mean": np.zeros(3072)})
    pixels = np.zeros((1, 3072), dtype=np.uint8)
    pixels[0, :1024] = 255  # red channel first, as published
    write_pickle(tmp_path / "Imagenet32_val" / "val_data", {"data": pixels, "labels": [5]})
    train = data.build_dataset("imagenet32", str(tmp_path), train=True)
    val = data.build_dataset("imagenet32", str(tmp_path), train=False)
    assert len(train) == 6 and train.targets[:3] == [0, 1, 999]
    assert np.all(val.data[0, :, :, 0] == 255) and np.all(val.data[0, :, :, 1:] == 0)
    image, label = val[0]
    assert label == 4 and image.shape == (3, 32, 32) and image[0].mean() > image[1].mean()


def test_imagenet32_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ImageNet32 val_data file under"):
        data.build_dataset("imagenet32", str(tmp_path), train=False)


def test_imagenet_image_folder(tmp_path):
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            os.makedirs(tmp_path / split / cls)
            for i in range(2):
                Image.fromarray(np.full((300, 260, 3), 40 * i, dtype=np.uint8)).save(tmp_path / split / cls / f"{i}.png")
    train = data.build_dataset("imagenet", str(tmp_path), train=True)
    val = data.build_dataset("imagenet", str(tmp_path), train=False)
    assert train.classes == ["cat", "dog"] and len(val) == 4
    assert train[0][0].shape == val[3][0].shape == (3, 224, 224) and val[3][1] == 1


def test_digits_offline_split_and_loader():
    train, test = data.build_dataset("digits", None, True), data.build_dataset("digits", None, False)
    assert len(train) + len(test) == 1797 and len(test) == 360
    assert data.INFO["digits"].num_classes == 10
    loader = data.make_loader(train, batch_size=64, train=True, workers=2)
    images, labels = next(iter(loader))
    assert images.shape == (64, 3, 32, 32) and labels.dtype == torch.int64
    assert all(len(batch[1]) == 64 for batch in loader)  # drop_last: one micro-batch shape
    # workers start from a fork server, never by forking a rank that runs gloo's threads (a forked worker once
    # hung in os.fork, two-process RevNet example); the examples' two-rank runs with workers are slow tests
    stream = resumable_loader(train, 64, seed=0, workers=1)
    assert [d.multiprocessing_context.get_start_method() for d in (loader, stream)] == ["forkserver"] * 2
    eval_images, _ = next(iter(data.make_loader(test, 360, train=False, workers=0)))
    assert -1 < eval_images.mean() < 1  # normalised
