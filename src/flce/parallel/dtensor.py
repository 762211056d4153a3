"""The DTensor adapter of the vocab-parallel loss: a weight sharded ``Shard(0)`` over a
1-D device mesh becomes its local tensor, the mesh's process group and the shard's
global start row."""

from __future__ import annotations

import math

from flce.parallel.handshake import ENTRY


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - very old torch
        return None, None
    return DTensor, Shard


def mesh_group(weight_shard):
    """The process group of a DTensor ``weight_shard``'s 1-D mesh (None for a plain
    tensor): the group the call's handshake runs in. Refuses, before any collective, a
    layout that is the same on every rank (a mesh of more dims, a placement other than
    ``Shard(0)``) and a rank outside the mesh: every rank raises alike, none waits."""
    DTensor, Shard = _dtensor_type()
    if DTensor is None or not isinstance(weight_shard, DTensor):
        return None
    mesh = weight_shard.device_mesh
    if mesh.ndim != 1 or tuple(weight_shard.placements) != (Shard(0),):
        raise ValueError(
            f"{ENTRY}: a DTensor weight_shard must be sharded on the vocabulary dim over a 1-D mesh "
            f"(placements (Shard(0),)), got a {mesh.ndim}-D mesh with placements {tuple(weight_shard.placements)}; "
            "otherwise pass weight.to_local() with vocab_start= and process_group= (the mesh dim's group)"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"{ENTRY}: this rank is not part of weight_shard's device mesh")
    return mesh.get_group()


def unwrap_dtensors(input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start):
    """DTensor adapter: a weight sharded ``Shard(0)`` over a 1-D mesh (``mesh_group``)
    becomes its local tensor, the mesh's process group and the shard's global start row.
    Its refusals may differ between ranks (a local shard of unexpected size, an argument
    passed on some ranks only): the caller raises them in the handshake."""
    DTensor, Shard = _dtensor_type()
    if DTensor is None:
        return input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start
    for name, t in (("input", input), ("target", target)):
        if isinstance(t, DTensor):
            raise TypeError(
                f"{ENTRY}: {name} is a DTensor; pass the full {name} on every rank as a plain tensor "
                f"({name}.full_tensor())"
            )
    if not isinstance(weight_shard, DTensor):
        for name, t in (("bias_shard", bias_shard), ("ce_weight_shard", ce_weight_shard)):
            if isinstance(t, DTensor):
                raise TypeError(
                    f"{ENTRY}: {name} is a DTensor but weight_shard is not; pass plain local shards "
                    "for all of them, or DTensors sharded Shard(0) on one mesh for all of them"
                )
        return input, target, weight_shard, bias_shard, ce_weight_shard, process_group, vocab_start

    mesh = weight_shard.device_mesh
    group = mesh_group(weight_shard)
    if vocab_start is not None:
        raise ValueError(f"{ENTRY}: vocab_start is inferred from a DTensor weight_shard's placement; do not pass it")
    if process_group is not None and process_group is not group:
        raise ValueError(f"{ENTRY}: process_group must be None or the weight_shard mesh's group (mesh.get_group())")
    coordinate = mesh.get_coordinate()
    local = weight_shard.to_local()  # differentiable: its gradient becomes a Shard(0) DTensor
    vocab, parts = weight_shard.shape[0], mesh.size()
    per_rank = math.ceil(vocab / parts)  # Shard(0) splits like torch.chunk
    start = min(coordinate[0] * per_rank, vocab)
    if local.shape[0] != min(per_rank, vocab - start):
        raise ValueError(
            f"{ENTRY}: cannot infer the vocabulary range of this rank's DTensor shard (local rows "
            f"{local.shape[0]}, expected {min(per_rank, vocab - start)}); pass weight.to_local() with "
            "vocab_start= and process_group="
        )

    def local_of(name, t):
        if not isinstance(t, DTensor):
            return t
        if t.device_mesh != mesh or tuple(t.placements) != (Shard(0),):
            raise ValueError(f"{ENTRY}: {name} must be sharded like weight_shard (same mesh, Shard(0))")
        return t.to_local()

    return (
        input,
        target,
        local,
        local_of("bias_shard", bias_shard),
        local_of("ce_weight_shard", ce_weight_shard),
        group,
        start,
    )
