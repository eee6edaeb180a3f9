"""A DeepSpeed ``PipelineModule`` cut into PETRA stages, several of which may live on one rank.

The layers are partitioned into J = pipeline ranks x ``stages_per_rank`` stages with DeepSpeed's own
partitioning methods, and rank r builds stages ``r*S .. r*S+S-1``. The partition and each layer's
initial weights (seeded by layer index) do not depend on the placement, so 1 rank x 4 stages,
2 x 2 and 4 x 1 train the same function.
"""

from __future__ import annotations

import copy
import functools
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from deepspeed import comm as dist
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ..nn.reversible import is_reversible
from ..util.checks import positive_int
from .partition import balanced_parts, load_costs


def spec_is_reversible(spec: Any) -> bool:
    """Whether a layer (spec, module or function) will be reversible once built."""
    if isinstance(spec, TiedLayerSpec):
        return False
    if isinstance(spec, LayerSpec):
        return isinstance(spec.typename, type) and callable(getattr(spec.typename, "inverse", None))
    return isinstance(spec, nn.Module) and is_reversible(spec)


def check_world(num_stages: Any, topology: Any) -> None:
    """Refuse a pipeline x data-parallel layout that does not cover the processes of this run, before
    DeepSpeed's grid fails on it with a bare "Invalid Grid"."""
    if not dist.is_initialized():
        raise RuntimeError("PetraPipelineModule needs torch.distributed: call petra_ds.init_distributed() (or "
                           "deepspeed.init_distributed()) first; it also works in a plain python process")
    world = dist.get_world_size()
    if topology is not None:
        size = topology.world_size()
        if size != world:
            axes = " x ".join(f"{axis} {topology.get_dim(axis)}" for axis in topology.get_axis_names())
            raise ValueError(
                f"the topology ({axes} = {size} processes) does not match the {world} processes of this run "
                f"(torch.distributed world size); launch {size} processes or build a topology whose "
                f"pipe x data = {world}")
        return
    if num_stages is None:
        return  # DeepSpeed asks for num_stages or topology
    positive_int(num_stages, "num_stages (pipeline ranks)")
    if world % num_stages:
        raise ValueError(
            f"num_stages={num_stages} pipeline ranks do not divide the {world} processes of this run "
            "(data-parallel replicas = processes / num_stages); num_stages counts pipeline ranks, not PETRA "
            "stages (J = num_stages x stages_per_rank): one process hosting J stages is num_stages=1, "
            "stages_per_rank=J")


class PetraPipelineModule(PipelineModule):
    """``PipelineModule`` with ``stages_per_rank`` PETRA stages per pipeline rank.

    Same arguments as ``PipelineModule`` plus ``stages_per_rank``; ``seed_layers`` defaults to True so
    that initial weights depend only on the layer index. ``partition_method="profile"`` cuts the layers by
    their cost (``petra_ds.pipeline.partition``): ``layer_costs`` gives one ``LayerCost`` (or dict, or a JSON file
    of them) per layer spec, ``partition_rule`` which schedule's cost to balance (``"petra"``; a
    backprop baseline built from this class passes ``"backprop"`` or ``"backprop_ckpt"``), and
    ``input_buffer`` the engine's ``petra.input_buffer``, on which a reversible PETRA stage's cost depends.
    """

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, *,
                 stages_per_rank: int = 1, seed_layers: bool = True, layer_costs=None, partition_rule: str = "petra",
                 input_buffer: str = "non_reversible", **kwargs) -> None:
        self.layer_costs = None if layer_costs is None else load_costs(layer_costs)
        self.partition_rule = partition_rule
        self.partition_input_buffer = input_buffer
        positive_int(stages_per_rank, "stages_per_rank", meaning=" (PETRA stages per pipeline rank)")
        check_world(num_stages, topology)
        self.stages_per_rank = stages_per_rank
        super().__init__(layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn,
                         seed_layers=seed_layers, **kwargs)
        local = range(self.stage_id * stages_per_rank, (self.stage_id + 1) * stages_per_rank)
        #: (reader stage, tie key) -> the module a local reader of a tie uses: its own copy where the owner
        #: is on this rank too (DeepSpeed builds one module per tie and rank)
        self.tied_copies: dict[tuple[int, str], nn.Module] = {
            (j, tie.key): twin for tie in stage_ties(self)
            for j, twin in give_readers_their_copy(self, tie, local).items()}

    def _partition_layers(self, method: str = "uniform") -> None:
        """DeepSpeed's methods (and ``profile``) cut the layers into J = ranks x stages_per_rank PETRA stages;
        DeepSpeed's ``num_stages`` keeps counting ranks."""
        ranks = self.num_stages
        num_petra = ranks * self.stages_per_rank
        if num_petra > len(self._layer_specs):
            raise ValueError(
                f"{num_petra} PETRA stages (pipeline ranks {ranks} x stages_per_rank {self.stages_per_rank}) "
                f"for {len(self._layer_specs)} layers: every stage needs at least one layer; use fewer "
                "ranks or a smaller stages_per_rank")
        self.parts = self._cut(method.lower(), num_petra)
        if self.global_rank == 0:
            self._print_parts(self.parts)
        self.petra_parts = [int(p) for p in self.parts]  # "parameters" partitioning returns numpy ints
        if any(b <= a for a, b in zip(self.petra_parts, self.petra_parts[1:])):
            raise ValueError(f"partition {self.petra_parts} leaves a PETRA stage without layers; "
                             "use partition_method='uniform' or fewer stages")
        rank = self._topo.get_coord(self.global_rank).pipe
        first = rank * self.stages_per_rank
        self._set_bounds(start=self.petra_parts[first], stop=self.petra_parts[first + self.stages_per_rank])
        # DeepSpeed's per-rank view (stage_owner, tied groups) keeps counting pipeline ranks
        self.parts = [self.petra_parts[r * self.stages_per_rank] for r in range(ranks + 1)]

    def _cut(self, method: str, num_petra: int) -> list[int]:
        """Layer boundaries of ``num_petra`` stages by ``method``, as DeepSpeed's ``_partition_layers`` cuts
        pipeline ranks (with DeepSpeed's own helpers), or by measured cost (``profile``)."""
        if method == "profile":
            return self._balanced_parts(num_petra)
        if method == "uniform":
            return ds_utils.partition_uniform(num_items=len(self._layer_specs), num_parts=num_petra)
        if method == "parameters":
            return ds_utils.partition_balanced(weights=self._count_layer_params(), num_parts=num_petra)
        if method.startswith("type:"):
            chosen = set(self._find_layer_type(method.split(":", 1)[1]))
            weights = [int(i in chosen) for i in range(len(self._layer_specs))]
            return ds_utils.partition_balanced(weights=weights, num_parts=num_petra)
        raise NotImplementedError(f"partition method {method!r}: use uniform, parameters, type:<regex> or profile")

    def _print_parts(self, parts: Sequence[int]) -> None:
        """Each PETRA stage's layers, in DeepSpeed's start-up format."""
        for stage, (start, stop) in enumerate(zip(parts, parts[1:])):
            print(f"stage={stage} layers={stop - start}")
            for idx, layer in enumerate(self._layer_specs[start:stop]):
                name = layer.typename.__name__ if isinstance(layer, LayerSpec) else getattr(
                    layer, "__name__", type(layer).__name__)
                print(f"    {idx + start:2d}: {name}")
        if self.loss_fn:
            print(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")

    def _balanced_parts(self, num_petra: int) -> list[int]:
        if self.layer_costs is None:
            raise ValueError('partition_method="profile" needs layer_costs=[...] '
                             "(petra_ds.pipeline.partition.LayerCost per layer spec, or a JSON file of them)")
        if len(self.layer_costs) != len(self._layer_specs):
            raise ValueError(f"layer_costs has {len(self.layer_costs)} entries for {len(self._layer_specs)} layer "
                             "specs; give one per layer spec, in order")
        return balanced_parts(self.layer_costs, num_petra, self.partition_input_buffer, self.partition_rule)


def petra_parts(module: PipelineModule) -> list[int]:
    """Layer boundaries of the PETRA stages (DeepSpeed's own partition for a plain module)."""
    return list(getattr(module, "petra_parts", module.parts))


def stages_per_rank_of(module: PipelineModule) -> int:
    return getattr(module, "stages_per_rank", 1)


def stage_layers(module: PipelineModule, stage: int) -> list[Callable]:
    """The built layers (callables) of local PETRA stage ``stage``."""
    parts = petra_parts(module)
    start, stop = parts[stage] - module._local_start, parts[stage + 1] - module._local_start
    if start < 0 or stop > len(module.forward_funcs):
        raise ValueError(f"PETRA stage {stage} is not built on this rank")
    return module.forward_funcs[start:stop]


def stage_reversible(module: PipelineModule) -> list[bool]:
    """For every PETRA stage, whether all its layers are reversible (known on every rank)."""
    parts = petra_parts(module)
    specs = module._layer_specs
    return [all(spec_is_reversible(s) for s in specs[a:b]) for a, b in zip(parts, parts[1:])]


def layer_module(layer: Callable) -> nn.Module | None:
    """The module behind a built layer: the layer itself, or the tied module of a ``TiedLayerSpec``
    with a ``forward_fn`` (DeepSpeed builds those as ``partial(forward_fn, module)``)."""
    if isinstance(layer, nn.Module):
        return layer
    if isinstance(layer, functools.partial) and layer.args and isinstance(layer.args[0], nn.Module):
        return layer.args[0]
    return None


@dataclass(frozen=True)
class Tie:
    """A ``TiedLayerSpec`` key used by several PETRA stages.

    The first stage using it (the owner) steps the tied weights with the sum of every user's gradient
    for the same k micro-batches; every later stage (a reader) keeps its own copy, sends its gradient
    to the owner at its own step, and receives the owner's new weights one clock after the owner steps.
    """

    key: str
    attrs: tuple[str, ...]
    owner: int
    readers: tuple[int, ...]


def stage_ties(module: PipelineModule) -> list[Tie]:
    """The ties that span PETRA stages (a tie inside one stage is plain weight sharing)."""
    parts = petra_parts(module)
    uses: dict[str, tuple[list[str], set[int]]] = {}
    for idx, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            uses.setdefault(spec.key, (list(spec.tied_weight_attr), set()))[1].add(bisect_right(parts, idx) - 1)
    ties = []
    for key, (attrs, stages) in sorted(uses.items()):
        ordered = sorted(stages)
        if len(ordered) > 1:
            ties.append(Tie(key, tuple(attrs), ordered[0], tuple(ordered[1:])))
    return ties


def tied_params(module: nn.Module, attrs: tuple[str, ...]) -> list[nn.Parameter]:
    return [functools.reduce(getattr, attr.split("."), module) for attr in attrs]


def reader_copies(module: PipelineModule, tie: Tie, local_stages: range) -> dict[int, nn.Module]:
    """Per local reader stage, the module it uses for ``tie``: the copy ``PetraPipelineModule`` gave it, or
    DeepSpeed's module of the tie (a plain ``PipelineModule`` hosts one stage per rank, so no reader shares a
    rank with its owner)."""
    copies = getattr(module, "tied_copies", {})
    return {j: copies.get((j, tie.key), module.tied_modules[tie.key]) for j in tie.readers if j in local_stages}


def give_readers_their_copy(module: PipelineModule, tie: Tie, local_stages: range) -> dict[int, nn.Module]:
    """Per local reader stage, the module it uses for ``tie``; a reader on the owner's rank gets a deep
    copy (DeepSpeed shares one module per rank), so that every reader holds its own weights whatever
    the placement of the stages."""
    parts = petra_parts(module)
    out = {}
    for j in tie.readers:
        if j not in local_stages:
            continue
        base = module.tied_modules[tie.key]
        twin = copy.deepcopy(base) if tie.owner in local_stages else base
        for idx in range(parts[j] - module._local_start, parts[j + 1] - module._local_start):
            layer = module.forward_funcs[idx]
            if layer is base:
                module.forward_funcs[idx] = twin
            elif isinstance(layer, functools.partial) and layer.args and layer.args[0] is base:
                module.forward_funcs[idx] = functools.partial(layer.func, twin, *layer.args[1:], **layer.keywords)
        if twin is not base:
            module.add_module(f"petra_tied_{tie.key}_stage{j}", twin)
        out[j] = twin
    return out


def tag_muon_parameters(module: PipelineModule) -> None:
    """Set ``use_muon`` on every parameter for DeepSpeed's ``"muon"`` optimizer: Muon for the hidden
    matrices (2-D weights of ``nn.Linear`` modules in layers other than the first and the last), AdamW for
    the rest (embeddings, the head, norms, biases, tied layers). DeepSpeed tags by name ("embed",
    "lm_head"), which a pipeline's layer-indexed names do not carry: it would orthogonalize the embedding
    and the head."""
    last = len(module._layer_specs) - 1
    hidden = set()
    for name, sub in module.named_modules():
        index = name.split(".", 1)[0]
        if isinstance(sub, nn.Linear) and index.isdigit() and 0 < int(index) < last:
            hidden.add(id(sub.weight))
    for p in module.parameters():
        p.use_muon = id(p) in hidden
