"""Reversible building blocks: couplings, chains, invertibility check, keyed RNG, batch-norm policy."""

from .batchnorm import BN_POLICIES, BatchNormPolicy, running_stats
from .check import NonFiniteError, ReversibilityError, check_reversible, reconstruction_error
from .coupling import AdditiveCoupling, HalfCoupling, SwapCoupling
from .reversible import (
    Activation,
    GraphTape,
    Merge,
    Reversible,
    ReversibleSequential,
    Split,
    Tape,
    assign_rng_keys,
    is_reversible,
    reconstruct,
)
from .rng import derive_seed, keyed_rng, layer_rng, micro_batch_rng

__all__ = [
    "Activation",
    "AdditiveCoupling",
    "BN_POLICIES",
    "BatchNormPolicy",
    "GraphTape",
    "HalfCoupling",
    "Merge",
    "NonFiniteError",
    "Reversible",
    "ReversibilityError",
    "ReversibleSequential",
    "Split",
    "SwapCoupling",
    "Tape",
    "assign_rng_keys",
    "check_reversible",
    "derive_seed",
    "is_reversible",
    "keyed_rng",
    "layer_rng",
    "micro_batch_rng",
    "reconstruct",
    "reconstruction_error",
    "running_stats",
]
