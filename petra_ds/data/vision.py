"""Image classification data for the RevNet example: CIFAR-10, ImageNet32, ImageNet and digits.

Everything goes through torchvision datasets and transforms and a ``DataLoader`` with workers, so
decoding and augmentation never run on the pipeline's thread. The paper's augmentation: random crop
with 4-pixel padding, horizontal flip and normalisation at 32x32; RandomResizedCrop(224) for ImageNet
training and Resize(256) + CenterCrop(224) for its evaluation.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms

from .stream import worker_context

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = (0.2, 0.2, 0.2), (0.3, 0.3, 0.3)


@dataclass(frozen=True)
class DataInfo:
    num_classes: int
    image_size: int
    cifar_stem: bool  # 3x3 stem without max-pool for 32x32 images


INFO = {
    "cifar10": DataInfo(10, 32, True),
    "imagenet32": DataInfo(1000, 32, True),
    "imagenet": DataInfo(1000, 224, False),
    "digits": DataInfo(10, 32, True),
}


def small_image_transform(train: bool, mean, std, flip: bool = True) -> Callable:
    steps = [transforms.RandomCrop(32, padding=4)] if train else []
    if train and flip:
        steps.append(transforms.RandomHorizontalFlip())
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(mean, std)])


def imagenet_transform(train: bool) -> Callable:
    if train:
        steps = [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip()]
    else:
        steps = [transforms.Resize(256), transforms.CenterCrop(224)]
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class DatasetNotFoundError(FileNotFoundError):
    """A data set's files are not on disk; the message says how to get them (the examples print it and exit)."""


class LocalCIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR-10 reader; without ``download`` it accepts any folder in the published
    pickle-batch layout (checks that the files exist, not their checksums), and a missing one raises
    :class:`DatasetNotFoundError` naming the options rather than torchvision's ``download=True`` hint."""

    def __init__(self, root: str, train: bool, transform: Callable, download: bool) -> None:
        if not download:  # torchvision skips the checksum of a file whose md5 is None
            self.train_list = [(name, None) for name, _ in self.train_list]
            self.test_list = [(name, None) for name, _ in self.test_list]
            self.meta = {**self.meta, "md5": None}
            names = [name for name, _ in self.train_list + self.test_list] + [self.meta["filename"]]
            folder = os.path.join(root, self.base_folder)
            missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
            if missing:
                raise DatasetNotFoundError(
                    f"CIFAR-10 is not in {folder}/ (missing {', '.join(missing)}): add --download to fetch it "
                    f"there (needs network access), or pass --data-dir DIR for a folder DIR holding "
                    f"{self.base_folder}/ in the published Python pickle layout (data_batch_1..5, test_batch, "
                    "batches.meta); offline, --dataset digits trains on scikit-learn's bundled digits")
        super().__init__(root, train=train, transform=transform, download=download)


class ImageNet32(Dataset):
    """Downsampled ImageNet 32x32 (Chrabaszcz et al. 2017) in its published pickle-batch format:
    ``<root>/train_data_batch_1..10`` and ``<root>/val_data``, each a dict with ``data`` (N x 3072 uint8,
    channel-major) and ``labels`` (1-based). The two folders of the download may also be nested as
    ``Imagenet32_train/`` and ``Imagenet32_val/``."""

    def __init__(self, root: str, train: bool, transform: Callable | None = None) -> None:
        names = [f"train_data_batch_{i}" for i in range(1, 11)] if train else ["val_data"]
        paths = []
        for name in names:
            candidates = [os.path.join(root, name),
                          os.path.join(root, "Imagenet32_train" if train else "Imagenet32_val", name)]
            paths += [p for p in candidates if os.path.exists(p)][:1]
        if not paths:
            raise FileNotFoundError(f"no ImageNet32 {'train_data_batch_*' if train else 'val_data'} file under {root}")
        data, labels = [], []
        for path in paths:
            with open(path, "rb") as f:
                batch = pickle.load(f)
            data.append(np.asarray(batch["data"], dtype=np.uint8))
            labels += [int(label) - 1 for label in batch["labels"]]
        self.data = np.concatenate(data).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        self.targets = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.data[index])
        return (self.transform(image) if self.transform else image), self.targets[index]


class Digits(Dataset):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images), upsampled to 32x32 RGB: a real
    data set that works offline. A fixed seeded split keeps 20% for evaluation."""

    def __init__(self, train: bool, transform: Callable | None = None, seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(seed).permutation(len(digits.target))
        cut = int(0.8 * len(order))
        chosen = order[:cut] if train else order[cut:]
        images = torch.from_numpy(digits.images[chosen] / 16.0).float().unsqueeze(1)
        images = torch.nn.functional.interpolate(images, size=32, mode="bilinear", align_corners=False)
        self.images = (images.clamp(0, 1) * 255).round().to(torch.uint8).repeat(1, 3, 1, 1)
        self.targets = [int(t) for t in digits.target[chosen]]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.images[index].permute(1, 2, 0).numpy())
        return (self.transform(image) if self.transform else image), self.targets[index]


def build_dataset(name: str, data_dir: str | None, train: bool, download: bool = False) -> Dataset:
    """The data set ``name`` with the paper's augmentation for training and plain normalisation for eval."""
    if name == "cifar10":
        return LocalCIFAR10(data_dir or "data", train, small_image_transform(train, CIFAR_MEAN, CIFAR_STD), download)
    if name == "imagenet32":
        return ImageNet32(data_dir or "data/imagenet32", train, small_image_transform(train, IMAGENET_MEAN, IMAGENET_STD))
    if name == "imagenet":
        folder = os.path.join(data_dir or "data/imagenet", "train" if train else "val")
        return datasets.ImageFolder(folder, transform=imagenet_transform(train))
    if name == "digits":  # digits are not mirror-symmetric: crop, no flip
        return Digits(train, small_image_transform(train, DIGITS_MEAN, DIGITS_STD, flip=False))
    raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(INFO)}")


def make_loader(dataset: Dataset, batch_size: int, train: bool, workers: int = 2, seed: int = 0) -> DataLoader:
    """Shuffled (train) or ordered loader; every micro-batch has the same size (PETRA exchanges shapes
    once), so the last partial batch is dropped in training."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, num_workers=workers,
                      persistent_workers=workers > 0, generator=generator, pin_memory=torch.cuda.is_available(),
                      multiprocessing_context=worker_context(workers))
