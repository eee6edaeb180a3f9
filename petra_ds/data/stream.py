"""An endless, shuffled stream of training micro-batches that can start at any position.

A run resumed from a checkpoint must see the micro-batches the uninterrupted run would have seen, with
the same augmentation. A ``DataLoader`` with ``shuffle=True`` draws each epoch's order, and its workers'
seeds, from one generator that advances as it goes, so its position cannot be restored without replaying
it. Here epoch ``e``'s order is drawn from ``(seed, e)`` alone and each sample's augmentation from
``(seed, its position in the stream)`` alone: starting at micro-batch ``n`` is arithmetic, and the result
does not depend on the number of loader workers.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def _seed(*key: int) -> int:
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + part) % (2**63 - 1)
    return seed


class EpochBatches(Sampler):
    """Batches of ``(index, position)`` pairs forever, from micro-batch ``start`` on: epoch ``e`` is a
    permutation of ``size`` drawn from ``(seed, e)`` cut into ``size // (batch_size * count)`` full global
    micro-batches (the tail is dropped, as PETRA needs a fixed micro-batch shape), of which data-parallel
    replica ``index`` of ``count`` (``part``) takes rows ``index * batch_size`` onward; ``position`` counts
    samples from the start of the stream and keys the sample's augmentation. So a global micro-batch is the
    same samples, with the same augmentation, whatever the number of replicas reading it: a run resumed on
    another data-parallel degree continues on the samples it would have seen."""

    def __init__(self, size: int, batch_size: int, seed: int, start: int = 0, part: tuple[int, int] = (0, 1)) -> None:
        index, count = part
        if not 0 <= index < count:
            raise ValueError(f"replica {index} of {count}: a data-parallel part is (index, count) with 0 <= index < count")
        if size < batch_size * count:
            raise ValueError(f"{size} samples cannot fill a micro-batch of {batch_size} on {count} replica(s)")
        self.size, self.batch_size, self.seed, self.start = size, batch_size, seed, start
        self.index, self.count = index, count
        self.per_epoch = size // (batch_size * count)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batch = self.start
        rows = self.batch_size * self.count
        while True:
            epoch, offset = divmod(batch, self.per_epoch)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(_seed(self.seed, epoch))).tolist()
            for b in range(offset, self.per_epoch):
                here = b * rows + self.index * self.batch_size  # this replica's first row in the epoch's order
                first = epoch * self.per_epoch * rows + here
                yield [(index, first + i) for i, index in enumerate(order[here:here + self.batch_size])]
            batch = (epoch + 1) * self.per_epoch


class KeyedSamples(Dataset):
    """``dataset[index]`` with torch's random generator seeded from ``(seed, position)`` for the call
    (restored afterwards), so a random augmentation draws the same numbers whenever that position is read."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, position = key
        # the CPU generator alone, where augmentations draw: ``torch.manual_seed`` would also queue a seed for
        # every CUDA device, recording a stack trace per sample (milliseconds) until CUDA starts
        generator = torch.random.default_generator
        saved = generator.get_state()
        try:
            generator.manual_seed(_seed(self.seed, 1, position))
            return self.dataset[index]
        finally:
            generator.set_state(saved)


def worker_context(workers: int) -> str | None:
    """How loader workers start: from a fork server, never by forking this process. A rank runs
    threads (gloo's, a loader's queue feeders); a fork copies their locks held, and a worker forked
    mid-training once hung inside ``os.fork`` (two-process RevNet example, after 2 steps)."""
    return "forkserver" if workers > 0 else None


def resumable_loader(dataset: Dataset, batch_size: int, seed: int, start: int = 0, workers: int = 0,
                     part: tuple[int, int] = (0, 1)) -> DataLoader:
    """An endless training ``DataLoader`` whose first micro-batch is micro-batch ``start`` of the stream
    that ``start=0`` gives, data-parallel replica ``part = (index, count)``'s rows of it (:class:`EpochBatches`);
    iterate it with ``iter()`` (it has no length)."""
    sampler = EpochBatches(len(dataset), batch_size, seed, start, part)
    return DataLoader(KeyedSamples(dataset, seed), batch_sampler=sampler,
                      num_workers=workers, persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                      multiprocessing_context=worker_context(workers))
