"""Backend-neutral row math, one module per loss head.

A loss head's module states its per-row formulas once (forward statistics, loss,
gradient with respect to the logits) in plain PyTorch fp32 ops. The torch backend's
kernels are these formulas applied to a chunk; the Triton and CuTe DSL kernels answer
to them; the drivers use them to combine block statistics (vocabulary blocks, vocab
parallelism) into whole-row results.
"""
