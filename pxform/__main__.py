"""`python -m pxform ...` (and `torchrun ... -m pxform calibrate ...`): the `pxform`
command (`pxform/cli.py`)."""

from pxform.cli import entry

entry()
