"""Small helpers every layer may use: atomic file writes, walks over nested tensors, argument checks."""
