"""Before a run: the memory model (parameters, gradients, optimizer state,
activations) and the `raypipe plan` command."""
