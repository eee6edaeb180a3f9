"""What the example training scripts share: the pipeline x data-parallel layout of a run, the files it
writes (``metrics.jsonl``, ``summary.json``, ``curves.png``) in its output directory, and its checkpoints
(``<output-dir>/checkpoints``, written every ``--save-every`` steps and loaded by ``--resume``)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology


def pipeline_topology(data_parallel: int) -> tuple[PipeDataParallelTopology, int]:
    """DeepSpeed's topology for ``data_parallel`` pipeline replicas over the world; and the pipeline ranks."""
    world = dist.get_world_size()
    if world % data_parallel:
        raise SystemExit(f"--data-parallel {data_parallel} does not divide the world size {world}")
    ranks = world // data_parallel
    return PipeDataParallelTopology(num_pp=ranks, num_dp=data_parallel), ranks


def stages_per_rank(stages: int, ranks: int) -> int:
    if stages % ranks:
        raise SystemExit(f"--stages {stages} must be a multiple of the {ranks} pipeline ranks")
    return stages // ranks


def add_run_arguments(parser: Any) -> None:
    """The options both example scripts share: checkpoints, resuming, the gradient-quality study."""
    parser.add_argument("--save-every", type=int, default=0,
                        help="checkpoint to <output-dir>/checkpoints every N train_batch calls (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in <output-dir>/checkpoints, if there is one")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end this run after N train_batch calls in all, as a preempted job would (no final "
                             "drain, eval or summary); continue with --resume")
    parser.add_argument("--gradient-quality", type=int, default=0, metavar="N",
                        help="PETRA: every N optimizer steps compare each stage's gradient with the delayed "
                             "and the end-to-end one (metrics.jsonl, gradient_quality.png); 0: off")


def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def save(engine: Any, output_dir: str, state: dict) -> None:
    """Checkpoint the engine (PETRA's or DeepSpeed's 1F1B) with the script's ``state``, this rank's torch
    random state and the module's forward counter: DeepSpeed's 1F1B draws dropout masks from the global
    stream, reseeded from that counter with ``seed_layers``, and saves neither (PETRA keys its masks by
    micro-batch)."""
    engine.save_checkpoint(checkpoint_dir(output_dir), client_state={"example": {
        **state, "rng": torch.get_rng_state(), "micro_offset": getattr(engine.module, "micro_offset", None)}})


def resume(engine: Any, output_dir: str) -> dict | None:
    """Load ``latest`` from ``<output_dir>/checkpoints`` into the engine (step count, optimizer and LR
    scheduler states, PETRA's micro-batches in flight) and return the state :func:`save` stored with it;
    None, and nothing loaded, when there is no checkpoint yet."""
    if not os.path.exists(os.path.join(checkpoint_dir(output_dir), "latest")):
        return None
    _, client_state = engine.load_checkpoint(checkpoint_dir(output_dir))
    state = dict(client_state["example"])
    torch.set_rng_state(state.pop("rng").cpu())
    micro_offset = state.pop("micro_offset")
    if micro_offset is not None:
        engine.module.micro_offset = micro_offset
    return state


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
        with open(self.path("metrics.jsonl") + ".tmp", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(self.path("metrics.jsonl") + ".tmp", self.path("metrics.jsonl"))

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def log(self, row: dict, engine: Any, events: list[tuple[str, float, int]], echo: Callable[[str], None]) -> None:
        """One evaluation row: echoed, appended to metrics.jsonl, and sent to DeepSpeed's monitor."""
        if not self.enabled:
            return
        echo(json.dumps(row))
        with open(self.path("metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        if engine.monitor.enabled:
            engine.monitor.write_events(events)

    def gradient_quality(self, engine: Any) -> None:
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
            from .analysis.gradient_quality import plot

            plot(self.gradient_quality_rows, self.path("gradient_quality.png"), title=title)

    def summary(self, summary: dict) -> None:
        with open(self.path("summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)

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
        fig.savefig(self.path("curves.png"), dpi=100)
        plt.close(fig)
