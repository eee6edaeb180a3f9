"""Observers and reports on a running engine: gradient quality, bytes held between clocks, what the run does."""
