"""Small fused calls replayed from CUDA graphs (``flce.driver.graphs``) on every CUDA
backend: each replay gives the launched call's outputs bit for bit on new data, within
3x eager PyTorch's error of float64, whatever happened to the weight in place; no output
is overwritten by a later replay; bad targets still give NaN then an error; no host sync;
and the calls that must not be graphed are not."""

from __future__ import annotations

import pytest
import torch

import flce
from flce.driver import graphs
from flce.reference import fused_linear_cross_entropy_reference
from tests.entry_points import assert_close_to_reference
from tests.gpu.common import CUDA, skip_unless_usable

if not torch.cuda.is_available():
    pytest.skip("graphed calls: need a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
BACKENDS = ["torch", "triton", "cutedsl"]
# H a multiple of 64 and bf16: the cutedsl loss-only route (fused GEMM) applies too.
N, H, V = 256, 128, 1031
FEATURES = {
    "plain": {},
    "features": dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0, return_z_loss=True),
    "accuracy": dict(return_token_accuracy=True, return_predicted_tokens=True),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
}


@pytest.fixture(autouse=True)
def fresh_graphs(monkeypatch):
    monkeypatch.delenv(graphs.GRAPHS_ENV_VAR, raising=False)
    graphs.GRAPHED_CALLS.clear()
    flce.check_errors()  # nothing pending from earlier tests
    yield
    graphs.GRAPHED_CALLS.clear()


def _weight(seed: int = 0, vocab: int = V) -> torch.Tensor:
    """(V, H) bf16: a layer's weight, the same tensor from call to call (a graph reads it
    in place)."""
    gen = torch.Generator(device=CUDA).manual_seed(1000 + seed)
    return (torch.randn(vocab, H, device=CUDA, generator=gen) * 0.3).bfloat16()


def _batch(seed: int, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """A new batch: hidden states (N, H) bf16 and targets (N,), every 7th ignored."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(N, H, device=CUDA, generator=gen).bfloat16()
    y = torch.randint(0, vocab, (N,), device=CUDA, generator=gen)
    y[::7] = -100
    return x, y


def _call(x, w, y, backend, b=None, cw=None, grad=True, **options):
    """One fwd(+bwd) call: its outputs and the gradients of x, w (and b), detached."""
    x, w = x.detach().requires_grad_(grad), w.detach().requires_grad_(grad)
    b = None if b is None else b.detach().requires_grad_(grad)
    out = flce.fused_linear_cross_entropy(x, w, y, bias=b, ce_weight=cw, backend=backend, **options)
    if isinstance(out, torch.Tensor):  # the loss alone (no other output asked for)
        outputs = [out]
    else:
        outputs = [t for t in (out.loss, out.z_loss, out.token_accuracy, out.predicted_tokens) if t is not None]
    if not grad:
        return outputs, []
    outputs[0].sum().backward()
    return outputs, [t.grad for t in (x, w, b) if t is not None]


def _truth_and_eager(x, w, y, upstream: float = 1.0):
    """(loss, dx, dw) in float64, and eager PyTorch's in bf16 (Hugging Face's recipe: bf16
    logits, the loss in fp32), with the loss's upstream gradient ``upstream``."""
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    truth = fused_linear_cross_entropy_reference(xd, wd, y).loss
    truth = [truth.detach(), *torch.autograd.grad(truth * upstream, (xd, wd))]
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    eager = torch.nn.functional.cross_entropy(torch.nn.functional.linear(xe, we).float(), y)
    eager = [eager.detach(), *torch.autograd.grad(eager * upstream, (xe, we))]
    return truth, eager


def _launched(*args, **kwargs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(graphs.GRAPHS_ENV_VAR, "off")
        return _call(*args, **kwargs)


def _call_matching_launched(x, w, y, backend, **kwargs):
    """``_call``, asserted bit for bit equal to the same call launched without a graph:
    its (outputs, gradients)."""
    got = _call(x, w, y, backend, **kwargs)
    expected = _launched(x, w, y, backend, **kwargs)
    _assert_identical(got[0] + got[1], expected[0] + expected[1])
    return got


def _assert_identical(got, expected):
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs), f"max diff {(ours.double() - theirs.double()).abs().max().item():.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("features", list(FEATURES))
def test_replays_match_the_launched_call(backend, features):
    """Calls 2.. of a layout replay its graph on new data: the launched call's outputs and
    gradients bit for bit; every replayed call's outputs stay as they were after later ones."""
    skip_unless_usable(backend)
    options = FEATURES[features]
    w = _weight()
    kept = []
    for seed in range(5):
        x, y = _batch(seed)
        got = _call(x, w, y, backend, **options)
        expected = _launched(x, w, y, backend, **options)
        _assert_identical(got[0] + got[1], expected[0] + expected[1])
        kept.append((got, expected))
    assert graphs.GRAPHED_CALLS.replays == 5 - graphs.CALLS_BEFORE_CAPTURE
    for got, expected in kept:  # later replays overwrote none of them
        _assert_identical(got[0] + got[1], expected[0] + expected[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_replays_against_float64(backend):
    """Replayed fwd+bwd within 3x eager PyTorch's own error (bf16) of the float64 truth."""
    skip_unless_usable(backend)
    w = _weight()
    for seed in range(4):
        x, y = _batch(10 + seed)
        (loss,), (dx, dw) = _call(x, w, y, backend)
        truth, eager = _truth_and_eager(x, w, y)
        for name, ours, t, e in zip(("loss", "dx", "dw"), (loss, dx, dw), truth, eager, strict=True):
            assert_close_to_reference(name, ours, t, e, floor=1e-6)
    assert graphs.GRAPHED_CALLS.replays == 4 - graphs.CALLS_BEFORE_CAPTURE


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_and_class_weights(backend):
    """The bias is read in place (a parameter), the class weights are copied in per call."""
    skip_unless_usable(backend)
    w = _weight()
    b = (torch.randn(V, device=CUDA) * 0.1).bfloat16()
    for seed in range(4):
        xs, y = _batch(20 + seed)
        cw = torch.rand(V, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(seed)) + 0.5
        _call_matching_launched(xs, w, y, backend, b=b, cw=cw)
    assert graphs.GRAPHED_CALLS.replays == 4 - graphs.CALLS_BEFORE_CAPTURE


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_updated_in_place_and_another_weight(backend):
    """An optimizer step (the weight changed in place) is read by the next replay; another
    weight tensor of the same shape gets a graph of its own."""
    skip_unless_usable(backend)
    w = _weight()
    x, y = _batch(30)
    for _ in range(4):
        got = _call_matching_launched(x, w, y, backend)
        w.sub_(0.1 * got[1][1])  # SGD in place: same address, new values
    other = w.clone()
    for _ in range(3):
        _call_matching_launched(x, other, y, backend)
    assert len(graphs.GRAPHED_CALLS) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_only_calls(backend):
    skip_unless_usable(backend)
    w = _weight()
    for seed in range(4):
        x, y = _batch(40 + seed)
        with torch.no_grad():
            _call_matching_launched(x, w, y, backend, grad=False)
    assert graphs.GRAPHED_CALLS.replays == 4 - graphs.CALLS_BEFORE_CAPTURE


@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_settings_changed_between_calls(backend):
    """A graph captured with TF32 allowed is not replayed once TF32 is turned off (an
    evaluation that wants fp32 products): the call is the launched one under its own
    settings, not the captured TF32 GEMMs."""
    skip_unless_usable(backend)
    w = _weight().float()
    x, y = _batch(45)
    x = x.float()
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        for _ in range(3):  # launched, captured, replayed: under TF32
            _call(x, w, y, backend)
        assert graphs.GRAPHED_CALLS.replays == 3 - graphs.CALLS_BEFORE_CAPTURE
        matmul.allow_tf32 = False
        for _ in range(3):
            _call_matching_launched(x, w, y, backend)
    finally:
        matmul.allow_tf32 = allowed


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_target_in_a_replay_gives_nan_then_an_error(backend):
    skip_unless_usable(backend)
    w = _weight()
    x, y = _batch(50)
    for _ in range(3):
        _call(x, w, y, backend)
    replays = graphs.GRAPHED_CALLS.replays
    bad = y.clone()
    bad[3] = V + 5
    (loss,), (dx, dw) = _call(x, w, bad, backend)
    assert graphs.GRAPHED_CALLS.replays == replays + 1
    counted = bad != -100
    assert torch.isnan(loss).item() and torch.isnan(dx[counted]).all().item() and torch.isnan(dw).all().item()
    assert (dx[~counted] == 0).all().item()
    with pytest.raises(ValueError, match="out of range"):
        flce.check_errors()
    (loss,), _ = _call(x, w, y, backend)  # the graph goes on with good targets
    assert torch.isfinite(loss).item()
    flce.check_errors()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_in_capture_or_replay(backend):
    skip_unless_usable(backend)
    w = _weight()
    x, y = _batch(60)
    _call(x, w, y, backend)  # launched: compiles the kernels (compilation may synchronize)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # the capture, then replays
            _call(x, w, y, backend)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert graphs.GRAPHED_CALLS.replays == 3


@pytest.mark.parametrize(
    "setting",
    [
        dict(memory_budget=2**30),
        dict(chunk_size=64),
        dict(vocab_chunk_size=512),
        "FLCE_MEMORY_BUDGET_MIB",
        graphs.GRAPHS_ENV_VAR,
        "FLCE_VALIDATE",
    ],
)
def test_not_graphed(setting, monkeypatch):
    """A stated memory bound, graphs turned off, synchronous validation: launched calls."""
    options = {}
    if setting == "FLCE_MEMORY_BUDGET_MIB":
        monkeypatch.setenv(setting, "1024")
    elif setting == graphs.GRAPHS_ENV_VAR:
        monkeypatch.setenv(setting, "off")
    elif setting == "FLCE_VALIDATE":
        monkeypatch.setenv(setting, "sync")
    else:
        options = setting
    w = _weight()
    x, y = _batch(70)
    for _ in range(4):
        _call(x, w, y, "triton", **options)
    assert len(graphs.GRAPHED_CALLS) == 0 and graphs.GRAPHED_CALLS.replays == 0


def test_inside_the_callers_capture():
    """A caller capturing its own graph captures the launched call (no graph in a graph)."""
    w = _weight()
    x, y = _batch(80)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: these calls capture and replay flce's own graph
            flce.fused_linear_cross_entropy(static_x, w, y, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    replays = graphs.GRAPHED_CALLS.replays
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = flce.fused_linear_cross_entropy(static_x, w, y, backend="triton")
    assert graphs.GRAPHED_CALLS.replays == replays
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    expected = _launched(x2, w, y, "triton", grad=False)[0][0]
    assert torch.equal(loss, expected)


def test_held_memory_stays_under_the_limit():
    """Past the memory all graphs may hold the least recently used graph goes, and its memory with it:
    under a limit of 4 MiB, graphs of 1.2, 1.8, 2.4 and 3.6 MB (N = 256, H = 128)."""
    LIMIT = 4 * 2**20  # noqa: N806
    graphs.GRAPHED_CALLS._held_bytes_limit = LIMIT
    try:
        for vocab in (1031, 1543, 2053, 3079):
            x, y = _batch(90, vocab)
            w = _weight(vocab=vocab)
            for _ in range(3):
                _call(x, w, y, "triton")
            assert graphs.GRAPHED_CALLS.held_bytes <= LIMIT
        assert 1 <= len(graphs.GRAPHED_CALLS) < 4
    finally:
        graphs.GRAPHED_CALLS._held_bytes_limit = None


def test_keys_that_evict_each_other_end_up_launched():
    """Two weights called in turn, under a memory limit that holds one graph: each capture
    evicts the other graph, so past ``FREE_CAPTURES`` the calls launch (correctly) instead
    of capturing on every call."""
    graphs.GRAPHED_CALLS._held_bytes_limit = 2 * 2**20  # one graph of 1.2 MB (N = 256, H = 128, V = 1031)
    try:
        weights = [_weight(0), _weight(1)]
        for step in range(24):
            x, y = _batch(100 + step)
            w = weights[step % 2]
            _call_matching_launched(x, w, y, "triton")
        assert graphs.GRAPHED_CALLS.captures == graphs.FREE_CAPTURES
    finally:
        graphs.GRAPHED_CALLS._held_bytes_limit = None


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_of_calls_whose_backward_waits(backend):
    """A replay's gradients are the graph's until the backward scales them into new
    tensors: two calls of one layout, then both backwards (the first call's gradients were
    overwritten by the second's replay: recomputed), with upstream gradients 2.5 and -1."""
    skip_unless_usable(backend)
    w = _weight()
    for seed in range(2):  # the capture
        x, y = _batch(110 + seed)
        _call(x, w, y, backend)
    batches = [_batch(120), _batch(121)]
    leaves, losses = [], []
    for x, y in batches:
        xr, wr = x.clone().requires_grad_(), w.detach().requires_grad_()  # the graph's weight, read in place
        losses.append(flce.fused_linear_cross_entropy(xr, wr, y, backend=backend))
        leaves.append((xr, wr))
    replays = graphs.GRAPHED_CALLS.replays
    (losses[0] * 2.5).backward()
    (losses[1] * -1.0).backward()
    assert graphs.GRAPHED_CALLS.replays == replays  # backward replays nothing
    for (x, y), (xr, wr), scale in zip(batches, leaves, (2.5, -1.0), strict=True):
        truth, eager = _truth_and_eager(x, w, y, scale)
        for name, ours, t, e in zip(("dx", "dw"), (xr.grad, wr.grad), truth[1:], eager[1:], strict=True):
            assert_close_to_reference(name, ours, t, e, floor=1e-6)
    # The second call's gradients were still the graph's: scaled into new tensors, they are
    # the launched call's bit for bit (the first call's were recomputed with the upstream
    # gradient folded into each row: another rounding).
    (x, y), (xr, wr) = batches[1], leaves[1]
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(graphs.GRAPHS_ENV_VAR, "off")
        (flce.fused_linear_cross_entropy(xl, wl, y, backend=backend) * -1.0).backward()
    _assert_identical([xr.grad, wr.grad], [xl.grad, wl.grad])
