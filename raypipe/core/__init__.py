"""What a step *is*, with no Ray: schedules and their lowering, the dry-run
simulator, partitioning, micro-batches and loss weights, the topology of
workers, the loss scale and step results."""
