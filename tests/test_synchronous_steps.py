"""``"petra": {"synchronous_steps": N}``: the first N ``train_batch`` calls feed k micro-batches and drain them
(GPipe's schedule), so their gradients are the end-to-end ones and delay compensation waits; PETRA goes on from
their weights. Against plain autograd and tests/oracle.py (float64, the toy model, dropout on); resuming from
inside them: test_delay_compensation.py."""

import pytest
import torch

from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.schedule import delay
from petra_ds.schedule.progress import Timeline
from petra_ds.tools.toy import toy_data

import oracle
from harness import merged_grads, merged_params
from test_delay_compensation import METHODS
from test_engine import SEED, SGD, TOL, max_diff, run

K, BATCHES, J = 2, 5, 4


def test_synchronous_calls_train_as_backprop_with_compensation_waiting():
    """Three synchronous calls with weight prediction on, J = 4 on 2 processes: every stage's gradient at every
    step is plain autograd's over the step's micro-batches at the weights of then, the weights are plain SGD's,
    each call runs k + 2(J-1) clocks and returns its own micro-batches' loss (no NaN while filling)."""
    calls = 3
    results = run(2, 2, k=K, train_batches=calls, optimizer=SGD, dropout=0.1,
                  petra={"delay_compensation": "weight_prediction", "synchronous_steps": calls})
    stages = oracle.build_stages(J, dropout=0.1)
    entry = oracle.synchronous_entry_clocks(K * calls, K, J, calls)
    data = dict(zip(entry, toy_data(K * calls, 4)))  # by the engine's index: the micro-batch's dropout key
    opts = [torch.optim.SGD(list(oracle.named_params(s).values()), lr=0.1, momentum=0.9) for s in stages]
    grads = merged_grads(results)
    for step in range(calls):
        want = oracle.autograd_group_grads(stages, data, entry[step * K:(step + 1) * K], SEED)
        for j in range(J):
            assert max_diff(grads[j][step], want[j]) < TOL
        for opt in opts:
            opt.step()
    final = {n: p.detach() for s in stages for n, p in oracle.named_params(s).items()}
    assert max_diff(merged_params(results), final) < TOL
    assert all(r["clock"] == calls * (K + delay(0, J)) for r in results)
    assert all(loss == loss for loss in results[0]["losses"][:calls])


@pytest.mark.parametrize("compensation", METHODS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_petra_follows_the_synchronous_calls_and_its_compensation_counts_from_there(compensation):
    """Two synchronous calls, then three of PETRA's: parameters and every step's gradient equal the oracle's
    (the methods act from step 3, lr_rescale's annealing counted from it), and the warm start changed training."""
    petra = {"delay_compensation": compensation, "synchronous_steps": 2}
    results = run(1, 4, k=K, train_batches=BATCHES, optimizer=SGD, dropout=0.1, petra=petra)
    final, grads = reference(compensation, 2)
    assert max_diff(results[0]["params"], final) < TOL
    for j in range(J):
        assert len(results[0]["grads"][j]) == len(grads[j]) == BATCHES
        for got, want in zip(results[0]["grads"][j], grads[j]):
            assert max_diff(got, want) < TOL
    assert max_diff(final, reference(compensation, 0)[0]) > 1e-6
    assert max_diff(final, reference(compensation, BATCHES)[0]) > 1e-6


def reference(compensation, synchronous_steps):
    return oracle.delayed_training(oracle.build_stages(J, 0.1), toy_data(K * BATCHES, 4), K, 0.1, 0.9, SEED,
                                   compensation=compensation, synchronous_steps=synchronous_steps)


def test_a_synchronous_window_runs_until_everything_fed_is_drained():
    timeline = Timeline(petra_stages=J)
    first = timeline.train_window(K, synchronous=True)
    assert (first.clocks, first.micro_batches) == (K + delay(0, J), K)
    timeline.advance(first)
    assert not timeline.in_flight
    timeline.advance(timeline.train_window(K))
    assert timeline.in_flight
    late = timeline.train_window(K, synchronous=True)  # drains what the asynchronous window left in flight too
    timeline.advance(late)
    assert late.clocks == K + delay(0, J) and not timeline.in_flight


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_a_bad_synchronous_steps_is_refused_by_name(value):
    with pytest.raises(PetraConfigError, match='"petra.synchronous_steps" must be an integer >= 0'):
        PetraConfig.from_dict({"synchronous_steps": value})


def test_synchronous_steps_train_a_tied_revgpt_as_one_stage_holding_it_does():
    """RevGPT with its embedding and output layer tied across stages, J = 4 on 2 processes, every call
    synchronous: the same weights as the whole model in one stage (plain training), tied gradients and weights
    exchanged inside the drained windows. No dropout (its keys follow the entry clocks), no clipping (PETRA clips
    per stage)."""
    common = dict(model="revgpt", tie_embeddings=True, k=2, train_batches=3, dropout=0.0, optimizer=SGD,
                  config={"gradient_clipping": 0})
    synchronous = merged_params(run(2, 2, **common, petra={"synchronous_steps": 3}))
    whole = merged_params(run(1, 1, **common))  # the tied layer once, where J = 4 names the reader's copy too
    assert max_diff({n: synchronous[n] for n in whole}, whole) < TOL
    assert max_diff(synchronous, merged_params(run(2, 2, **common))) > 1e-6
