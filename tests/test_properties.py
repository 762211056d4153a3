"""Property test: random shapes x random feature combinations x reductions x dtypes
x chunkings against the float64 reference (tolerance tied to eager PyTorch's error)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flce.testing import Case, run_case

option_sets = st.fixed_dictionaries(
    {},
    optional={
        "label_smoothing": st.sampled_from([0.05, 0.3, 1.0]),
        "lse_square_scale": st.sampled_from([1e-4, 1e-2]),
        "softcap": st.sampled_from([2.0, 15.0]),
        "ce_weight": st.just(True),
        "use_token_scaling": st.just(True),
        "return_z_loss": st.just(True),
        "return_token_accuracy": st.just(True),
        "return_predicted_tokens": st.just(True),
    },
)


@st.composite
def cases(draw, vocab_blocks: bool = True):
    """Random small cases; ``vocab_blocks=False`` for a backend without split-row kernels."""
    n_rows = draw(st.integers(1, 40))
    options = draw(option_sets)
    if options.get("return_token_accuracy") != options.get("return_predicted_tokens"):
        options.pop("return_token_accuracy", None), options.pop("return_predicted_tokens", None)
    return Case(
        n_rows=n_rows,
        hidden=draw(st.integers(1, 24)),
        vocab=draw(st.integers(1, 70)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        bias=draw(st.booleans()),
        grads=draw(st.sampled_from([("input", "weight", "bias"), ("weight",), ("input",)])),
        ignore_index=draw(st.sampled_from([-100, 0])),
        ignored_fraction=draw(st.sampled_from([0.0, 0.3, 1.0])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, n_rows))),
        vocab_chunk_size=draw(st.one_of(st.none(), st.none(), st.integers(1, 70))) if vocab_blocks else None,
        seed=draw(st.integers(0, 2**16)),
        options=tuple(sorted(options.items())) or (("label_smoothing", 0.0),),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_random_cases_match_reference(case):
    outcome = run_case(case, "torch", torch.device("cpu"))
    assert outcome.passed, f"{case}: {outcome.failures} {outcome.errors}"
