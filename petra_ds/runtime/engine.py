"""PetraEngine: DeepSpeed's PipelineEngine running the PETRA schedule.

The engine executes instructions and holds what is in flight between them; everything else plugs in
(ARCHITECTURE.md). As DeepSpeed's DualPipeV engine does, a ``PipeSchedule`` subclass
(``schedule/schedules.py``) produces the instructions, for training and for ``eval_batch``, and this
subclass sets ``_INSTRUCTION_MAP``: one handler per PETRA instruction, reading each instruction's channel
and key from the instruction itself. Each stage steps its own optimizer after its k-th backward, reducing
its gradients (and batch-norm running statistics) inside its data-parallel group only.
"""

from __future__ import annotations

import math
import operator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Iterator

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch import Tensor

from ..nn.batchnorm import BatchNormPolicy
from ..nn.rng import RowBlocks
from ..pipeline.module import layer_module, stage_layers, stage_reversible, stages_per_rank_of
from ..pipeline.ties import TiedWeights
from ..schedule import (AccumulateAndStep, ClockTemplates, CommitP2P, DelayedBackward, EvalForward, EvalSchedule,
                        FedMicroBatches, ForwardPass, LoadMicroBatch, PetraSchedule, PostP2P, RecvActivation, RecvGrad,
                        RecvTiedGrad, RecvTiedWeight, ReverseReconstruct, SendActivation, SendGrad, SendTiedGrad,
                        SendTiedWeight, Timeline, Window, channels)
from . import checkpoint
from .config import PetraConfig, Precision, check_stages_per_rank  # Precision: split_config's
from .fifo import StreamCopies
from .ledger import memory_report
from .local_stages import LocalStages
from .observe import INSTRUCTION_LABEL, Callbacks, Holdings, Observer, hook_table
from .offload_plan import OffloadPlanner, link_bytes_per_s
from .optimizers import StageOptimizers, StageSchedulers, single_or_combined, stage_optimizers, stage_schedulers
from .replicas import row_blocks
from .stage import StageOptions
from .transport import Inbox, Transport

if TYPE_CHECKING:
    from .background_save import BackgroundSave, HostStaging


class PetraEngine(PipelineEngine):
    """Runs PETRA on a ``PipelineModule``; created by :func:`petra_ds.initialize`."""

    def __init__(self, *args, petra_config: PetraConfig, precision: Precision = Precision(), **kwargs) -> None:
        self.petra_config, self.precision = petra_config, precision
        super().__init__(*args, **kwargs)
        if not hasattr(self, "ties"):  # no optimizer configured: _configure_optimizer did not run
            self.ties = TiedWeights(self.module, self._local_range())
            self.stage_optimizers = self.stage_schedulers = [None] * len(self._local_range())
        module = self.module
        self._all_modules = tuple(module.modules())
        self.stages_per_rank = stages_per_rank_of(module)
        check_stages_per_rank(petra_config, self.stages_per_rank)
        #: P and J: DeepSpeed's ``num_stages`` / ``stage_id`` count pipeline ranks; PETRA's stages are J = P x S
        self.pipeline_ranks = self.num_stages
        self.num_petra_stages = self.pipeline_ranks * self.stages_per_rank
        self.local_stage_ids = self._local_range()
        self.reversible = stage_reversible(module)
        options = StageOptions(
            gradient_accumulation_steps=self.micro_batches, seed=petra_config.seed,
            rows=RowBlocks(self.grid.data_parallel_id), input_buffer=petra_config.input_buffer,
            param_buffer=petra_config.param_buffer, bn_policy=BatchNormPolicy(petra_config.bn_running_stats),
            autocast_dtype=precision.autocast, device_type=self.device.type,
            check_reversible=petra_config.check_reversible, reconstruct_overlap=petra_config.reconstruct_overlap,
            compile=petra_config.compile, cuda_graphs=petra_config.cuda_graphs, fifo_offload=petra_config.fifo_offload)
        #: keyed random draws go by row blocks of the global micro-batch: this run's first degree's replicas
        self.row_blocks, self._options = self.grid.data_parallel_size, options
        replicas = self.grid.data_parallel_size > 1
        #: this rank's stages by index, with their step units (``runtime/step.py``), ties and NaN watch
        self.stages = LocalStages(
            module, self.local_stage_ids, self.num_petra_stages, options, petra_config, self.ties,
            self.stage_optimizers, self.stage_schedulers, reversible=self.reversible, loss_scale=precision.loss_scale,
            clipping=self.gradient_clipping(), clock=lambda: self._running_clock, device=self.device,
            average=self._average_over_replicas if replicas else None, take=self._take_message, notify=self._notify)
        #: (stage, step) of the updates skipped for non-finite gradients, as the windows' reads found them
        self.skipped_steps: list[tuple[int, int]] = self.stages.skipped_steps
        self.timeline = Timeline(self.num_petra_stages)
        self._clock_templates = ClockTemplates()  # this rank's steady clocks, derived once per phase
        #: messages received for the next clock, by ``channels.Key`` (the receiving stage first); with
        #: ``message_offload`` those between this rank's stages wait in host memory
        self.inbox = Inbox(StreamCopies() if petra_config.message_offload == "cpu" else None, self.stages.finite.flush)
        self._outbox: dict[int, dict[channels.Key, tuple]] = {j: {} for j in self.local_stage_ids}
        self._running_clock, self._window_losses, self._data, self._window_loss = 0, [], None, math.nan
        #: every message and collective of this rank (``PETRA_DS_COMM_TRACE=<dir>`` records them)
        self.transport = Transport(rank=self.global_rank, device=self.device, local_stages=self.local_stage_ids,
                                   stage_rank=self.stage_rank, clock=lambda: self._running_clock)
        self._eval: dict[str, Any] | None = None  # an eval_batch call's options and results
        self._callbacks = Callbacks()
        #: what watches the clocks (``observe``); the gradient-quality study is one of them when enabled
        self._observers: tuple[Observer, ...] = (self._callbacks,)
        self._hooks = hook_table(self._observers)
        if petra_config.fifo_offload == "auto" and self.device.type == "cuda":
            self.observe(OffloadPlanner(self, link_bytes_per_s(self.device)))
        self.gradient_quality: Observer | None = None
        #: a checkpoint being written in the background (``"async_save"``) until it is committed, and the host
        #: memory such saves copy into, reused from one save to the next (both ``checkpoint.py``'s)
        self.pending_save: BackgroundSave | None = None
        self.host_staging: HostStaging | None = None
        self._configure_python_gc()

    # --- observers ---

    def observe(self, observer: Observer) -> Observer:
        """Call ``observer``'s hooks from now on (see :mod:`petra_ds.runtime.observe`); returns it."""
        self._observers += (observer,)
        self._hooks = hook_table(self._observers)
        return observer

    def unobserve(self, observer: Observer) -> None:
        """Stop calling ``observer``'s hooks."""
        self._observers = tuple(o for o in self._observers if o is not observer)
        self._hooks = hook_table(self._observers)

    @property
    def observers(self) -> tuple[Observer, ...]:
        """The registered observers, in the order their hooks run (``observe`` / ``unobserve`` change it)."""
        return self._observers

    @property
    def step_observers(self) -> list:
        """``f(stage_index, stage)`` after the data-parallel reduction, before each optimizer step."""
        return self._callbacks.steps

    @property
    def clock_observers(self) -> list:
        """``f(engine, clock)`` at the end of every clock."""
        return self._callbacks.clocks

    def _notify(self, hook: str, *args: Any) -> None:
        for method in self._hooks[hook]:
            method(self, *args)

    def holdings(self, stage: int) -> Holdings:
        """What ``stage`` keeps alive now beyond its model and optimizer (a read-only view)."""
        own = self.stages[stage].held()
        inbox = [(key.kind == channels.DATA, v) for key, v in self.inbox.on_device() if key.stage == stage]
        loaded = tuple(v for data, v in inbox if data)  # stage 0's micro-batches read, not yet run
        mine = tuple(v for data, v in inbox if not data) + tuple(self._outbox[stage].values())
        return Holdings(data=(*own["data"], *loaded), inputs=own["inputs"], outputs=own["outputs"],
                        param_stash=own["param_stash"], messages=(*mine, *own["messages"]),
                        offloaded=own["offloaded"], graphs=own["graphs"],
                        messages_host=tuple(v for key, v in self.inbox.on_host() if key.stage == stage))

    # --- optimizers and schedulers, one per local stage (DeepSpeed's constructor calls these) ---

    def _local_range(self) -> range:
        spr, rank = stages_per_rank_of(self.module), self.module.mpu().get_stage_id()
        return range(rank * spr, (rank + 1) * spr)

    def _configure_optimizer(self, client_optimizer, model_parameters) -> None:
        self.ties = TiedWeights(self.module, self._local_range())
        stage_params = {}
        for j in self._local_range():
            modules = [layer_module(layer) for layer in stage_layers(self.module, j)]
            ids = {id(p) for m in modules if m is not None for p in m.parameters()}
            stage_params[j] = ids - self.ties.reader_ids(j)
        self.stage_optimizers = stage_optimizers(client_optimizer, model_parameters, self.module, stage_params,
                                                 self.ties.copy_of, self._configure_basic_optimizer)
        combined = single_or_combined(self.stage_optimizers, StageOptimizers)
        self.basic_optimizer = self.optimizer = combined or StageOptimizers([])

    def _configure_lr_scheduler(self) -> None:
        self.stage_schedulers = stage_schedulers(self.client_lr_scheduler, self.stage_optimizers,
                                                 self._scheduler_from_config)
        self.lr_scheduler = single_or_combined(self.stage_schedulers, StageSchedulers)

    # --- public API ---

    def train_batch(self, data_iter: Iterator | None = None) -> Tensor:
        """Advance k clocks feeding k micro-batches; no flush (the first ``synchronous_steps`` calls drain). Returns
        the mean loss of the micro-batches whose loss was computed in these clocks (NaN while the pipeline fills),
        the same value on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self._data = data_iter
        elif self._data is None and self.training_dataloader is not None:
            self._data = iter(self.training_dataloader)
        if self._data is None and 0 in self.stages:
            raise ValueError("train_batch() needs a data iterator (or training_data in initialize)")
        self._train_mode()
        synchronous = self.global_steps < self.petra_config.synchronous_steps  # then each stage's step is too
        loss = self._run_window(self.timeline.train_window(self.micro_batches, synchronous=synchronous))
        checkpoint.after_train_batch(self)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.agg_train_loss = loss
        if self.global_rank == 0 and self.monitor.enabled and not math.isnan(self._window_loss):
            self.monitor.write_events([("Train/Samples/train_loss", self._window_loss, self.global_samples)])
        return loss

    def drain(self) -> Tensor:
        """Run clocks without new data until every fed micro-batch had its backward everywhere.
        Returns the mean loss of the micro-batches finished during the drain (NaN if none)."""
        self._train_mode()
        return self._run_window(self.timeline.drain_window())

    def _train_mode(self) -> None:
        """``module.train()``, as DeepSpeed's ``train_batch`` calls it, when a module is in eval mode (it sets every flag
        by ``nn.Module.__setattr__``); the modules are those the engine was built with, not the tree walked anew."""
        if not all(map(operator.attrgetter("training"), self._all_modules)):
            self.module.train()

    @property
    def clock(self) -> int:
        """The next clock to run (the clock a ``train_batch`` call opens with); the one running is private."""
        return self.timeline.clock

    def stage_rank(self, stage: int) -> int:
        """The global rank hosting PETRA stage ``stage`` in this rank's data-parallel replica."""
        return self.grid.stage_to_global(stage_id=stage // self.stages_per_rank)

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        """Forward-only pass of ``num_micro_batches`` (default k) micro-batches through all stages (the
        schedule's ``EvalSchedule``), with the current parameters and batch-norm running statistics.
        Micro-batches in flight in training are not touched. Returns the mean loss (the same on every
        rank); with ``return_logits`` also the last stage's outputs (``None`` on other ranks). ``reduce_output``:
        ``"avg"``, or None for each micro-batch's loss in a list (on the last stage; ``None`` on the others), as
        DeepSpeed's ``PipelineEngine`` gives them."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' (the mean loss, on every rank) "
                             "or None (each micro-batch's loss, on the last stage)")
        n = self.micro_batches if num_micro_batches is None else num_micro_batches
        was_training, data, clock = self.module.training, self._data, self._running_clock
        self.module.eval()
        self._eval = {"compute_loss": compute_loss, "return_logits": return_logits, "losses": [], "logits": []}
        self._data = data_iter
        try:
            with torch.no_grad():
                self._exec(EvalSchedule(n, self.pipeline_ranks, self.stage_id, self.stages_per_rank))
            losses, logits = self._eval["losses"], self._eval["logits"]
        finally:
            self.module.train(was_training)
            self._data, self._eval, self._running_clock = data, None, clock
        if reduce_output is None:
            loss = losses if compute_loss and self.is_last_stage() else None
        else:
            loss = self._reduce_loss(losses) if (compute_loss and bcast_loss) else (
                torch.stack(losses).mean() if losses else None)
        self.transport.save_trace()
        if return_logits:
            return loss, (logits if self.is_last_stage() else None)
        return loss

    # --- the executor ---

    def _run_window(self, window: Window) -> Tensor:
        self._window_losses = []
        self._notify("window_start", window)
        with self.stages.window():
            self._exec(PetraSchedule.for_window(
                window, self.pipeline_ranks, self.stage_id, stages_per_rank=self.stages_per_rank,
                gradient_accumulation_steps=self.micro_batches, reversible=self.reversible,
                input_buffer=self.petra_config.input_buffer, ties=self.stages.tie_specs(),
                templates=self._clock_templates))
        loss = self._reduce_loss(self._window_losses)
        self._read_window(loss)
        self.timeline.advance(window)
        self._notify("window_end", window)
        self.transport.save_trace()
        return loss

    def _read_window(self, loss: Tensor) -> None:
        """The window's one host transfer: the loss (kept for the monitor) and every non-finite check of the
        window; raises for the first non-finite value (``non_finite: "raise"``) or logs it."""
        checks = self.stages.checks()
        values = (loss.reshape(1) if checks is None else torch.cat([loss.reshape(1).float(), checks])).tolist()
        self._window_loss = values[0]
        self.stages.report(None if checks is None else values[1:])

    def _exec(self, schedule: PetraSchedule | EvalSchedule) -> None:
        """DeepSpeed's instruction loop, one clock per step."""
        training = isinstance(schedule, PetraSchedule)
        start = schedule.start_clock if training else 0
        for clock, cmds in enumerate(schedule, start=start):
            with self.stages.clock():  # each weight cast to bf16 once a clock
                self._run_clock(clock, cmds, training)

    def _run_clock(self, clock: int, cmds: list, training: bool) -> None:
        """A training clock tells the observers where its forwards end (``Clock.forwards_end``) and that it ended."""
        self._running_clock, handlers = clock, self._INSTRUCTION_MAP
        if not handlers.keys() >= set(map(type, cmds)):
            unknown = next(cmd for cmd in cmds if type(cmd) not in handlers)
            raise RuntimeError(f"{type(self).__name__} does not understand instruction {unknown!r}")
        middle = cmds.forwards_end if training else len(cmds)
        self._run_instructions(cmds, 0, middle)
        if training:
            self._notify("forwards_done", clock)
            self._run_instructions(cmds, middle, len(cmds))
            self.stages.end_clock()
            self._notify("clock_end", clock)

    def _run_instructions(self, cmds: list, start: int, end: int) -> None:
        """Instructions ``start`` to ``end`` of a clock; the per-instruction work of a prefetch, an observer or a
        trace only where there is one (the usual clock has none: about 16 bytecodes an instruction, not 40)."""
        handlers, watched = self._INSTRUCTION_MAP, self._hooks["before_instruction"] or self._hooks["after_instruction"]
        parks, labelled = self.inbox.copies is not None, torch.autograd._profiler_enabled()
        if not (parks or watched or labelled):
            for cmd in cmds[start:end]:
                handlers[type(cmd)](self, cmd)
            return
        for i in range(start, end):
            cmd = cmds[i]
            if parks:
                self.inbox.prefetch_next(cmds, i)
            if watched:
                self._notify("before_instruction", cmd)
            # a trace shows each instruction as one labelled range
            with torch.profiler.record_function(f"{INSTRUCTION_LABEL}{cmd!r}") if labelled else nullcontext():
                handlers[type(cmd)](self, cmd)
            if watched:
                self._notify("after_instruction", cmd)

    def _reduce_loss(self, losses: list[Tensor]) -> Tensor:
        """Mean over the finished micro-batches, averaged over data parallelism and broadcast from the
        last stage: a collective at the window's end, where every rank is."""
        nan = torch.tensor(float("nan"), dtype=torch.float32)
        value = (torch.stack([loss.float() for loss in losses]).mean() if losses else nan).reshape(1).to(self.device)
        if self.is_last_stage() and self.grid.data_parallel_size > 1:
            self.transport.all_reduce(value, self.grid.get_data_parallel_group(),
                                      "the loss reduction over data-parallel replicas")
            value /= self.grid.data_parallel_size
        if self.pipeline_ranks > 1:
            self.transport.broadcast(value, self.grid.stage_to_global(stage_id=self.pipeline_ranks - 1),
                                     self.grid.get_pipe_parallel_group(), "the loss broadcast at the end of the window")
        return value[0]

    # --- instructions: compute (one handler per class of ``schedule.instructions``) ---

    def _exec_load(self, cmd: LoadMicroBatch) -> None:
        m = cmd.micro_batch
        if self._eval is not None:
            ran_out = (f"the evaluation data ran out at micro-batch {m}; give eval_batch at least "
                       "num_micro_batches micro-batches")
        else:
            ran_out = (f"the data iterator ran out at micro-batch {m} (clock {self._running_clock}) inside a "
                       f"train_batch call of {self.micro_batches} clocks; give it k micro-batches per call "
                       "(e.g. deepspeed.utils.RepeatingLoader) or call drain() to finish")
        # training exchanges shapes once; evaluation renegotiates every call
        self.inbox[cmd.produces] = self.transport.load(self._data, self.batch_fn, m, ran_out,
                                                       fixed_layout=self._eval is None)

    def _exec_forward(self, cmd: ForwardPass) -> None:
        stage, m, st = cmd.stage, cmd.micro_batch, self.stages[cmd.stage]
        x, labels = self.inbox.pop(cmd.consumes)
        out = st.forward(m, x, labels)
        self._notify("after_forward", stage, m, x, labels)
        if cmd.produces is None:
            self._window_losses.append(out)
        else:
            self._outbox[stage][cmd.produces] = (out, labels)

    def _exec_eval_forward(self, cmd: EvalForward) -> None:
        st, ev = self.stages[cmd.stage], self._eval
        x, labels = self.inbox.pop(cmd.consumes)
        out = st.run(x)
        if cmd.produces is not None:
            self._outbox[cmd.stage][cmd.produces] = (out, labels)
            return
        if ev["compute_loss"]:
            ev["losses"].append(st.loss_fn(out, labels).detach().float())
        if ev["return_logits"]:
            ev["logits"].append(out)

    def _exec_reconstruct(self, cmd: ReverseReconstruct) -> None:
        delta, x_tilde = self.inbox.pop(cmd.consumes)
        self.stages[cmd.stage].reconstruct(cmd.micro_batch, x_tilde, delta)

    def _exec_backward(self, cmd: DelayedBackward) -> None:
        stage, m, st = cmd.stage, cmd.micro_batch, self.stages[cmd.stage]
        delta = None if cmd.consumes is None else self.inbox.pop(cmd.consumes)[0]
        rebuilt = st.reconstruction  # a reconstructing stage was handed delta with its reconstruction
        self._notify("before_backward", stage, m, delta if rebuilt is None else rebuilt.delta)
        dx, x_tilde = st.backward(m, delta)
        self._notify("after_backward", stage, m, x_tilde)
        if cmd.produces is not None:
            self._outbox[stage][cmd.produces] = (dx, x_tilde)

    def _exec_step(self, cmd: AccumulateAndStep) -> None:
        self._outbox[cmd.stage].update(self.stages.step(cmd.stage, cmd.step))

    def _average_over_replicas(self, tensors: list[Tensor], what: str) -> None:
        self.transport.average_over_replicas(tensors, self.grid.get_data_parallel_group(), what)

    def _take_message(self, key: channels.Key) -> tuple | None:
        return self.inbox.pop(key, None)

    @property
    def stage_steps(self) -> dict[int, int]:
        """Optimizer steps each local stage took (skipped ones included)."""
        return self.stages.step_counts

    # --- instructions: messages (each names its channel and key; transport.py moves them) ---

    def _exec_send(self, cmd: SendActivation | SendGrad | SendTiedGrad | SendTiedWeight) -> None:
        key, channel = cmd.key(), cmd.channel()
        payload = cmd.payload(self._outbox[cmd.stage].pop(key))
        self.transport.send(channel, key, self.inbox.park(key, payload, channel[2] in self.local_stage_ids))

    def _exec_recv(self, cmd: RecvActivation | RecvGrad | RecvTiedGrad | RecvTiedWeight) -> None:
        self.transport.recv(cmd.channel(), cmd.key())

    def _exec_post(self, cmd: PostP2P) -> None:
        self.transport.post(f"the {cmd.batch} batch of clock {self._running_clock}",
                            fresh_layouts=cmd.batch == channels.EVAL)

    def _exec_commit(self, cmd: CommitP2P) -> None:
        received = self.transport.commit(f"the commit of clock {self._running_clock}")
        self.inbox.update(self.stages.receive(received))

    # --- checkpoints (petra_ds.runtime.checkpoint) ---

    @property
    def mid_clock(self) -> bool:
        """Whether a clock's work is half done (messages in flight or produced, data loaded)."""
        return self.transport.in_flight or any(self._outbox.values()) or any(
            key.kind == channels.DATA for key in self.inbox)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Write layer weights in DeepSpeed's layout and every rank's in-flight PETRA state, atomically.

        Called by every rank between ``train_batch`` calls; no micro-batch needs to be drained."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        return checkpoint.save_engine(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def wait_for_checkpoint(self) -> None:
        """Called by every rank: wait until a checkpoint written in the background (``"async_save"``) is on disk
        and committed (``latest`` names it). ``save_checkpoint`` and ``load_checkpoint`` call it first; call it
        before the processes exit."""
        checkpoint.wait(self)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, **_: Any) -> tuple[str | None, dict]:
        """Load what :meth:`save_checkpoint` wrote; training continues exactly where it stopped.
        Returns ``(path, client_state)`` like DeepSpeed."""
        self.wait_for_checkpoint()
        return checkpoint.load_engine(self, load_dir, None if tag is None else str(tag), load_module_strict,
                                      load_optimizer_states, load_lr_scheduler_states, load_module_only)

    def petra_state(self) -> dict[str, Any]:
        """What is in flight between two ``train_batch`` calls (``checkpoint.py`` writes it): where the run is,
        how many row blocks its random draws are keyed by (its first data-parallel degree), and under ``"stages"``
        each local stage's own state by index (its optimizer and scheduler, and the messages it received for the
        next clock, included), which loads wherever that stage lives next."""
        return {"clock": self.timeline.clock, "feed": self.timeline.feed.intervals,
                "global_steps": self.global_steps, "global_samples": self.global_samples,
                "row_blocks": self.row_blocks,
                "stages": {j: self._stage_state(i, j) for i, j in enumerate(self.local_stage_ids)}}

    def _stage_state(self, i: int, j: int) -> dict[str, Any]:
        optimizer, scheduler = self.stage_optimizers[i], self.stage_schedulers[i]
        return {**self.stages.stage_state(j), "optimizer": None if optimizer is None else optimizer.state_dict(),
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "inbox": {tuple(key): value for key, value in self.inbox.items() if key.stage == j}}

    def load_petra_state(self, state: dict[str, Any], optimizer_states: bool = True,
                         scheduler_states: bool = True) -> None:
        """Continue from :meth:`petra_state` (the optimizers' and schedulers' states when asked); ``"stages"``
        must hold this rank's stages, whoever wrote them."""
        fed = FedMicroBatches(tuple(map(tuple, state["feed"])))
        self.timeline = Timeline(self.num_petra_stages, state["clock"], fed)
        self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
        self.row_blocks = state.get("row_blocks", self.grid.data_parallel_size)
        self._options.rows = row_blocks(self.grid.data_parallel_id, self.row_blocks, self.grid.data_parallel_size)
        self.inbox.clear()
        for i, j in enumerate(self.local_stage_ids):
            own = state["stages"][j]
            for obj, sd, wanted in ((self.stage_optimizers[i], own["optimizer"], optimizer_states),
                                    (self.stage_schedulers[i], own["scheduler"], scheduler_states)):
                if wanted and obj is not None and sd is not None:
                    obj.load_state_dict(sd)
            self.stages.load_stage_state(j, own)
            for key, value in own["inbox"].items():
                self.inbox[channels.Key(*key)] = self.inbox.park(channels.Key(*key), value)

    # --- introspection ---

    def memory_report(self) -> dict[int, dict[str, int]]:
        """Per local stage, bytes held now (see :func:`petra_ds.runtime.ledger.memory_report`)."""
        return memory_report(self)

    #: one handler per PETRA instruction, and nothing else. DualPipeV merges DeepSpeed's map into its own
    #: because its schedule still runs DeepSpeed's instructions; a PETRA schedule produces only
    #: ``schedule.INSTRUCTIONS``, so DeepSpeed's handlers (written for 1F1B's buffers) stay out of reach.
    _INSTRUCTION_MAP = {
        LoadMicroBatch: _exec_load, ForwardPass: _exec_forward, EvalForward: _exec_eval_forward,
        ReverseReconstruct: _exec_reconstruct, DelayedBackward: _exec_backward, AccumulateAndStep: _exec_step,
        SendActivation: _exec_send, SendGrad: _exec_send, SendTiedGrad: _exec_send, SendTiedWeight: _exec_send,
        RecvActivation: _exec_recv, RecvGrad: _exec_recv, RecvTiedGrad: _exec_recv, RecvTiedWeight: _exec_recv,
        PostP2P: _exec_post, CommitP2P: _exec_commit,
    }
