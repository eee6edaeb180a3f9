"""What the example training scripts share: the pipeline x data-parallel layout of a run and the files
it writes (``metrics.jsonl``, ``summary.json``, ``curves.png``) in its output directory."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

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


class RunFiles:
    """The output directory of one run; only the writing rank (``enabled``) touches the files."""

    def __init__(self, output_dir: str, enabled: bool) -> None:
        self.output_dir = output_dir
        self.enabled = enabled
        os.makedirs(output_dir, exist_ok=True)
        if enabled:  # this run's rows only
            open(self.path("metrics.jsonl"), "w").close()

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
