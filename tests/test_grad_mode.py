"""``petra_ds.util.grad_mode``: the hot paths' grad-mode switches do what torch's ``no_grad`` and ``enable_grad`` do
(record or not inside, the mode found put back on exit, an exception's too, nested either way) at a fraction of
their Python (on Python 3.11, 26 bytecodes a use against 89)."""

import pytest
import torch

from petra_ds.diagnostics.host_cost import Bytecodes
from petra_ds.util.grad_mode import enable_grad, no_grad


@pytest.mark.parametrize("outer", [True, False])
@pytest.mark.parametrize("ours, theirs", [(no_grad, torch.no_grad), (enable_grad, torch.enable_grad)])
def test_inside_and_after_as_torch_s(outer, ours, theirs):
    x = torch.ones(2, requires_grad=True)
    seen = []
    for switch in (ours, theirs):
        with torch.set_grad_enabled(outer):
            with switch():
                inside = (x * 2).requires_grad
                with (enable_grad if switch is ours else torch.enable_grad)():
                    nested = (x * 2).requires_grad
                with (no_grad if switch is ours else torch.no_grad)():
                    nested_off = (x * 2).requires_grad
                after_nested = torch.is_grad_enabled()
            with pytest.raises(RuntimeError), switch():
                raise RuntimeError("inside")
            seen.append((inside, nested, nested_off, after_nested, torch.is_grad_enabled()))
    assert seen[0] == seen[1]
    assert seen[0][-1] is outer


def test_a_switch_interprets_at_most_half_of_torch_s_bytecodes():
    counts = []
    for switch in (no_grad, torch.no_grad):
        with Bytecodes() as counter:
            for _ in range(10):
                with switch():
                    pass
        counts.append(counter.total)
    assert 0 < counts[0] * 2 <= counts[1]
