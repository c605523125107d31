"""Function transforms (`shard`, `pipeline`, `recompute`, `coshard`, `auto`,
`value_and_grad`), installed as `pxform.transforms`. They arrive with later issues; each
annotates the IR during tracing and never runs tensors."""
