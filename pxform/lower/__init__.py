"""Lowering: Graph + a layout for every value -> per-rank programs (DESIGN.md §7)."""
