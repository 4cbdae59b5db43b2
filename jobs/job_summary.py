"""What both jobs print once a run ends: its main figures and where its outputs are.

Imported by ``jobs/train_tiny.py`` and ``jobs/train_7b.py`` (a helper, not a job to run).
"""
from __future__ import annotations

import json
from typing import Any

SHOWN = ("num_parameters", "steps", "steps_run", "initial_loss", "final_loss", "final_eval_loss",
         "tokens_per_second")
"""The keys of ``raypipe.run.train``'s summary a job prints (summary.json in --out holds them all)."""


def print_summary(summary: dict[str, Any], out: str) -> None:
    """Print ``summary``'s main figures as JSON and where the outputs went; nothing when the run
    trained no step (the checkpoints already held the last one: the resume line said so)."""
    if summary["steps_run"] == 0:
        return
    print(json.dumps({key: summary[key] for key in SHOWN}, indent=2))
    print(f"outputs in {out}: summary.json loss.png trace.json timeline.png; "
          f"checkpoints in {summary['checkpoint_dir']}")
