"""A keyed scope with nothing to key is skipped (``petra_ds.nn.draws``): which modules can draw random numbers, decided
conservatively and once per training window (in an engine, once while its modules stay as they were:
``test_lasting.py``); training with the skipped scopes equals training with every scope keyed, bit for bit; a
dropout switched on between windows is keyed from the next window on."""

import os
import sys

import pytest
import torch
from harness import assert_same_bits, launch, merged_params
from torch import nn
from torch.nn import functional as F

from petra_ds.models.decoder import DecoderBlock, DecoderNorm
from petra_ds.models.revnet import DownsampleBlock, RevBlock, Stem
from petra_ds.models.transformer import Embedding, RevGPTBlock, lm_loss
from petra_ds.nn import AdditiveCoupling, draws
from petra_ds.nn.draws import draws_random, may_draw
from petra_ds.nn.window import modules_fixed


def mlp(p: float = 0.0) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(p), nn.Linear(8, 4))


class Noisy(nn.Module):
    """Draws in its own forward: nothing says it does not."""

    def forward(self, x):
        return x + torch.rand_like(x)


class Declared(nn.Module):
    def __init__(self, draws: bool) -> None:
        super().__init__()
        self.draws = draws

    def draws_random(self) -> bool:
        return self.draws

    def forward(self, x):
        return x


class Overridden(Declared):
    """Inherits a declaration but runs a forward of its own."""

    def forward(self, x):
        return x + torch.rand_like(x)


class SubclassedLinear(nn.Linear):
    pass


class Unhashable(nn.Identity):
    """A module that compares by value, which makes Python drop its hash: the walk still answers for it."""

    def __eq__(self, other):
        return isinstance(other, Unhashable)

    def draws_random(self) -> bool:
        return False


def tiny_llama(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, **overrides)


@pytest.mark.parametrize("module, draws", [
    (mlp(0.0), False), (mlp(0.1), True), (mlp(0.1).eval(), False), (nn.Dropout(0.0), False),
    (Noisy(), True), (nn.RReLU(), True), (SubclassedLinear(2, 2), True), (nn.Sequential(mlp(), Noisy()), True),
    (Declared(False), False), (Declared(True), True), (Overridden(False), True),
    (AdditiveCoupling(mlp(), mlp()), False), (AdditiveCoupling(mlp(), mlp(0.5)), True),
    (AdditiveCoupling(mlp(), Noisy()), True),
    (RevGPTBlock(8, 2, dropout=0.0), False), (RevGPTBlock(8, 2, dropout=0.1), True),
    (RevGPTBlock(8, 2, dropout=0.1).eval(), False), (Embedding(10, 8, 4, 0.0), False),
    (Embedding(10, 8, 4, 0.2), True), (RevBlock("basic", 4), False), (DownsampleBlock("basic", 4, 4, 2), False),
    (Stem(4, cifar=True, streams=2), False),
    (DecoderBlock(tiny_llama(), 0), False), (DecoderBlock(tiny_llama(attention_dropout=0.1), 0), True),
    (DecoderNorm(tiny_llama()), False),
    ((mlp(), mlp()), False), ((mlp(), mlp(0.1)), True),
    (F.cross_entropy, False), (lm_loss, False), (lambda x: x, True),
], ids=lambda v: type(v).__name__ if not isinstance(v, bool) else str(v))
def test_what_can_draw(module, draws):
    assert draws_random(module) is draws


def test_a_forward_hook_may_draw():
    """A hook runs user code in the module's forward, its own or one for every module."""
    module = mlp()
    handle = module[0].register_forward_hook(lambda *args: None)
    assert draws_random(module)
    handle.remove()
    assert not draws_random(module)
    decoder = DecoderBlock(tiny_llama(), 0)
    decoder.F.self_attn.register_forward_hook(lambda *args: None)  # inside a part that declares what it draws
    assert draws_random(decoder)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert draws_random(module)
    finally:
        handle.remove()
    assert not draws_random(module)


def test_asked_once_per_window_and_keyed_outside_one():
    """Outside a window every scope is keyed; inside, the answer stands for the window and is asked anew in the next."""
    module = mlp(0.0)
    assert may_draw(module)
    with modules_fixed():
        assert not may_draw(module)
        module[2].p = 0.5
        assert not may_draw(module)  # the window's answer
    with modules_fixed():
        assert may_draw(module)


def walks_counted(monkeypatch) -> list:
    """The modules ``draws`` walks from now on (each walked module is asked once whether it is hooked)."""
    walked = []
    hooked = draws.hooked
    monkeypatch.setattr(draws, "hooked", lambda module: walked.append(module) or hooked(module))
    return walked


def test_inside_a_window_one_walk_serves_every_module_under_it(monkeypatch):
    """The window walks each module once, and a module under one already walked (a branch asked after its stage) is
    not walked again; a slot that holds no module (``register_module(name, None)``) draws nothing, a module without a
    hash is walked too, and an answer once given stands for the window."""
    walked = walks_counted(monkeypatch)
    module = mlp(0.0)
    module.register_module("empty", None)
    module.append(Unhashable())
    with modules_fixed():
        assert not may_draw(module)
        assert len(walked) == 6  # the Sequential, its four layers and the Unhashable, each once
        assert not may_draw(module[2]) and not may_draw(module[-1])
        module[2].p = 0.5
        assert not may_draw(module)  # the window's answer
        assert len(walked) == 6
    assert draws_random(module[2]) and draws_random(module)


#: (in a rank) the keyed scopes entered since :func:`keyed_scopes`
SCOPES = {"entered": 0}


def keyed_scopes(engine) -> None:
    """(setup, in the rank) count the keyed scopes the run enters, their generators' seeding, from the end of its
    second window on (J = 4, k = 2: by then every stage has run its first forward, which checks its layers' inverses
    under a keyed scope of its own)."""
    from petra_ds.runtime.observe import Observer

    seeding = os.path.join("petra_ds", "nn", "rng.py")
    SCOPES["entered"] = 0

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__enter__" and frame.f_code.co_filename.endswith(seeding):
            SCOPES["entered"] += 1

    class Count(Observer):
        windows = 0

        def window_end(self, eng, window) -> None:
            self.windows += 1
            if self.windows == 2:
                sys.setprofile(count)

    engine.observe(Count())


def scopes_counted(engine) -> int:
    """(probe, in the rank) the keyed scopes entered since :func:`keyed_scopes`, which stops counting (a pooled rank
    serves other tests next)."""
    sys.setprofile(None)
    return SCOPES["entered"]


def hook_every_part(engine) -> None:
    """(setup, in the rank) a forward hook that does nothing on every layer and branch: every scope stays keyed."""
    for stage in engine.stages.values():
        for module in stage.modules:
            for part in module.modules():
                part.register_forward_hook(lambda *args: None)


def hook_every_part_and_count(engine) -> None:
    hook_every_part(engine)
    keyed_scopes(engine)


SPEC = {"model": "revgpt", "micro_batch": 2, "pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 3,
        "probe": "test_draws:scopes_counted"}


def test_skipped_scopes_train_the_same_bits_as_keyed_ones():
    """RevGPT without dropout enters no keyed scope at all (its stages, branches and loss draw nothing); hooked on
    every part, it keys every scope as before, and trains the same parameters, gradients and losses bit for bit.
    With dropout, the stages and branches that hold one are keyed (all but the last stage, a head and a loss)."""
    skipped = launch({**SPEC, "dropout": 0.0, "setup": "test_draws:keyed_scopes"})
    keyed = launch({**SPEC, "dropout": 0.0, "setup": "test_draws:hook_every_part_and_count"})
    assert skipped[0]["probe"] == 0
    assert keyed[0]["probe"] > 0
    assert_same_bits(skipped, keyed)
    with_dropout = launch({**SPEC, "dropout": 0.1, "setup": "test_draws:keyed_scopes"})
    assert 0 < with_dropout[0]["probe"] < keyed[0]["probe"]


def switch_dropout_on(engine) -> None:
    """(setup, in the rank) every dropout of the model goes from 0 to 0.2 after the first window."""
    from petra_ds.runtime.observe import Observer

    class SwitchOn(Observer):
        def window_end(self, eng, window) -> None:
            for module in eng.module.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.2
                if hasattr(module, "attn_dropout"):
                    module.attn_dropout = 0.2

    engine.observe(SwitchOn())


def switch_dropout_on_and_hook_every_part(engine) -> None:
    switch_dropout_on(engine)
    hook_every_part(engine)


def test_a_dropout_switched_on_between_windows_is_keyed_from_the_next():
    """Asked anew each window: after the switch the skipping run keys the scopes it skipped and draws the masks of
    the run keyed throughout (an answer kept from the first window would draw them from the global stream)."""
    spec = {**SPEC, "dropout": 0.0, "train_batches": 4, "probe": None}
    switched = launch({**spec, "setup": "test_draws:switch_dropout_on"})
    assert_same_bits(switched, launch({**spec, "setup": "test_draws:switch_dropout_on_and_hook_every_part"}))
    on, off = merged_params(switched), merged_params(launch(spec))
    assert not all(torch.equal(on[name], off[name]) for name in off)  # the dropout was on
