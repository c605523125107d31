#!/usr/bin/env bash
# The flagship demo: trace the example GPT at a realistic size on the meta device and print
# its IR summary and op table. Later issues grow this into planning and training.
set -euo pipefail
source "$(dirname "$0")/scripts/setup.sh" ""
SIZE="${PXFORM_DEMO_SIZE:-1.3B}"
python examples/gpt.py --size "$SIZE" --batch 8 "$@"
