"""petra_ds: PETRA (Parallel End-to-end Training with Reversible Architectures) on DeepSpeed."""

__version__ = "0.1.0"
