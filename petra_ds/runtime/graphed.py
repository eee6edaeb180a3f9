"""``"petra": {"cuda_graphs": true}``: a stage's parts replay CUDA graphs instead of launching their kernels one by one.

On a GPU at the micro-batches PETRA trains best with, a clock is host-bound: each op of a coupling's F and G, and of
each layer that is not reversible, is a kernel launched from Python, twice per micro-batch (forward, reconstruction)
where backprop launches it once. Those parts (the ones ``"compile"`` compiles, :func:`compiled_parts`) get a
:class:`GraphedForward` as their ``forward``; the module keeps its parameters, names and state dict.

A call in training mode with tensor arguments replays one graph per signature (grad mode, the arguments' shapes,
dtypes and ``requires_grad``, the batch norms' update flags, autocast):
- without grad, the forward alone, captured at its first call;
- with grad, the forward, and the VJP into the inputs and the parameters in a second graph (as
  ``torch.cuda.make_graphed_callables`` builds them), behind an autograd function. Its first call runs eagerly and
  notes the layouts of the gradients its backward receives; the second captures, its static gradients laid out so.
  Inputs, outputs and gradients keep the layouts (strides, offsets, shared storages) of the eager call: a kernel's
  rounding may depend on them.
Anything else (evaluation, keyword arguments, other argument types, draws split by row blocks) runs eagerly.

Every output and gradient is copied out of the graph's memory, so a replay never overwrites what the stage still
holds (a message, a FIFO entry, a tape, a ``.grad``). A VJP replays what its graph's latest forward saved: a second
forward of the same graph before the VJP raises instead of returning another micro-batch's gradients.

Keyed RNG: a replay draws from the CUDA generator's seed and offset at the moment of replay, so the keyed scope
around a part (``nn/rng.py``) seeds it as it seeds eager code, and the forward and the reconstruction draw the same
masks. A capture runs the part a few times: the generators and the part's buffers (running statistics) are put back
afterwards, and the capturing call is the graphs' first replay, so capturing changes nothing a run computes.

A graph holds the addresses it was captured with: a parameter moved to other memory (replaced, or its ``.data``
reassigned) fails the next replay, which checks; weight prediction and weight stashing write into the weights'
storage. A Python attribute changed after capture (a dropout rate) is not seen.

``"cuda_graphs": "emulate"`` runs this code on any device with eager stand-ins for the graphs that keep their static
buffers and replay semantics: a check on CPU that a model's parts are safe to graph, bit for bit against eager. A
stand-in's capture also refuses a part that reads device values on the host, as a CUDA capture would; a copy from
host memory it cannot see, every tensor being in host memory on a CPU.
"""

from __future__ import annotations

import collections
import functools
import operator
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from ..nn.batchnorm import batch_norms
from ..nn.rng import current_draws
from ..util.host_reads import HostSyncs
from .compiled import compiled_parts
from .fifo import moved

#: ``"petra": {"cuda_graphs": "emulate"}``: eager stand-ins for the graphs, on any device
EMULATE = "emulate"
#: signatures one part captures before it warns and runs eagerly for new ones (each holds its own graph memory)
MAX_SIGNATURES = 8
#: eager calls that settle a capture's kernels (cuDNN's choices, lazy allocations) before it is recorded
WARMUP = 2
#: the profiler range of a replay: always for the eager stand-ins (``OpCounter`` counts what runs inside as one launch),
#: on CUDA while a profiler records
REPLAY_LABEL = "petra_ds.graph_replay"

_SIGNATURE = operator.attrgetter("shape", "dtype", "requires_grad")
_ADDRESS = Tensor.data_ptr
_TRACKS = operator.attrgetter("track_running_stats")


def graph_layers(layers: Iterable[object], mode: bool | str, device_type: str) -> list[GraphedForward]:
    """Give every part of ``layers`` that ``"compile"`` would compile a :class:`GraphedForward`; ``mode``: true (CUDA
    graphs, on a CUDA device only), ``"emulate"`` or false (none). Returns the installed forwards."""
    if not mode:
        return []
    if mode is True and device_type != "cuda":
        raise ValueError(f'"petra.cuda_graphs": true needs a CUDA device, and this engine runs on {device_type!r}; '
                         f'set it to false, or to "emulate" to check on this device that the model can be graphed')
    capture = _capture_cuda if mode is True else _capture_eagerly
    installed = []
    for layer in layers:
        for module in compiled_parts(layer):
            if not isinstance(module.forward, GraphedForward):
                module.forward = GraphedForward(module, capture)
            installed.append(module.forward)
    return installed


class GraphedForward:
    """A module's ``forward`` that replays graphs (module docstring). ``captured``: the signatures captured;
    ``replays``: the graphs replayed (a forward per call, a VJP per backward)."""

    def __init__(self, module: nn.Module, capture: Callable) -> None:
        self.module, self.eager, self.capture = module, module.forward, capture
        self.norms = batch_norms(module)
        self.graphs: dict[tuple, _Graphs] = {}
        #: per signature with grad, called once eagerly: the gradients its outputs received (None until they do)
        self.received: dict[tuple, list[Tensor | None]] = {}
        self._warned = False

    @property
    def captured(self) -> int:
        return len(self.graphs)

    @property
    def replays(self) -> int:
        return sum(graphs.replays for graphs in self.graphs.values())

    def held(self) -> tuple[Tensor, ...]:
        """The static tensors of its graphs: inputs, outputs, incoming and outgoing gradients."""
        return tuple(t for graphs in self.graphs.values() for t in graphs.static())

    @property
    def pool_bytes(self) -> int:
        """The device bytes its graphs' memory pools reserve (CUDA; 0 for the eager stand-ins)."""
        return sum(graphs.pool_bytes for graphs in self.graphs.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and type(args[0]) is Tensor:  # the common call, without the walk
            flat, spec = args, _ONE_TENSOR
        else:
            flat, spec = _flatten(args)
        if kwargs or not flat or not self.module.training or current_draws() is not None:
            return self.eager(*args, **kwargs)
        device = flat[0].device.type
        grad = torch.is_grad_enabled()
        key = (grad, tuple(map(_SIGNATURE, flat)), spec, tuple(map(_TRACKS, self.norms)),
               torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        graphs = self.graphs.get(key)
        if graphs is None:
            if len(self.graphs) + len(self.received) >= MAX_SIGNATURES and key not in self.received:
                return self._eager_beyond_cap(args)
            if grad and key not in self.received:
                return self._noting_gradients(key, args)
            graphs = self.graphs[key] = _Graphs(self, spec, flat, grad, device, self.received.pop(key, None))
        return graphs.run(flat)

    def _noting_gradients(self, key: tuple, args: tuple) -> Any:
        """An eager call whose outputs' gradients are kept for the capture (their layouts)."""
        out = self.eager(*args)
        outs = [out] if isinstance(out, Tensor) else list(out)
        received: list[Tensor | None] = [None] * len(outs)
        self.received[key] = received
        for i, o in enumerate(outs):
            if isinstance(o, Tensor) and o.requires_grad:
                o.register_hook(functools.partial(operator.setitem, received, i))
        return out

    def _eager_beyond_cap(self, args: tuple) -> Any:
        if not self._warned:
            self._warned = True
            warnings.warn(f"cuda_graphs: {type(self.module).__name__} met more than {MAX_SIGNATURES} argument "
                          f"signatures (shapes, dtypes, grad mode); new ones run eagerly. Feed micro-batches of one "
                          f"shape to graph them all", stacklevel=3)
        return self.eager(*args)


class _Graphs:
    """One signature's graphs: static inputs, the forward (and with grad, the VJP) and their static results."""

    def __init__(self, owner: GraphedForward, spec: tuple[int, ...], flat: Sequence[Tensor], grad: bool, device: str,
                 received: list[Tensor | None] | None) -> None:
        self.spec = spec
        self.inputs = [t.requires_grad_(a.requires_grad and grad) for t, a in zip(_same_views(list(flat)), flat)]
        self.params = [p for p in owner.module.parameters() if p.requires_grad] if grad else []
        self.grad = grad and (bool(self.params) or any(t.requires_grad for t in self.inputs))
        self.forwards = 0  # forward replays so far: a VJP must follow the latest
        self.replays = 0
        #: the module's parameters and where they lived at capture: what the graphs read
        self.weights = list(owner.module.parameters())
        self.addresses = tuple(map(_ADDRESS, self.weights))
        module, latest = owner.module, {}

        def forward() -> list[Tensor]:
            with torch.set_grad_enabled(self.grad):
                out = owner.eager(*_unflatten(self.inputs, self.spec))
            out_flat = [out] if isinstance(out, Tensor) else list(out)
            self.out_tuple = not isinstance(out, Tensor)
            if self.grad:  # what the VJP differentiates, until it has
                latest["out"] = out_flat
            return out_flat

        bodies = [forward]
        if self.grad:
            wrt = [t for t in self.inputs if t.requires_grad] + self.params

            def vjp() -> list[Tensor | None]:
                outs = [o for o in latest.pop("out") if o.requires_grad]
                return list(torch.autograd.grad(outs, wrt, [self.grad_outputs[i] for i in self.differentiable],
                                                allow_unused=True))

        with _unchanged(module, device), _autocast_uncached(device):
            if self.grad:
                self.outputs = forward()
                self.differentiable = [i for i, o in enumerate(self.outputs) if o.requires_grad]
                self.grad_outputs = _laid_out(self.outputs, received)
                bodies = [forward, vjp]
            try:
                replays, results, self.pool_bytes = owner.capture(bodies, device)
            except RuntimeError as error:
                raise RuntimeError(
                    f'"petra.cuda_graphs": {type(module).__name__} cannot be captured in a CUDA graph ({error}). A '
                    f'graph holds no read of a device value on the host (.item(), float(t), bool(t), .tolist(), '
                    f'.cpu(), nonzero) and no copy from host memory: change the module, or set "petra.cuda_graphs": '
                    f'false') from error
        self.replay_forward, self.outputs = replays[0], results[0]
        # an output returned at several places (RevGPT's embedding starts both streams from one h) is one tensor
        # there too, so that its gradients add up as eager autograd adds them
        first = {id(o): i for i, o in reversed(list(enumerate(self.outputs)))}
        self.distinct = sorted(set(first.values()))
        self.places = [self.distinct.index(first[id(o)]) for o in self.outputs]
        self.distinct_outputs = [self.outputs[i] for i in self.distinct]
        self.copy_out = _copies if _plain_layouts(self.distinct_outputs) else _same_views
        self.grads: list[Tensor | None] = []
        if self.grad:
            self.replay_vjp, self.grads = replays[1], results[1]
            self.wants = [t.requires_grad for t in self.inputs]
            self.all_want = all(self.wants)
            self.integral = [i for i, o in enumerate(self.outputs) if not o.is_floating_point()]
            self.present = [g for g in self.grads if g is not None]
            self.copy_grads = _copies if _plain_layouts(self.present) else _same_views

    def static(self) -> list[Tensor]:
        return [*self.inputs, *self.distinct_outputs, *((*self.grad_outputs, *self.present) if self.grad else ())]

    def run(self, flat: list[Tensor]) -> Any:
        if self.grad:
            outs = _Replayed.apply(self, *flat, *self.params)
        else:
            outs = self.forward_replay(flat)
        return tuple(outs) if self.out_tuple else outs[0]

    def forward_replay(self, flat: Sequence[Tensor]) -> list[Tensor]:
        if tuple(map(_ADDRESS, self.weights)) != self.addresses:
            raise RuntimeError(
                "cuda_graphs: a parameter of a graphed part now lives in other memory than when its graph was "
                "captured (replaced, or its .data reassigned), and the graph would read the old memory: write new "
                'values into the parameter in place, or set "petra.cuda_graphs": false')
        self.forwards += 1
        copies = self._replayed(self.inputs, flat, self.replay_forward, self.copy_out, self.distinct_outputs)
        return copies if len(copies) == len(self.places) else [copies[i] for i in self.places]

    def _replayed(self, static: list[Tensor], values: Sequence[Tensor], replay: Callable[[], None],
                  copy: Callable[[list[Tensor]], list[Tensor]], results: list[Tensor]) -> list[Tensor]:
        """``values`` into a graph's ``static`` inputs, the graph replayed, and copies of its ``results``."""
        torch._foreach_copy_(static, values)
        replay()
        self.replays += 1
        return copy(results)

    def vjp_replay(self, forwards: int, grad_outputs: Sequence[Tensor]) -> list[Tensor | None]:
        if forwards != self.forwards:
            raise RuntimeError(
                "cuda_graphs: a part's graph ran its forward again before the backward of an earlier forward, so "
                "its saved activations are another micro-batch's; this stage's order of calls cannot be graphed "
                'as it is: set "petra.cuda_graphs": false')
        copies = self._replayed(self.grad_outputs, grad_outputs, self.replay_vjp, self.copy_grads, self.present)
        if len(copies) == len(self.grads):
            return copies
        found = iter(copies)
        return [None if g is None else next(found) for g in self.grads]


class _Replayed(torch.autograd.Function):
    """A graphed part under autograd: the forward graph's replay, and the VJP graph's in its backward."""

    @staticmethod
    def forward(ctx: Any, graphs: _Graphs, *inputs_and_params: Tensor) -> tuple[Tensor, ...]:
        ctx.graphs = graphs
        outs = graphs.forward_replay(inputs_and_params[:len(graphs.inputs)])
        ctx.forwards = graphs.forwards
        if graphs.integral:
            ctx.mark_non_differentiable(*(outs[i] for i in graphs.integral))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        graphs = ctx.graphs
        grads = graphs.vjp_replay(ctx.forwards, grad_outputs)
        if graphs.all_want:
            return (None, *grads)
        found = iter(grads)
        return (None, *[next(found) if wanted else None for wanted in graphs.wants], *found)


def _copies(tensors: list[Tensor]) -> list[Tensor]:
    """New tensors equal to ``tensors`` bit for bit, in one multi-tensor op (x * 1 keeps -0, NaN and Inf), each dense
    one in its layout."""
    return torch._foreach_mul(tensors, 1) if tensors else []


def _same_views(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` that are the same views (offsets, strides, shared storages) of copies of their storages:
    a kernel's rounding may depend on its input's layout and alignment (a channel half of a stream is a view at an
    offset), and a replay must compute what the eager call computes."""
    return list(moved(tensors, lambda storages: ([s.clone() for s in storages], None))[0])


def _laid_out(outputs: list[Tensor], received: list[Tensor | None] | None) -> list[Tensor]:
    """Static gradients for ``outputs``: the same views as the gradients an eager call received where it did, else
    each output's layout."""
    received = received if received is not None and len(received) == len(outputs) else [None] * len(outputs)
    starts = collections.Counter(g.data_ptr() for g in received if g is not None)
    # no layout that repeats elements, nor two outputs' gradients at one address (a tensor returned twice)
    received = [None if g is None or _broadcast(g) or starts[g.data_ptr()] > 1 else g for g in received]
    kept = [g for g in received if g is not None]
    copies = iter(_same_views(kept) if kept else [])
    return [torch.zeros_like(o) if g is None else next(copies) for o, g in zip(outputs, received)]


def _broadcast(t: Tensor) -> bool:
    """Whether ``t`` repeats elements (a gradient expanded from a scalar): no copy can be written into its layout."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def _plain_layouts(tensors: Sequence[Tensor]) -> bool:
    """Whether :func:`_copies` keeps ``tensors``' layouts: each dense, none sharing a storage."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return len(storages) == len(tensors) and all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


def _flatten(args: tuple) -> tuple[list[Tensor] | None, tuple[int, ...]]:
    """The tensors of ``args`` (each a tensor or a tuple / list of tensors; None if any is something else) and each
    argument's shape: -1 a tensor, n a tuple of n."""
    flat, spec = [], []
    for a in args:
        if type(a) is Tensor:
            flat.append(a)
            spec.append(-1)
        elif isinstance(a, (tuple, list)) and a and all(type(t) is Tensor for t in a):
            flat.extend(a)
            spec.append(len(a))
        else:
            return None, ()
    return flat, tuple(spec)


#: the spec of one tensor argument
_ONE_TENSOR = (-1,)


def _unflatten(flat: Sequence[Tensor], spec: tuple[int, ...]) -> list[Any]:
    args, i = [], 0
    for n in spec:
        if n < 0:
            args.append(flat[i])
            i += 1
        else:
            args.append(tuple(flat[i:i + n]))
            i += n
    return args


class _unchanged:
    """Inside, the module's buffers and the random generators may change: they are put back on exit."""

    def __init__(self, module: nn.Module, device: str) -> None:
        self.module, self.device = module, device

    def __enter__(self) -> None:
        self.buffers = [b for b in self.module.buffers()]
        self.saved = [b.detach().clone() for b in self.buffers]
        devices = [torch.cuda.current_device()] if self.device == "cuda" else []
        self.rng = torch.random.fork_rng(devices=devices)
        self.rng.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.rng.__exit__(*exc)
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved):
                b.copy_(s)


def _autocast_uncached(device: str) -> Any:
    """The enclosing autocast without its cast cache: a graph must not read a cast made outside it."""
    enabled = torch.is_autocast_enabled(device)
    return torch.autocast(device, dtype=torch.get_autocast_dtype(device), enabled=enabled, cache_enabled=False)


def _capture_cuda(bodies: Sequence[Callable[[], list]], device: str) -> tuple[list[Callable], list[list], int]:
    """Warm ``bodies`` up in order on a side stream, then record each into a CUDA graph (one memory pool for them);
    returns each graph's replay, the static results its recording made, and the bytes the pool reserves."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            for body in bodies:
                body()
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    replays, results = [], []
    for body in bodies:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            results.append(body())
        replays.append(functools.partial(_labelled_when_profiled, graph.replay))
    reserved = sum(segment.get("total_size", 0) for segment in torch.cuda.memory_snapshot()
                   if tuple(segment.get("segment_pool_id", ())) == tuple(pool))
    return replays, results, reserved


def _labelled_when_profiled(replay: Callable[[], None]) -> None:
    """A replay, a range of its own in a profiler's trace when one records (no label's cost otherwise)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(REPLAY_LABEL):
            replay()
    else:
        replay()


def _capture_eagerly(bodies: Sequence[Callable[[], list]], device: str) -> tuple[list[Callable], list[list], int]:
    """The stand-in for :func:`_capture_cuda`: a body's first run makes its static results, and a "replay" runs it
    again and writes what it computed into those same tensors, as a graph's replay overwrites its memory (inside a
    :data:`REPLAY_LABEL` range, as one launch to ``diagnostics.host_cost.OpCounter``)."""
    replays, results = [], []
    for body in bodies:
        with HostSyncs() as reads:  # what a CUDA graph could not capture, found on any device
            static = body()
        if reads.count:
            raise RuntimeError(f"it reads device values on the host: {dict(reads.where)}")

        def replay(body: Callable[[], list] = body, static: list = static) -> None:
            with torch.no_grad(), torch.profiler.record_function(REPLAY_LABEL):
                for into, value in zip(static, body()):
                    if into is not None:
                        into.copy_(value)
        replays.append(replay)
        results.append(static)
    return replays, results, 0
