"""What lives inside one stage actor: the worker and its compute ops, the
activation store and offload, precision, per-layer optimizer state and the
stage's own data reader. Nothing here knows the driver."""
