"""`python -m pxform ...` (and `torchrun ... -m pxform calibrate ...`): the `pxform`
command (`pxform/tools/cli.py`)."""

from pxform.tools.cli import entry

entry()
