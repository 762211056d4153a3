"""The asynchronous input checks (``flce.driver.validation``): the error at the next call
or at ``check_errors()``, ``discard_pending()``, nothing under CUDA-graph capture, and
the pinned buffers and events reused from call to call instead of allocated per call.

The CUDA pieces are stand-ins (a CPU buffer for the pinned one, an event
whose copy lands when the test says); ``test_gpu_*`` run the real ones."""

from __future__ import annotations

import pytest
import torch

import flce
from flce.driver import validation


class _Event:
    """A stand-in for ``torch.cuda.Event``: the copy lands when ``landed`` says."""

    def __init__(self) -> None:
        self.landed = True

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


class _FakeCuda:
    def __init__(self) -> None:
        self.capturing = False
        self.slots: list = []  # every slot made, in order

    def new_slot(self, key):
        _, shape, dtype = key
        slot = validation._Slot(key, torch.empty(shape, dtype=dtype), _Event())
        self.slots.append(slot)
        return slot


@pytest.fixture
def cuda(monkeypatch):
    """The CUDA side of ``validation`` stood in for, on any machine: the counts these tests
    defer are CPU tensors, and the stand-in's slots are what they inspect."""
    fake = _FakeCuda()
    monkeypatch.setattr(validation, "_free_slots", {})
    monkeypatch.setattr(validation, "_new_slot", fake.new_slot)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    yield fake
    validation.discard_pending()


@pytest.fixture
def pool(monkeypatch):
    """The real pinned slots and events, in a fresh pool of their own (GPU tests)."""
    monkeypatch.setattr(validation, "_free_slots", {})
    yield
    validation.discard_pending()


def _describe(counts: list) -> str | None:
    return f"{int(counts[0])} bad" if counts[0] else None


def _counts(bad: int, size: int = 2) -> torch.Tensor:
    return torch.tensor([bad] + [0] * (size - 1), dtype=torch.float32)


def test_a_bad_call_raises_at_the_next_read_once(cuda):
    validation.defer(_counts(0), _describe)
    validation.defer(_counts(3), _describe)
    validation.defer(_counts(5), _describe)  # after the first error: discarded with it
    with pytest.raises(ValueError, match="^3 bad$"):
        validation.raise_pending()
    validation.raise_pending()
    flce.check_errors()


def test_a_copy_in_flight_is_read_when_it_lands_or_when_waited_for(cuda):
    validation.defer(_counts(2), _describe)
    cuda.slots[0].landed.landed = False
    validation.raise_pending()  # not landed: nothing to read yet, no wait
    with pytest.raises(ValueError, match="2 bad"):
        flce.check_errors()  # waits


def test_slots_are_reused_once_read(cuda):
    for _ in range(5):
        validation.defer(_counts(0), _describe)
        validation.raise_pending()
    assert len(cuda.slots) == 1
    # Two calls pending at once take two slots; both come back.
    cuda.slots[0].landed.landed = False
    validation.defer(_counts(0), _describe)
    validation.defer(_counts(0), _describe)
    assert len(cuda.slots) == 2
    validation.raise_pending()
    assert len(validation._pending) == 2  # the first has not landed: neither is read
    flce.check_errors()
    assert not validation._pending
    validation.defer(_counts(0), _describe)
    validation.defer(_counts(0), _describe)
    assert len(cuda.slots) == 2


def test_a_bad_call_reuses_its_slot_too(cuda):
    validation.defer(_counts(1), _describe)
    with pytest.raises(ValueError):
        validation.raise_pending()
    validation.defer(_counts(0), _describe)
    assert len(cuda.slots) == 1


def test_counts_of_another_shape_or_dtype_get_their_own_slots(cuda):
    validation.defer(_counts(0), _describe)
    validation.raise_pending()
    validation.defer(_counts(4, size=13), _describe)
    validation.defer(_counts(0).long(), _describe)
    assert [tuple(s.host.shape) for s in cuda.slots] == [(2,), (13,), (2,)]
    assert cuda.slots[2].host.dtype == torch.int64
    with pytest.raises(ValueError, match="4 bad"):
        validation.raise_pending()


def test_discarded_checks_never_raise_and_their_slots_are_not_reused(cuda):
    validation.defer(_counts(7), _describe)
    cuda.slots[0].landed.landed = False  # the copy may still be in flight
    validation.discard_pending()
    flce.check_errors()
    validation.defer(_counts(0), _describe)
    assert len(cuda.slots) == 2


def test_nothing_is_deferred_or_read_under_graph_capture(cuda):
    validation.defer(_counts(1), _describe)
    cuda.capturing = True
    validation.defer(_counts(2), _describe)
    assert len(validation._pending) == 1 and len(cuda.slots) == 1
    validation.raise_pending(wait=True)  # capture: no read
    cuda.capturing = False
    with pytest.raises(ValueError, match="1 bad"):
        flce.check_errors()


# ------------------------------------------------------------------ on a GPU


def _gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
def test_gpu_counts_land_in_reused_pinned_slots(pool):
    device = _gpu()
    for call in range(4):
        validation.defer(_counts(call % 2).to(device), _describe)
        if call % 2:
            with pytest.raises(ValueError, match="1 bad"):
                flce.check_errors()
        else:
            flce.check_errors()
    (free,) = validation._free_slots.values()
    assert len(free) == 1 and free[0].host.is_pinned()


@pytest.mark.gpu
def test_gpu_bad_targets_raise_at_the_next_call_with_reused_slots(pool):
    device = _gpu()
    x = torch.randn(8, 16, device=device)
    w = torch.randn(32, 16, device=device)
    good = torch.randint(0, 32, (8,), device=device)
    bad = good.clone()
    bad[2] = 99
    for _ in range(3):
        assert flce.fused_linear_cross_entropy(x, w, bad).isnan().item()
        with pytest.raises(ValueError, match="found 1 out of range"):
            flce.fused_linear_cross_entropy(x, w, good)
        flce.check_errors()
    assert sum(len(free) for free in validation._free_slots.values()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_gpu_slots_made_under_inference_mode_serve_later_calls(pool, backend):
    """A slot outlives the call that made it: one made by an evaluation under
    ``torch.inference_mode`` must take the counts of the training calls after it (an
    inference tensor refuses in-place updates outside that mode), and bad targets still
    raise on either side of it."""
    device = _gpu()
    x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    good = torch.randint(0, 32, (8,), device=device)
    bad = good.clone()
    bad[3] = 40
    with torch.inference_mode():
        flce.fused_linear_cross_entropy(x, w, good, backend=backend)
        flce.check_errors()
    slots = [slot for free in validation._free_slots.values() for slot in free]
    assert slots and not any(slot.host.is_inference() for slot in slots)
    trained = x.clone().requires_grad_()
    flce.fused_linear_cross_entropy(trained, w, good, backend=backend).backward()
    assert flce.fused_linear_cross_entropy(trained, w, bad, backend=backend).isnan().item()
    with pytest.raises(ValueError, match="found 1 out of range"):
        flce.check_errors()
    with torch.inference_mode():
        assert flce.fused_linear_cross_entropy(x, w, bad, backend=backend).isnan().item()
        with pytest.raises(ValueError, match="found 1 out of range"):
            flce.check_errors()


@pytest.mark.gpu
def test_gpu_slots_stay_pinned_host_memory_under_an_ambient_cuda_device(pool):
    """Under ``torch.set_default_device("cuda")`` or a ``torch.device`` context a slot is
    still pinned host memory (a CUDA tensor cannot be pinned: the calls would raise)."""
    device = _gpu()
    with torch.device(device):
        validation.defer(_counts(0).to(device), _describe)
        flce.check_errors()
        validation.defer(_counts(1).to(device), _describe)
        with pytest.raises(ValueError, match="1 bad"):
            flce.check_errors()
    (free,) = validation._free_slots.values()
    assert free[0].host.device.type == "cpu" and free[0].host.is_pinned()


def test_deferred_statistics_follow_the_first_gemm_and_are_still_checked(cuda, monkeypatch):
    """With asynchronous validation a call launches its first logits GEMM before the batch
    statistics (the GPU starts while the host works), and a bad target still poisons the
    call and raises at the next read."""
    from flce.driver import chunks, statistics

    monkeypatch.setattr(validation, "validates_synchronously", lambda device: False)
    order = []
    logits_product, deferred = chunks.logits_product, statistics._deferred_statistics

    def gemm(*args, **kwargs):
        order.append("gemm")
        return logits_product(*args, **kwargs)

    def stats(*args):
        order.append("statistics")
        return deferred(*args)

    monkeypatch.setattr(chunks, "logits_product", gemm)
    monkeypatch.setattr(statistics, "_deferred_statistics", stats)
    x, w = torch.randn(6, 8), torch.randn(16, 8)
    good = torch.tensor([0, 3, 5, 15, -100, 2])
    flce.fused_linear_cross_entropy(x, w, good, backend="torch")
    flce.check_errors()
    assert order == ["gemm", "statistics"]
    bad = good.clone()
    bad[1] = 99
    assert flce.fused_linear_cross_entropy(x, w, bad, backend="torch").isnan()
    with pytest.raises(ValueError, match="found 1 out of range"):
        flce.check_errors()


def test_earlier_reads_at_most_the_checks_pending_before_the_call(cuda):
    validation.defer(_counts(0), _describe)
    validation.defer(_counts(2), _describe)  # the current call's own check, landed already
    validation.raise_pending(earlier=0)  # nothing was pending before the call: nothing read
    assert len(validation._pending) == 2
    validation.raise_pending(earlier=1)  # the earlier call's check only
    assert len(validation._pending) == 1
    with pytest.raises(ValueError, match="2 bad"):
        validation.raise_pending(earlier=1)


def test_a_call_raises_an_earlier_error_once_its_own_gemm_is_queued(cuda, monkeypatch):
    """A call reads the earlier calls' checks after launching its kernels (their host work
    does not delay its first GEMM), and never raises for its own input, even where its
    check has landed by its end (here every copy lands at once): its outputs are NaN and
    the next call raises."""
    from flce.driver import chunks

    monkeypatch.setattr(validation, "validates_synchronously", lambda device: False)
    order = []
    logits_product = chunks.logits_product

    def gemm(*args, **kwargs):
        order.append("gemm")
        return logits_product(*args, **kwargs)

    monkeypatch.setattr(chunks, "logits_product", gemm)
    x, w = torch.randn(6, 8), torch.randn(16, 8)
    good = torch.tensor([0, 3, 5, 15, -100, 2])
    bad = good.clone()
    bad[4] = 16
    assert flce.fused_linear_cross_entropy(x, w, bad, backend="torch").isnan()  # its own check: pending
    assert order == ["gemm"]
    with pytest.raises(ValueError, match="found 1 out of range"):
        flce.fused_linear_cross_entropy(x, w, good, backend="torch")
    assert order == ["gemm", "gemm"]  # raised after the second call's GEMM
    flce.fused_linear_cross_entropy(x, w, good, backend="torch")
    flce.check_errors()


def test_threads_reading_at_once_read_each_check_once_and_free_each_slot_once(cuda):
    # DataParallel's replicas (threads) call flce at once: each reads the checks pending.
    # A check read by two threads, and popped twice, lost the next call's check, and its
    # slot freed twice went to two later calls at once.
    import threading
    import time

    described = []

    def describe(counts: list) -> str | None:
        described.append(int(counts[1]))
        return None

    def slow_query() -> bool:
        time.sleep(0.01)  # both threads between reading the oldest check and popping it
        return True

    for call in range(4):
        validation.defer(torch.tensor([0.0, float(call)]), describe)
    for slot in cuda.slots:
        slot.landed.query = slow_query
    start = threading.Barrier(2)

    def read():
        start.wait(5)
        validation.raise_pending()

    threads = [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(described) == [0, 1, 2, 3]
    assert not validation._pending
    free = [slot for slots in validation._free_slots.values() for slot in slots]
    assert len(free) == len({id(slot) for slot in free}) == len(cuda.slots) == 4


ENTRY_POINTS = {
    "fused": lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, backend="torch"),
    "fused-none": lambda x, w, t: flce.fused_linear_cross_entropy(x, w, t, reduction="none", backend="torch").sum(),
    "cross_entropy": lambda x, w, t: flce.cross_entropy(x @ w.T, t, backend="torch"),
    "logprobs": lambda x, w, t: flce.fused_linear_logprobs(x, w, t, backend="torch").logprobs.sum(),
    "distillation": lambda x, w, t: flce.fused_linear_distillation(x, w, x.detach(), w.detach(), t, backend="torch"),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_raises_a_bad_input_at_the_next_call_and_reuses_its_slots(cuda, monkeypatch, entry, compiled):
    """Eager and under torch.compile (whose custom ops run the plan), every head's call
    leaves its own check pending (its outputs are NaN) and the next call raises it: never
    a loop that reports nothing, and the slots are read and reused, not one made per call."""
    monkeypatch.setattr(validation, "validates_synchronously", lambda device: False)
    loss_of = ENTRY_POINTS[entry]
    if compiled:
        torch._dynamo.reset()
        loss_of = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    good = torch.tensor([0, 3, 5, 15, -100, 2])
    bad = good.clone()
    bad[4] = 16
    loss = loss_of(x, w, bad)
    assert loss.isnan()
    loss.backward()
    with pytest.raises(ValueError, match="found 1 out of range"):
        loss_of(x, w, good)
    for _ in range(4):
        loss_of(x, w, good).backward()
    slots_made = len(cuda.slots)
    for _ in range(8):
        loss_of(x, w, good).backward()
    # A forward's and a backward's check at most stay pending; their slots are reused.
    assert validation.pending_checks() <= 2
    assert len(cuda.slots) == slots_made
