"""Run tooling: the examples' layout, arguments, files and checkpoints; spawning processes; recipes and the toy
model."""
