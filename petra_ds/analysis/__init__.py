"""Diagnostics and estimates about PETRA runs: gradient quality (the paper's App. B)."""
