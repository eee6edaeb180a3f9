"""One PETRA stage's math, independent of transport, so that one process can host several stages.

A stage is a run of layers F_j. Per micro-batch m it does a forward (nothing kept if it is
reversible) and, clocks later, a backward with its parameters as they are *then*:

- the last stage computes the loss in its forward and backpropagates it in the same clock;
- a reversible stage rebuilds x~_{j-1} from x~_j, building the graph on the way, then runs the VJPs
  (with ``reconstruct_overlap``, block by block, overlapping on CUDA: ``nn.reversible.reconstruct_and_backward``);
- any other stage recomputes F_j with grad from its exact input: the FIFO for a non-reversible
  stage (``runtime/fifo.py``: on the device, or in host memory with ``fifo_offload``), the raw micro-batch
  (data, not an activation buffer) for stage 0, kept the same way.

``Delta_j`` accumulates into the parameters' ``.grad``; the loss is divided by k at the last stage so
that after k backwards ``.grad`` is the mean over the k micro-batches, as DeepSpeed does (under fp16, times the
stage's loss scale, which its step removes: ``runtime/loss_scale.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..nn.accumulate import backprop
from ..nn.batchnorm import BatchNormPolicy, batch_norms, norms_running_stats
from ..nn.casts import weights_written
from ..nn.check import check_reversible
from ..nn.draws import may_draw
from ..nn.reversible import (Activation, GraphTape, SequentialTape, as_tuple, assign_rng_keys, detach_leaf,
                             is_reversible, reconstruct, reconstruct_and_backward, shaped_like)
from ..nn.rng import RowBlocks
from ..pipeline.module import layer_module
from ..schedule import reconstructs
from ..util.grad_mode import enable_grad, no_grad
from .compensation import NoCompensation
from .compiled import compile_layers
from .fifo import InputFifo, StreamCopies, saved_entries
from .finite import FiniteWatch
from .grad_buffer import StageGrads
from .graphed import graph_layers
from .ledger import tensor_bytes
from .loss_scale import NoLossScale, StageLossScale
from .scope import NO_SCOPE, StageScope


@dataclass
class StageOptions:
    """Per-stage policies shared by all stages of an engine."""

    gradient_accumulation_steps: int = 1
    seed: int = 0
    #: the data-parallel replica's row blocks (``nn.rng.RowBlocks``; its index in a run's first degree): the keyed
    #: RNG's key, so replicas draw different dropout masks and each replica's reconstruction replays its own
    rows: RowBlocks = RowBlocks(0)
    input_buffer: str = "non_reversible"  # "all": every stage keeps its exact inputs; "first_N": stages 1 .. N
    param_buffer: bool = False  # weight stashing: the backward uses the forward's parameters
    bn_policy: BatchNormPolicy = BatchNormPolicy()
    autocast_dtype: torch.dtype | None = None  # e.g. torch.bfloat16; streams stay in their dtype
    device_type: str = "cpu"
    #: diagnostic: keep a copy of each reconstructing stage's true input to measure x~ against it
    #: (this is the buffer PETRA saves; never on in training runs)
    track_reconstruction: bool = False
    #: check the layers declared reversible on the stage's first input
    check_reversible: bool = False
    #: a reconstructing stage goes block by block from its last block (reconstruct it, backpropagate through
    #: it) instead of reconstructing all blocks first; on CUDA block i-1's reconstruction runs on a second
    #: stream while block i's gradients are computed (PaReprop). Same bits; at most two blocks' graphs
    #: alive instead of the stage's
    reconstruct_overlap: bool = False
    #: the stage's layers run through ``torch.compile`` (``petra_ds.runtime.compiled``): False, True (inductor) or
    #: a backend's name
    compile: bool | str = False
    #: where a stage's FIFO entries wait for their backward: "none" (on the device) or "cpu" (host memory but the
    #: head, ``petra_ds.runtime.fifo``)
    fifo_offload: str = "none"
    #: the same parts replay CUDA graphs (``petra_ds.runtime.graphed``): False, True or "emulate"
    cuda_graphs: bool | str = False


@dataclass
class Reconstruction:
    """A reconstructing stage between its ``ReverseReconstruct`` and its ``DelayedBackward`` (one clock):
    the micro-batch, the gradient delta_{j+1} that came with x~_j, and the rebuilt input x~_{j-1} with
    its graph, or, with ``reconstruct_overlap``, x~_j itself (``tape`` None: the backward rebuilds block
    by block)."""

    micro_batch: int
    delta: Activation
    x: Activation
    tape: SequentialTape | None


class Stage:
    """Stage ``index`` of ``petra_stages``: its layers, what it keeps between forward and backward."""

    def __init__(
        self,
        index: int,
        petra_stages: int,
        layers: Sequence[Callable],
        options: StageOptions,
        loss_fn: Callable | None = None,
        *,
        finite: FiniteWatch | None = None,
        compensation: Any = None,
        not_stepped: Collection[int] = (),
        loss_scale: StageLossScale | NoLossScale = NoLossScale(),
    ) -> None:
        """``finite``: where the stage reports what it reads and makes (default: checks nothing);
        ``compensation``: the engine's delay compensation (anything with ``for_stage``; default none);
        ``not_stepped``: ids of parameters another stage steps (a reader's copies of tied weights);
        ``loss_scale``: fp16's scale s_j, which its backward applies to the delta it gets and removes from
        the one it sends (``runtime/loss_scale.py``)."""
        if not layers:
            raise ValueError(f"stage {index} has no layers")
        self.index = index
        self.petra_stages = petra_stages
        self.layers = list(layers)
        self.options = options
        compile_layers(self.layers, options.compile)
        #: the parts' graphed forwards (``cuda_graphs``)
        self.graphed = graph_layers(self.layers, options.cuda_graphs, options.device_type)
        self.loss_fn, self.loss_scale = loss_fn, loss_scale
        #: everything it runs, as ``nn.draws`` asks whether any of it can draw random numbers
        self.runs = (*self.layers, loss_fn) if loss_fn is not None else tuple(self.layers)
        self.is_first = index == 0
        self.is_last = index == petra_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn (PipelineModule(loss_fn=...))")
        self.reversible = all(isinstance(l, nn.Module) and is_reversible(l) for l in self.layers)
        self.reconstructs = reconstructs(index, petra_stages, self.reversible, options.input_buffer)
        self.keeps_input = not (self.is_first or self.is_last or self.reconstructs)
        #: whether it stores inputs for its delayed backwards: a FIFO, or stage 0's micro-batches
        self.has_input_fifo = self.keeps_input or (self.is_first and not self.is_last)
        self.modules = []
        for layer in self.layers:
            module = layer_module(layer)
            if module is not None and all(module is not m for m in self.modules):
                self.modules.append(module)
        key = 0
        for module in self.modules:  # keyed-RNG layer indices, unique inside the stage
            key = assign_rng_keys(module, key)
        self.params = list({id(p): p for module in self.modules for p in module.parameters()}.values())
        #: what this stage's own step updates: what it clips and what delay compensation acts on (not a
        #: reader's copies of tied weights, which follow their owner)
        self.stepped = [p for p in self.params if p.requires_grad and id(p) not in not_stepped]
        #: the gradients, checked after each backward and cleared after each step (``runtime/grad_buffer.py``)
        self.grads = StageGrads(self.params, self.stepped)
        self.norms = [bn for module in self.modules for bn in batch_norms(module)]

        #: exact inputs of a non-reversible stage, and stage 0's micro-batches (data), each read in the order they
        #: were stored: on the device, or offloaded to host memory
        copies = StreamCopies() if options.fifo_offload == "cpu" else None
        self.fifo = InputFifo(copies)
        self.raw = InputFifo(copies)
        self.stash: dict[int, list[Tensor]] = {}  # param_buffer ablation
        self.live: tuple[int, Activation, Activation, Tensor] | None = None  # last stage: (m, x, leaf, loss)
        #: a reconstructing stage's micro-batch between its reconstruction and its backward
        self.reconstruction: Reconstruction | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self._swapped: list[Tensor] | None = None
        self.backwards = 0
        #: the micro-batch of the last backward (what names a step's gradients)
        self.last_micro_batch = -1
        #: backwards that ran block by block (``reconstruct_overlap``)
        self.block_wise_backwards = 0
        self._truth: dict[int, Activation] = {}
        #: max |x~ - x| / max |x| per reconstructed micro-batch, with ``track_reconstruction``
        self.reconstruction_errors: list[float] = []
        self.peak_input_bytes = 0
        self.peak_param_buffer_bytes = 0
        self._checked = not options.check_reversible
        #: delay compensation (``petra_ds.runtime.compensation``): the weights a forward runs with, how a step is taken
        self.compensation = NoCompensation() if compensation is None else compensation.for_stage(
            self.stepped, index, petra_stages, options.gradient_accumulation_steps)
        #: where this stage reports what it reads and makes, to find the first NaN / Inf
        self.finite = FiniteWatch.off() if finite is None else finite

    def check_layers(self, x: Activation) -> None:
        """``inverse(forward(x)) == x`` for every layer declared reversible, on this input: a wrong inverse
        would otherwise train a wrong model silently. Raises ``ReversibilityError`` naming the layer."""
        self._checked = True
        with torch.no_grad(), norms_running_stats(self.norms, update=False):
            for i, layer in enumerate(self.layers):
                if isinstance(layer, nn.Module) and is_reversible(layer):
                    check_reversible(layer, x, name=f"stage {self.index}, its layer {i} ({type(layer).__name__})",
                                     seed=self.options.seed)
                x = layer(x)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The stage's parameters, each once (what its graphs accumulate into)."""
        return iter(self.params)

    # --- running the layers ---

    def _autocast(self):
        """bf16 autocast when configured: the forward, the recomputation and the reconstruction must
        evaluate F and G identically, or the reconstruction would not undo the forward. Without it, nothing: every
        evaluation runs as :meth:`run` does, in the caller's autocast state."""
        dtype = self.options.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(self.options.device_type, dtype=dtype)

    def run(self, x: Activation) -> Activation:
        """F_j(x) with the current parameters (autocast inside, outputs back in the input dtype)."""
        dtype = self.options.autocast_dtype
        if dtype is None:
            for layer in self.layers:
                x = layer(x)
            return x
        stream_dtype = next((t.dtype for t in as_tuple(x) if t.is_floating_point()), torch.float32)
        with self._autocast():
            for layer in self.layers:
                x = layer(x)
        return shaped_like(x, [t.to(stream_dtype) if t.is_floating_point() and t.dtype == dtype else t
                        for t in as_tuple(x)])

    def scope(self, m: int, update_bn: bool) -> AbstractContextManager[None]:
        """Keyed RNG of (seed, m, stage, replica's rows) where anything it runs can draw (``nn.draws``); batch norms
        update running statistics iff ``update_bn``."""
        keyed = may_draw(self.runs)
        if not (keyed or self.norms):
            return NO_SCOPE
        return StageScope(self.options.seed, m, self.index, self.options.rows, self.norms, update_bn, keyed=keyed)

    @property
    def _bn_in_forward(self) -> bool:
        return self.options.bn_policy.update_in == "forward"

    # --- forward ---

    def forward(self, m: int, x: Activation, labels: Any = None) -> Activation | Tensor:
        """x_j = F_j(x_{j-1}); the last stage returns the (unscaled, detached) loss instead."""
        if self.is_first:
            self.finite.micro_batch(m, x, labels)
        if not self._checked:
            self.finite.check()  # a NaN that reached this input is named where it began, not as a wrong inverse
            self.check_layers(x)
        if self.is_last:
            # its only evaluation is the one that is differentiated: it plays the backward's role
            leaf, loss = self.graph(m, x, labels, update_bn=True)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            self.live = (m, x, leaf, loss)
            self.finite.loss(self.index, m, loss)
            return loss.detach()
        with self.scope(m, update_bn=self._bn_in_forward), no_grad(), self.compensation.forward_weights():
            y = self.run(x)
        if self.is_first:
            self.raw.append(m, x)
        elif self.keeps_input:
            self.fifo.append(m, x)
        elif self.reconstructs and self.options.track_reconstruction:
            self._truth[m] = x
        if self.options.param_buffer:
            self.stash[m] = [p.detach().clone() for p in self.params]
        self._account()
        self.finite.activation(self.index, m, y)
        return y

    # --- backward ---

    def reconstruct(self, m: int, y_tilde: Activation, delta: Activation) -> Activation | None:
        """x~_{j-1} = F_j^{-1}(x~_j) with the current parameters, keeping the graph and ``delta`` (delta_{j+1},
        which came with x~_j) for the backward.

        With ``reconstruct_overlap`` it only records x~_j and returns None: block i-1 is reconstructed
        while block i's gradients are computed, which needs delta, so ``backward`` does both (and
        returns x~_{j-1})."""
        if not self.reconstructs:
            raise RuntimeError(f"stage {self.index} does not reconstruct its input")
        if self.options.reconstruct_overlap:
            self.reconstruction = Reconstruction(m, delta, y_tilde, None)
            return None
        self._use_forward_params(m)
        with self.scope(m, update_bn=not self._bn_in_forward), self._autocast():
            x = y_tilde
            tapes = []
            for layer in reversed(self.layers):
                x, tape = reconstruct(layer, x)
                tapes.append(tape)
        self.reconstruction = Reconstruction(m, delta, x, SequentialTape(tapes))
        self._note_reconstruction(m, x)
        return x

    def _reconstruct_and_backward(self, m: int, y_tilde: Activation,
                                  delta: Activation) -> tuple[Activation, Activation]:
        """(dx, x~_{j-1}) block by block, under the same RNG / batch-norm scope and autocast as
        ``reconstruct``; the VJPs run without autocast, as ``backward`` runs them after ``reconstruct``."""
        self.block_wise_backwards += 1
        self._use_forward_params(m)
        dtype = self.options.autocast_dtype
        no_autocast = ((lambda: torch.autocast(self.options.device_type, enabled=False)) if dtype is not None
                       else nullcontext)
        with self.scope(m, update_bn=not self._bn_in_forward), self._autocast():
            x, dx = reconstruct_and_backward(self.layers, y_tilde, delta, vjp_context=no_autocast,
                                             side_stream=self._stream_beside(y_tilde))
        self._note_reconstruction(m, x)
        return dx, x

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        """The second CUDA stream ``reconstruct_overlap`` created (None before, and on CPU)."""
        return self._side_stream

    def _stream_beside(self, y: Activation) -> torch.cuda.Stream | None:
        """The second CUDA stream of ``reconstruct_overlap`` (None on CPU: the same order, one stream)."""
        if not (t := as_tuple(y)[0]).is_cuda:
            return None
        if self._side_stream is None or self._side_stream.device != t.device:
            self._side_stream = torch.cuda.Stream(device=t.device)
        return self._side_stream

    def _note_reconstruction(self, m: int, x: Activation) -> None:
        """A rebuilt input is checked for NaN / Inf; with ``track_reconstruction`` max |x~ - x| / max |x| is noted."""
        self.finite.reconstruction(self.index, m, x)
        truth = self._truth.pop(m, None)
        if truth is not None:
            error = max(float((a - b).abs().max()) for a, b in zip(as_tuple(x), as_tuple(truth)))
            scale = max(float(t.abs().max()) for t in as_tuple(truth))
            self.reconstruction_errors.append(error / max(scale, 1e-30))

    def backward(self, m: int, delta: Activation | None = None) -> tuple[Activation | None, Activation]:
        """delta_j and x~_{j-1} for micro-batch ``m``; Delta_j accumulates into ``.grad``. ``delta`` is
        delta_{j+1} (None at the last stage); a reconstructing stage was handed it with its reconstruction."""
        scale = self.loss_scale
        if self.is_last:
            if self.live is None or self.live[0] != m:
                raise RuntimeError(f"last stage: no live graph for micro-batch {m}")
            _, x_tilde, leaf, loss = self.live
            self.live = None
            self._use_forward_params(m)
            dx = shaped_like(leaf, backprop([scale.loss(loss, self.options.gradient_accumulation_steps)], [None],
                                            as_tuple(leaf), self))
        elif self.reconstructs:
            rebuilt = self.reconstruction
            if rebuilt is None or rebuilt.micro_batch != m:
                raise RuntimeError(f"stage {self.index}: backward of micro-batch {m} without its reconstruction")
            if delta is not None:
                raise ValueError(f"stage {self.index} reconstructs: it was handed delta with its reconstruction")
            self.reconstruction, delta = None, scale.scaled(rebuilt.delta)
            if rebuilt.tape is None:
                dx, x_tilde = self._reconstruct_and_backward(m, rebuilt.x, delta)
            else:
                x_tilde, dx = rebuilt.x, rebuilt.tape.backward(delta)
        else:
            x_tilde = self._pop_input(m)
            self._use_forward_params(m)
            dx = self.vjp(m, x_tilde, scale.scaled(delta), update_bn=not self._bn_in_forward)
        dx = scale.unscaled(dx)
        self._restore_params()
        self.backwards += 1
        self.last_micro_batch = m
        self._account()
        self.finite.gradients(self.index, m, self.grads.tensors(), dx)
        return dx, x_tilde

    def vjp(self, m: int, x: Activation, delta: Activation, *, update_bn: bool) -> Activation:
        """Recompute F_j from input ``x`` under micro-batch ``m``'s keyed RNG and pull ``delta`` back through it:
        the parameter gradients accumulate into ``.grad``; returns the input gradient."""
        # stage 0 sends no input gradient: its data stays out of the graph (no detached leaf, no dx computed)
        leaf, out = self.graph(m, x, update_bn=update_bn, input_grad=not self.is_first)
        return GraphTape(leaf, out, self).backward(delta)

    def graph(self, m: int, x: Activation, labels: Any = None, *, update_bn: bool,
              input_grad: bool = True) -> tuple[Activation, Activation | Tensor]:
        """F_j evaluated from ``x`` with its graph, under micro-batch ``m``'s keyed RNG: (the leaf it starts from,
        its output, or at the last stage its loss on ``labels``). ``input_grad=False``: ``x`` is used as it is."""
        with self.scope(m, update_bn=update_bn), enable_grad():
            leaf = detach_leaf(x) if input_grad else x
            out = self.run(leaf)
            return leaf, (self.loss_fn(out, labels) if self.is_last else out)

    @contextmanager
    def swapped_params(self, values: Sequence[Tensor]) -> Iterator[None]:
        """Run with ``values`` in place of the trainable parameters, put back afterwards."""
        params = [p for p in self.params if p.requires_grad]
        saved = self._swap_in(params, values)
        try:
            yield
        finally:
            self._swap_in(params, saved)

    @staticmethod
    def _swap_in(params: Sequence[Tensor], values: Sequence[Tensor]) -> list[Tensor]:
        """Copy ``values`` into ``params``; return what they held."""
        with no_grad():
            saved = [p.detach().clone() for p in params]
            for p, v in zip(params, values):
                p.copy_(v)
        weights_written()
        return saved

    def _pop_input(self, m: int) -> Activation:
        if self.is_first:
            if self.raw.head != m:
                raise RuntimeError(f"stage 0 lost micro-batch {m}")
            return self.raw.pop(m)
        if self.fifo.head != m:
            raise RuntimeError(f"stage {self.index}: FIFO head is not micro-batch {m}")
        return self.fifo.pop(m)

    # --- weight stashing (ablation) ---

    def _use_forward_params(self, m: int) -> None:
        if not self.options.param_buffer or self._swapped is not None:
            return
        stashed = self.stash.pop(m, None)
        if stashed is None:  # the last stage's forward and backward share a clock
            return
        self._swapped = self._swap_in(self.params, stashed)

    def _restore_params(self) -> None:
        if self._swapped is not None:
            self._swap_in(self.params, self._swapped)
            self._swapped = None

    # --- checkpoint ---

    def state_dict(self) -> dict:
        """What is in flight at this stage between two clocks (parameters are saved elsewhere): the tensors
        themselves, not copies (a checkpoint writes them at once, or copies them to host memory first)."""
        if self.live is not None or self.reconstruction is not None or self._swapped is not None:
            raise RuntimeError(f"stage {self.index} is in the middle of a clock")
        return {
            "grads": [None if p.grad is None else p.grad.detach() for p in self.params],
            "fifo": self.fifo.state(),
            "raw": self.raw.state(),
            "stash": dict(self.stash),
            "backwards": self.backwards,
            "peak_input_bytes": self.peak_input_bytes,
            "peak_param_buffer_bytes": self.peak_param_buffer_bytes,
            "compensation": self.compensation.state_dict(),
            "loss_scale": self.loss_scale.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        for p, g in zip(self.params, state["grads"]):
            p.grad = None if g is None else g.to(p.device).clone()
        self.grads.attach()
        self.fifo.load(state["fifo"])
        self.raw.load(saved_entries(state["raw"]))
        self.stash = dict(state["stash"])
        self.backwards = state["backwards"]
        self.peak_input_bytes = state["peak_input_bytes"]
        self.peak_param_buffer_bytes = state["peak_param_buffer_bytes"]
        self.compensation.load_state_dict(state.get("compensation", {}))
        self.loss_scale.load_state_dict(state.get("loss_scale"))

    # --- accounting ---

    def held(self) -> dict[str, tuple]:
        """What this stage keeps alive now, by ``petra_ds.runtime.observe.Holdings`` field (references)."""
        return {
            "data": self.raw.on_device(),
            "inputs": self.fifo.on_device(),
            "offloaded": self.fifo.on_host() + self.raw.on_host(),
            "outputs": tuple(x for x in (self.live, self._rebuilt_input()) if x is not None),
            "messages": (self.reconstruction.delta,) if self.reconstruction is not None else (),
            "param_stash": tuple(self.stash.values()),
            "graphs": tuple(t for graphed in self.graphed for t in graphed.held()),
        }

    @property
    def offloads_inputs(self) -> bool:
        """Whether this stage's stored inputs wait in host memory (``fifo_offload``)."""
        return self.has_input_fifo and self.fifo.offloads

    def offload_inputs(self) -> None:
        """Keep the stored inputs in host memory from now on (``fifo_offload: "auto"`` once it decided)."""
        copies = StreamCopies()
        self.fifo.start_offloading(copies)
        self.raw.start_offloading(copies)

    def kept_entry_bytes(self) -> int | None:
        """The bytes of the next stored input read (None while none is stored)."""
        kept = self.raw if self.is_first else self.fifo
        return tensor_bytes(kept.on_device()[:1]) if len(kept) else None

    def _rebuilt_input(self) -> Activation | None:
        rebuilt = self.reconstruction
        return rebuilt.x if rebuilt is not None and rebuilt.tape is not None else None

    def input_buffer_bytes(self) -> int:
        """The FIFO's bytes on the device (an offloaded entry's host copy is not the device's)."""
        return self.fifo.device_bytes

    def param_buffer_bytes(self) -> int:
        return tensor_bytes(list(self.stash.values()))

    def _account(self) -> None:
        self.peak_input_bytes = max(self.peak_input_bytes, self.input_buffer_bytes())
        if self.stash:
            self.peak_param_buffer_bytes = max(self.peak_param_buffer_bytes, self.param_buffer_bytes())
