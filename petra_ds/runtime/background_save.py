"""A checkpoint written while training goes on (``"petra": {"async_save": true}``).

At the save, each rank copies what it writes to host memory (the only stall: a memory copy, not a disk write)
and hands it to a thread that writes the files into the checkpoint's partial directory, then a marker file
``.written-rank<R>``. Rank 0 commits the checkpoint (``checkpoint.commit``: rename into place, ``latest``) once every
rank's marker is there: it looks, without any collective, after each ``train_batch``, and at the latest in
:meth:`BackgroundSave.finish`, which every rank calls at the next save or at ``engine.wait_for_checkpoint()``. The
atomic protocol is the synchronous save's: a process killed during a background write leaves the previous
checkpoint and ``latest`` as they were. The thread does no collective, so the engine's communication order is
untouched.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from ..util.files import atomic_save, write_text_atomic
from ..util.nested import map_tensors


class HostStaging:
    """The host memory a background save copies into, kept from one save to the next (pinned, for a GPU): the
    second save copies into memory already mapped instead of faulting in new pages, which costs more than the copy
    itself. A save reuses the buffers once the previous save's thread is done with them (the engine waits for it
    before the next save)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def copy(self, value: Any) -> Any:
        """``value`` with every tensor (nested dicts, lists, tuples) copied to host memory; the rest as it is. From a
        GPU the copies are asynchronous and waited for once."""
        old, new, cuda = self._buffers, [], []

        def copy(t: torch.Tensor) -> torch.Tensor:
            i = len(new)
            reuse = i < len(old) and old[i].shape == t.shape and old[i].dtype == t.dtype
            host = old[i] if reuse else torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            host.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            if t.device.type == "cuda":
                cuda.append(t)
            new.append(host)
            return host

        copied = map_tensors(copy, value)
        if cuda:
            torch.cuda.synchronize()
        self._buffers = new
        return copied


def marker(partial: str, rank: int) -> str:
    return os.path.join(partial, f".written-rank{rank}")


class BackgroundSave:
    """One rank's share of a checkpoint (``files``: (path, object in host memory)), written by a thread. On rank
    0, ``commit`` puts the checkpoint in place once all ``world`` ranks have written."""

    def __init__(self, files: list[tuple[str, Any]], partial: str, rank: int, world: int,
                 commit: Callable[[], str] | None) -> None:
        self.partial, self.rank, self.world, self._commit = partial, rank, world, commit
        self.committed = False
        self.error: BaseException | None = None
        # not a daemon: the interpreter waits for the files before a process that ends normally exits
        self._thread = threading.Thread(target=self._write, args=(files,), name=f"petra-save-rank{rank}")
        self._thread.start()

    def _write(self, files: list[tuple[str, Any]]) -> None:
        try:
            for path, obj in files:
                atomic_save(obj, path)
            write_text_atomic(marker(self.partial, self.rank), "")
        except BaseException as error:  # raised in the training thread at the next poll or finish
            self.error = error

    def _raise_failure(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the background checkpoint write into {self.partial} failed on rank {self.rank}: "
                               f"{self.error!r}") from self.error

    @property
    def written(self) -> bool:
        """Whether this rank's files are on disk (raises what the writing thread raised)."""
        if self._thread.is_alive():
            return False
        self._raise_failure()
        return True

    def wait_written(self) -> None:
        """Wait for this rank's files (raises what the writing thread raised)."""
        self._thread.join()
        self._raise_failure()

    def poll(self) -> None:
        """Between two ``train_batch`` calls: rank 0 commits if every rank has written (no collective, no wait)."""
        if self._commit is not None and not self.committed and self.written and all(
                os.path.exists(marker(self.partial, r)) for r in range(self.world)):
            self._put_in_place()

    def finish(self, barrier: Callable[[str], None]) -> None:
        """Every rank: wait for this rank's files, meet the others, and (rank 0) commit if not done yet."""
        self.wait_written()
        barrier("background checkpoint: every rank wrote its files")
        if self._commit is not None and not self.committed:
            self._put_in_place()
        barrier("background checkpoint: committed")

    def _put_in_place(self) -> None:
        for r in range(self.world):
            os.remove(marker(self.partial, r))
        self._commit()
        self.committed = True
