"""Atomic checkpoint directories in DeepSpeed's pipeline layout, plus PETRA's in-flight state by stage.

Layer weights go to ``<dir>/<tag>/layer_XX-model_states.pt`` exactly as DeepSpeed's ``PipelineModule``
writes them (so a plain ``PipelineModule.load_state_dir`` reads them); each rank adds one
``petra_stage-JJ-data_YY.pt`` per PETRA stage it hosts, with what is in flight there: accumulated gradients,
input FIFO, stashed parameters, stage 0's raw micro-batches, the messages the stage received for the next
clock, its optimizer and scheduler states, and where the run is (clock, micro-batches fed, steps). A stage's
file names no rank: a run resumes on another placement of the same J stages (P x stages_per_rank), each rank
reading the files of the stages it hosts now; on another data-parallel degree with the same global micro-batch,
each replica joins or cuts the rows of the replicas it replaces (``replicas.py``). Checkpoints written before (one
``petra_state-pipe_XX-data_YY.pt`` per rank) load on the layout that wrote them.

Everything is written into ``<dir>/.<tag>.partial`` first; once every rank has written, rank 0 moves
the previous ``<tag>`` aside, renames the partial directory into place and rewrites ``latest``
through a temporary file. A process killed at any point leaves the previous checkpoint and ``latest``
loadable (``resolve`` falls back to the moved-aside copy in the one window where it is needed).

Every file is read with ``torch.load(weights_only=True)``: tensors and plain Python values only, so a
crafted file cannot run code; one that needs more is refused, naming it (:class:`UnsafeCheckpointError`).
"""

from __future__ import annotations

import glob
import os
import pickle
import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ..pipeline.module import petra_parts
from ..util.files import atomic_save, write_text_atomic
from . import replicas
from .background_save import BackgroundSave, HostStaging
from .config import PetraConfig

if TYPE_CHECKING:
    from .engine import PetraEngine

LATEST = "latest"
#: ``petra`` keys that do not change training: a checkpoint resumes under other values
DIAGNOSTIC_KEYS = ("gradient_quality_every", "check_reversible", "reconstruct_overlap", "compile", "cuda_graphs",
                   "fifo_offload", "message_offload", "async_save")


def partial_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.partial")


def state_file(ckpt_dir: str, pipe: int, data: int) -> str:
    """A rank's file in checkpoints written before the state was kept by stage (read only)."""
    return os.path.join(ckpt_dir, f"petra_state-pipe_{pipe:02d}-data_{data:02d}.pt")


def stage_file(ckpt_dir: str, stage: int, data: int) -> str:
    """PETRA stage ``stage``'s file, in data-parallel replica ``data``."""
    return os.path.join(ckpt_dir, f"petra_stage-{stage:02d}-data_{data:02d}.pt")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds objects that loading would construct by running code."""


def load_file(path: str, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs more is refused, naming it, never executed."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsafeCheckpointError(
            f"{path} holds more than tensors and plain Python values, so loading it could run code, and it was "
            f"not loaded ({reason}). petra_ds reads checkpoints with torch.load(weights_only=True); use a "
            "checkpoint written by petra_ds's save_checkpoint, from a source you trust") from None


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` (``load_file``): the layer files
    of a checkpoint are read as tensors, never unpickled into arbitrary objects."""

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_file(path, map_location)


def prepare(save_dir: str, tag: str) -> str:
    """(rank 0) A fresh partial directory for ``tag``."""
    path = partial_dir(save_dir, tag)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def commit(save_dir: str, tag: str, save_latest: bool) -> str:
    """(rank 0, after every rank wrote) Put the partial directory in place of ``tag``."""
    final = os.path.join(save_dir, tag)
    aside = os.path.join(save_dir, f".{tag}.old")
    if os.path.exists(aside) and not os.path.exists(final):
        os.replace(aside, final)  # an earlier crash left this tag only aside: it is the live copy
    if os.path.exists(aside):
        shutil.rmtree(aside)
    if os.path.exists(final):
        os.replace(final, aside)
    os.replace(partial_dir(save_dir, tag), final)
    if save_latest:
        write_text_atomic(os.path.join(save_dir, LATEST), tag)
    if os.path.exists(aside):
        shutil.rmtree(aside)
    return final


def resolve(load_dir: str, tag: str | None) -> tuple[str, str]:
    """(tag, directory) to load; ``tag=None`` reads ``latest``."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.exists(latest):
            raise FileNotFoundError(f"no '{LATEST}' file in {load_dir}: pass tag=... or save with save_latest=True")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        aside = os.path.join(load_dir, f".{tag}.old")
        if os.path.isdir(aside):
            return str(tag), aside
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return str(tag), path


# --- a PetraEngine's checkpoint (the engine's save_checkpoint / load_checkpoint) ---


class CollectedFiles(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, collecting ``(path, state_dict)`` instead of writing: the layer files of
    ``PipelineModule.save_state_dict``, written with the stages' files by :func:`save_engine`. ``clone``: whether
    DeepSpeed clones each tensor first (not when a snapshot in host memory copies them anyway)."""

    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.clone = clone
        self.files: list[tuple[str, Any]] = []

    def preserves_storage_sharing(self) -> bool:
        return self.clone

    def save(self, state_dict: Any, path: str) -> None:
        self.files.append((path, state_dict))


def save_engine(engine: PetraEngine, save_dir: str, tag: str, client_state: dict | None, save_latest: bool,
                exclude_frozen_parameters: bool) -> str:
    """Every rank: its layer files in DeepSpeed's layout and one file per PETRA stage it hosts, then rank 0
    commits; with ``async_save``, the files are copied to host memory and written by a thread
    (``background_save.py``), and this returns as soon as the copy is taken."""
    if engine.mid_clock:
        raise RuntimeError("save_checkpoint() must be called between train_batch() calls")
    engine.wait_for_checkpoint()
    if engine.global_rank == 0:
        prepare(save_dir, tag)
    engine.transport.barrier("save_checkpoint: the directory is prepared")
    path = partial_dir(save_dir, tag)
    background = engine.petra_config.async_save
    layers = CollectedFiles(clone=not background)
    engine.module.save_state_dict(path, checkpoint_engine=layers, exclude_frozen_params=exclude_frozen_parameters)
    files = layers.files + [(stage_file(path, j, engine.grid.data_parallel_id), record)
                            for j, record in stage_records(engine, client_state).items()]
    final = os.path.join(save_dir, tag)
    rank0 = engine.global_rank == 0
    if background:
        if engine.host_staging is None:
            engine.host_staging = HostStaging()
        engine.pending_save = BackgroundSave(
            engine.host_staging.copy(files), path, engine.global_rank, engine.world_size,
            (lambda: commit(save_dir, tag, save_latest)) if rank0 else None)
        engine.transport.save_trace()
        return final
    for file, obj in files:
        atomic_save(obj, file)
    engine.transport.barrier("save_checkpoint: every rank wrote its files")
    if rank0:
        final = commit(save_dir, tag, save_latest)
    engine.transport.barrier("save_checkpoint: committed")
    engine.transport.save_trace()
    return final


def after_train_batch(engine: PetraEngine) -> None:
    """Rank 0 commits a checkpoint written in the background once every rank's files are on disk (no collective)."""
    if engine.pending_save is not None:
        engine.pending_save.poll()


def wait(engine: PetraEngine) -> None:
    """Every rank: wait for a checkpoint written in the background to be on disk and committed."""
    if engine.pending_save is not None:
        engine.pending_save.finish(engine.transport.barrier)
        engine.pending_save = None
        engine.transport.save_trace()


def signature(engine: PetraEngine) -> dict:
    """What a checkpoint must match to be resumed: J and how the layers are cut into stages, the data-parallel
    degree and micro-batch size (or another pair with the same product, :func:`_matching`), k and the
    training-relevant ``petra`` config. Not the placement (P x stages_per_rank)."""
    petra = {k: v for k, v in asdict(engine.petra_config).items() if k not in DIAGNOSTIC_KEYS + ("stages_per_rank",)}
    return {"stages": engine.num_petra_stages, "parts": list(petra_parts(engine.module)),
            "data_parallel": engine.grid.data_parallel_size, "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "k": engine.micro_batches, "petra": petra}


def _matching(written: dict, ours: dict) -> dict:
    """``written`` (a checkpoint's signature) with our data-parallel degree and micro-batch size where its global
    micro-batch (their product) is ours: the run resumes with the replicas regrouped. A checkpoint written
    before the micro-batch size was recorded is taken to have ours."""
    written = {**written, "micro_batch": written.get("micro_batch", ours["micro_batch"]),
               "petra": with_defaults(written.get("petra", {}), ours["petra"])}
    if written["data_parallel"] * written["micro_batch"] == ours["data_parallel"] * ours["micro_batch"]:
        written.update(data_parallel=ours["data_parallel"], micro_batch=ours["micro_batch"])
    return written


def stage_records(engine: PetraEngine, client_state: dict | None) -> dict[int, dict]:
    """The file of each local stage: its state, where the run is, the signature and the client state."""
    state = engine.petra_state()
    run = {key: value for key, value in state.items() if key != "stages"}
    placement = {"pipe": engine.pipeline_ranks, "stages_per_rank": engine.stages_per_rank}
    common = {"format": 2, "signature": signature(engine), "placement": placement, "run": run,
              "client_state": client_state or {}}
    return {j: {**common, "stage": own} for j, own in state["stages"].items()}


def layout_signature(engine: PetraEngine) -> dict:
    """What a per-rank checkpoint (written before the state was kept by stage) must match: its placement too."""
    return {"pipe": engine.pipeline_ranks, "data": engine.grid.data_parallel_size,
            "stages_per_rank": engine.stages_per_rank, "k": engine.micro_batches,
            "petra": {k: v for k, v in asdict(engine.petra_config).items() if k not in DIAGNOSTIC_KEYS}}


def with_defaults(written: dict, ours: dict) -> dict:
    """A checkpoint's ``petra`` config with the keys it lacks at their defaults: the code that wrote it had no
    such key, so it ran as the default does."""
    defaults = asdict(PetraConfig())
    return {**{k: defaults[k] for k in ours if k not in written}, **written}


def differences(written: dict, ours: dict, prefix: str = "") -> list[str]:
    """``key: written -> ours`` for every entry that differs (nested dictionaries by dotted key)."""
    out = []
    for key in sorted(set(written) | set(ours)):
        a, b = written.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the checkpoint, {b!r} in this run")
    return out


def _stage_state(engine: PetraEngine, path: str) -> tuple[dict, dict]:
    """(the state ``load_petra_state`` takes, the client state) from the files of this rank's stages: of its own
    replica, or of the replicas whose rows it holds now (``replicas.py``)."""
    ours = signature(engine)
    written = written_replicas(path)
    olds, part, parts = replicas.sources(engine.grid.data_parallel_id, written, ours["data_parallel"])
    records = {j: [load_file(stage_file(path, j, r), engine.device) for r in olds] for j in engine.local_stage_ids}
    first = records[engine.local_stage_ids[0]][0]
    differ = differences(_matching(first["signature"], ours), ours)
    if differ:
        raise ValueError(f"checkpoint {path} cannot continue in this run: " + "; ".join(differ) +
                         ". Resume with the same stages, k and petra config, and the same global micro-batch "
                         "(data_parallel x micro_batch: train_micro_batch_size_per_gpu); the number of processes, "
                         "stages_per_rank and the data-parallel degree may change")
    if any(r["run"] != first["run"] for rs in records.values() for r in rs):
        raise ValueError(f"checkpoint {path}: its stage files were written at different clocks")
    stages = {j: rs[0]["stage"] if written == ours["data_parallel"] else
              replicas.regroup([r["stage"] for r in rs], part, parts) for j, rs in records.items()}
    return {"row_blocks": written, **first["run"], "stages": stages}, first["client_state"]


def _rank_state(engine: PetraEngine, path: str) -> tuple[dict, dict]:
    """The same from a per-rank file, on the layout that wrote it."""
    old = load_file(state_file(path, engine.stage_id, engine.grid.data_parallel_id), engine.device)
    ours = layout_signature(engine)
    differ = differences({**old["layout"], "petra": with_defaults(old["layout"]["petra"], ours["petra"])}, ours)
    if differ:
        raise ValueError(f"checkpoint {path} cannot continue in this run: " + "; ".join(differ) +
                         ". A checkpoint written before the state was kept by stage resumes on the same layout and "
                         "petra config")
    stages = {}
    for i, j in enumerate(engine.local_stage_ids):
        copies = {key.split(":", 1)[1]: sd for key, sd in old["reader_tied_modules"].items()
                  if int(key.split(":", 1)[0]) == j}
        stages[j] = {"state": old["stages"][j], "steps": old["stage_steps"][j], "tied_copies": copies,
                     "optimizer": old["optimizers"][i], "scheduler": old["schedulers"][i],
                     "inbox": {key: value for key, value in old["inbox"].items() if key[0] == j}}
    run = {key: old[key] for key in ("clock", "feed", "global_steps", "global_samples")}
    return {**run, "stages": stages}, old["client_state"]


def written_per_rank(path: str) -> bool:
    """Whether the checkpoint in ``path`` was written with one state file per rank (before the state was kept by
    stage)."""
    return bool(glob.glob(os.path.join(path, "petra_state-pipe_*.pt"))) and not glob.glob(
        os.path.join(path, "petra_stage-*.pt"))


def written_replicas(path: str) -> int:
    """How many data-parallel replicas wrote the checkpoint in ``path`` (stage 0's files; 0 if it has none)."""
    return len(glob.glob(os.path.join(path, "petra_stage-00-data_*.pt")))


def state_files(engine: PetraEngine, path: str, per_rank: bool) -> list[str]:
    """The PETRA state files this rank's load of the checkpoint in ``path`` opens: its stages' (its rank's when
    ``per_rank``, :func:`written_per_rank`), of each replica whose rows it holds now."""
    if per_rank:
        return [state_file(path, engine.stage_id, engine.grid.data_parallel_id)]
    written = written_replicas(path) or engine.grid.data_parallel_size
    try:
        olds = replicas.sources(engine.grid.data_parallel_id, written, engine.grid.data_parallel_size)[0]
    except ValueError as error:
        raise ValueError(f"checkpoint {path}: {error}") from None
    return [stage_file(path, j, r) for j in engine.local_stage_ids for r in olds]


def load_engine(engine: PetraEngine, load_dir: str, tag: str | None, strict: bool, optimizer_states: bool,
                scheduler_states: bool, module_only: bool) -> tuple[str, dict]:
    """Load what :func:`save_engine` wrote, on this placement; training continues exactly where it stopped."""
    tag, path = resolve(load_dir, tag)
    engine.module.load_state_dir(load_dir=path, checkpoint_engine=WeightsOnlyCheckpointEngine(), strict=strict)
    if module_only:
        return path, {}
    per_rank = written_per_rank(path)
    missing = [f for f in state_files(engine, path, per_rank) if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"checkpoint {path} lacks {', '.join(os.path.basename(f) for f in missing)}: it "
                                "was not written by PetraEngine.save_checkpoint for these stages and data-parallel "
                                "replicas; load its layers alone with load_module_only=True")
    state, client_state = _rank_state(engine, path) if per_rank else _stage_state(engine, path)
    engine.load_petra_state(state, optimizer_states, scheduler_states)
    return path, client_state
