"""Keyed draws by row blocks: a replica holding several replicas' rows, or part of one's, draws the masks those
replicas drew, bit for bit, forward and backward; a draw that cannot be split is named once."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from petra_ds.nn import layer_rng, micro_batch_rng
from petra_ds.nn.rng import RowBlocks
from petra_ds.runtime.replicas import row_blocks

ROWS, T, D = 4, 5, 8  # rows per old replica, sequence, width
CAUSAL = torch.ones(T, T, dtype=torch.bool).tril()


class Draws(nn.Module):
    """Every kind of draw the split covers, at micro-batch level and in two layer scopes, two draws in a row in
    one scope (a block's stream must continue), in place and by channel, and attention dropout with a per-row
    mask and with a broadcast one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).double()
        self.drop2d = nn.Dropout2d(0.3)

    def forward(self, x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.3)
        with layer_rng(5, 0):
            h = F.dropout(self.lin(x), 0.2)
            h = F.dropout(h * 1.0, 0.4, True, True)
            q = h.view(len(h), T, 2, D // 2).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=masks, dropout_p=0.5)
            b = F.scaled_dot_product_attention(q, q, q, CAUSAL, 0.25)
        with layer_rng(6, 1):
            c = self.drop2d(h.unsqueeze(-1)).squeeze(-1)
            c = torch.dropout(c, 0.1, True)
        return (a + b).transpose(1, 2).reshape_as(h) + c


def data(replicas: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(replicas * ROWS, T, D, generator=g, dtype=torch.float64)
    masks = torch.rand(replicas * ROWS, 1, T, T, generator=g) < 0.8
    return x, masks | torch.eye(T, dtype=torch.bool)


def run(net, x, masks, replica):
    x = x.clone().requires_grad_()
    with micro_batch_rng(7, 3, 1, replica):
        y = net(x, masks)
    y.backward(torch.arange(y[0].numel(), dtype=y.dtype).reshape_as(y[0]).cos().expand_as(y))  # the same per row
    return y.detach(), x.grad, net.lin.weight.grad.clone()


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Draws().train()


def test_a_replica_holding_two_replicas_rows_draws_both_ones_masks(net):
    """Two old replicas' rows on one: outputs and input gradients equal the old replicas' joined, bit for bit."""
    x, masks = data(2)
    old = [run(net, x[r * ROWS:(r + 1) * ROWS], masks[r * ROWS:(r + 1) * ROWS], r) for r in range(2)]
    net.zero_grad()
    y, dx, _ = run(net, x, masks, RowBlocks(0, 2))
    assert torch.equal(y, torch.cat([o[0] for o in old]))
    assert torch.equal(dx, torch.cat([o[1] for o in old]))
    one = run(net, x, masks, 0)[0]  # as one replica drawing for all rows: other masks
    assert not torch.equal(one, y)


@pytest.mark.parametrize("part", [0, 1])
def test_a_replica_holding_part_of_a_replicas_rows_draws_that_part_of_its_masks(net, part):
    """Half of old replica 1's rows: its half of that replica's outputs and input gradients, bit for bit."""
    x, masks = data(1)
    y_old, dx_old, _ = run(net, x, masks, 1)
    half = slice(part * ROWS // 2, (part + 1) * ROWS // 2)
    y, dx, _ = run(net, x[half], masks[half], RowBlocks(1, 1, part, 2))
    assert torch.equal(y, y_old[half])
    assert torch.equal(dx, dx_old[half])


def test_a_draw_not_split_by_rows_is_named_once():
    """``torch.rand`` inside a scope holding two blocks: a warning that says what is not covered, once per process;
    none where everything drawn was split."""
    import petra_ds.nn.rng as rng

    x = torch.ones(2 * ROWS, D, dtype=torch.float64)
    for unsplit, warned in ((False, 0), (True, 1)):
        rng.__dict__["_warned_unsplit"] = False  # as in a fresh process
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                with micro_batch_rng(7, 0, 0, RowBlocks(0, 2)):
                    with layer_rng(1, 0):
                        F.dropout(x + torch.rand(D, dtype=torch.float64) if unsplit else x, 0.5)
        assert len([w for w in seen if "other than dropout or attention dropout" in str(w.message)]) == warned


def test_the_blocks_a_replica_holds_follow_the_regrouping():
    assert row_blocks(1, 2, 2) == RowBlocks(1) and RowBlocks(1).whole
    assert row_blocks(0, 4, 2) == RowBlocks(2 * 0, 2) and row_blocks(1, 4, 2) == RowBlocks(2, 2)
    assert row_blocks(3, 2, 4) == RowBlocks(1, 1, 1, 2)
    with pytest.raises(ValueError, match="keyed by 4 row blocks.*6 replicas"):
        row_blocks(0, 4, 6)
