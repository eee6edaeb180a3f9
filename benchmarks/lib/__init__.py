"""The benchmarks' bodies and what they share. The six entry points in ``benchmarks/`` (``peers``, ``memory``,
``accuracy``, ``gpu``, ``soak``, ``host_overhead``) pick one of these modules by their first word; nothing here is
meant to be run by hand, except as the worker processes the benchmarks start themselves."""
