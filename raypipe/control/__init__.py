"""The control plane: the controller, the one owner of the running layout and of the
step loop, and what it decides with and acts through.

``view.py`` holds the frozen facts a decision needs and ``policy.py`` the pure
decisions (no Ray, no I/O): which source heals a failure, whether to shrink,
re-partition or raise, and whether to grow or go back to the configured
partition; ``stragglers.py`` finds slow workers, as purely, from their own compute. ``controller.py``'s :class:`~raypipe.control.controller.Controller`
runs the steps, moves through the states of ``states.py`` and is the only one
that asks the policies; the mechanisms carry the decisions out and hold no
reference to it: ``compound.py`` (replacing workers, folding in a worker lost
meanwhile), ``state_transfer.py`` (giving workers their state), ``snapshots.py``
and ``persisted.py`` (what a heal restores from), ``elastic.py`` (resizing the
replicas) and ``partitioning.py`` (fewer stages, and the way back). ``steps.py``
runs one step from its batch to its result around the controller. This
package's ``__init__`` imports nothing, so using the three pure modules pulls in
no higher layer.
"""
