#!/usr/bin/env bash
# Refresh constraints.txt: resolve pyproject's ranges (build backend included) afresh
# in a clean virtual environment, CPU torch first as scripts/install.sh does, and pin
# every package that got installed. Run it on the machine kind CI uses, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
python -m venv "$venv"
build_requires=$("$venv/bin/python" -c \
  "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))")
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" $build_requires
"$venv/bin/python" -m pip install --quiet --no-build-isolation -e ".[test]"
{
  echo "# Exact versions for CI and the README's install (scripts/install.sh), the build backend included."
  echo "# Refresh with: bash scripts/lock.sh   (pyproject.toml keeps the ranges users install against)"
  # torch's local tag (+cpu) names the wheel, not the release: keep the constraint build-neutral
  "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed -E 's/^(torch==[^+]+)\+.*$/\1/'
} > constraints.txt
rm -rf "$(dirname "$venv")"
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
