"""Independent plain-PyTorch references for the engine tests.

``delayed_training`` replays PETRA's clock (and its ablations) in one loop with plain autograd: the
reversible reconstruction inverts layer by layer and then re-runs the forward (the naive route, not
the engine's fused one) and weight stashing differentiates with ``torch.func.functional_call`` on
the stashed tensors (not the engine's parameter swap).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe.module import TiedLayerSpec
from deepspeed.runtime.utils import partition_uniform, set_random_seed
from torch import nn
from torch.func import functional_call

from petra_ds.nn import assign_rng_keys, is_reversible, micro_batch_rng
from petra_ds.tools.toy import toy_layer_specs

LOSS = nn.CrossEntropyLoss()


def build_stages(num_stages: int, dropout: float, base_seed: int = 1234, specs=None):
    """The layers built as PetraPipelineModule builds them (seed per layer index), cut into stages."""
    torch.set_default_dtype(torch.float64)
    specs = toy_layer_specs(dropout) if specs is None else specs
    layers, tied = [], {}
    for idx, spec in enumerate(specs):
        set_random_seed(base_seed + idx)
        if isinstance(spec, TiedLayerSpec):  # one shared module: plain weight tying, end to end
            module = tied.setdefault(spec.key, spec.build())
            layers.append(module if spec.forward_fn is None else _Tied(spec.forward_fn, module))
        else:
            layers.append(spec.build())
    parts = partition_uniform(len(specs), num_stages)
    stages = []
    for a, b in zip(parts, parts[1:]):
        key = 0
        for layer in layers[a:b]:
            key = assign_rng_keys(layer, key)
        stages.append([(idx, layers[idx]) for idx in range(a, b)])
    return stages


def named_params(stage):
    return {f"{idx}.{n}": p for idx, layer in stage
            for n, p in (layer.tied if isinstance(layer, _Tied) else layer).named_parameters()}


def run(stage, x):
    for _, layer in stage:
        x = layer(x)
    return x


def autograd_group_grads(stages, data, group, seed, loss=LOSS):
    """Plain end-to-end autograd of the mean loss over micro-batches ``group``."""
    for stage in stages:
        for _, layer in stage:
            layer.zero_grad(set_to_none=True)
    for m in group:
        x, y = data[m]
        for j, stage in enumerate(stages):
            with micro_batch_rng(seed, m, j):
                x = run(stage, x)
        (loss(x, y) / len(group)).backward()
    return [{n: p.grad.clone() for n, p in named_params(stage).items()} for stage in stages]


def backprop_group(stage, data, group, seed, k):
    """Plain autograd of one stage holding the whole model over micro-batches ``group``, each loss / k."""
    for m in group:
        x, y = data[m]
        with micro_batch_rng(seed, m, 0):
            (LOSS(run(stage, x), y) / k).backward()


class _Tied(nn.Module):
    """``forward_fn(module, x)`` of a TiedLayerSpec, as a module whose parameters are the shared ones."""

    def __init__(self, forward_fn, module):
        super().__init__()
        self.forward_fn = forward_fn
        self.tied = module

    def forward(self, x):
        return self.forward_fn(self.tied, x)


class _Inverse(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, y):
        return self.layer.inverse(y)


class ConstantMomentumNAdam:
    """Nesterov Adam with a constant momentum coefficient (Dozat's form, decoupled weight decay), written
    from its equations: m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2,
    w <- w (1 - lr wd) - lr [b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)] / (sqrt(v / (1 - b2^t)) + eps)."""

    def __init__(self, params, lr, betas, eps=1e-8, weight_decay=0.0):
        self.params = list(params)
        self.param_groups = [{"lr": lr}]
        self.b1, self.b2 = betas
        self.eps, self.wd, self.t = eps, weight_decay, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        lr, b1, b2 = self.param_groups[0]["lr"], self.b1, self.b2
        self.t += 1
        t = self.t
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            p.mul_(1 - lr * self.wd)
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            mixed = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1 ** t)
            p.sub_(lr * mixed / ((v / (1 - b2 ** t)).sqrt() + self.eps))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def synchronous_entry_clocks(micro_batches: int, k: int, J: int, synchronous_steps: int) -> list[int]:
    """The clock each micro-batch enters at, its index in the engine, when the first ``synchronous_steps`` steps fill
    and drain: the next step's first one enters 2(J-1) clocks after the last of a synchronous step."""
    synced = synchronous_steps * k
    return [m // k * (k + 2 * (J - 1)) + m % k if m < synced else
            synchronous_steps * (k + 2 * (J - 1)) + m - synced for m in range(micro_batches)]


def delayed_training(stages, data, k, lr, momentum, seed, input_buffer_all=False, param_buffer=False,
                     compensation=None, clip=0.0, optimizer=None, kept_first=None, synchronous_steps=0):
    """PETRA's clock in one loop. Returns (final params by name, grads per stage per step).

    ``compensation`` ({"method": ..., its parameters}, or a list of them) and ``clip`` (per-stage gradient
    clipping) follow their papers' rules written out here, not petra_ds.runtime.compensation: weight prediction
    runs the forward through ``functional_call`` on w + scale * tau_j / k * d (d: the last update, or its
    average with ``beta``); the LR rescaling multiplies SGD's lr by max(1, tau_j / k) ** -max(0, 1 - (t - 1)
    / anneal); error feedback adds scale * tau_j / k * (u_t - u_{t-1}) to the weights after each step (u_t: the
    step's update, u_0 = 0); the adaptive momentum hands ``optimizer`` the coefficient b1 + (beta1_max - b1) * s_j /
    (s_0 + 1), s_j = tau_j / k; clipping scales the stage's gradient by C / (norm + 1e-6) when that is below
    1. ``optimizer(params, j, beta1_moved)`` builds stage j's optimizer (default: SGD with ``momentum``);
    ``beta1_moved(b1)`` is stage j's adaptive coefficient (b1 itself without that method).
    ``synchronous_steps`` N: the first N steps' k micro-batches enter at consecutive clocks and the next step's
    enter 2(J-1) clocks after the last of them (a fill and a drain); their forwards run on the weights and their
    steps are plain; the methods act from step N + 1 on, counting steps from there (not adaptive_momentum, which
    the optimizer holds from the start)."""
    J, M = len(stages), len(data)
    parts = compensation if isinstance(compensation, list) else [compensation or {"method": "none"}]
    comp = {}
    for part in parts:
        comp.update(part)
    methods = {part["method"] for part in parts}
    updates = [None] * J  # weight prediction's d per stage
    feedback = next((part for part in parts if part["method"] == "error_feedback"), None)
    last_updates = [None] * J  # error feedback's u_{t-1} per stage
    params = [named_params(s) for s in stages]

    def moved(j):
        fraction = 2 * (J - 1 - j) / k / (2 * (J - 1) / k + 1)
        return lambda b1: b1 + (comp.get("beta1_max", 0.99) - b1) * fraction if "adaptive_momentum" in methods else b1

    if optimizer is None:
        opts = [torch.optim.SGD(list(p.values()), lr=lr, momentum=moved(j)(momentum)) for j, p in enumerate(params)]
    else:
        opts = [optimizer(list(p.values()), j, moved(j)) for j, p in enumerate(params)]
    reconstructs = [0 < j < J - 1 and all(is_reversible(l) for _, l in s) and not input_buffer_all
                    and not (kept_first and j <= kept_first) for j, s in enumerate(stages)]
    inputs, stash, acts, grads_in = {}, {}, {}, {}
    counts, recorded = [0] * J, [[] for _ in range(J)]

    synced = synchronous_steps * k  # micro-batches of the synchronous steps
    entry = synchronous_entry_clocks(M, k, J, synchronous_steps)  # the index the engine gives (its RNG key)

    def call(j, m, x, values=None, inverse=False):
        stage = stages[j]
        with micro_batch_rng(seed, entry[m], j):
            for idx, layer in (reversed(stage) if inverse else stage):
                module = _Inverse(layer) if inverse else layer
                prefix = "layer." if inverse else ""
                if values is None:
                    x = module(x)
                else:
                    local = {prefix + n.split(".", 1)[1]: v for n, v in values.items() if n.split(".")[0] == str(idx)}
                    x = functional_call(module, local, (x,))
        return x

    entering = {e: m for m, e in enumerate(entry)}
    for t in range(entry[-1] + 2 * (J - 1) + 1):
        new_acts, new_grads = {}, {}
        for j in range(J - 1):
            m = entering.get(t - j, -1)
            if 0 <= m < M:
                x = data[m][0] if j == 0 else acts.pop((j, m))
                ahead = comp.get("scale", 1.0) * 2 * (J - 1 - j) / k
                predicted = None
                if "weight_prediction" in methods and updates[j] is not None and m >= synced:
                    predicted = {n: p.detach() + ahead * updates[j][n] for n, p in params[j].items()}
                with torch.no_grad():
                    new_acts[(j + 1, m)] = call(j, m, x, predicted)
                inputs[(j, m)] = x
                if param_buffer:
                    stash[(j, m)] = {n: p.detach().clone() for n, p in params[j].items()}
        for j in range(J):
            m = entering.get(t - 2 * (J - 1) + j, -1)
            if not 0 <= m < M:
                continue
            if j == J - 1:
                x_in = data[m][0] if J == 1 else acts.pop((j, m))
                delta = None
            else:
                delta, y_tilde = grads_in.pop((j, m))
                values = stash.get((j, m)) if param_buffer else None
                if reconstructs[j]:
                    with torch.no_grad():
                        x_in = call(j, m, y_tilde, values, inverse=True)
                else:
                    x_in = inputs[(j, m)]
            values = stash.pop((j, m), None) if param_buffer else None
            inputs.pop((j, m), None)
            leaves = [v.detach().requires_grad_() for v in values.values()] if values else None
            if values:
                values = dict(zip(values.keys(), leaves))
            x_leaf = tuple(t.detach().requires_grad_() for t in x_in) if isinstance(x_in, tuple) \
                else x_in.detach().requires_grad_(x_in.is_floating_point())
            out = call(j, m, x_leaf, values)
            wrt = list(params[j].values()) if values is None else leaves
            leaves_x = list(x_leaf) if isinstance(x_leaf, tuple) else ([x_leaf] if x_leaf.requires_grad else [])
            if j == J - 1:
                grads = torch.autograd.grad(LOSS(out, data[m][1]) / k, leaves_x + wrt, allow_unused=True)
            else:
                grads = torch.autograd.grad(list(out), leaves_x + wrt, grad_outputs=list(delta), allow_unused=True)
            dx, dtheta = grads[:len(leaves_x)], grads[len(leaves_x):]
            for p, g in zip(params[j].values(), dtheta):
                if g is not None:
                    p.grad = g.clone() if p.grad is None else p.grad + g
            if j > 0:
                new_grads[(j - 1, m)] = (tuple(dx), x_in)
            counts[j] += 1
            if counts[j] % k == 0:
                step = counts[j] // k
                delayed = step > synchronous_steps
                for p in params[j].values():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                if clip > 0:
                    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params[j].values()))
                    coef = clip / (norm + 1e-6)
                    if coef < 1:
                        for p in params[j].values():
                            p.grad = p.grad * coef
                recorded[j].append({n: p.grad.clone() for n, p in params[j].items()})
                factor = 1.0
                if "lr_rescale" in methods and j < J - 1 and delayed:
                    power = max(0.0, 1.0 - (step - synchronous_steps - 1) / comp.get("anneal_steps", 100))
                    factor = max(1.0, 2 * (J - 1 - j) / k) ** -power
                opts[j].param_groups[0]["lr"] = lr * factor
                before = {n: p.detach().clone() for n, p in params[j].items()}
                opts[j].step()
                opts[j].param_groups[0]["lr"] = lr
                opts[j].zero_grad(set_to_none=True)
                if feedback is not None and delayed:
                    ahead = feedback.get("scale", 1.0) * 2 * (J - 1 - j) / k
                    raw = {n: p.detach() - before[n] for n, p in params[j].items()}
                    with torch.no_grad():
                        for n, p in params[j].items():
                            p += ahead * (raw[n] - (0 if last_updates[j] is None else last_updates[j][n]))
                    last_updates[j] = raw
                if delayed:
                    update = {n: p.detach() - before[n] for n, p in params[j].items()}
                    beta = comp.get("beta", 0.0)
                    updates[j] = update if updates[j] is None else {
                        n: beta * updates[j][n] + (1 - beta) * u for n, u in update.items()}
        acts.update(new_acts)
        grads_in.update(new_grads)
    final = {n: p.detach().clone() for ps in params for n, p in ps.items()}
    return final, recorded
