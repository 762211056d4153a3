"""Every architecture in transformers' causal-LM auto mapping: once patched, its loss and
every parameter gradient are the stock model's (as close to float64 as stock fp32 is), or
``apply_flce`` refuses it with a reason. Never a silently different loss.

Tiny random models are built from each model type's default config (``hf_tiny``); one whose
tiny build or stock forward/backward fails here is skipped with that error (nothing flce
could be checked against). The README lists the outcomes (``python -m
tests.integrations.hf_tiny`` regenerates the list); each test also checks its entry there.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from tests.integrations import hf_tiny  # noqa: E402
from tests.integrations.hf_tiny import one_thread  # noqa: E402, F401 (an autouse fixture)


@pytest.fixture(scope="module")
def recorded():
    return hf_tiny.recorded_outcomes()


@pytest.mark.parametrize("model_type", hf_tiny.model_types())
def test_architecture_matches_stock_or_is_refused(model_type, recorded):
    category, detail = hf_tiny.outcome(model_type)  # raises if a patched loss or gradient differs from stock
    if recorded is not None:
        assert recorded.get(model_type) == category, (
            f"README lists {model_type} as {recorded.get(model_type)!r}, now {category!r} ({detail}); "
            "regenerate the list with `python -m tests.integrations.hf_tiny`"
        )
    if category == hf_tiny.UNBUILDABLE:
        pytest.skip(f"tiny {model_type} cannot be built and trained here: {detail}")


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "bart"])  # gemma2: a fitted softcap; bart: the inline probe
def test_patched_model_under_an_ambient_default_device(model_type):
    """Patching and training under ``torch.set_default_device`` or a ``torch.device``
    context (meta here: a tensor that followed it would hold no data) matches stock."""
    import transformers

    from flce.integrations import transformers as flce_hf

    stock = hf_tiny.build(hf_tiny.tiny_config(model_type))
    batch = hf_tiny.inputs(stock)
    patched = hf_tiny.clone(stock)
    with torch.device("meta"):
        # Nothing to compare against where the model's own forward follows the context, in
        # either mode (patching probes both): transformers 5.17's bart draws its layer-drop
        # number in training mode without a device and branches on it.
        for training in (True, False):
            try:
                stock.train(training)(**batch).loss.backward()
            except Exception as error:
                mode = "training" if training else "eval"
                with pytest.raises(flce_hf.UnsupportedModelError, match=f"its own forward fails in {mode} mode"):
                    flce_hf.apply_flce(patched)
                pytest.skip(
                    f"{model_type}'s own forward fails in {mode} mode under a meta default device "
                    f"(transformers {transformers.__version__}): {error!r}"
                )
        stock.zero_grad(set_to_none=True)
        flce_hf.apply_flce(patched)
        hf_tiny.compare_with_stock(stock, patched, batch)
