"""Bounds on config values that keep any value from hanging a run or exhausting memory: counts
and sizes, epochs, learning rates and the weights of loss terms (no float may be inf or NaN).
Run-dependent limits (sizes against the data, models against memory) are checked when a run
is built, before round 1."""

MAX_COUNT = 1_000_000  # rounds, clients, samples, batch sizes, chunk sizes
MAX_EPOCHS = 10_000
MAX_LR = 100.0
MAX_WEIGHT = 1e6  # proximal weights, thresholds on norms
MAX_HIDDEN = 65_536
MAX_CLASSES = 100_000  # labels 0..MAX_CLASSES-1: a model's output layer and every per-class table stay small
MAX_MODEL_BYTES = 4 << 30  # all the models an algorithm keeps on the server at once
