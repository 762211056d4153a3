"""The cutedsl row kernels compile for sm_90a without a GPU: the chunk CE kernel
(``flce.backends.cutedsl.ce``) and the split-row kernels (``flce.backends.cutedsl.partial``),
for every feature the key bakes in, each alone and all at once, every dtype, a ragged
row of one-element vectors and a row long enough for a cluster of CTAs.

A GPU run compiles only the keys its calls need, so a feature combination that no GPU
test happens to reach would fail first in a user's call; here every one is compiled.
Needs nvidia-cutlass-dsl (no GPU: the DSL compiles for the architecture
``tests.backends.cutedsl_gpu`` names); the GPU tests of these kernels check their values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.backends.cutedsl_gpu import HAS_DSL, needs_dsl

if HAS_DSL:
    from flce.backends.cutedsl import ce, partial

pytestmark = needs_dsl

DTYPE_VECTORS = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4}  # 16-byte vectors
# A ragged row read one element at a time, and a row whose gradient pass spreads it over a
# cluster of CTAs (ce.default_config: longer than one CTA's shared memory holds).
ROWS = {"ragged": (1001, 1), "cluster": (128256, None)}

CE_FLAGS = (
    "target_int64",
    "has_weight",
    "has_smoothing",
    "has_softcap",
    "token_scaling",
    "write_z_loss",
    "write_correct",
    "write_predicted",
    "has_row_scale",
    "compute_grad",
)


def _ce_key(dtype: torch.dtype, vocab: int, vec: int, flags: set[str]) -> ce.KernelKey:
    return ce.KernelKey(
        dtype=dtype,
        vocab=vocab,
        vec=vec,
        approximate_tanh="has_softcap" in flags and dtype != torch.float32,
        **{flag: flag in flags for flag in CE_FLAGS},
    )


@pytest.mark.parametrize("flag", CE_FLAGS)
def test_chunk_kernel_compiles_with_each_feature_alone(flag):
    assert ce.compile_kernel(_ce_key(torch.bfloat16, 32000, 8, {flag})) is not None


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("features", ["none", "all"])
@pytest.mark.parametrize("dtype", list(DTYPE_VECTORS), ids=str)
def test_chunk_kernel_compiles(dtype, features, row):
    vocab, vec = ROWS[row]
    flags = set(CE_FLAGS) if features == "all" else set()
    key = _ce_key(dtype, vocab, vec or DTYPE_VECTORS[dtype], flags)
    assert ce.compile_kernel(key) is not None


SPLIT_ROW_KERNELS = {
    # name: (its compile function and key class in flce.backends.cutedsl.partial, the key's features)
    "statistics": (
        "compile_statistics",
        "StatisticsKey",
        ("target_int64", "has_weight", "has_smoothing", "has_softcap", "write_argmax"),
    ),
    "gradient": (
        "compile_gradient",
        "GradientKey",
        ("target_int64", "has_weight", "has_smoothing", "has_softcap", "has_z_grad"),
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("features", ["none", "all"])
@pytest.mark.parametrize("dtype", list(DTYPE_VECTORS), ids=str)
@pytest.mark.parametrize("kernel", list(SPLIT_ROW_KERNELS))
def test_split_row_kernel_compiles(kernel, dtype, features, row):
    compile_name, key_name, flags = SPLIT_ROW_KERNELS[kernel]
    vocab, vec = ROWS[row]
    on = features == "all"
    key = getattr(partial, key_name)(
        dtype=dtype,
        vocab=vocab,
        vec=vec or DTYPE_VECTORS[dtype],
        approximate_tanh=on and dtype != torch.float32,
        **dict.fromkeys(flags, on),
    )
    assert getattr(partial, compile_name)(key) is not None


def test_the_flags_name_every_field_of_the_keys():
    """The parametrizations above set every field of the three keys (a field added to a
    key must be added to its flags here, or that feature is never compiled on the CPU)."""
    shape_fields = {"dtype", "vocab", "vec", "approximate_tanh"}
    for _, key_name, flags in SPLIT_ROW_KERNELS.values():
        assert {f.name for f in dataclasses.fields(getattr(partial, key_name))} == {*shape_fields, *flags}
    assert {f.name for f in dataclasses.fields(ce.KernelKey)} == {*shape_fields, *CE_FLAGS}
