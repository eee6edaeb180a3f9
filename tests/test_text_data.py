"""Language-modelling data: local text files through Hugging Face datasets, a trained tokenizer, packing."""

import pytest
import torch

from petra_ds.data.text import EOS, build_tokenizer, lm_loader, load_text, pack

WORDS = "the reversible stage sends its delayed gradient to the previous one every clock".split()


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def corpus(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(3, 20, (1,), generator=g)),),
                                                      generator=g)) for _ in range(n)]


def test_local_files_a_named_validation_file_and_a_held_out_fraction(tmp_path):
    train = write(tmp_path / "train.txt", corpus(200))
    valid = write(tmp_path / "valid.txt", corpus(20, seed=1))
    named = load_text([train, valid])
    assert (len(named["train"]), len(named["validation"])) == (200, 20)
    held = load_text([train], val_fraction=0.1)
    assert (len(held["train"]), len(held["validation"])) == (180, 20)
    with pytest.raises(ValueError, match="either --data-files"):
        load_text()
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text([str(tmp_path / "nope.txt")])


@pytest.mark.parametrize("kind,size", [("bpe", 300), ("bytes", 257)])
def test_trained_tokenizer_round_trips_and_packs_fixed_blocks(tmp_path, kind, size):
    data = load_text([write(tmp_path / "train.txt", corpus(300)), write(tmp_path / "valid.txt", corpus(30, 1))])
    tok = build_tokenizer(kind, data["train"], vocab_size=300)
    assert len(tok) == size and tok.eos_token == EOS
    text = "the reversible stage sends"
    assert tok.decode(tok(text)["input_ids"]) == text
    if kind == "bpe":  # merges learned: fewer tokens than bytes
        assert len(tok(text)["input_ids"]) < len(text.encode())
    blocks = pack(data["train"], tok, seq_len=16)
    ids = torch.stack([blocks[i]["block"] for i in range(len(blocks))])
    assert ids.shape[1] == 17
    flat = [t for text in data["train"]["text"] for t in tok(text)["input_ids"] + [tok.eos_token_id]]
    assert len(blocks) == len(flat) // 17
    assert ids.flatten().tolist() == flat[:len(blocks) * 17]  # documents joined by EOS, in order, tail dropped
    tok.save_pretrained(tmp_path / "tok")
    again = build_tokenizer(str(tmp_path / "tok"))
    assert again(text)["input_ids"] == tok(text)["input_ids"]


def test_loader_yields_shifted_pairs_of_one_shape_and_shards(tmp_path):
    data = load_text([write(tmp_path / "a.txt", corpus(300))], val_fraction=0.1)
    tok = build_tokenizer("bytes", data["train"])
    blocks = pack(data["train"], tok, seq_len=8)
    loader = lm_loader(blocks, micro_batch=4, train=True, seed=0)
    shapes = {tuple(x.shape) for x, _ in loader}
    assert shapes == {(4, 8)}
    x, y = next(iter(loader))
    assert torch.equal(x[:, 1:], y[:, :-1])
    a, b = (lm_loader(blocks, 4, train=False, shard=(i, 2)) for i in (0, 1))
    assert len(a.dataset) + len(b.dataset) == len(blocks)
    with pytest.raises(ValueError, match="cannot fill a micro-batch"):
        lm_loader(blocks, micro_batch=len(blocks) + 1, train=False)
