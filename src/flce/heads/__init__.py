"""The plans of the loss heads beyond the cross-entropy (the plan layer, beside
``flce.plan``): each module holds a head's operands, its plan (the ``flce.plan.LossPlan``
protocol, run by ``flce.plan``'s one forward/backward pair, its autograd Function and
the custom ops of ``flce.ops``) and the plan's constructor.

- ``logprobs``: per-token log-probabilities of the target and entropies
  (``flce.fused_linear_logprobs``; row math in ``flce.rows.logprobs``);
- ``distillation``: the generalized Jensen-Shannon divergence between a teacher's and a
  student's LM head (``flce.fused_linear_distillation``; ``flce.rows.distillation``).

Both run on the token-chunk loop of ``flce.driver.chunks.run_token_chunks`` with the
kernels of the backend's ``logprobs``/``distillation`` slot.
"""
