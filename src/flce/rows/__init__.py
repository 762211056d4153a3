"""Backend-neutral row math of each loss head: the per-row equations, their numerically
careful forms, and how statistics of column blocks of one row combine. Written in
PyTorch (the torch backend calls these functions); the fused kernels restate the same
formulas in their own language and answer to the docstrings here."""
