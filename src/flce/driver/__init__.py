"""The drivers: how a call's rows are run through a backend's kernels.

- ``sizing``: rows per chunk from the memory budget, and the peak memory it implies;
- ``statistics``: the batch statistics (valid rows, class-weight sums) and kernel scalars;
- ``gemm``: fp32 accumulation helpers and the one-GEMM dW rule;
- ``chunks``: the token-chunk scheme (and the kernel over given logits);
- ``vocab_blocks``: token chunks x vocabulary blocks (exact, bounded dW workspace);
- ``fused``: whole-row statistics from a backend's fused GEMM, for calls without gradients;
- ``scaling``: the upstream-gradient scaling of gradients computed in the forward.

The plan (``flce.plan``) picks the scheme of a call.
"""
