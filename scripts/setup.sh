# Shared set-up for run.sh and test.sh; source it with the pip extras to install:
#   source scripts/setup.sh ""        # pxform only
#   source scripts/setup.sh "[test]"  # pxform and its test dependencies
# Creates .venv if missing and installs torch only when it is not importable, pinned to
# 2.13.0 (the CPU wheel on these machines: an unpinned torch would pull GBs of CUDA).
set -euo pipefail
EXTRAS="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0"
    python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
    python -c "import torch" || { echo "setup: torch did not install"; exit 1; }
fi
python -m pip install -q -e ".${EXTRAS}" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import pxform" || { echo "setup: pxform did not install"; exit 1; }
