"""Triton device functions the kernels of this backend share: fp32 tanh and its
derivative without libdevice (or the hardware's approximate one), the single-rounding
softcap product, the interpreter's
bf16 rounding, the online-softmax row pass and the gradient row writer of the
cross-entropy (``ce``, ``partial``; the loss heads ``logprobs`` and ``distillation``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh_fp32(x):
    """fp32 tanh (see ``tanh_and_derivative``; the unused derivative is compiled away)."""
    t, _ = tanh_and_derivative(x)
    return t


@triton.jit
def tanh_and_derivative(x):
    """(tanh(x), 1 - tanh(x)^2) in fp32, to about 1.5 ulp, without ``libdevice`` (which
    Triton's interpreter lacks).

    tanh: for |x| >= 0.625, (1 - t) / (1 + t) with t = exp(-2|x|) (no cancellation there,
    since tanh >= 0.55); below, x + x^3 * P(x^2) with P a degree-5 polynomial fitted to
    (tanh(x) - x) / x^3 on [0, 0.625] by relative-error weighted least squares.
    Derivative: 4t / (1 + t)^2 where tanh saturates, since 1 - r*r from a rounded r
    cancels there (relative error ~1e-4 at |x| = 4.7); below 0.625, 1 - r*r (r < 0.56)."""
    ax = tl.abs(x)
    t = tl.exp2(ax * (-2.0 * 1.4426950408889634))
    one_plus_t = 1.0 + t
    big = tl.fdiv(1.0 - t, one_plus_t)
    x2 = x * x
    poly = -0.008184662088751793 + x2 * 0.0021489840000867844
    poly = 0.021703999489545822 + x2 * poly
    poly = -0.05394745245575905 + x2 * poly
    poly = 0.13333211839199066 + x2 * poly
    poly = -0.3333333134651184 + x2 * poly
    small = ax + ax * x2 * poly
    is_small = ax < 0.625
    r = tl.where(is_small, small, big)
    derivative = tl.where(is_small, 1.0 - small * small, tl.fdiv(4.0 * t, one_plus_t * one_plus_t))
    return tl.where(x < 0.0, -r, r), derivative


@triton.jit
def tanh_approx(x):
    """PTX ``tanh.approx.f32`` (sm_75+): one special-function op, relative error about
    2^-11 by the PTX ISA (``flce.backends.base.softcap_tanh_is_approximate`` says where it is used).
    Compiled kernels only: Triton's interpreter cannot run inline PTX."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def softcap_tanh(x, APPROX: tl.constexpr):
    """tanh of ``z / c`` for the softcap: ``tanh_approx`` or the accurate ``tanh_fp32``."""
    if APPROX:
        t = tanh_approx(x)
    else:
        t = tanh_fp32(x)
    return t


@triton.jit
def softcap_tanh_and_derivative(x, APPROX: tl.constexpr):
    """``(tanh(x), 1 - tanh(x)^2)``: from ``tanh_approx`` (the derivative's absolute error
    is then ~2^-10, within what the 16-bit logits' own rounding gives PyTorch's), or the
    accurate ``tanh_and_derivative``."""
    if APPROX:
        t = tanh_approx(x)
        derivative = 1.0 - t * t
    else:
        t, derivative = tanh_and_derivative(x)
    return t, derivative


@triton.jit
def softcapped(t, softcap):
    """``softcap * t`` rounded on its own, as ``fma(softcap, t, +0)``: a plain product
    may be contracted by the compiler into a different FMA at each use (``z' - m``,
    ``m - z'_y``, the smoothing sum), so that the max, the target logit and the exponents
    would see differently rounded copies of one z' (on a one-class row the loss then
    comes out as a rounding residue instead of exactly 0)."""
    return tl.fma(softcap, t, 0.0)


@triton.jit
def fp32_to_bf16_rtne(x):
    """Round-to-nearest-even fp32 -> bf16 on the bits (finite inputs). Used only under
    Triton's interpreter, whose fp32 -> bf16 cast truncates; compiled kernels use the
    hardware conversion, which already rounds to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF).to(tl.uint32)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


# The vector of a row's masked loads and stores: Triton vectorizes them only where the mask
# is constant over a vector, which it knows when the mask's bound is a multiple of 16.
# With an odd V (GPT-2's 50257, or 32001) a mask ``offs < V`` made every access scalar; the
# row loops of every kernel (these, and the logprobs' and distillation's) run to
# ``aligned_extent(V)``, a multiple of 16, and take the last < 16 columns in one more loop
# (one masked block, or two of a block narrower than 16). The two loops are the two parts of
# a ``tl.static_range(2)``: each is compiled with its own bound, and one call site serves
# both (the compiled instructions are those of two loops written out).
ALIGNED_COLUMNS = tl.constexpr(16)
# exp(x) = exp2(x * LOG2_E): the kernels' exponentials (a tl.constexpr object: Triton's
# compiler refuses a plain or annotated global).
LOG2_E = tl.constexpr(1.4426950408889634)
LN_2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * LN_2


@triton.jit
def aligned_extent(V):
    """``V`` rounded down to a multiple of ``ALIGNED_COLUMNS`` (which Triton then knows)."""
    return (V // ALIGNED_COLUMNS) * ALIGNED_COLUMNS


@triton.jit
def first_argmax_step(z, offs, block_max, m, best_idx):
    """The running first argmax after the columns ``offs`` of values ``z`` (masked lanes
    -inf), ``block_max = tl.max(z)``, the running max ``m`` and index ``best_idx`` before
    them -> ``(best_idx, block_max)``. torch.argmax's rule: the first index among ties, and
    a NaN above every number (its first one wins). ``tl.max`` may drop a NaN (maxnum on a
    GPU): the NaN lanes are found with ``z != z``, and ``block_max`` comes back NaN for a
    block holding one, so that the caller's max, kept NaN, freezes the index at the first."""
    no_index = 2147483647
    nan_idx = tl.min(tl.where(z != z, offs, no_index), axis=0)
    has_nan = nan_idx < no_index
    block_idx = tl.where(has_nan, nan_idx, tl.min(tl.where(z == block_max, offs, no_index), axis=0))
    block_max = tl.where(has_nan, float("nan"), block_max)
    # strict >: an earlier block keeps a tie (first index wins); a NaN so far keeps its index
    takes = (m == m) & (has_nan | (block_max > m))
    return tl.where(takes, block_idx, best_idx), block_max


@triton.jit
def _statistics_block(
    row_ptr,
    weight_ptr,
    offs,
    mask,
    m,
    s,
    smooth_sum,
    weight_sum,
    best_idx,
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    SUM_WEIGHTS: tl.constexpr,
    WRITE_ARGMAX: tl.constexpr,
):
    """``row_statistics``' state after the columns ``offs`` (where ``mask``)."""
    z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcapped(softcap_tanh(z * inv_softcap, TANH_APPROX), softcap)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:  # masked lanes: z' = 0 and w = 0
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
            smooth_sum += tl.sum(w * z, axis=0)
            if SUM_WEIGHTS:
                weight_sum += tl.sum(w, axis=0)
        else:
            smooth_sum += tl.sum(z, axis=0)
    z = tl.where(mask, z, -float("inf"))
    block_max = tl.max(z, axis=0)
    if WRITE_ARGMAX:
        best_idx, block_max = first_argmax_step(z, offs, block_max, m, best_idx)
    m_new = tl.maximum(m, block_max)
    if WRITE_ARGMAX:
        # NaN from the first NaN on (tl.maximum may drop one): first_argmax_step reads it
        m_new = tl.where((m != m) | (block_max != block_max), float("nan"), m_new)
    # While every logit so far is -inf (a masked prefix of the vocabulary) m_new is -inf and
    # m - m_new NaN: sums are then taken relative to 0 (each exp2 is 0, s stays 0).
    reference = tl.where(m_new == -float("inf"), 0.0, m_new)
    s = s * tl.exp2((m - reference) * LOG2_E) + tl.sum(tl.exp2((z - reference) * LOG2_E), axis=0)
    return m_new, s, smooth_sum, weight_sum, best_idx


@triton.jit
def row_statistics(
    row_ptr,  # one row of logits (V,)
    weight_ptr,  # (V,) fp32 class weights of the row's columns (HAS_WEIGHT)
    V,
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,  # softcap_tanh_is_approximate
    HAS_SMOOTHING: tl.constexpr,
    SUM_WEIGHTS: tl.constexpr,  # also sum the class weights (a shard's share of W)
    WRITE_ARGMAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One streaming pass over a row: ``(m, s, smooth_sum, weight_sum, best_idx)`` with
    ``m = max z'``, ``s = sum exp2((z' - m) log2 e)``, ``smooth_sum = sum w_i z'_i``
    (HAS_SMOOTHING), ``weight_sum = sum w_i`` (SUM_WEIGHTS) and the first index of the max
    (WRITE_ARGMAX); the quantities not asked for stay 0."""
    offs0 = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    smooth_sum = 0.0
    weight_sum = 0.0
    best_idx = 0
    aligned = aligned_extent(V)
    for part in tl.static_range(2):  # the aligned columns, then the last < 16 (own bound each)
        end = aligned if part == 0 else V
        for start in range(0 if part == 0 else aligned, end, BLOCK_V):
            offs = start + offs0
            m, s, smooth_sum, weight_sum, best_idx = _statistics_block(
                row_ptr, weight_ptr, offs, offs < end, m, s, smooth_sum, weight_sum, best_idx, softcap, inv_softcap,
                HAS_WEIGHT, HAS_SOFTCAP, TANH_APPROX, HAS_SMOOTHING, SUM_WEIGHTS, WRITE_ARGMAX,
            )  # fmt: skip
    return m, s, smooth_sum, weight_sum, best_idx


@triton.jit
def _gradient_block(
    row_ptr,
    out_row_ptr,
    weight_ptr,
    offs,
    mask,
    y,
    m,
    inv_s,
    multiplier,
    target_grad,
    smooth_coef,
    weight_sum,
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
):
    """``write_gradient_row`` over the columns ``offs`` (where ``mask``)."""
    z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        t, softcap_derivative = softcap_tanh_and_derivative(z * inv_softcap, TANH_APPROX)
        z = softcapped(t, softcap)
    e = tl.exp2((z - m) * LOG2_E)  # p_i * s
    g = tl.where(offs == y, target_grad, e * multiplier)
    if HAS_SMOOTHING:
        p = e * inv_s
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
            g += smooth_coef * (weight_sum * p - w)
        else:
            g += smooth_coef * (weight_sum * p - 1.0)
    if HAS_SOFTCAP:
        g = g * softcap_derivative
    if BF16_ROUND_BY_BITS:
        g = fp32_to_bf16_rtne(g)
    tl.store(out_row_ptr + offs, g.to(out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def write_gradient_row(
    row_ptr,  # one row of logits (V,), read
    out_row_ptr,  # where dL/dlogits of the row goes (V,); row_ptr itself when in place
    weight_ptr,  # (V,) fp32 class weights of the row's columns (HAS_WEIGHT)
    V,
    y,  # the target's column; outside [0, V) when the row holds none
    m,  # the row max of z' (of the whole row, where the row is split)
    inv_s,  # 1 / sum exp(z' - m): p_i = exp(z'_i - m) * inv_s
    onehot_coef,  # row_scale * ce_grad_scale * (1 - ls) * w_y
    smooth_coef,  # row_scale * ce_grad_scale * eps
    z_coef,  # row_scale * z_grad_scale * 2 s lse
    weight_sum,  # W: sum of the class weights (V without weights)
    softcap,
    inv_softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr,  # softcap_tanh_is_approximate
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_GRAD: tl.constexpr,
    BF16_ROUND_BY_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The grouped form of flce.rows.cross_entropy, each group exact where the true value is
    ~0 (p_y ~ 1, V = 1):
    grad_i = (onehot_coef (p_i - [i == y]) + smooth_coef (W p_i - w_i) + z_coef p_i) dz'_i/dz_i.

    Every column but the target's has ``onehot_coef p_i + z_coef p_i = e_i * multiplier``
    with ``e_i = exp(z'_i - m)`` and one multiplier per row, ``(onehot_coef + z_coef) / s``:
    one product per logit instead of three operations. Right after a GEMM (the GPU at its
    power limit, its SM clock lowered) this pass is bound by instructions, not by memory
    traffic. The target's column keeps the grouped form, ``onehot_coef (p_y - 1) + z_coef
    p_y`` with ``p_y - 1`` formed before it is scaled (exact cancellation on a confident
    row), from the row's own target logit, read once here."""
    offs0 = tl.arange(0, BLOCK_V)
    y_in_row = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=y_in_row, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        t_y, _ = softcap_tanh_and_derivative(z_y * inv_softcap, TANH_APPROX)
        z_y = softcapped(t_y, softcap)
    p_y = tl.exp2((z_y - m) * LOG2_E) * inv_s
    target_grad = onehot_coef * (p_y - 1.0)
    multiplier = onehot_coef
    if HAS_Z_GRAD:
        target_grad += z_coef * p_y
        multiplier += z_coef
    multiplier = multiplier * inv_s
    aligned = aligned_extent(V)
    for part in tl.static_range(2):  # the aligned columns, then the last < 16 (own bound each)
        end = aligned if part == 0 else V
        for start in range(0 if part == 0 else aligned, end, BLOCK_V):
            offs = start + offs0
            _gradient_block(
                row_ptr, out_row_ptr, weight_ptr, offs, offs < end, y, m, inv_s, multiplier, target_grad, smooth_coef,
                weight_sum, softcap, inv_softcap, HAS_WEIGHT, HAS_SOFTCAP, TANH_APPROX, HAS_SMOOTHING,
                BF16_ROUND_BY_BITS,
            )  # fmt: skip
