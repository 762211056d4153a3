"""The heads' options dataclasses (validated once, numbers normalised as in
``LossOptions``) and the custom-op schemas derived from their fields; the registry's
head slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flce import dispatch
from flce.backends.base import HEAD_SLOTS
from flce.options import (
    DistillationOptions,
    LogprobsOptions,
    option_fields,
    option_values,
    options_from_values,
    options_schema,
)


def test_numbers_are_normalised_to_python_types():
    logprobs = LogprobsOptions(temperature=np.float32(0.5), ignore_index=np.int64(-1), chunk_size=np.int32(8))
    assert type(logprobs.temperature) is float and type(logprobs.ignore_index) is int
    assert type(logprobs.chunk_size) is int and logprobs.inv_temperature == 2.0
    distillation = DistillationOptions(beta=1, temperature=3, backend=" Triton ")
    assert type(distillation.beta) is float and distillation.backend == "triton"


@pytest.mark.parametrize(
    "options_type,kwargs,error,message",
    [
        (LogprobsOptions, dict(temperature=0), ValueError, "temperature must be > 0"),
        (LogprobsOptions, dict(temperature=float("inf")), TypeError, "finite float"),
        # positive, but 1 / temperature overflows float32: NaN logprobs before
        (LogprobsOptions, dict(temperature=1e-39), ValueError, "temperature must be >= 2.94e-39"),
        (DistillationOptions, dict(temperature=1e-300), ValueError, "temperature must be >= 2.94e-39"),
        (LogprobsOptions, dict(temperature=torch.tensor(1.0)), TypeError, r"pass float\(t\)"),
        (LogprobsOptions, dict(ignore_index=2**63), ValueError, "fit in int64"),
        (LogprobsOptions, dict(return_entropy="yes"), TypeError, "return_entropy must be a bool"),
        (DistillationOptions, dict(beta=-0.1), ValueError, r"beta must be in \[0, 1\]"),
        (DistillationOptions, dict(beta=float("nan")), TypeError, "beta must be a finite float"),
        (DistillationOptions, dict(reduction="batchmean"), ValueError, "reduction must be one of"),
        (DistillationOptions, dict(chunk_size=-4), ValueError, "chunk_size must be a positive int"),
        (DistillationOptions, dict(backend="tpu"), ValueError, "backend must be one of"),
    ],
)
def test_bad_options_raise_naming_the_argument(options_type, kwargs, error, message):
    with pytest.raises(error, match=message):
        options_type(**kwargs)


@pytest.mark.parametrize(
    "options", [LogprobsOptions(temperature=0.7, return_entropy=True), DistillationOptions(beta=0)]
)
def test_op_schema_and_values_derive_from_the_fields(options):
    options_type = type(options)
    names = option_fields(options_type)
    assert names == tuple(f.name for f in dataclasses.fields(options_type))
    schema = options_schema(options_type)
    assert [part.split()[-1] for part in schema.split(", ")] == list(names)
    assert options_from_values(option_values(options), options_type) == options


def test_every_head_slot_is_filled_by_torch_and_triton_not_cutedsl():
    for slot in HEAD_SLOTS:
        assert getattr(dispatch.get_backend("torch"), slot) is not None
        assert getattr(dispatch.get_backend("triton"), slot) is not None
        assert getattr(dispatch.get_backend("cutedsl"), slot) is None


def test_needs_must_name_a_slot():
    with pytest.raises(ValueError, match="needs must be one of"):
        dispatch.resolve_backend(None, torch.device("cpu"), needs="cross_entropy_chunk")
