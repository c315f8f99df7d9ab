"""A transformers release whose patch targets do not all verify, made so by the test itself (run on each rank).

`digest`: the pinned digests of the gated DeltaNet forward are replaced by one no release has (as when upstream
changes the layer): the Qwen3.5 families do not verify. `parameter`: Qwen3-VL's top-level forward is replaced by
one without `labels` and `position_ids` (as when upstream drops a parameter the patch relies on): the Qwen3-VL
family does not verify. The package is imported with VLMCP_DISABLE=1, the target changed, then applied.
"""

from __future__ import annotations

import os
import time
import warnings

import torch


def _break(how: str):
    """Make one target unverifiable; returns (family name, a model of it, the other family's model)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as vl

    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config
    from vlmcp_patch.models import qwen3_5

    if how == "digest":
        qwen3_5.GATED_DELTANET_FORWARD.clear()
        qwen3_5.GATED_DELTANET_FORWARD["0" * 16] = "transformers>=99"
        return "qwen3_5", build_model(tiny_qwen3_5_config(), seed=0), build_model(tiny_qwen3_vl_config(), seed=0)
    # Reached through the class, not a closure: a closure over it would read as a decorator around stock's forward.
    vl.Qwen3VLForConditionalGeneration.stock_forward = vl.Qwen3VLForConditionalGeneration.forward

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None,
                mm_token_type_ids=None, **kwargs):
        return self.stock_forward(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                                  image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids, **kwargs)

    vl.Qwen3VLForConditionalGeneration.forward = forward
    return "qwen3_vl", build_model(tiny_qwen3_vl_config(), seed=0), build_model(tiny_qwen3_5_config(), seed=0)


def _batch():
    from vlmcp_patch.fixtures.data import Segment, make_batch

    batch = make_batch([[Segment(text=5), Segment(image=(16, 24)), Segment(text=7)]], seed=3)
    batch.pop("labels")
    return batch


def _forward(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def run_unverified_case(rank: int, world_size: int, how: str) -> dict:
    os.environ["VLMCP_DISABLE"] = "1"
    import transformers

    import vlmcp_patch
    from vlmcp_patch.patching import PATCHES

    family, model, other = _break(how)
    os.environ.pop("VLMCP_DISABLE")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vlmcp_patch.apply()  # as `import vlmcp_patch` does: never raises
    messages = [str(w.message) for w in caught if issubclass(w.category, vlmcp_patch.UntestedVersionWarning)]
    out = {"warnings": messages, "unverified": sorted(PATCHES.unverified), "version": transformers.__version__}
    top = type(model).__dict__["forward"]
    # CP off: the guarded forward is stock's (the installed class's own function), bit for bit.
    batch = _batch()
    out["p1_identical"] = bool(torch.equal(_forward(model, batch), _forward_stock(model, top, batch)))
    text_model = type(other.model.language_model)  # the other family's decoder: patched
    out["other_patched"] = getattr(text_model.__dict__["forward"], "vlmcp_original", None) is not None
    vlmcp_patch.enable(cp_size=world_size)
    start = time.monotonic()
    try:
        _forward(model, batch)
        out["cp"] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        out["cp"] = {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    out["family"] = family
    return out


def _forward_stock(model, patched, batch):
    with torch.no_grad():
        return patched.vlmcp_original(model, **batch).logits
