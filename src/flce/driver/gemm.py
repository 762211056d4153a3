"""GEMM helpers of the drivers: fp32 accumulation of dW/dX/db across chunks, and the rule
for writing dW with one GEMM."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def full_precision_reductions():
    """cuBLAS may reduce split-K partial sums of bf16/fp16 GEMMs in that dtype unless
    told not to (PyTorch allows it by default); a dW GEMM that replaces the fp32
    accumulator must keep every partial sum in fp32."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


def weight_accumulator_dtype(accum_dtype: torch.dtype | None, param_dtype: torch.dtype) -> torch.dtype:
    """fp32 unless the caller asked to accumulate in the (low-precision) parameter dtype."""
    if accum_dtype is not None and accum_dtype == param_dtype:
        return param_dtype
    return torch.float32


_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def weight_grad_in_one_gemm(
    n_rows: int, chunk: int, weight_dtype: torch.dtype, compute_dtype: torch.dtype, accumulator_dtype
) -> bool:
    """Whether dW (or a block of its rows) comes from one GEMM written in the weight's
    dtype: with one chunk the GEMM sums over every row with fp32 accumulation (cuBLAS, and
    PyTorch's CPU GEMM), so an fp32 accumulator would only add a pass over it and a cast.
    The caller runs that GEMM under ``full_precision_reductions``."""
    return (
        n_rows > 0
        and chunk >= n_rows
        and weight_dtype == compute_dtype
        and accumulator_dtype == torch.float32
        and weight_dtype in (torch.bfloat16, torch.float16)
    )


def fp32_output_gemm_supported(device: torch.device) -> bool:
    # addmm(out_dtype=float32) with bf16/fp16 operands: a cuBLAS GEMM whose C/D are fp32,
    # added in torch 2.8 and implemented for CUDA only.
    return device.type == "cuda" and _TORCH_VERSION >= (2, 8)


def accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b when ``first``: the accumulator starts uninitialised, so
    neither a memset nor a read of it is paid), in acc's dtype, with no parameter-sized
    temporary."""
    beta = 0.0 if first else 1.0  # beta = 0: the GEMM ignores acc's contents (even NaN)
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif acc.dtype == torch.float32 and fp32_output_gemm_supported(acc.device):
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # CPU (or an old torch): upcast the chunk operands, which is exact and small.
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


def accumulate_column_sums(acc: torch.Tensor, a: torch.Tensor, first: bool) -> None:
    """acc += a.sum(dim=0) (acc = ... when ``first``): db's fp32 sum over a chunk's rows of
    dL/dlogits, ``acc`` (V,) fp32, ``a`` (C, V) bf16/fp16/fp32.

    On CUDA it is the product ``ones(1, C) @ a`` with an fp32 output, one read of ``a``
    with fp32 accumulation: PyTorch's column reduction of a row-major ``(C, V)`` bf16 matrix
    stages its partial sums in a workspace, 0.49 GiB at C = 8192, V = 128256, which raised
    a reference-shape call's peak by as much; the product takes the same time there
    (measured on an H200, ``benchmarks/results/features-h200``)."""
    if a.dtype != torch.float32 and fp32_output_gemm_supported(a.device):
        ones = torch.ones(1, a.shape[0], dtype=a.dtype, device=a.device)  # exact in any dtype
        with full_precision_reductions():
            accumulate_product(acc.view(1, -1), ones, a, first)
    elif first:
        torch.sum(a, dim=0, dtype=torch.float32, out=acc)
    else:
        acc += a.sum(dim=0, dtype=torch.float32)
