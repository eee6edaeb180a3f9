"""Language-modelling data: Hugging Face ``datasets`` + a tokenizer, packed into fixed-length blocks.

Offline (the default) the text comes from local files through ``load_dataset("text", data_files=...)``
and the tokenizer is a byte-level BPE trained on the training split with ``tokenizers`` (or plain
bytes); online, any hub data set and any hub tokenizer work the same way. Documents are tokenized,
joined with an end-of-text token and cut into blocks of ``seq_len + 1`` tokens; a block yields
``(ids[:-1], ids[1:])``, the (inputs, labels) pair DeepSpeed's pipeline expects.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

EOS = "<|endoftext|>"


def load_text(data_files: list[str] | None = None, dataset: str | None = None, dataset_config: str | None = None,
              text_column: str = "text", val_fraction: float = 0.05, seed: int = 0):
    """A ``DatasetDict`` with "train" and "validation" splits of one "text" column.

    ``data_files``: local text files (one document per line, as ``load_dataset("text")`` reads them);
    a file whose name contains "valid" or "test" becomes the validation split, otherwise
    ``val_fraction`` of the training lines is held out. ``dataset``: a hub data set name (online).
    """
    from datasets import DatasetDict, load_dataset

    if (data_files is None) == (dataset is None):
        raise ValueError("give either --data-files (local text files) or --dataset (a Hugging Face hub name)")
    if data_files is not None:
        missing = [f for f in data_files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"text files not found: {missing}")
        held = [f for f in data_files if any(w in os.path.basename(f).lower() for w in ("valid", "test"))]
        train = [f for f in data_files if f not in held]
        if not train:
            raise ValueError(f"no training file among {data_files} (names with 'valid'/'test' are held out)")
        files = {"train": train, **({"validation": held} if held else {})}
        raw = load_dataset("text", data_files=files)
    else:
        raw = load_dataset(dataset, dataset_config)
        if text_column != "text":
            raw = raw.rename_column(text_column, "text")
    raw = raw.select_columns(["text"])
    if "validation" not in raw:
        if "test" in raw:
            raw = DatasetDict(train=raw["train"], validation=raw["test"])
        else:
            split = raw["train"].train_test_split(test_size=val_fraction, seed=seed)
            raw = DatasetDict(train=split["train"], validation=split["test"])
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def _texts(split, batch: int = 1000) -> Iterator[list[str]]:
    for i in range(0, len(split), batch):
        yield [t for t in split[i:i + batch]["text"] if t]


def build_tokenizer(kind: str, train_split=None, vocab_size: int = 4096):
    """A ``transformers.PreTrainedTokenizerFast``.

    ``kind``: "bpe" trains a byte-level BPE of ``vocab_size`` on ``train_split`` (offline); "bytes" is
    the 256 byte values; anything else is a hub name or a local directory for ``AutoTokenizer``.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if kind not in ("bpe", "bytes"):
        tokenizer = AutoTokenizer.from_pretrained(kind)
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {kind!r} has no end-of-text token to separate documents")
        return tokenizer
    from tokenizers import ByteLevelBPETokenizer

    if train_split is None:
        raise ValueError("training a tokenizer needs the training split")
    bpe = ByteLevelBPETokenizer()
    size = 257 if kind == "bytes" else vocab_size  # bytes: the 256-symbol alphabet and EOS, no merges
    bpe.train_from_iterator(_texts(train_split), vocab_size=size, min_frequency=2, special_tokens=[EOS],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS)


def pack(split, tokenizer, seq_len: int, num_proc: int | None = None):
    """Blocks of ``seq_len + 1`` token ids (documents joined by EOS, the tail dropped), as torch tensors."""
    eos = tokenizer.eos_token_id
    block = seq_len + 1

    def tokenize(batch):
        return {"ids": [ids + [eos] for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        n = len(flat) // block
        return {"block": [flat[i * block:(i + 1) * block] for i in range(n)]}

    tokens = split.filter(lambda r: bool(r["text"])).map(tokenize, batched=True, remove_columns=["text"],
                                                          num_proc=num_proc)
    blocks = tokens.map(group, batched=True, batch_size=1000, remove_columns=["ids"], num_proc=num_proc)
    if len(blocks) == 0:
        raise ValueError(f"not enough text for one block of {block} tokens")
    return blocks.with_format("torch")


class Blocks(Dataset):
    """(inputs, labels) views of packed blocks."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.blocks[i]["block"]
        return ids[:-1], ids[1:]


def _replica_blocks(blocks, micro_batch: int, shard: tuple[int, int]):
    data: Iterable = Blocks(blocks)
    index, count = shard
    if count > 1:
        data = torch.utils.data.Subset(data, range(index, len(data), count))
    if len(data) < micro_batch:
        raise ValueError(f"{len(data)} blocks cannot fill a micro-batch of {micro_batch}; use more text, a shorter "
                         "--seq-len or a smaller micro-batch")
    return data


def lm_stream(blocks, micro_batch: int, seed: int = 0, start: int = 0, shard: tuple[int, int] = (0, 1)) -> DataLoader:
    """Endless shuffled training micro-batches that can begin at micro-batch ``start``, data-parallel replica
    ``shard = (index, count)``'s rows of each (``petra_ds.data.stream``): what a resumed run needs to see the data
    an uninterrupted one sees, on any number of replicas."""
    from .stream import resumable_loader

    if len(blocks) < micro_batch * shard[1]:
        raise ValueError(f"{len(blocks)} blocks cannot fill a micro-batch of {micro_batch} on {shard[1]} replica(s); "
                         "use more text, a shorter --seq-len or a smaller micro-batch")
    return resumable_loader(Blocks(blocks), micro_batch, seed, start, part=shard)


def lm_loader(blocks, micro_batch: int, train: bool, seed: int = 0, shard: tuple[int, int] = (0, 1)) -> DataLoader:
    """Fixed-size micro-batches (PETRA exchanges shapes once), shuffled each epoch when training;
    ``shard = (index, count)`` gives one data-parallel replica its part."""
    data = _replica_blocks(blocks, micro_batch, shard)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(data, batch_size=micro_batch, shuffle=train, drop_last=True, generator=generator)
