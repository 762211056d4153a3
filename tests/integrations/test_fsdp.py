"""FSDP2 (fully_shard) over gloo on CPU, 2 processes: flce inside the model's forward
gets FSDP's unsharded parameters and gives the gradients of the data-parallel mean loss;
a sharded DTensor passed straight in is refused with a message that says what to do."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("torch.distributed.fsdp")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

from tests.gloo_ranks import free_port, gloo_rank

WORLD = 2


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 13, bias=False)

    def forward(self, x, target):
        import flce

        return flce.fused_linear_cross_entropy(
            torch.tanh(self.proj(x)), self.lm_head.weight, target, label_smoothing=0.1
        )


def _batch(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 13, (6,), generator=gen)


def _dtensor_refusals(mesh) -> dict[str, str]:
    """Every tensor argument of every entry point given as a DTensor: the message of the
    TypeError it raised (or what else happened), by case."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    import flce

    def dtensor(tensor):
        return distribute_tensor(tensor, mesh, [Replicate()])

    x, w, y, class_weights = torch.randn(4, 8), torch.randn(13, 8), torch.zeros(4, dtype=torch.long), torch.ones(13)
    logits = x @ w.T
    cases = {
        "target": lambda: flce.fused_linear_cross_entropy(x, w, dtensor(y)),
        "ce_weight": lambda: flce.fused_linear_cross_entropy(x, w, y, ce_weight=dtensor(class_weights)),
        "module ce_weight": lambda: flce.FusedLinearCrossEntropyLoss(ce_weight=dtensor(class_weights))(x, w, y),
        "logits": lambda: flce.cross_entropy(dtensor(logits), y),
        "logits target": lambda: flce.cross_entropy(logits, dtensor(y)),
        "logits weight": lambda: flce.cross_entropy(logits, y, weight=dtensor(class_weights)),
        "logprobs target": lambda: flce.fused_linear_logprobs(x, w, dtensor(y)),
        "distillation target": lambda: flce.fused_linear_distillation(x, w, x, w, dtensor(y)),
    }
    outcomes = {}
    for case, call in cases.items():
        try:
            call()
            outcomes[case] = "no error"
        except Exception as exc:  # recorded, judged by the test
            outcomes[case] = f"{type(exc).__name__}: {exc}"
    return outcomes


def _worker(rank, port, out_dir):
    with gloo_rank(rank, WORLD, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        import flce

        mesh = init_device_mesh("cpu", (WORLD,))
        model = fully_shard(Head(), mesh=mesh)
        loss = model(*_batch(rank))
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        refused = ""
        sharded = distribute_tensor(torch.randn(13, 8), mesh, [Shard(0)])
        try:
            flce.fused_linear_cross_entropy(torch.randn(4, 8), sharded, torch.zeros(4, dtype=torch.long))
        except TypeError as exc:
            refused = str(exc)
        torch.save(
            {"loss": loss.detach(), "grads": grads, "refused": refused, "refused_each": _dtensor_refusals(mesh)},
            os.path.join(out_dir, f"{rank}.pt"),
        )


def test_fsdp2_gradients_equal_the_data_parallel_mean(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]

    reference = Head()
    losses = [reference(*_batch(r)) for r in range(WORLD)]
    (sum(losses) / WORLD).backward()  # FSDP2 averages gradients over the data-parallel ranks
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], losses[rank].detach())
        for name, param in reference.named_parameters():
            torch.testing.assert_close(result["grads"][name], param.grad, rtol=1e-5, atol=1e-6)
        assert "weight is a DTensor" in result["refused"] and "fully_shard" in result["refused"]
        for case, outcome in result["refused_each"].items():
            assert outcome.startswith("TypeError: ") and "is a DTensor" in outcome, (case, outcome)
