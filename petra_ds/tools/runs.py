"""What the example training scripts share: the pipeline x data-parallel layout of a run, fitted to the
processes launched (:func:`choose_layout`), the files it writes (``metrics.jsonl``, ``summary.json``,
``curves.png``) in its output directory, and its checkpoints (``<output-dir>/checkpoints``, written every
``--save-every`` steps and loaded by ``--resume``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from deepspeed import comm as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from ..runtime.config import PetraConfigError, check_section_names
from ..runtime.distributed import is_rank0
from ..runtime.shutdown import before_exit, shutdown
from ..schedule import delay
from ..util.checks import positive_int
from ..util.files import save_figure, write_text_atomic
from .run_checkpoints import checkpoint_dir


@dataclass(frozen=True)
class Layout:
    """How a run's processes are arranged: ``pipeline_ranks`` x ``data_parallel`` processes, each pipeline
    rank hosting ``stages_per_rank`` of the ``stages`` (J) stages cut from ``layers`` layers. For DeepSpeed's
    1F1B (``petra`` false) every pipeline rank is one stage and DeepSpeed partitions the layers itself."""

    pipeline_ranks: int
    data_parallel: int
    stages_per_rank: int
    stages: int
    layers: int
    petra: bool = True

    @property
    def world(self) -> int:
        return self.pipeline_ranks * self.data_parallel

    def topology(self) -> PipeDataParallelTopology:
        """DeepSpeed's grid for this layout (data-parallel innermost: rank r is replica r % data_parallel)."""
        return PipeDataParallelTopology(num_pp=self.pipeline_ranks, num_dp=self.data_parallel)

    def describe(self) -> str:
        """One line for the start of a run, e.g. ``layout: 18 processes = 9 pipeline ranks x 2 data-parallel
        replicas; J = 9 PETRA stages (1 per rank) over 10 layers``."""
        head = (f"layout: {_count(self.world, 'process', 'processes')} = "
                f"{_count(self.pipeline_ranks, 'pipeline rank')} x "
                f"{_count(self.data_parallel, 'data-parallel replica')}")
        if not self.petra:
            return f"{head}; DeepSpeed 1F1B, one stage per pipeline rank over {_count(self.layers, 'layer')}"
        return (f"{head}; J = {_count(self.stages, 'PETRA stage')} ({self.stages_per_rank} per rank) "
                f"over {_count(self.layers, 'layer')}")


def _count(n: int, singular: str, plural: str | None = None) -> str:
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def choose_layout(num_layers: int, world: int, stages: int | None = None, data_parallel: int | None = None,
                  *, petra: bool = True) -> Layout:
    """Fit the pipeline x data-parallel layout to the ``world`` processes that were launched, so a launch
    command works at any process count; an explicit ``stages`` (J) or ``data_parallel`` (D) is kept, and an
    impossible one raises a ValueError that says what to change.

    PETRA needs the same number of stages S on every pipeline rank (J = P x S), but a stage may hold
    several layers, so:

    - neither given: D is the smallest divisor of ``world`` leaving at most one pipeline rank per layer,
      P = world / D, S = floor(num_layers / P) (J = num_layers when P divides it; otherwise some stages
      hold two layers). One process hosts every layer as its own stage: the paper's single-device setting;
    - ``stages`` only: D is the smallest divisor of ``world`` whose P = world / D divides J;
    - ``data_parallel`` only: P = world / D, S = floor(num_layers / P);
    - both: D must divide ``world`` and J be a multiple of P.

    ``petra=False`` (DeepSpeed's 1F1B, which partitions the layers itself) gives P x D with one stage per
    pipeline rank and refuses ``stages``.
    """
    for name, value in (("the number of layers", num_layers), ("the number of processes", world),
                        ("--stages", stages), ("--data-parallel", data_parallel)):
        if value is not None:
            positive_int(value, name)
    if not petra and stages is not None:
        raise ValueError(f"--stages {stages} sets PETRA's number of stages J, but a config without a \"petra\" "
                         "section runs DeepSpeed's 1F1B with one stage per pipeline rank: leave --stages out "
                         "(set the pipeline ranks with --data-parallel) or add a \"petra\" section")
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    if stages is not None and stages > num_layers:
        raise ValueError(f"--stages {stages} is more than the {num_layers} layers of this model: every PETRA "
                         f"stage needs at least one layer; use --stages {num_layers} or fewer")
    if data_parallel is not None:
        if world % data_parallel:
            raise ValueError(f"--data-parallel {data_parallel} does not divide the {world} processes of this "
                             f"run; use one of {divisors} or launch a multiple of {data_parallel} processes")
        ranks = world // data_parallel
        fits = [d for d in divisors if world // d <= num_layers]
        if ranks > num_layers:
            raise ValueError(f"--data-parallel {data_parallel} leaves {world} / {data_parallel} = {ranks} pipeline "
                             f"ranks for {num_layers} layers: every rank needs at least one layer; use "
                             f"--data-parallel {fits[0]} or another of {fits}")
        if stages is not None and stages % ranks:
            multiples = list(range(ranks, num_layers + 1, ranks))
            raise ValueError(f"--stages {stages} must be a multiple of the {ranks} pipeline ranks ({world} "
                             f"processes / --data-parallel {data_parallel}): use --stages in {multiples}, or "
                             "leave --data-parallel out to fit it to --stages")
    elif stages is not None:
        data_parallel = next(d for d in divisors if stages % (world // d) == 0)  # d = world: P = 1 always fits
    else:
        data_parallel = next(d for d in divisors if world // d <= num_layers)  # d = world: P = 1 always fits
    ranks = world // data_parallel
    if stages is None:
        stages = ranks * (num_layers // ranks if petra else 1)
    return Layout(pipeline_ranks=ranks, data_parallel=data_parallel, stages_per_rank=stages // ranks,
                  stages=stages, layers=num_layers, petra=petra)


def run_layout(num_layers: int, stages: int | None = None, data_parallel: int | None = None, *,
               petra: bool = True, name: str = "") -> Layout:
    """:func:`choose_layout` for this run's processes, as the example scripts use it: rank 0 prints the layout;
    an impossible request ends the run with the fix (SystemExit) rather than a traceback on every rank. With
    ``petra`` false, ``--stages`` is ignored with a note, as the scripts always did for DeepSpeed's 1F1B."""
    rank0 = dist.get_rank() == 0
    if stages is not None and not petra:
        if rank0:
            print(f"--stages {stages} ignored: DeepSpeed's 1F1B (no \"petra\" config section) runs one stage per "
                  "pipeline rank")
        stages = None
    try:
        layout = choose_layout(num_layers, dist.get_world_size(), stages, data_parallel, petra=petra)
    except ValueError as error:
        raise SystemExit(f"{name}: {error}" if name else str(error)) from None
    if rank0:
        print(layout.describe(), flush=True)
    return layout


def split_global_batch(global_batch: int, replicas: int, stages: int,
                       micro_batches: int | None = None) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step k) for ``global_batch`` samples per optimizer step over
    ``replicas`` data-parallel replicas. ``micro_batches`` fixes k; without it, k is the smallest divisor of
    the per-replica batch that keeps stage 0 at most one optimizer step behind (k >= 2(J - 1), the first
    stage's delay 2(J - 1) / k in steps), or the whole per-replica batch as single samples if none does."""
    positive_int(global_batch, "--global-batch")
    if global_batch % replicas:
        raise ValueError(f"--global-batch {global_batch} does not divide over {replicas} data-parallel replicas; "
                         f"use a multiple of {replicas}")
    per_replica = global_batch // replicas
    if micro_batches is not None:
        positive_int(micro_batches, "--micro-batches")
        if per_replica % micro_batches:
            raise ValueError(f"--micro-batches {micro_batches} does not divide the {per_replica} samples each "
                             "replica takes per step; pick a divisor of it")
        return per_replica // micro_batches, micro_batches
    k = next((d for d in range(1, per_replica + 1) if per_replica % d == 0 and d >= delay(0, stages)), per_replica)
    return per_replica // k, k


def apply_global_batch(args: Any, config: dict, layout: Layout, *, split_for_depth: bool = False) -> None:
    """--global-batch / --micro-batches: write the micro-batch size and k into ``config`` (rank 0 says which).

    ``split_for_depth`` (a PETRA run of the LM example): without --global-batch, the config's own global batch is
    split the same way when its k would leave stage 0 more than one optimizer step behind (k < 2(J-1)), since the
    delay then costs quality that more, smaller micro-batches of the same global batch buy back;
    ``--micro-batches K`` alone splits it into K."""
    global_batch = args.global_batch
    config_micro, config_k = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
    if global_batch is None:
        if not split_for_depth:
            if args.micro_batches is not None:
                raise SystemExit("--micro-batches splits --global-batch: give --global-batch too")
            return
        if args.micro_batches is None and config_k >= delay(0, layout.stages):
            return
        global_batch = config_micro * config_k * layout.data_parallel
    try:
        micro, k = split_global_batch(global_batch, layout.data_parallel, layout.stages, args.micro_batches)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.global_batch is None and is_rank0():
        reason = ("--micro-batches" if args.micro_batches is not None else
                  f"k = {config_k} would leave stage 0 {delay(0, layout.stages) / config_k:g} optimizer steps behind "
                  f"at J = {layout.stages}")
        print(f"the config's global batch of {global_batch} (micro-batch {config_micro} x k = {config_k}) is split as "
              f"micro-batch {micro} x k = {k} ({reason}; --micro-batches {config_k} keeps the config's split)",
              flush=True)
    config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = micro, k
    config.pop("train_batch_size", None)
    if args.global_batch is not None and is_rank0():
        print(f"global batch {global_batch} = {layout.data_parallel} replica(s) x micro-batch {micro} x k = {k} "
              f"micro-batches per step", flush=True)


def add_run_arguments(parser: Any) -> None:
    """The options both example scripts share: checkpoints, resuming, the gradient-quality study, the
    partition."""
    parser.add_argument("--save-every", type=int, default=0,
                        help="checkpoint to <output-dir>/checkpoints every N train_batch calls (0: never)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, choices=("latest", "auto"),
                        help="continue from the latest checkpoint in <output-dir>/checkpoints; without one the run "
                             "stops with an error. --resume auto: continue if there is one, else start fresh")
    parser.add_argument("--keep-last", type=int, default=2, metavar="N",
                        help="keep the newest N checkpoints, removing older ones after each save (0: keep all); "
                             "--resume auto falls back to an older one when the newest is damaged")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end this run after N train_batch calls in all, as a preempted job would (no final "
                             "drain, eval or summary); continue with --resume (needs --save-every)")
    parser.add_argument("--async-save", action="store_true",
                        help='PETRA: sets "petra": {"async_save": true}: a checkpoint is copied to host memory and '
                             "written in the background while training goes on")
    parser.add_argument("--gradient-quality", type=int, default=0, metavar="N",
                        help="PETRA: every N optimizer steps compare each stage's gradient with the delayed "
                             "and the end-to-end one (metrics.jsonl, gradient_quality.png); 0: off")
    parser.add_argument("--delay-compensation", default=None, metavar="METHOD",
                        help='PETRA: sets "petra": {"delay_compensation": ...}: none, weight_prediction, '
                             'lr_rescale, adaptive_momentum, error_feedback, a JSON object such as '
                             '\'{"method": "weight_prediction", "beta": 0.5}\' or a JSON list of them')
    parser.add_argument("--synchronous-steps", type=int, default=0, metavar="N",
                        help='PETRA: sets "petra": {"synchronous_steps": N}: the first N train_batch calls fill and '
                             "drain the pipeline (exact gradients, 2(J-1) more clocks each), against the delay's "
                             "damage early in training")
    parser.add_argument("--global-batch", type=int, default=None, metavar="N",
                        help="samples per optimizer step over all replicas; the micro-batch size and k are chosen from "
                             "it (k: the fewest micro-batches that keep PETRA's first stage at most one optimizer "
                             "step behind) instead of read from the config")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="K",
                        help="with --global-batch: exactly K micro-batches per step (the LM example with PETRA: also "
                             "without it, K micro-batches of the config's global batch)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="the output directory of a finished run to compare with (e.g. the backprop run): the "
                             "summary states this run's gap to it, and whether both trained with the same optimizer")
    parser.add_argument("--partition", default="auto", choices=("auto", "profile"),
                        help="how the layers are cut into stages, for PETRA and the backprop baseline alike: auto, "
                             "the script's own rule; profile, the cut that balances the stages' measured costs "
                             "(rank 0 measures every layer once; <output-dir>/layer_costs.json)")
    parser.add_argument("--layer-costs", default=None, metavar="FILE",
                        help="--partition profile: cut from this costs file (an earlier run's layer_costs.json) "
                             "instead of measuring")


def apply_run_arguments(args: Any, config: dict) -> str:
    """Write --gradient-quality, --delay-compensation, --synchronous-steps and --async-save into a PETRA config's
    "petra" section; returns the method ("petra" or "backprop"). They are PETRA's: with a config without that
    section they exit, as --layer-costs does without --partition profile (it would be ignored)."""
    try:
        check_section_names(config)
    except PetraConfigError as error:
        raise SystemExit(str(error)) from None
    method = "petra" if "petra" in config else "backprop"
    wanted = [flag for flag, value in (("--gradient-quality", args.gradient_quality),
                                       ("--delay-compensation", args.delay_compensation),
                                       ("--synchronous-steps", args.synchronous_steps),
                                       ("--async-save", args.async_save)) if value]
    if wanted and method != "petra":
        raise SystemExit(f"{' and '.join(wanted)} configure PETRA: use a config that has a \"petra\" section")
    if args.layer_costs and args.partition != "profile":
        raise SystemExit("--layer-costs gives the costs --partition profile cuts from: add --partition profile")
    if args.resume == "latest" and not os.path.exists(os.path.join(checkpoint_dir(args.output_dir), "latest")):
        raise SystemExit(f"--resume: no checkpoint to resume from in {checkpoint_dir(args.output_dir)} (no 'latest' "
                         "file); check --output-dir, or use --resume auto to start fresh when there is none")
    if args.baseline and not os.path.exists(os.path.join(args.baseline, "summary.json")):
        raise SystemExit(f"--baseline {args.baseline}: no summary.json there; give the output directory of a finished "
                         "run")
    if args.stop_after is not None and not args.save_every and is_rank0():
        print(f"warning: --stop-after {args.stop_after} without --save-every writes no checkpoint: a later --resume "
              "will have nothing to continue from", flush=True)
    if args.gradient_quality:
        config["petra"]["gradient_quality_every"] = args.gradient_quality
    if args.async_save:
        config["petra"]["async_save"] = True
    if args.synchronous_steps:
        config["petra"]["synchronous_steps"] = args.synchronous_steps
    if args.delay_compensation:
        value = args.delay_compensation
        try:
            config["petra"]["delay_compensation"] = json.loads(value) if value.lstrip()[:1] in "{[" else value
        except json.JSONDecodeError as error:
            raise SystemExit(f"--delay-compensation {value!r} is not valid JSON ({error}); give a method name "
                             "or an object such as '{\"method\": \"weight_prediction\"}'") from None
    return method


#: optimizer parameters that do not say which optimizer it is: the learning rates a search sets, and which
#: implementation of the same update runs (torch's AdamW or DeepSpeed's fused one)
_NOT_THE_OPTIMIZER = ("lr", "muon_lr", "torch_adam")


def optimizer_identity(config: dict) -> dict | None:
    """A DeepSpeed config's optimizer without its learning rates and implementation (None: the examples'
    default AdamW)."""
    section = config.get("optimizer")
    if section is None:
        return None
    params = {k: v for k, v in section.get("params", {}).items() if k not in _NOT_THE_OPTIMIZER}
    return {"type": section["type"].lower(), "params": params}


def against_baseline(summary: dict, baseline_dir: str, metric: str, higher_is_better: bool = False) -> dict:
    """This run's ``metric`` against the baseline run's (its summary.json): the gap (lower is better: relative,
    positive when this run is worse; higher is better: in points, positive when this run is worse) and whether
    both trained with the same optimizer, learning rates aside, so that a gap is the method's and not the
    optimizer's."""
    with open(os.path.join(baseline_dir, "summary.json")) as f:
        baseline = json.load(f)
    mine, theirs = summary[metric], baseline[metric]
    gap = (theirs - mine) * 100 if higher_is_better else (mine - theirs) / theirs
    same = optimizer_identity(summary["config"]) == optimizer_identity(baseline["config"])
    other = optimizer_identity(baseline["config"])
    named = "the default AdamW" if other is None else other["type"]
    gap_text = f"{gap:+.2f} points" if higher_is_better else f"{gap:+.2%}"
    label = (f"{summary['method']} {metric} {mine:.4f} against {baseline['method']} {theirs:.4f}: {gap_text}, "
             + (f"the same optimizer ({named})" if same else f"another optimizer ({named} for {baseline['method']})"))
    return {"baseline": baseline_dir, "metric": metric, "baseline_method": baseline["method"], "value": mine,
            "baseline_value": theirs, "gap": gap, "gap_unit": "points" if higher_is_better else "relative",
            "same_optimizer": same, "label": label}


def skipped_steps(engine: DeepSpeedEngine) -> dict[str, Any]:
    """The optimizer steps a run skipped (non-finite gradients, fp16 overflows) and, under PETRA's fp16, each stage's
    loss scale now, for summary.json. PETRA: every rank's stages, gathered (a collective: every rank calls it);
    DeepSpeed's engine: its own count."""
    from ..runtime.engine import PetraEngine

    if not isinstance(engine, PetraEngine):
        return {"skipped_steps": int(getattr(engine, "skipped_steps", 0) or 0)}
    gathered = engine.transport.all_gather_object((list(engine.skipped_steps), engine.stages.loss_scales()),
                                                  "the skipped steps and loss scales for summary.json")
    skipped = sorted({tuple(s) for steps, _ in gathered for s in steps})
    scales = {j: scale for _, rank_scales in gathered for j, scale in rank_scales.items()}
    return {"skipped_steps": len(skipped), "skipped": [list(s) for s in skipped],
            "loss_scales": {str(j): scales[j] for j in sorted(scales)} or None}


def run_main(main: Callable[[], None]) -> None:
    """An example's ``main()``, with a configuration error ended as one line on rank 0 and a non-zero exit
    on every rank instead of a traceback per rank, and a finished run's process groups ended before the
    interpreter's teardown (:func:`petra_ds.runtime.shutdown.shutdown`: a finished run exits 0), and that
    teardown kept short (:func:`~petra_ds.runtime.shutdown.before_exit`)."""
    try:
        main()
    except PetraConfigError as error:
        raise SystemExit(f"configuration error: {error}" if is_rank0() else 2) from None
    shutdown()
    before_exit()


class RunFiles:
    """The output directory of one run; only the writing rank (``enabled``) touches the files.

    ``resumed_at``: the step of the checkpoint a resumed run starts from; ``metrics.jsonl`` keeps its rows up
    to that step (``kept_rows``; rows a killed run wrote after its last checkpoint are dropped, the resumed
    run writes them again) and is appended to. Otherwise it is started afresh."""

    def __init__(self, output_dir: str, enabled: bool, resumed_at: int | None = None) -> None:
        self.output_dir = output_dir
        self.enabled = enabled
        self.kept_rows: list[dict] = []
        #: ``"kind": "gradient_quality"`` rows (``--gradient-quality``), kept apart from the evaluation rows
        self.gradient_quality_rows: list[dict] = []
        self._gradient_quality_seen = 0
        os.makedirs(output_dir, exist_ok=True)
        if not enabled:
            return
        rows: list[dict] = []
        if resumed_at is not None and os.path.exists(self.path("metrics.jsonl")):
            with open(self.path("metrics.jsonl")) as f:
                rows = [row for line in f if line.strip() and (row := json.loads(line))["step"] <= resumed_at]
            self.kept_rows = [row for row in rows if "kind" not in row]
            self.gradient_quality_rows = [row for row in rows if row.get("kind") == "gradient_quality"]
        write_text_atomic(self.path("metrics.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def log(self, row: dict, engine: DeepSpeedEngine, events: list[tuple[str, float, int]],
            echo: Callable[[str], None]) -> None:
        """One evaluation row: echoed, appended to metrics.jsonl, and sent to DeepSpeed's monitor."""
        if not self.enabled:
            return
        echo(json.dumps(row))
        with open(self.path("metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        if engine.monitor.enabled:
            engine.monitor.write_events(events)

    def gradient_quality(self, engine: DeepSpeedEngine) -> None:
        """Append the gradient-quality rows the engine gathered since the last call (PETRA's
        ``petra.gradient_quality_every``; the engine already sent them to DeepSpeed's monitor)."""
        probe = getattr(engine, "gradient_quality", None)
        if probe is None or len(probe.records) == self._gradient_quality_seen:
            return
        new = [{"kind": "gradient_quality", **row} for row in probe.records[self._gradient_quality_seen:]]
        self._gradient_quality_seen = len(probe.records)
        self.gradient_quality_rows += new
        if self.enabled:
            with open(self.path("metrics.jsonl"), "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in new)

    def gradient_quality_plot(self, title: str) -> None:
        """gradient_quality.png (the paper's Fig. 5 / Fig. 6) when the run measured any."""
        if self.enabled and self.gradient_quality_rows:
            from ..diagnostics.gradient_quality import plot

            plot(self.gradient_quality_rows, self.path("gradient_quality.png"), title=title)

    def summary(self, summary: dict) -> None:
        write_text_atomic(self.path("summary.json"), json.dumps(summary, indent=1, default=str))

    def curves(self, losses: list[tuple[int, float]], metrics: list[dict], *, eval_key: str, eval_label: str,
               loss_label: str, right: tuple[str, str, str, str], right_scale: float = 1.0,
               right_log: bool = False) -> None:
        """curves.png: train and eval loss against train_batch calls on the left; on the right
        ``right = (x key, y key, x label, y label)`` of the metric rows, y times ``right_scale``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, panel) = plt.subplots(1, 2, figsize=(10, 4))
        if losses:
            left.plot(*zip(*losses), lw=0.8, label="train")
        left.plot([m["step"] for m in metrics], [m[eval_key] for m in metrics], "o-", label=eval_label)
        left.set_xlabel("train_batch calls")
        left.set_ylabel(loss_label)
        left.legend()
        x_key, y_key, x_label, y_label = right
        panel.plot([m[x_key] for m in metrics], [right_scale * m[y_key] for m in metrics], "o-")
        panel.set_xlabel(x_label)
        panel.set_ylabel(y_label)
        if right_log:
            panel.set_yscale("log")
        fig.tight_layout()
        save_figure(fig, self.path("curves.png"), dpi=100)
        plt.close(fig)
