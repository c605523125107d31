"""The runtime: the only part of pxform that calls `torch.distributed`."""
