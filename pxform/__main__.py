"""`python -m pxform ...` (and `torchrun ... -m pxform calibrate ...`): the `pxform`
command (`pxform/cli.py`)."""

import sys

from pxform.cli import main

sys.exit(main())
