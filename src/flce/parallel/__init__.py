"""Model-parallel variants of the fused loss (``docs/parallel.md``).

``vocab_parallel_fused_linear_cross_entropy``: the LM-head weight sharded over the
vocabulary across the ranks of a ``torch.distributed`` process group (Megatron-style
tensor parallelism, or a ``DTensor`` sharded ``Shard(0)``). The package's modules:
``handshake`` (the once-per-call agreement of the ranks), ``dtensor`` (the DTensor
adapter) and ``loss`` (the plan, the chunk math and the public functions).
"""

from flce.parallel.loss import (
    VocabParallelFusedLinearCrossEntropyLoss,
    vocab_parallel_fused_linear_cross_entropy,
)

__all__ = ["VocabParallelFusedLinearCrossEntropyLoss", "vocab_parallel_fused_linear_cross_entropy"]
