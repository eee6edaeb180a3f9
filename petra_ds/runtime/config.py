"""The ``"petra"`` section of a DeepSpeed config, and what PETRA cannot take from the rest of it."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from ..schedule import kept_first
from ..util.checks import int_at_least, positive_int
from .compensation import Combined, DelayCompensation, DelayCompensationError
from .compiled import CUDA_GRAPH_MODES
from .fifo import FIFO_OFFLOADS
from .graphed import EMULATE
from .loss_scale import LossScaleConfig
from .precision import Precision
from .transport import MESSAGE_OFFLOADS

INPUT_BUFFERS = ("non_reversible", "all")
BN_RUNNING_STATS = ("backward", "forward")
NON_FINITE = ("raise", "skip")


class PetraConfigError(ValueError):
    """A config value PETRA cannot run with; the message names the key and what to change."""


@dataclass(frozen=True)
class PetraConfig:
    """Parsed ``"petra"`` section (its keys: docs/reference/config.md)."""

    stages_per_rank: int = 1
    input_buffer: str = "non_reversible"
    param_buffer: bool = False
    bn_running_stats: str = "backward"
    seed: int = 0
    #: a non-finite loss or gradient: "raise" (naming stage, micro-batch / step and clock) or "skip" the
    #: stage's update for that step; parameters are never overwritten with NaN
    non_finite: str = "raise"
    #: find the first NaN / Inf in a micro-batch, an activation, a reconstruction or a gradient and stop with a
    #: ``NonFiniteError`` naming it, its stage, micro-batch and clock (``petra_ds.runtime.finite``; logged instead under
    #: ``non_finite: "skip"``). Device-side checks, read once per ``train_batch``
    check_finite: bool = True
    #: check every layer declared reversible once, on its first input (``inverse(forward(x)) == x``)
    check_reversible: bool = True
    #: every this many optimizer steps, compare PETRA's gradient with the delayed and the end-to-end
    #: gradient per stage (``petra_ds.diagnostics.gradient_quality``); 0 turns it off. A diagnostic: it does
    #: not change training, and a checkpoint may be resumed with another value
    gradient_quality_every: int = 0
    #: a reversible stage's backward goes block by block from its last block (reconstruct the block's input,
    #: then backpropagate through it) instead of reconstructing every block first; on CUDA the
    #: reconstruction of block i-1 runs on a second stream while block i's gradients are computed
    #: (PaReprop). The same arithmetic, so the same gradients (bit for bit on CPU); at most two blocks'
    #: graphs are alive at once instead of the whole stage's. A speed / memory setting: it does not change
    #: training
    reconstruct_overlap: bool = False
    #: run every stage's forward, reconstruction and VJP through ``torch.compile`` (``runtime/compiled.py``; true:
    #: torch's default backend, inductor, or a backend's name such as "aot_eager"): each
    #: coupling's F and G, and each layer that is not reversible, compiled in place (names and checkpoints
    #: unchanged). The same arithmetic up to the compiler's rounding (float64 on CPU: tested). Off by default: it
    #: costs compile time at the first clocks, and no GPU run has yet shown what it saves
    compile: bool | str = False
    #: each of those parts replays CUDA graphs, one per argument signature, captured at its first calls
    #: (``runtime/graphed.py``): fewer host launches where a clock is host-bound. "emulate" runs the same code with
    #: eager stand-ins on any device, to check on a CPU that a model can be graphed (bit for bit against eager).
    #: Off by default until a GPU run shows what it saves
    cuda_graphs: bool | str = False
    #: what each stage does about its delay tau_j (``petra_ds.runtime.compensation``): "none" (the paper's PETRA),
    #: "weight_prediction", "lr_rescale", "adaptive_momentum" or "error_feedback", an object {"method": ...,
    #: its parameters}, or a list of them applied together
    delay_compensation: DelayCompensation | Combined = DelayCompensation()
    #: the first this many ``train_batch`` calls run synchronously: each feeds its k micro-batches and runs on
    #: until they had their backwards everywhere (GPipe's schedule, 2(J-1) clocks more per call), so every
    #: gradient is the end-to-end one and delay compensation waits (``runtime/compensation.py``). Against the
    #: delay's damage early in training, when the weights move fastest
    synchronous_steps: int = 0
    #: where a non-reversible stage's FIFO entries wait for their backward (``runtime/fifo.py``): "none" (on the
    #: device) or "cpu" (host memory; each entry is copied out as it is stored, and back one clock before its
    #: backward reads it). The same bits either way: a memory setting, not a training one
    fifo_offload: str = "none"
    #: where a message between two stages of one rank waits for the instruction that reads it (``Inbox`` in
    #: ``runtime/transport.py``): "none" (on the device) or "cpu" (host memory from its send until the compute
    #: instruction before its reader). For one process hosting many stages; the same bits either way
    message_offload: str = "none"
    #: ``save_checkpoint`` copies what it writes to host memory and returns; a thread writes the files while
    #: training goes on, and rank 0 commits the checkpoint once every rank has written (``runtime/background_save.py``).
    #: ``engine.wait_for_checkpoint()`` waits for it (the next save and every load do). Not a training setting
    async_save: bool = False

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> "PetraConfig":
        if section is not None and not isinstance(section, Mapping):
            raise PetraConfigError(
                f'the "petra" config section must be an object of keys such as "stages_per_rank", got '
                f'{section!r}; use "petra": {{}} for the defaults')
        section = dict(section or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise PetraConfigError(
                f'unknown key(s) {unknown} in the "petra" config section; the known keys are {sorted(known)}'
            )
        try:
            section["delay_compensation"] = DelayCompensation.parse(section.get("delay_compensation"))
        except DelayCompensationError as error:
            raise PetraConfigError(str(error)) from None
        config = cls(**section)
        config.validate()
        return config

    def validate(self) -> None:
        positive_int(self.stages_per_rank, '"petra.stages_per_rank"', PetraConfigError)
        if self.input_buffer not in INPUT_BUFFERS and kept_first(self.input_buffer) is None:
            raise PetraConfigError(f'"petra.input_buffer" must be one of {INPUT_BUFFERS} or "first_N" with N >= 1 '
                                   f'(stages 1 .. N keep their inputs), got {self.input_buffer!r}')
        if not isinstance(self.param_buffer, bool):
            raise PetraConfigError(f'"petra.param_buffer" must be true or false, got {self.param_buffer!r}')
        if self.bn_running_stats not in BN_RUNNING_STATS:
            raise PetraConfigError(
                f'"petra.bn_running_stats" must be one of {BN_RUNNING_STATS}, got {self.bn_running_stats!r}')
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise PetraConfigError(f'"petra.seed" must be an integer, got {self.seed!r}')
        if self.non_finite not in NON_FINITE:
            raise PetraConfigError(f'"petra.non_finite" must be one of {NON_FINITE}, got {self.non_finite!r}')
        if not isinstance(self.check_finite, bool):
            raise PetraConfigError(f'"petra.check_finite" must be true or false, got {self.check_finite!r}')
        if not isinstance(self.check_reversible, bool):
            raise PetraConfigError(f'"petra.check_reversible" must be true or false, got {self.check_reversible!r}')
        if not isinstance(self.compile, (bool, str)) or self.compile == "":
            raise PetraConfigError(f'"petra.compile" must be true, false or a torch.compile backend\'s name (e.g. '
                                   f'"inductor", "aot_eager"), got {self.compile!r}')
        if self.compile in CUDA_GRAPH_MODES:
            raise PetraConfigError(
                f'"petra.compile": {self.compile!r} replays CUDA graphs, and a replay overwrites the outputs a stage '
                f'keeps across other replays, from its reconstruction until its VJP reads them (an H100 with torch '
                f'2.11 stopped training so). Set it to true (inductor without CUDA graphs) or '
                f'"max-autotune-no-cudagraphs"')
        self._check_cuda_graphs()
        if not isinstance(self.reconstruct_overlap, bool):
            raise PetraConfigError(
                f'"petra.reconstruct_overlap" must be true or false, got {self.reconstruct_overlap!r}')
        if self.fifo_offload not in FIFO_OFFLOADS:
            raise PetraConfigError(
                f'"petra.fifo_offload" must be one of {FIFO_OFFLOADS} ("cpu": a non-reversible stage keeps its input '
                f'FIFO, stage 0 its micro-batches, in host memory; "auto": only where the copies hide under its '
                f'compute), got {self.fifo_offload!r}')
        if self.message_offload not in MESSAGE_OFFLOADS:
            raise PetraConfigError(
                f'"petra.message_offload" must be one of {MESSAGE_OFFLOADS} ("cpu": messages between stages of one '
                f'rank wait in host memory until the instruction before their reader), got {self.message_offload!r}')
        int_at_least(0, self.synchronous_steps, '"petra.synchronous_steps"', PetraConfigError,
                     " (train_batch calls run without delay before PETRA's own; 0: none)")
        if not isinstance(self.async_save, bool):
            raise PetraConfigError(f'"petra.async_save" must be true or false, got {self.async_save!r}')
        if self.param_buffer and self.delay_compensation.method != "none":
            raise PetraConfigError(
                '"petra.param_buffer" (weight stashing) already runs each backward with its forward\'s weights; '
                'it cannot be combined with "petra.delay_compensation": remove one of them')
        int_at_least(0, self.gradient_quality_every, '"petra.gradient_quality_every"', PetraConfigError, " (0: off)")

    def _check_cuda_graphs(self) -> None:
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == EMULATE):
            raise PetraConfigError(f'"petra.cuda_graphs" must be true, false or "emulate", got {self.cuda_graphs!r}')
        if self.cuda_graphs is False:
            return
        clashes = [(self.compile, '"petra.compile" (compiled code and graphs of it are not checked together)'),
                   (self.reconstruct_overlap, '"petra.reconstruct_overlap" (replays on its second stream are not '
                    'checked)')]
        for clash, what in clashes:
            if clash:
                raise PetraConfigError(f'"petra.cuda_graphs" cannot be combined with {what}: turn one of them off')


#: DeepSpeed's "muon" without a "muon_lr": the examples and benchmarks give the hidden matrices this many
#: times the AdamW lr (Muon's step is in spectral units). 10 was the best of 10 and 20 for PETRA and for
#: backprop in the RevGPT sweep at 1,500 steps (BENCHMARKS.md, accuracy of language models)
MUON_LR_RATIO = 10


def uses_muon(config: Mapping[str, Any]) -> bool:
    """Whether the config trains with DeepSpeed's Muon (hidden matrices) and AdamW for the other parameters."""
    return str(config.get("optimizer", {}).get("type", "")).lower() == "muon"


#: DeepSpeed optimizer types (lower case) that it builds from its own CUDA sources (those of ``_TORCH_ADAM`` unless
#: "torch_adam" is set)
_JIT_BUILT = {"adam": "FusedAdam", "adamw": "FusedAdam", "muon": "FusedAdam (for the AdamW of the non-matrix "
              "parameters)", "lamb": "FusedLamb", "onebitadam": "FusedAdam", "zerooneadam": "FusedAdam",
              "onebitlamb": "FusedLamb", "lion": "FusedLion"}
#: the types whose "torch_adam": true makes DeepSpeed use torch's AdamW instead
_TORCH_ADAM = ("adam", "adamw", "muon")


def jit_build_notice(config: Mapping[str, Any], environ: Mapping[str, str], cuda: bool) -> str | None:
    """What DeepSpeed would compile before training on a GPU for this config's optimizer, and what to do about
    it; None when nothing is compiled (CPU, ``"torch_adam": true``, an optimizer passed in code)."""
    optimizer = config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    if not cuda or kind not in _JIT_BUILT or (kind in _TORCH_ADAM and params.get("torch_adam")):
        return None
    text = (f'DeepSpeed will JIT-compile its {_JIT_BUILT[kind]} for "optimizer": {{"type": "{optimizer["type"]}"}} '
            "before the first step: it needs nvcc (a pip-installed torch brings none) and takes about a minute the "
            "first time.")
    if kind in _TORCH_ADAM:
        text += (' Add "torch_adam": true (and "fused": true for torch\'s fused kernel) to its "params" to use '
                 "torch's AdamW instead: no build.")
    arch = environ.get("TORCH_CUDA_ARCH_LIST", "")
    if re.search(r"\d\.\d+[a-zA-Z]", arch):
        text += (f" TORCH_CUDA_ARCH_LIST={arch!r} has an architecture with a suffix, which DeepSpeed's op builder "
                 "cannot parse (ValueError: invalid literal for int()): drop the suffix (e.g. 9.0a -> 9.0) for the "
                 "build.")
    return text


def check_section_names(config: Mapping[str, Any]) -> None:
    """A section named like "petra" but not exactly so ("PETRA", "Petra", "petra_") would otherwise be
    ignored, and the run would silently train DeepSpeed's 1F1B."""
    for key in config:
        if key != "petra" and isinstance(key, str) and \
                difflib.SequenceMatcher(None, key.lower().strip(" _-"), "petra").ratio() >= 0.8:
            raise PetraConfigError(
                f'the config has a "{key}" section, which is not "petra": PETRA reads only "petra" (lower case). '
                'Rename it to train with PETRA, or remove it to train with DeepSpeed\'s 1F1B')


def check_stages_per_rank(petra: PetraConfig, built: int) -> None:
    """The model must be built with the ``stages_per_rank`` the config names."""
    if built != petra.stages_per_rank:
        raise PetraConfigError(
            f'"petra.stages_per_rank" is {petra.stages_per_rank} but the model was built with '
            f"stages_per_rank={built}; build it with petra_ds.PetraPipelineModule(..., stages_per_rank=...) "
            "matching the config")


def split_config(config: Mapping[str, Any]) -> tuple[PetraConfig, dict[str, Any], Precision]:
    """(PETRA's section, the config DeepSpeed's engine is built with, the run's precision).

    DeepSpeed would cast the model to bf16 or fp16 and wrap the optimizer in one whose overflow check and gradient
    norm are collectives over every stage, with one loss scale for the whole model; PETRA keeps fp32 parameters and
    runs autocast itself, fp16 with a loss scale per stage (``runtime/loss_scale.py``), so the ``bf16`` and ``fp16``
    sections are taken out here.
    """
    config = dict(config)
    petra = PetraConfig.from_dict(config.pop("petra", None))
    bf16, fp16 = _section(config, "bf16"), _section(config, "fp16")
    config.pop("bf16", None)
    config.pop("fp16", None)
    precision = Precision()
    if bf16.get("enabled", False) and fp16.get("enabled", False):
        raise PetraConfigError('"bf16" and "fp16" are both enabled: enable one (bf16 on a GPU of compute capability '
                               '8.0 or later, fp16 before that)')
    if bf16.get("enabled", False):
        precision = Precision(torch.bfloat16)
    elif fp16.get("enabled", False):
        try:
            precision = Precision(torch.float16, LossScaleConfig.from_section(fp16))
        except ValueError as e:  # pydantic's ValidationError is one: its messages, without its banner
            errors = e.errors() if callable(getattr(e, "errors", None)) else None
            text = "; ".join(error["msg"] for error in errors) if errors else str(e)
            raise PetraConfigError(f'the "fp16" section: {text}') from None
    if _section(config, "torch_autocast").get("enabled", False):
        raise PetraConfigError(
            '"torch_autocast" is not supported with PETRA: its engine runs the stages itself, so DeepSpeed\'s '
            'autocast would be silently ignored; use "bf16": {"enabled": true} or "fp16": {"enabled": true} '
            '(autocast inside each stage, fp32 parameters)')
    clipping = config.get("gradient_clipping") or 0.0
    if not isinstance(clipping, (int, float)) or isinstance(clipping, bool) or clipping < 0:
        raise PetraConfigError(
            f'"gradient_clipping" must be a number >= 0 (0: off; with PETRA each stage clips its own gradient '
            f'norm to it), got {clipping!r}')
    _check_zero(config.get("zero_optimization"))
    gas = config.get("gradient_accumulation_steps", 1)
    if gas is not None and (not isinstance(gas, int) or isinstance(gas, bool)):
        raise PetraConfigError(f'"gradient_accumulation_steps" (PETRA\'s k) must be an integer >= 1, got {gas!r}')
    if gas is not None and gas < 1:
        raise PetraConfigError(f'"gradient_accumulation_steps" (PETRA\'s k) must be >= 1, got {gas}')
    return petra, config, precision


ZERO_OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param")


def _section(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``config[key]`` as a dict (empty when absent or null), so that a malformed section is refused by
    name instead of failing on an attribute lookup."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PetraConfigError(f'"{key}" must be an object ({{"enabled": ...}}), got {value!r}')
    return dict(value)


def _check_zero(zero: Any) -> None:
    """ZeRO partitions optimizer states and reduces gradients for the whole model at one step, while
    PETRA's stages step at different clocks: only stage 0 runs. Offload settings are read by ZeRO alone,
    so at stage 0 DeepSpeed would ignore them without a word; they are refused instead."""
    if zero is None or zero is False:
        return
    if zero is True:  # DeepSpeed's legacy spelling of stage 1
        raise PetraConfigError('"zero_optimization": true (ZeRO stage 1) is not supported with PETRA: ZeRO '
                               'partitions and reduces gradients across the whole model at one step; remove it')
    if not isinstance(zero, Mapping):
        raise PetraConfigError(f'"zero_optimization" must be an object such as {{"stage": 0}}, got {zero!r}')
    stage = zero.get("stage", 0)
    try:
        stage_number = int(stage or 0)
    except (TypeError, ValueError):
        raise PetraConfigError(f'"zero_optimization.stage" must be 0 with PETRA, got {stage!r}') from None
    if stage_number != 0:
        raise PetraConfigError(
            f'"zero_optimization.stage" {stage} is not supported with PETRA: ZeRO partitions and '
            'reduces gradients across the whole model at one step; set it to 0')
    for key in ZERO_OFFLOAD_KEYS:
        value = zero.get(key)
        if not value or (isinstance(value, Mapping) and value.get("device") in (None, "none")):
            continue
        raise PetraConfigError(
            f'"zero_optimization.{key}" is not supported with PETRA: offloading is part of ZeRO (stage >= 1), '
            'which PETRA cannot run, so it would be ignored; remove it')
