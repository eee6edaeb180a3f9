"""Checkers that need no GPU and no torch.distributed: every rank's instruction streams replayed (deadlocks,
PETRA's semantics) and recorded traffic replayed under NCCL's rules."""
