"""The engine and what it runs: stages, messages and collectives, checkpoints, optimizers, delay compensation,
the "petra" config, NaN / Inf checks, bytes held, the observer interface, process groups."""
