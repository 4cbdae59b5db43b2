"""Fail unless every package raypipe[test] needs, and its build backend, is installed
at the version constraints.txt pins: a dependency added to pyproject.toml without
re-locking (scripts/lock.sh) would otherwise install at whatever version is newest.

    python scripts/check_pins.py     (scripts/install.sh runs it after installing)
"""
from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pairs = (line.split("==", 1) for line in lines if line.strip() and not line.startswith("#"))
    return {canonicalize_name(name): version.strip() for name, version in pairs}


def needed(name: str, extras: set[str], seen: dict[str, set[str]]) -> None:
    """``name`` and everything it requires with ``extras``, into ``seen`` (name -> extras)."""
    key = canonicalize_name(name)
    if key in seen and extras <= seen[key]:
        return
    seen[key] = seen.get(key, set()) | extras
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        environments = [{"extra": extra} for extra in seen[key]] or [{"extra": ""}]
        if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
            needed(requirement.name, set(requirement.extras), seen)


def main() -> int:
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    seen: dict[str, set[str]] = {}
    needed("raypipe", {"test"}, seen)
    for text in build:
        needed(Requirement(text).name, set(), seen)
    pinned, problems = pins(), []
    for key in sorted(seen):
        if key == "raypipe":
            continue
        installed = metadata.version(key).split("+")[0]  # torch's local tag (+cpu) names the wheel
        if key not in pinned:
            problems.append(f"{key} {installed} is not pinned")
        elif pinned[key] != installed:
            problems.append(f"{key} is {installed}, constraints.txt pins {pinned[key]}")
    if problems:
        print("constraints.txt does not hold what is installed (re-lock with scripts/lock.sh):\n  "
              + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"every one of the {len(seen) - 1} packages raypipe[test] needs is at its pinned version")
    return 0


if __name__ == "__main__":
    sys.exit(main())
