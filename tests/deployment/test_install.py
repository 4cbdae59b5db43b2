"""CI and the README install at constraints.txt's exact versions, so a new upstream
release cannot change what a fresh install runs (pytest 9.2 once broke one)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def commands(text: str) -> list[str]:
    """The shell commands of a script or code block: comments dropped, split at && and ;."""
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [part.strip() for line in lines for part in re.split(r"&&|;", line) if part.strip()]


def test_ci_and_the_readme_install_only_through_scripts_install_sh():
    readme_block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL).group(1)
    for where, text in (("README", readme_block), (".ci/run", (REPO / ".ci" / "run").read_text())):
        found = commands(text)
        assert "bash scripts/install.sh" in found, where
        assert not [c for c in found if "pip install" in c], f"{where} installs around scripts/install.sh"
        first_python = next(i for i, c in enumerate(found) if c.startswith("python"))
        assert found.index("bash scripts/install.sh") < first_python, f"{where} runs Python before installing"


@pytest.mark.parametrize(("install_status", "ran"), [(0, ["jobs/train_tiny.py", "-m pytest -q"]), (3, [])],
                         ids=["installed", "install failed"])
def test_ci_runs_the_job_and_the_tests_only_after_an_install_that_succeeded(tmp_path, install_status, ran):
    # .ci/run as CI runs it, with an install that exits install_status and a python that logs its arguments
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install.sh").write_text(f"exit {install_status}\n")
    log, bin_dir = tmp_path / "python.log", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (bin_dir / "python").chmod(0o755)
    result = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert result.returncode == install_status, result.stderr  # a failed install's own status
    assert (log.read_text().splitlines() if log.exists() else []) == ran


def test_every_install_of_scripts_install_sh_takes_the_constraints():
    installs = [c for c in commands((REPO / "scripts" / "install.sh").read_text()) if "pip install" in c]
    assert len(installs) >= 2  # the build backend and torch first, then raypipe[test]
    for command in installs:
        words = shlex.split(command)
        assert words[words.index("-c") + 1] == "constraints.txt", command
    assert "--no-build-isolation" in installs[-1]  # pip's isolated build environment ignores -c
    assert any(c.startswith("python scripts/check_pins.py") for c in commands((REPO / "scripts" / "install.sh")
                                                                              .read_text()))


def test_constraints_pin_every_package_exactly():
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+", pin) for pin in pins), \
        [pin for pin in pins if "==" not in pin]
    names = {pin.split("==")[0].lower() for pin in pins}
    assert {"torch", "ray", "pytest", "setuptools", "pyarrow"} <= names
