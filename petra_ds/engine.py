"""PetraEngine: DeepSpeed's PipelineEngine running the PETRA schedule.

The engine owns the clock and the transport; the math of a stage lives in ``stage.py``. It extends
DeepSpeed the way DeepSpeed's DualPipeV engine does: a ``PipeSchedule`` subclass produces the
instructions and this subclass merges its handlers into ``_INSTRUCTION_MAP``.

Messages and collectives go through ``petra_ds.transport`` (one batch per clock and phase, safe under
NCCL's rules); a message between two stages of the same rank is handed over in memory. Each stage
steps its own optimizer and LR scheduler after its k-th backward, reducing its gradients (and batch-norm
running statistics) inside its data-parallel group only: no collective on the training path spans stages.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any, Callable, Iterator

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim import Optimizer

from . import checkpoint, messages
from .analysis.gradient_quality import GradientQuality
from .config import PetraConfig, PetraConfigError
from .module import (
    Tie,
    give_readers_their_copy,
    layer_module,
    stage_layers,
    stage_reversible,
    stage_ties,
    stages_per_rank_of,
    tied_params,
)
from .nn.batchnorm import BatchNormPolicy, running_stat_tensors
from .schedule import (
    AccumulateAndStep,
    CommitP2P,
    DelayedBackward,
    FeedLog,
    ForwardPass,
    LoadMicroBatch,
    PetraSchedule,
    PostP2P,
    RecvActivation,
    RecvGrad,
    RecvTiedGrad,
    RecvTiedWeight,
    ReverseReconstruct,
    SendActivation,
    SendGrad,
    SendTiedGrad,
    SendTiedWeight,
    Timeline,
    Window,
    delay,
)
from .stage import Stage, StageOptions, tensor_bytes
from .transport import Transport


#: ``petra`` keys that do not change training: a checkpoint resumes under other values
DIAGNOSTIC_KEYS = ("gradient_quality_every", "check_reversible", "reconstruct_overlap")


class StageOptimizers:
    """The optimizers of a rank's stages seen as one, for code that expects ``engine.optimizer``.

    Each stage steps its own optimizer at its own clock; ``step()`` here is not part of PETRA.
    """

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"stages": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["stages"]):
            opt.load_state_dict(s)


class StageSchedulers:
    """The LR schedulers of a rank's stages seen as one."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def get_last_lr(self) -> list[float]:
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict:
        return {"stages": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for s, sd in zip(self.schedulers, state["stages"]):
            s.load_state_dict(sd)


def _param_groups(model_parameters: Any) -> list[dict]:
    params = list(model_parameters)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


#: what a clock runs before its first backward (the gradient-quality probe goes after these and the
#: activations' batch)
_BEFORE_BACKWARD = (LoadMicroBatch, ForwardPass, SendActivation, RecvActivation)


def _before_backward(cmd: Any) -> bool:
    return isinstance(cmd, _BEFORE_BACKWARD) or (isinstance(cmd, PostP2P) and cmd.phase == "act")


class PetraEngine(PipelineEngine):
    """Runs PETRA on a ``PipelineModule``; created by :func:`petra_ds.initialize`."""

    def __init__(self, *args, petra_config: PetraConfig, bf16: bool = False, **kwargs) -> None:
        self.petra_config = petra_config
        super().__init__(*args, **kwargs)
        if not hasattr(self, "ties"):  # no optimizer configured: _configure_optimizer did not run
            self._setup_ties()
        module = self.module
        self.stages_per_rank = stages_per_rank_of(module)
        if self.stages_per_rank != petra_config.stages_per_rank:
            raise PetraConfigError(
                f'"petra.stages_per_rank" is {petra_config.stages_per_rank} but the model was built with '
                f"stages_per_rank={self.stages_per_rank}; build it with "
                "petra_ds.PetraPipelineModule(..., stages_per_rank=...) matching the config")
        self.num_petra_stages = self.num_stages * self.stages_per_rank
        self.local_stage_ids = self._local_range()
        self.reversible = stage_reversible(module)
        options = StageOptions(
            gradient_accumulation_steps=self.micro_batches,
            seed=petra_config.seed,
            replica=self.grid.data_parallel_id,
            input_buffer=petra_config.input_buffer,
            param_buffer=petra_config.param_buffer,
            bn_policy=BatchNormPolicy(petra_config.bn_running_stats),
            autocast_dtype=torch.bfloat16 if bf16 else None,
            device_type=self.device.type,
            check_reversible=petra_config.check_reversible,
            reconstruct_overlap=petra_config.reconstruct_overlap,
        )
        self.stages: dict[int, Stage] = {}
        for j in self.local_stage_ids:
            last = j == self.num_petra_stages - 1
            stage = Stage(j, self.num_petra_stages, stage_layers(module, j), options,
                          loss_fn=module.loss_fn if last else None)
            if stage.reversible != self.reversible[j]:
                raise TypeError(f"stage {j}: its built layers and their specs disagree on reversibility")
            self.stages[j] = stage
        #: per local stage, the parameters its own step updates (a reader's tied copies follow the owner):
        #: what it clips and what its delay compensation acts on
        self._stepped = {j: [p for p in st.params if p.requires_grad and id(p) not in self._reader_tied_ids(j)]
                         for j, st in self.stages.items()}
        for j, stage in self.stages.items():
            stage.compensation = petra_config.delay_compensation.for_stage(
                self._stepped[j], delay(j, self.num_petra_stages) / self.micro_batches)
        self.timeline = Timeline(self.num_petra_stages)
        self.stage_steps = {j: 0 for j in self.local_stage_ids}
        self.inbox: dict[tuple[int, str, int], tuple] = {}  # (stage, kind, m) -> fields, for the next clock
        self.produced: dict[tuple[int, str, int], tuple] = {}
        self._loaded: dict[int, tuple[Any, Any]] = {}
        self._pending_delta: dict[int, Any] = {}
        self.clock_now = 0
        #: every message and collective of this rank (``PETRA_DS_COMM_TRACE=<dir>`` records them)
        self.transport = Transport(rank=self.global_rank, device=self.device, local_stages=self.local_stage_ids,
                                   stage_rank=self._stage_rank, clock=lambda: self.clock_now)
        self._window_losses: list[Tensor] = []
        #: (stage, micro-batch, loss) not yet checked for ``non_finite: "raise"``
        self._unchecked_losses: list[tuple[int, int, Tensor]] = []
        self._first_inputs_layout: messages.Layout | None = None
        self._petra_data_iter: Iterator | None = None
        #: called as f(stage_index, stage) after the data-parallel reduction, before each optimizer step
        self.step_observers: list[Callable[[int, Stage], None]] = []
        #: called as f(engine, clock) at the end of every clock
        self.clock_observers: list[Callable[["PetraEngine", int], None]] = []
        #: (stage, step) of the updates skipped for non-finite gradients (``non_finite: "skip"``)
        self.skipped_steps: list[tuple[int, int]] = []
        #: the App. B gradient-quality study, when ``petra.gradient_quality_every`` > 0
        self.gradient_quality: GradientQuality | None = (
            GradientQuality(self, petra_config.gradient_quality_every)
            if petra_config.gradient_quality_every > 0 else None)

    # --- optimizers and schedulers, one per local stage ---

    def _local_range(self) -> range:
        """This rank's PETRA stages (also needed while DeepSpeed's constructor builds the optimizers)."""
        spr = stages_per_rank_of(self.module)
        rank = self.module._grid.get_stage_id()
        return range(rank * spr, (rank + 1) * spr)

    def _setup_ties(self) -> None:
        """Ties across stages: readers' own copies, and the parameters each side sends and receives."""
        self.ties: list[Tie] = stage_ties(self.module)
        local = self._local_range()
        #: (stage, key) -> the tied tensors that stage sends (reader: gradients) or receives (reader: weights)
        self.tied_tensors: dict[tuple[int, str], list[torch.nn.Parameter]] = {}
        self._copy_of: dict[int, int] = {}  # id(reader copy's param) -> id(the owner's param it mirrors)
        for tie in self.ties:
            if tie.owner in local:
                self.tied_tensors[(tie.owner, tie.key)] = tied_params(self.module.tied_modules[tie.key], tie.attrs)
            for j, twin in give_readers_their_copy(self.module, tie, local).items():
                self.tied_tensors[(j, tie.key)] = tied_params(twin, tie.attrs)
                base = self.module.tied_modules[tie.key]
                if twin is not base:
                    self._copy_of.update({id(c): id(b) for c, b in zip(twin.parameters(), base.parameters())})

    def _reader_tied_ids(self, stage: int) -> set[int]:
        return {id(p) for tie in self.ties if stage in tie.readers for p in self.tied_tensors[(stage, tie.key)]}

    def _local_stage_params(self) -> dict[int, set[int]]:
        """Per local stage, the parameters its optimizer steps (a reader's tied copies are not among them)."""
        out = {}
        for j in self._local_range():
            ids = set()
            for layer in stage_layers(self.module, j):
                module = layer_module(layer)
                if module is not None:
                    ids.update(id(p) for p in module.parameters())
            out[j] = ids - self._reader_tied_ids(j)
        return out

    def _configure_optimizer(self, client_optimizer, model_parameters) -> None:
        self._setup_ties()
        stage_params = self._local_stage_params()
        groups = _param_groups(model_parameters)
        if self._copy_of:  # a reader's copy joins the groups of the parameters it copies
            by_id = {id(p): p for p in self.module.parameters()}
            for g in groups:
                members = {id(p) for p in g["params"]}
                g["params"] += [by_id[c] for c, b in self._copy_of.items()
                                if b in members and c not in members and c in by_id]
        if isinstance(client_optimizer, Optimizer) and len(stage_params) > 1:
            raise PetraConfigError(
                "an optimizer instance cannot serve several PETRA stages that step at different clocks; "
                "pass a callable `optimizer=lambda params: ...` or configure it in the config")
        optimizers = []
        for ids in stage_params.values():
            stage_groups = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in groups]
            stage_groups = [g for g in stage_groups if g["params"]]
            if not stage_groups:  # a stage without trainable parameters (e.g. a reshape) steps nothing
                opt = None
            elif isinstance(client_optimizer, Optimizer):
                opt = client_optimizer
            elif client_optimizer is not None:
                opt = client_optimizer(stage_groups)
            else:
                opt = self._configure_basic_optimizer(stage_groups)
            optimizers.append(opt)
        self.stage_optimizers = optimizers
        present = [opt for opt in optimizers if opt is not None]
        self.basic_optimizer = self.optimizer = present[0] if len(present) == 1 else StageOptimizers(present)

    def _configure_lr_scheduler(self) -> None:
        client = self.client_lr_scheduler
        if client is not None and not callable(client) and len(self.stage_optimizers) > 1:
            raise PetraConfigError(
                "an LR scheduler instance cannot serve several PETRA stages; pass a callable "
                "`lr_scheduler=lambda optimizer: ...` or configure it in the config")
        schedulers = []
        for opt in self.stage_optimizers:
            if opt is None:
                schedulers.append(None)
            elif client is None:
                schedulers.append(self._scheduler_from_config(opt))
            elif callable(client) and not hasattr(client, "step"):
                schedulers.append(client(opt))
            else:
                schedulers.append(client)
        self.stage_schedulers = schedulers
        present = [s for s in schedulers if s is not None]
        self.lr_scheduler = (present[0] if len(present) == 1 else StageSchedulers(present)) if present else None

    # --- public API ---

    def train_batch(self, data_iter: Iterator | None = None) -> Tensor:
        """Advance k clocks feeding k micro-batches; no flush. Returns the mean loss of the
        micro-batches whose loss was computed in these clocks (NaN while the pipeline fills), the
        same value on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self._petra_data_iter = data_iter
        elif self._petra_data_iter is None and self.training_dataloader is not None:
            self._petra_data_iter = iter(self.training_dataloader)
        if self._petra_data_iter is None and 0 in self.stages:
            raise ValueError("train_batch() needs a data iterator (or training_data in initialize)")
        self.module.train()
        window = self.timeline.train_window(self.micro_batches)
        if self.gradient_quality is not None:
            self.gradient_quality.start_window(window.start_clock, window.micro_batches > 0)
        loss = self._run_window(window)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.agg_train_loss = loss
        if self.global_rank == 0 and self.monitor.enabled and not math.isnan(loss.item()):
            self.monitor.write_events([("Train/Samples/train_loss", loss.item(), self.global_samples)])
        return loss

    def drain(self) -> Tensor:
        """Run clocks without new data until every fed micro-batch had its backward everywhere.
        Returns the mean loss of the micro-batches finished during the drain (NaN if none)."""
        self.module.train()
        return self._run_window(self.timeline.drain_window())

    @property
    def clock(self) -> int:
        return self.timeline.clock

    def _schedule(self, window: Window) -> PetraSchedule:
        return PetraSchedule.for_window(
            window, self.num_stages, self.stage_id, stages_per_rank=self.stages_per_rank,
            gradient_accumulation_steps=self.micro_batches, reversible=self.reversible,
            input_buffer=self.petra_config.input_buffer,
            ties=[(tie.key, tie.owner, tie.readers) for tie in self.ties])

    def _run_window(self, window: Window) -> Tensor:
        self._window_losses = []
        self._exec_schedule(self._schedule(window))
        self._check_losses()
        self.timeline.advance(window)
        loss = self._reduce_loss(self._window_losses)
        if self.gradient_quality is not None:
            self.gradient_quality.end_window()
        self.transport.save_trace()
        return loss

    def _exec_schedule(self, pipe_schedule: PetraSchedule) -> None:
        """DeepSpeed's instruction loop, one clock per step, with the clock observers. The
        gradient-quality probe runs after a clock's forwards, before any parameter changes."""
        for clock, step_cmds in enumerate(pipe_schedule, start=pipe_schedule.start_clock):
            self.clock_now = clock
            probe = self.gradient_quality
            for cmd in step_cmds:
                if probe is not None and not _before_backward(cmd):
                    probe.mid_clock(clock)
                    probe = None
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
                handler(self, **cmd.kwargs)
            for observe in self.clock_observers:
                observe(self, clock)
            if probe is not None:
                probe.mid_clock(clock)

    def _reduce_loss(self, losses: list[Tensor]) -> Tensor:
        """Mean over this window's finished micro-batches, averaged over data parallelism and
        broadcast from the last stage: a collective at the window's end, where every rank is."""
        last_rank = self.grid.stage_to_global(stage_id=self.num_stages - 1)
        nan = torch.tensor(float("nan"), dtype=torch.float32)
        value = torch.stack([loss.float() for loss in losses]).mean() if losses else nan
        value = value.reshape(1).to(self.device)
        if self.is_last_stage() and self.grid.data_parallel_size > 1:
            self.transport.all_reduce(value, self.grid.get_data_parallel_group(),
                                      "the loss reduction over data-parallel replicas")
            value /= self.grid.data_parallel_size
        if self.num_stages > 1:
            self.transport.broadcast(value, last_rank, self.grid.get_pipe_parallel_group(),
                                     "the loss broadcast at the end of the window")
        return value[0]

    # --- instructions ---

    def _exec_petra_load(self, stage: int, micro_batch: int) -> None:
        if self._petra_data_iter is None:
            raise ValueError("no data iterator: pass one to train_batch()")
        try:
            batch = next(self._petra_data_iter)
        except StopIteration:
            raise ValueError(
                f"the data iterator ran out at micro-batch {micro_batch} (clock {self.clock_now}) inside a "
                f"train_batch call of {self.micro_batches} clocks; give it k micro-batches per call "
                "(e.g. deepspeed.utils.RepeatingLoader) or call drain() to finish") from None
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("the data iterator must yield (inputs, labels) pairs, as for DeepSpeed's pipeline")
        inputs, labels = (self._to_device(batch[0]), self._to_device(batch[1]))
        layout = messages.layout_of((inputs, labels))
        if self._first_inputs_layout is None:
            self._first_inputs_layout = layout
        elif layout != self._first_inputs_layout:
            raise messages.MessageLayoutError(
                f"micro-batch {micro_batch} has layout {messages.describe(layout)} but the first one had "
                f"{messages.describe(self._first_inputs_layout)}; PETRA exchanges shapes once: keep the "
                "micro-batch size fixed (e.g. DataLoader(drop_last=True))")
        self._loaded[micro_batch] = (inputs, labels)

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.to(self.device)
        if isinstance(value, (tuple, list)):
            return tuple(self._to_device(v) for v in value)
        return value

    def _exec_petra_forward(self, stage: int, micro_batch: int) -> None:
        st = self.stages[stage]
        if stage == 0:
            x, labels = self._loaded.pop(micro_batch)
        else:
            x, labels = self.inbox.pop((stage, "act", micro_batch))
        if self.gradient_quality is not None:
            self.gradient_quality.on_forward(stage, micro_batch, x, labels)
        out = st.forward(micro_batch, x, labels)
        if st.is_last:
            if self.petra_config.non_finite == "raise":
                self._unchecked_losses.append((stage, micro_batch, out))
            self._window_losses.append(out)
        else:
            self.produced[(stage, "act", micro_batch)] = (out, labels)

    def _exec_petra_reconstruct(self, stage: int, micro_batch: int) -> None:
        delta, x_tilde = self.inbox.pop((stage, "grad", micro_batch))
        self.stages[stage].reconstruct(micro_batch, x_tilde)
        self._pending_delta[stage] = delta

    def _exec_petra_backward(self, stage: int, micro_batch: int) -> None:
        st = self.stages[stage]
        if st.is_last:
            delta = None
        elif st.reconstructs:
            delta = self._pending_delta.pop(stage)
        else:
            delta, _ = self.inbox.pop((stage, "grad", micro_batch))
        if self.gradient_quality is not None:
            self.gradient_quality.before_backward(stage, micro_batch, delta)
        dx, x_tilde = st.backward(micro_batch, delta)
        if self.gradient_quality is not None:
            self.gradient_quality.after_backward(stage, micro_batch, x_tilde)
        if stage > 0:
            self.produced[(stage, "grad", micro_batch)] = (dx, x_tilde)

    def _exec_accumulate_and_step(self, stage: int, step: int) -> None:
        st = self.stages[stage]
        index = stage - self.local_stage_ids[0]
        optimizer = self.stage_optimizers[index]
        params = [p for p in st.params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.grid.data_parallel_size > 1:
            self._average_over_replicas(stage, [p.grad for p in params] + running_stat_tensors(st.norms))
        self._tied_gradients(stage, step)
        if st.is_last:
            self._check_losses()
        finite = self._gradients_finite(stage, step, params)
        if finite and self.gradient_clipping() > 0:
            torch.nn.utils.clip_grad_norm_(self._stepped[stage], self.gradient_clipping())
        for observe in self.step_observers:
            observe(stage, st)
        if optimizer is not None and finite:
            st.compensation.step(optimizer.step, optimizer, step)
        for p in params:  # not optimizer.zero_grad(): DeepSpeed's fused optimizers differ in signature
            p.grad = None
        self._tied_weights(stage, step)
        scheduler = self.stage_schedulers[index]
        if scheduler is not None:
            scheduler.step()
        self.stage_steps[stage] += 1
        if self.stage_steps[stage] != step:
            raise RuntimeError(f"stage {stage} took step {self.stage_steps[stage]}, the schedule says {step}")

    def _average_over_replicas(self, stage: int, tensors: list[Tensor]) -> None:
        """One all-reduce inside the stage's data-parallel group: the accumulated gradients, and the
        batch-norm running statistics, so every replica evaluates with the same ones (each replica's
        reconstructions updated them from its own micro-batches)."""
        floats = [t for t in tensors if t.is_floating_point()]
        if not floats:
            return
        flat = _flatten_dense_tensors(floats)
        self.transport.all_reduce(flat, self.grid.get_data_parallel_group(),
                                  f"the data-parallel reduction of stage {stage}")
        flat /= self.grid.data_parallel_size
        for t, synced in zip(floats, _unflatten_dense_tensors(flat, floats)):
            t.copy_(synced)

    def _check_losses(self) -> None:
        """``non_finite: "raise"``: one host sync for the losses since the last check, at the last
        stage's optimizer step (before the gradients they poisoned are looked at) or the window's end,
        instead of one per micro-batch."""
        pending, self._unchecked_losses = self._unchecked_losses, []
        if not pending:
            return
        finite = torch.stack([torch.isfinite(loss) for _, _, loss in pending]).tolist()
        for (stage, m, loss), ok in zip(pending, finite):
            if not ok:
                raise FloatingPointError(
                    f"non-finite loss {loss.item()} at stage {stage}, micro-batch {m}, clock {m + stage}; fix "
                    'the data or the learning rate, or set "petra": {"non_finite": "skip"} to skip the updates '
                    "it poisons")

    def _gradients_finite(self, stage: int, step: int, params: list[Tensor]) -> bool:
        """One check per step (not per micro-batch): are the k accumulated gradients finite? With
        ``non_finite: "raise"`` a non-finite one raises before the optimizer could write NaN."""
        if not params or bool(torch.stack([torch.isfinite(p.grad).all() for p in params]).all()):
            return True
        if self.petra_config.non_finite == "raise":
            raise FloatingPointError(
                f"non-finite gradient at stage {stage}, optimizer step {step}, clock {self.clock_now}; "
                'set "petra": {"non_finite": "skip"} to skip such updates')
        self.skipped_steps.append((stage, step))
        return False

    # --- tied weights across stages (see module.Tie) ---

    def _tied_gradients(self, stage: int, step: int) -> None:
        """A reader sets aside its gradient of the tied weights for the owner; the owner adds every
        reader's gradient of the same step (a reader's k-th backward comes before the owner's)."""
        for tie in self.ties:
            if stage in tie.readers:
                self.produced[(stage, f"tied_grad:{tie.key}", step)] = tuple(
                    p.grad.detach().clone() for p in self.tied_tensors[(stage, tie.key)])
            elif stage == tie.owner:
                for reader in tie.readers:
                    contribution = self.inbox.pop((stage, f"tied_grad:{tie.key}:{reader}", step), None)
                    if contribution is None:
                        raise RuntimeError(f"stage {stage} takes step {step} without stage {reader}'s gradient "
                                           f"of the tied weights {tie.key!r}")
                    for p, g in zip(self.tied_tensors[(stage, tie.key)], contribution):
                        p.grad.add_(g)

    def _tied_weights(self, stage: int, step: int) -> None:
        for tie in self.ties:
            if stage == tie.owner:
                weights = tuple(p.detach().clone() for p in self.tied_tensors[(stage, tie.key)])
                for reader in tie.readers:
                    self.produced[(stage, f"tied_weight:{tie.key}:{reader}", step)] = weights

    def _exec_send_tied_grad(self, stage: int, owner: int, key: str, step: int) -> None:
        self.transport.send((f"tied_grad:{key}", stage, owner), (owner, f"tied_grad:{key}:{stage}", step),
                            self.produced.pop((stage, f"tied_grad:{key}", step)))

    def _exec_recv_tied_grad(self, stage: int, reader: int, key: str, step: int) -> None:
        self.transport.recv((f"tied_grad:{key}", reader, stage), (stage, f"tied_grad:{key}:{reader}", step))

    def _exec_send_tied_weight(self, stage: int, reader: int, key: str, step: int) -> None:
        self.transport.send((f"tied_weight:{key}", stage, reader), (reader, f"tied_weight:{key}", step),
                            self.produced.pop((stage, f"tied_weight:{key}:{reader}", step)))

    def _exec_recv_tied_weight(self, stage: int, owner: int, key: str, step: int) -> None:
        self.transport.recv((f"tied_weight:{key}", owner, stage), (stage, f"tied_weight:{key}", step))

    def _apply_tied_weights(self) -> None:
        """Weights received this clock replace the readers' copies before the next clock."""
        if not self.ties:  # every clock commits: no inbox scan for models without ties
            return
        for key in [k for k in self.inbox if k[1].startswith("tied_weight:")]:
            stage, kind, _step = key
            with torch.no_grad():
                for p, w in zip(self.tied_tensors[(stage, kind.split(":", 1)[1])], self.inbox.pop(key)):
                    p.copy_(w)

    def _stage_rank(self, stage: int) -> int:
        return self.grid.stage_to_global(stage_id=stage // self.stages_per_rank)

    def _exec_petra_send_act(self, stage: int, micro_batch: int) -> None:
        self.transport.send(("act", stage, stage + 1), (stage + 1, "act", micro_batch),
                            self.produced.pop((stage, "act", micro_batch)))

    def _exec_petra_send_grad(self, stage: int, micro_batch: int, with_input: bool) -> None:
        dx, x_tilde = self.produced.pop((stage, "grad", micro_batch))
        self.transport.send(("grad", stage, stage - 1), (stage - 1, "grad", micro_batch),
                            (dx, x_tilde if with_input else None))

    def _exec_petra_recv_act(self, stage: int, micro_batch: int) -> None:
        self.transport.recv(("act", stage - 1, stage), (stage, "act", micro_batch))

    def _exec_petra_recv_grad(self, stage: int, micro_batch: int, with_input: bool) -> None:
        self.transport.recv(("grad", stage + 1, stage), (stage, "grad", micro_batch))

    def _exec_petra_post(self, phase: str) -> None:
        self.transport.post(f"the {phase} batch of clock {self.clock_now}")

    def _exec_petra_commit(self) -> None:
        self.inbox.update(self.transport.commit(f"the commit of clock {self.clock_now}"))
        self._apply_tied_weights()

    # --- evaluation ---

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None):
        """Forward-only pass of ``num_micro_batches`` (default k) micro-batches through all stages,
        with the current parameters and batch-norm running statistics. Micro-batches in flight in
        training are not touched. Returns the mean loss (the same on every rank); with
        ``return_logits`` also the last stage's outputs (``None`` on other ranks)."""
        n = self.micro_batches if num_micro_batches is None else num_micro_batches
        J = self.num_petra_stages
        was_training = self.module.training
        self.module.eval()
        losses, logits = [], []
        inbox: dict[tuple[int, int], tuple] = {}
        try:
            with torch.no_grad():
                for clock in range(n + J - 1):
                    sends, recvs, arrivals = [], [], {}
                    for j in self.local_stage_ids:
                        m = clock - j
                        if not 0 <= m < n:
                            continue
                        st = self.stages[j]
                        if j == 0:
                            batch = next(data_iter)
                            if self.batch_fn is not None:
                                batch = self.batch_fn(batch)
                            x, labels = self._to_device(batch[0]), self._to_device(batch[1])
                        else:
                            x, labels = inbox.pop((j, m))
                        out = st.run(x)
                        if st.is_last:
                            if compute_loss:
                                losses.append(st.loss_fn(out, labels).detach().float())
                            if return_logits:
                                logits.append(out)
                        elif j + 1 in self.stages:
                            arrivals[(j + 1, m)] = (out, labels)
                        else:
                            sends.append((("eval", j, j + 1), (out, labels)))
                    for j in self.local_stage_ids:
                        m = clock + 1 - j
                        if j > 0 and 0 <= m < n and j - 1 not in self.stages:
                            recvs.append((("eval", j - 1, j), (j, m)))
                    inbox.update(arrivals)
                    inbox.update(self.transport.exchange(sends, recvs, f"evaluation clock {clock}"))
        finally:
            self.module.train(was_training)
        loss = self._reduce_loss(losses) if (compute_loss and bcast_loss) else (
            torch.stack(losses).mean() if losses else None)
        self.transport.save_trace()
        if return_logits:
            return loss, (logits if self.is_last_stage() else None)
        return loss

    # --- checkpoints ---

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Write layer weights in DeepSpeed's layout and every rank's in-flight PETRA state, atomically.

        Called by every rank between ``train_batch`` calls; no micro-batch needs to be drained."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        if self.transport.in_flight or self.produced or self._loaded:
            raise RuntimeError("save_checkpoint() must be called between train_batch() calls")
        if self.global_rank == 0:
            checkpoint.prepare(save_dir, tag)
        self.transport.barrier("save_checkpoint: the directory is prepared")
        path = checkpoint.partial_dir(save_dir, tag)
        self.module.save_state_dict(path, checkpoint_engine=self.checkpoint_engine,
                                    exclude_frozen_params=exclude_frozen_parameters)
        checkpoint.atomic_save(self._petra_state(client_state),
                               checkpoint.state_file(path, self.stage_id, self.grid.data_parallel_id))
        self.transport.barrier("save_checkpoint: every rank wrote its files")
        final = os.path.join(save_dir, tag)
        if self.global_rank == 0:
            final = checkpoint.commit(save_dir, tag, save_latest)
        self.transport.barrier("save_checkpoint: committed")
        self.transport.save_trace()
        return final

    def _petra_state(self, client_state: dict | None) -> dict:
        return {
            "format": 1,
            "layout": self._layout_signature(),
            "clock": self.timeline.clock,
            "feed": self.timeline.feed.intervals,
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "stage_steps": dict(self.stage_steps),
            "optimizers": [None if opt is None else opt.state_dict() for opt in self.stage_optimizers],
            "schedulers": [s.state_dict() if s is not None else None for s in self.stage_schedulers],
            "stages": {j: st.state_dict() for j, st in self.stages.items()},
            "inbox": self.inbox,
            "reader_tied_modules": {f"{j}:{tie.key}": self._reader_module(j, tie).state_dict()
                                    for tie in self.ties for j in tie.readers if j in self.stages},
            "client_state": client_state or {},
        }

    def _layout_signature(self) -> dict:
        return {"pipe": self.num_stages, "data": self.grid.data_parallel_size,
                "stages_per_rank": self.stages_per_rank, "k": self.micro_batches,
                "petra": {k: v for k, v in asdict(self.petra_config).items() if k not in DIAGNOSTIC_KEYS}}

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, **_: Any) -> tuple[str | None, dict]:
        """Load what :meth:`save_checkpoint` wrote; training continues exactly where it stopped.
        Returns ``(path, client_state)`` like DeepSpeed."""
        tag, path = checkpoint.resolve(load_dir, None if tag is None else str(tag))
        self.module.load_state_dir(load_dir=path, checkpoint_engine=self.checkpoint_engine,
                                   strict=load_module_strict)
        if load_module_only:
            return path, {}
        state_path = checkpoint.state_file(path, self.stage_id, self.grid.data_parallel_id)
        state = torch.load(state_path, map_location=self.device, weights_only=False)
        if state["layout"] != self._layout_signature():
            raise ValueError(f"checkpoint {path} was written with {state['layout']}, this run has "
                             f"{self._layout_signature()}; resume with the same layout and petra config")
        self.timeline = Timeline(self.num_petra_stages, state["clock"], FeedLog(tuple(map(tuple, state["feed"]))))
        self.global_steps = state["global_steps"]
        self.global_samples = state["global_samples"]
        self.stage_steps = dict(state["stage_steps"])
        if load_optimizer_states:
            for opt, sd in zip(self.stage_optimizers, state["optimizers"]):
                if opt is not None:
                    opt.load_state_dict(sd)
        if load_lr_scheduler_states:
            for sched, sd in zip(self.stage_schedulers, state["schedulers"]):
                if sched is not None and sd is not None:
                    sched.load_state_dict(sd)
        for j, st in self.stages.items():
            st.load_state_dict(state["stages"][j])
        self.inbox = dict(state["inbox"])
        for tie in self.ties:  # DeepSpeed's layer files hold the owner's weights, not a reader's copy
            for j in tie.readers:
                if j in self.stages:
                    self._reader_module(j, tie).load_state_dict(state["reader_tied_modules"][f"{j}:{tie.key}"])
        return path, state["client_state"]

    def _reader_module(self, stage: int, tie: Tie) -> torch.nn.Module:
        ids = {id(p) for p in self.tied_tensors[(stage, tie.key)]}
        return next(m for m in self.stages[stage].modules if any(id(p) in ids for p in m.parameters()))

    # --- introspection ---

    def memory_report(self) -> dict[int, dict[str, int]]:
        """Per local stage, bytes held now: parameters, gradients, optimizer state, input buffer (now and
        peak), parameter buffer (now and peak), stage 0's raw micro-batches, messages held, the delay
        compensation's state (weight prediction's averaged update)."""
        report = {}
        for j, st in self.stages.items():
            optimizer = self.stage_optimizers[j - self.local_stage_ids[0]]
            state = {} if optimizer is None else optimizer.state
            opt_bytes = sum(tensor_bytes(list(s.values())) for s in state.values())
            held = [v for key, v in list(self.inbox.items()) + list(self.produced.items()) if key[0] == j]
            report[j] = {
                "params": tensor_bytes(st.params),
                "grads": tensor_bytes([p.grad for p in st.params if p.grad is not None]),
                "optimizer_state": opt_bytes,
                "input_buffer": st.input_buffer_bytes(),
                "input_buffer_peak": st.peak_input_bytes,
                "input_buffer_micro_batches": len(st.fifo),
                "param_buffer": st.param_buffer_bytes(),
                "param_buffer_peak": st.peak_param_buffer_bytes,
                "raw_micro_batches": tensor_bytes(list(st.raw.values())),
                "messages": tensor_bytes(held),
                "delay_compensation": tensor_bytes(st.compensation.state_dict()),
            }
        return report

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        LoadMicroBatch: _exec_petra_load,
        ForwardPass: _exec_petra_forward,
        ReverseReconstruct: _exec_petra_reconstruct,
        DelayedBackward: _exec_petra_backward,
        AccumulateAndStep: _exec_accumulate_and_step,
        SendActivation: _exec_petra_send_act,
        RecvActivation: _exec_petra_recv_act,
        SendGrad: _exec_petra_send_grad,
        RecvGrad: _exec_petra_recv_grad,
        SendTiedGrad: _exec_send_tied_grad,
        RecvTiedGrad: _exec_recv_tied_grad,
        SendTiedWeight: _exec_send_tied_weight,
        RecvTiedWeight: _exec_recv_tied_weight,
        PostP2P: _exec_petra_post,
        CommitP2P: _exec_petra_commit,
    }
