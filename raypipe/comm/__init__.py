"""How a tensor crosses a stage boundary: Ray's object store, Ray Direct
Transport over a collective group, or torch.distributed point-to-point."""
