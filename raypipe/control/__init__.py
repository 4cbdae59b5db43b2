"""The control plane: what decides a change of the running layout.

``view.py`` holds the frozen facts a decision needs and ``policy.py`` the pure
decisions (no Ray, no I/O): which source heals a failure, whether to shrink,
re-partition or raise, and whether to grow or go back to the configured
partition. ``controller.py``'s :class:`~raypipe.control.controller.Controller`
is the one owner of the running layout, moving through explicit states; the
mechanisms (``executor/recovery.py``, ``executor/elastic.py`` and this package's
``partitioning.py``) gather the facts, ask, and carry out the decision through
it. This package's ``__init__`` imports nothing, so the executor's use of the
two pure modules pulls in no higher layer.
"""
