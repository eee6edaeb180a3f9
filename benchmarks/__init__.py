"""PETRA's benchmarks, run from a checkout (the repository root) and not installed with ``petra_ds``.

Six entry points, each ``python -m benchmarks.<name> [sub-benchmark] [flags]`` (no sub-benchmark: the default
one; ``--help`` lists them):

    peers          speed against plain backprop, DeepSpeed's pipeline and torch's pipeline schedules
    memory         memory held per stage, the fastest schedule under a memory cap, peak memory against depth
    accuracy       accuracy against backprop: vision, language, time to a loss, gradient quality
    gpu            one GPU: step time and peak memory against backprop; predicted speed on 8 and 10 GPUs
    soak           thousands of clocks with checkpoints: memory stays flat
    host_overhead  what a PETRA clock costs the host: ops, syncs, host time

``docs/benchmarks.md`` says which question each answers, how long it takes and which JSON it writes. The
bodies live in ``benchmarks.lib``.
"""
