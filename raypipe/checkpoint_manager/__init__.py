"""The checkpoint manager: when and what to save, the trainer's state in and out
(:mod:`~raypipe.checkpoint_manager.trainer_state`), and a save in flight
(:mod:`~raypipe.checkpoint_manager.pending`). It sits above the controller; the
files themselves are :mod:`raypipe.checkpoint`'s (storage, below the stage)."""
