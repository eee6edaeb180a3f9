"""The time model (per-stage costs, an event simulator, every schedule lowered to its programs, predictions,
Gantt charts) and the paper's Tab. 3 memory estimate."""
