#!/usr/bin/env bash
# Set up (with the test extra) and run the whole test suite, then lint and check the floors.
set -euo pipefail
source "$(dirname "$0")/scripts/setup.sh" "[test,dev]"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
python -m pytest "$@"
ruff check pxform transforms schedules tests examples benchmarks scripts
mypy
# the floors: each imports only from those below it (import-linter, pyproject.toml)
python scripts/check_layers.py
