"""How good is PETRA's gradient? The study of the paper's App. B, run inside a real training run.

Every ``petra.gradient_quality_every`` optimizer steps one micro-batch ``m`` (the first one the
``train_batch`` call feeds) is followed through every stage ``j``, and three gradients of its loss with
respect to ``theta_j`` are compared, each for that micro-batch alone and the unscaled loss:

- **petra**: what the engine accumulated at its backward of ``m``: the reconstructed input ``x~``,
  the parameters as they are at that clock, the incoming ``delta`` of the next stage;
- **delayed** (Zhuang et al., 2020): the same ``delta`` through the *exact* input and the parameters
  the forward used (stashed here only for this micro-batch);
- **end-to-end**: synchronous backprop of ``m`` through all stages with the parameters every stage
  has when stage ``j`` runs its backward (a separate forward and backward through the whole pipeline
  at that clock, after the forwards and before any parameter changes, so it sees the same weights).

Per stage it reports cosine similarities and norm ratios between the three, and the reconstruction
error ``||x~ - x|| / ||x||`` of the input (0 where the stage uses an exact input). Two more numbers say
how the optimizer moves the stage: ``cos_update_prev``, the mean cosine between consecutive updates
``u_t = w_t - w_{t-1}`` over the steps since the last record (near 1: a steady direction; near 0 or
below: oscillation, which stale gradients under Adam at a high learning rate cause), and
``cos_update_e2e``, the cosine between the stage's latest update and the end-to-end gradient's descent
direction ``-g_e2e`` (with ``cos_update_petra`` the same for PETRA's gradient, its baseline: the update
follows the optimizer's momentum and preconditioner, not one micro-batch's gradient). All the extra work
happens at the chosen micro-batch's clocks only; the training math is not touched. The probe passes
are p2p exchanges of every pipeline rank at the same clock, and the results are gathered at the end of
a ``train_batch`` call, when every rank is there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
from torch import Tensor

from ..nn.reversible import Activation, as_tuple, shaped_like
from ..runtime.observe import Observer
from ..schedule import Window, backward_micro_batch, channels, delay
from ..util.files import save_figure

if TYPE_CHECKING:
    from ..runtime.engine import PetraEngine

PAIRS = (("petra", "delayed"), ("petra", "e2e"), ("delayed", "e2e"))


def cosine(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """Cosine similarity of two gradients given as lists of tensors (float64)."""
    u, v = flat(a), flat(b)
    denominator = float(u.norm() * v.norm())
    return max(-1.0, min(1.0, float(u @ v) / denominator)) if denominator > 0 else math.nan


def norm_ratio(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """``||a|| / ||b||``."""
    denominator = float(flat(b).norm())
    return float(flat(a).norm()) / denominator if denominator > 0 else math.nan


def flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def relative_error(x_tilde: Activation, x: Activation) -> float:
    """``||x~ - x|| / ||x||`` over the floating tensors of an activation."""
    pairs = [(a, b) for a, b in zip(as_tuple(x_tilde), as_tuple(x)) if b.is_floating_point()]
    if not pairs:
        return math.nan
    diff = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in pairs)
    norm = sum(float(b.double().pow(2).sum()) for _, b in pairs)
    return math.sqrt(diff / norm) if norm > 0 else math.nan


def compare(grads: dict[str, Sequence[Tensor]]) -> dict[str, float]:
    """The six numbers of one stage: ``cos_a_b`` and ``norm_a_b`` for the three pairs."""
    out = {}
    for a, b in PAIRS:
        out[f"cos_{a}_{b}"] = cosine(grads[a], grads[b])
        out[f"norm_{a}_{b}"] = norm_ratio(grads[a], grads[b])
    return out


@dataclass
class _Probe:
    """One followed micro-batch, on one rank."""

    m: int
    step: int
    samples: int
    forward: dict[int, tuple[Activation, Any, list[Tensor]]] = field(default_factory=dict)  # j: x, labels, theta
    before: dict[int, tuple[Activation | None, list[Tensor | None]]] = field(default_factory=dict)
    grads: dict[int, dict[str, list[Tensor]]] = field(default_factory=dict)  # j: kind -> gradient
    reconstruction: dict[int, float] = field(default_factory=dict)


class GradientQuality(Observer):
    """Observes a :class:`PetraEngine` when ``petra.gradient_quality_every`` > 0 (``petra_ds.initialize``
    attaches it as ``engine.gradient_quality``).

    ``records`` (on every rank) holds one dict per followed micro-batch and stage, averaged over the
    data-parallel replicas; with ``keep_vectors`` the raw gradients of this rank's stages are kept in
    ``vectors[(m, j)]`` too (for tests and notebooks).
    """

    def __init__(self, engine: "PetraEngine", every: int, keep_vectors: bool = False) -> None:
        self.engine = engine
        self.every = every
        self.keep_vectors = keep_vectors
        self.J = engine.num_petra_stages
        self.open: dict[int, _Probe] = {}
        self.records: list[dict[str, Any]] = []
        self.vectors: dict[tuple[int, int], dict[str, list[Tensor]]] = {}
        self._before_step: dict[int, list[Tensor]] = {}
        self._update: dict[int, list[Tensor]] = {}  # each local stage's latest update
        self._update_cosines: dict[int, list[float]] = {}  # cos(u_t, u_{t-1}) since the stage's last record

    # --- the observer's hooks ---

    def window_start(self, engine: "PetraEngine", window: Window) -> None:
        """A ``train_batch`` call begins: follow its first micro-batch every ``every`` steps."""
        if window.micro_batches > 0 and engine.global_steps % self.every == 0:
            self.open[window.start_clock] = _Probe(window.start_clock, engine.global_steps, engine.global_samples)

    def after_forward(self, engine: "PetraEngine", stage: int, m: int, x: Activation, labels: Any) -> None:
        probe = self.open.get(m)
        if probe is None:
            return
        st = engine.stages[stage]
        with st.compensation.forward_weights():  # the weights the forward ran with (predicted, if it predicts)
            theta = [p.detach().clone() for p in self._params(st)]
        probe.forward[stage] = (x, labels, theta)

    def forwards_done(self, engine: "PetraEngine", clock: int) -> None:
        """After the clock's forwards, before any backward or step: the end-to-end passes due now."""
        for probe in list(self.open.values()):
            due = [j for j in range(self.J) if backward_micro_batch(clock, j, self.J) == probe.m]
            if due:
                self._end_to_end(probe, due)

    def before_backward(self, engine: "PetraEngine", stage: int, m: int, delta: Activation | None) -> None:
        probe = self.open.get(m)
        if probe is not None:
            st = engine.stages[stage]
            probe.before[stage] = (delta, [None if p.grad is None else p.grad.detach().clone()
                                           for p in self._params(st)])

    def after_backward(self, engine: "PetraEngine", stage: int, m: int, x_tilde: Activation) -> None:
        probe = self.open.get(m)
        if probe is None:
            return
        st = engine.stages[stage]
        k = engine.micro_batches  # the engine scales the loss by 1/k
        delta, before = probe.before.pop(stage)
        params = self._params(st)
        probe.grads.setdefault(stage, {})["petra"] = list(st.loss_scale.unscaled(tuple(  # fp16: .grad is scaled
            k * (p.grad.detach() - (torch.zeros_like(p) if b is None else b)) if p.grad is not None
            else torch.zeros_like(p) for p, b in zip(params, before))))
        x, labels, theta = probe.forward.pop(stage)
        probe.grads[stage]["delayed"] = [k * g if delta is not None else g
                                         for g in self._delayed(st, m, x, labels, theta, delta)]
        probe.reconstruction[stage] = relative_error(x_tilde, x) if st.reconstructs else 0.0  # else: exact

    def before_step(self, engine: "PetraEngine", stage: int, step: int) -> None:
        self._before_step[stage] = [p.detach().clone() for p in self._params(engine.stages[stage])]

    def after_step(self, engine: "PetraEngine", stage: int, step: int) -> None:
        before = self._before_step.pop(stage)
        update = [p.detach() - w for p, w in zip(self._params(engine.stages[stage]), before)]
        if stage in self._update:
            self._update_cosines.setdefault(stage, []).append(cosine(update, self._update[stage]))
        self._update[stage] = update

    def window_end(self, engine: "PetraEngine", window: Window) -> list[dict[str, Any]]:
        """After a window, when every rank is here: gather the followed micro-batches that finished."""
        done = [m for m in self.open if m + delay(0, self.J) < engine.clock]  # stage 0's backward ran
        if not done:
            return []
        local = [self._local_records(self.open.pop(m)) for m in done]
        gathered = engine.transport.all_gather_object([r for rows in local for r in rows],
                                                      "the gradient-quality records")
        new = average_replicas([row for rows in gathered for row in rows])
        self.records.extend(new)
        if engine.global_rank == 0 and engine.monitor.enabled:
            engine.monitor.write_events([
                (f"GradientQuality/stage_{row['stage']}/{key}", row[key], row["samples"])
                for row in new for key in metric_keys(row) if not math.isnan(row[key])])
        return new

    # --- the two reference gradients ---

    @staticmethod
    def _params(st) -> list[Tensor]:
        return [p for p in st.params if p.requires_grad]

    def _delayed(self, st, m: int, x: Activation, labels: Any, theta: list[Tensor],
                 delta: Activation | None) -> list[Tensor]:
        """The same delta through the exact input and the forward's parameters (swapped in, then back:
        PETRA's graph of this micro-batch is spent and no step ran yet)."""
        with st.swapped_params(theta):
            return self._vjp(st, m, x, labels, delta)[0]

    @staticmethod
    def _vjp(st, m: int, x: Activation, labels: Any, delta: Activation | None) -> tuple[list[Tensor], Activation]:
        """(parameter gradients, input gradient) of stage ``st`` for micro-batch ``m`` (``delta=None``:
        the last stage's loss): the stage's own VJP, with the training forward's keyed RNG and loss scale (fp16),
        ``.grad`` and the batch-norm running statistics left alone."""
        scale = st.loss_scale
        leaf, out = st.graph(m, x, labels, update_bn=False)
        params = [p for p in st.params if p.requires_grad]
        if st.is_last:
            outs, grad_outs = [scale.loss(out, 1)], [None]
        else:
            pairs = [(o, g) for o, g in zip(as_tuple(out), as_tuple(scale.scaled(delta)))
                     if g is not None and o.requires_grad]
            outs, grad_outs = [o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs]
        leaves = [t for t in as_tuple(leaf) if t.requires_grad]
        grads = list(torch.autograd.grad(outs, params + leaves, grad_outs, allow_unused=True)) if outs \
            else [None] * (len(params) + len(leaves))
        theta_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        leaf_grads = iter(grads[len(params):])
        dx = [None if not t.requires_grad else (g if (g := next(leaf_grads)) is not None else torch.zeros_like(t))
              for t in as_tuple(leaf)]
        return list(scale.unscaled(tuple(theta_grads))), scale.unscaled(shaped_like(leaf, dx))

    def _end_to_end(self, probe: _Probe, due: list[int]) -> None:
        """Synchronous backprop of the followed micro-batch through every stage, now; the gradients of
        the stages in ``due`` (whose PETRA backward is this clock) are kept."""
        engine, m = self.engine, probe.m
        local = list(engine.local_stage_ids)
        inputs: dict[int, tuple[Activation, Any]] = {}
        # stage 0's input: its forward stash, still there (its backward is this clock at the latest)
        carry: Any = probe.forward[0][:2] if 0 in probe.forward else None
        for j in local:  # forward through this rank's stages, in pipeline order
            if j > 0 and j == local[0]:
                key = channels.forward_key(j - 1, m, channels.PROBE_ACT)
                carry = engine.transport.exchange([], [(channels.forward_channel(j - 1, channels.PROBE_ACT), key)],
                                                  "the probe's forward")[key]
            inputs[j] = carry
            st = engine.stages[j]
            if st.is_last:
                break
            x, labels = carry
            with st.scope(m, update_bn=False), torch.no_grad():
                carry = (st.run(x), labels)
            if j == local[-1]:
                out = channels.forward_channel(j, channels.PROBE_ACT)
                engine.transport.exchange([(out, carry)], [], "the probe's forward")
        dy: Any = None
        for j in reversed(local):  # backward: each stage's graph recomputed from its input of this pass
            st = engine.stages[j]
            if not st.is_last and j == local[-1]:
                key = channels.backward_key(j + 1, m, channels.PROBE_GRAD)
                dy = engine.transport.exchange([], [(channels.backward_channel(j + 1, channels.PROBE_GRAD), key)],
                                               "the probe's backward")[key]
            x, labels = inputs[j]
            grads, dy = self._vjp(st, m, x, labels, None if st.is_last else dy)
            if j in due:
                probe.grads.setdefault(j, {})["e2e"] = grads
            if j > 0 and j == local[0]:
                out = channels.backward_channel(j, channels.PROBE_GRAD)
                engine.transport.exchange([(out, dy)], [], "the probe's backward")

    # --- results ---

    def _local_records(self, probe: _Probe) -> list[dict[str, Any]]:
        rows = []
        for j, grads in sorted(probe.grads.items()):
            row = {"step": probe.step, "samples": probe.samples, "micro_batch": probe.m, "stage": j,
                   "replica": self.engine.grid.data_parallel_id,
                   "reconstruction_error": probe.reconstruction.get(j, math.nan)}
            if self._params(self.engine.stages[j]):
                row.update(compare(grads))
                row.update(self.update_cosines(j, grads))
            if self.keep_vectors:
                self.vectors[(probe.m, j)] = grads
            rows.append(row)
        return rows

    def update_cosines(self, j: int, grads: dict[str, Sequence[Tensor]]) -> dict[str, float]:
        """``cos_update_prev``, ``cos_update_e2e`` and ``cos_update_petra`` of stage ``j`` against the
        ``grads`` of a followed micro-batch (NaN before its first update); the consecutive cosines are
        consumed: the next record averages the steps after this one."""
        cosines = self._update_cosines.pop(j, [])
        update = self._update.get(j)
        descent = {name: [-g for g in grads[name]] for name in ("e2e", "petra") if name in grads}
        return {"cos_update_prev": sum(cosines) / len(cosines) if cosines else math.nan,
                **{f"cos_update_{name}": cosine(update, d) if update is not None else math.nan
                   for name, d in descent.items()}}


def metric_keys(row: dict[str, Any]) -> list[str]:
    return [key for key in row if key.startswith(("cos_", "norm_")) or key == "reconstruction_error"]


def average_replicas(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (micro-batch, stage): the data-parallel replicas' numbers averaged."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["micro_batch"], row["stage"]), []).append(row)
    out = []
    for (_, _), group in sorted(groups.items()):
        merged = {key: value for key, value in group[0].items() if key != "replica"}
        for key in metric_keys(merged):
            merged[key] = sum(r[key] for r in group) / len(group)
        merged["replicas"] = len(group)
        out.append(merged)
    return out


def by_stage(rows: Iterable[dict[str, Any]], first_step: int = 0, last_step: int | None = None) -> list[dict[str, Any]]:
    """Per stage, the mean of each number over the rows with ``first_step <= step <= last_step``."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if row["step"] >= first_step and (last_step is None or row["step"] <= last_step):
            groups.setdefault(row["stage"], []).append(row)
    out = []
    for stage, group in sorted(groups.items()):
        merged: dict[str, Any] = {"stage": stage, "rows": len(group)}
        for key in metric_keys(group[0]):
            values = [r[key] for r in group if not math.isnan(r[key])]
            merged[key] = sum(values) / len(values) if values else math.nan
        out.append(merged)
    return out


def plot(rows: list[dict[str, Any]], path: str, title: str = "") -> str:
    """The paper's Fig. 5 (the numbers against training steps, one line per stage), Fig. 6 (cosine
    similarities against the stage index at a few steps) and the update cosines in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stage"] for r in rows})
    steps = sorted({r["step"] for r in rows})
    colors = plt.get_cmap("viridis")
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    axes[2, 2].axis("off")
    panels = [
        (axes[2, 0], [("cos_update_prev", "-")], "cosine of consecutive updates (oscillation: <= 0)"),
        (axes[2, 1], [("cos_update_e2e", "-"), ("cos_update_petra", "--")],
         "cosine update / -gradient: end-to-end (dashed: PETRA's)"),
        (axes[0, 0], [("cos_petra_delayed", "-")], "cosine PETRA vs delayed"),
        (axes[0, 1], [("cos_petra_e2e", "-"), ("cos_delayed_e2e", "--")], "cosine vs end-to-end (dashed: delayed)"),
        (axes[0, 2], [("reconstruction_error", "-")], "reconstruction error ||x~ - x|| / ||x||"),
        (axes[1, 0], [("norm_petra_delayed", "-")], "norm ratio PETRA / delayed"),
        (axes[1, 1], [("norm_petra_e2e", "-"), ("norm_delayed_e2e", "--")],
         "norm ratio / end-to-end (dashed: delayed)"),
    ]
    for ax, series, label in panels:
        for i, stage in enumerate(stages):
            mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["step"])
            for key, style in series:
                ax.plot([r["step"] for r in mine], [r.get(key, math.nan) for r in mine], style,
                        color=colors(i / max(1, len(stages) - 1)), label=f"stage {stage}" if style == "-" else None)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("optimizer step")
    axes[0, 2].set_yscale("symlog", linthresh=1e-6)
    axes[0, 0].legend(fontsize=7)
    ax = axes[1, 2]
    picks = sorted({steps[int(i * (len(steps) - 1) / 3)] for i in range(4)}) if steps else []
    for i, step in enumerate(picks):
        table = by_stage(rows, step, step)
        color = colors(i / max(1, len(picks) - 1))
        for key, style in (("cos_petra_e2e", "-"), ("cos_delayed_e2e", "--"), ("cos_petra_delayed", ":")):
            ax.plot([r["stage"] for r in table], [r[key] for r in table], style, marker="o", ms=3, color=color,
                    label=f"step {step}" if style == "-" else None)
    ax.set_title("cosine by stage (- PETRA/e2e, -- delayed/e2e, : PETRA/delayed)", fontsize=10)
    ax.set_xlabel("stage j")
    ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path
