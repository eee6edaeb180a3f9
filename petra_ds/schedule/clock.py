"""The PETRA clock: when each stage runs each micro-batch, and which stages rebuild their input.

The clock equations (docs/design/clock.md) live in the functions below and nowhere else:
micro-batch ``m`` enters stage 0 at clock ``m``; at stage ``j`` of ``J`` its forward runs at clock
``m + j`` and its backward ``2(J-1-j)`` clocks later; the last stage does forward, loss and backward in
one clock.
"""

from __future__ import annotations


def forward_micro_batch(clock: int, stage: int) -> int:
    """The micro-batch whose forward stage ``stage`` runs at ``clock``."""
    return clock - stage


def backward_micro_batch(clock: int, stage: int, petra_stages: int) -> int:
    """The micro-batch whose backward stage ``stage`` runs at ``clock``."""
    return clock - 2 * (petra_stages - 1) + stage


def delay(stage: int, petra_stages: int) -> int:
    """tau_j: clocks between a micro-batch's forward and its backward at ``stage``."""
    return 2 * (petra_stages - 1 - stage)


def first_stage_lateness(petra_stages: int, k: int) -> str | None:
    """A warning when stage 0 applies its gradients more than one optimizer step after their forward
    (tau_0 / k > 1): at a high learning rate that delay, more than any compensation, decides how far PETRA
    trails backprop. None otherwise."""
    behind = delay(0, petra_stages) / k
    if behind <= 1:
        return None
    need = delay(0, petra_stages)
    return (f"PETRA: stage 0 applies its gradients {behind:g} optimizer steps after its forward (J = {petra_stages} "
            f"stages, k = {k} micro-batches per step); at a high learning rate this costs quality. Keep the global "
            f"batch and split it into at least {need} micro-batches per step (\"gradient_accumulation_steps\": "
            f"{need}, the micro-batch made smaller to match; the examples do it with --global-batch N). DeepSpeed's "
            "\"muon\" tolerates the delay better than Adam, and gains from more micro-batches too")


def reconstructs(stage: int, petra_stages: int, reversible: bool, input_buffer: str = "non_reversible") -> bool:
    """Whether ``stage`` rebuilds its input by inversion instead of keeping it: a reversible middle
    stage, unless ``input_buffer="all"`` keeps every input or ``"first_N"`` keeps those of stages 1 .. N.
    Reconstruction errors grow down the pipeline, each stage rebuilding its input from the one above it with
    newer weights, and weigh most where the input is small (a language model's embedding output at stage 1):
    keeping the first stages' inputs stops them where they cost most, at a FIFO's memory per stage. Stage 0
    re-reads its data and the last stage keeps its graph within the clock, so neither does. The schedule (and
    through it the engine), the replay, the timeline, the partition and the stage all ask this function."""
    if not (0 < stage < petra_stages - 1 and reversible) or input_buffer == "all":
        return False
    return stage > (kept_first(input_buffer) or 0)


def kept_first(input_buffer: str) -> int | None:
    """N of ``input_buffer="first_N"`` (N >= 1), None for any other value."""
    head, _, n = str(input_buffer).partition("first_")
    return int(n) if not head and n.isdigit() and int(n) >= 1 else None
