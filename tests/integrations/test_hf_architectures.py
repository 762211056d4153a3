"""Every architecture in transformers' causal-LM auto mapping: once patched, its loss and
every parameter gradient are the stock model's (as close to float64 as stock fp32 is), or
``apply_flce`` refuses it with a reason. Never a silently different loss.

Tiny random models are built from each model type's default config (``hf_tiny``); one whose
tiny build or stock forward/backward fails here is skipped with that error (nothing flce
could be checked against).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from flce.integrations import transformers as flce_hf  # noqa: E402
from tests.integrations import hf_tiny  # noqa: E402

MODEL_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_or_skip(model_type: str):
    try:
        model = hf_tiny.build(hf_tiny.tiny_config(model_type))
        batch = hf_tiny.inputs(model)
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    except Exception as exc:  # the stock model itself cannot run from a tiny default config
        pytest.skip(f"tiny {model_type} cannot be built and trained here: {type(exc).__name__}: {exc}"[:300])
    if loss is None:
        pytest.skip(f"stock {model_type} computes no loss from labels")
    return model, batch


def architecture_outcome(model_type: str) -> str:
    """'supported' after checking loss and gradients against stock, or the refusal reason."""
    stock, batch = build_or_skip(model_type)
    patched = hf_tiny.clone(stock)
    try:
        flce_hf.apply_flce(patched)
    except flce_hf.UnsupportedModelError as exc:
        assert exc.reason and exc.model_name == type(stock).__name__
        assert not flce_hf.is_patched(patched)  # refused means left as it was
        return exc.reason
    hf_tiny.compare_with_stock(stock, patched, batch)
    return "supported"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: threads cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_architecture_matches_stock_or_is_refused(model_type):
    architecture_outcome(model_type)
