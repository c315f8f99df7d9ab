"""Frozen input embeddings with gradient checkpointing (LoRA's setup) under CP (`integrations/input_grads.py`): the
embeddings' output still carries the gradient into reentrant and non-reentrant checkpoints, every gradient equals
stock's, and the output is no longer kept until the end of backward; with CP off stock keeps it, unchanged."""

from __future__ import annotations

import weakref

import pytest

from tests.helpers.cases import FAMILIES, build_batch
from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL, compare
from vlmcp_patch.fixtures.models import build_model


def _embedding_output_kept(model, batch) -> bool:
    """Whether the embedding module's own output is still alive once the forward has returned (a hook placed before
    transformers' sees the very tensor it turns into a leaf)."""
    seen = {}
    handle = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: seen.__setitem__("output", weakref.ref(out)), prepend=True)
    try:
        out = model(**batch)
        kept = seen["output"]() is not None
        out.loss.backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return kept


def frozen_embeddings_run(rank: int, world_size: int, family: str, reentrant: bool, case: str) -> dict:
    import vlmcp_patch

    make_config, cases = FAMILIES[family]
    _, layout = cases[case]
    model = build_model(make_config(), seed=1)
    model.get_input_embeddings().requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    batch = build_batch(layout, seed=7)
    hooked = bool(getattr(model, "_require_grads_hooks", None))
    result = compare(model, batch, world_size)
    vlmcp_patch.revert()
    try:
        kept_stock = _embedding_output_kept(model, batch)
    finally:
        vlmcp_patch.apply()
    vlmcp_patch.enable(cp_size=world_size)
    try:
        kept_cp = _embedding_output_kept(model, batch)
    finally:
        vlmcp_patch.enable(cp_size=1)
    return {**result, "hooked": hooked, "kept_stock": kept_stock, "kept_cp": kept_cp}


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
# a text-only row with reentrant checkpoints: nothing but the embeddings' output can carry the gradient into them
# padded rows of images (with their mask: no release cuts them, tests/helpers/cases.py)
@pytest.mark.parametrize("reentrant, case", [(False, "padded_pair"), (True, "text_only")],
                         ids=["non-reentrant", "reentrant"])
def test_frozen_embeddings_with_checkpointing_equal_stock_without_keeping_the_output(family, reentrant, case):
    for rank, m in enumerate(run_distributed(frozen_embeddings_run, 2, family, reentrant, case, timeout=600)):
        where = f"{family}, reentrant={reentrant}, rank {rank}"
        assert m["hooked"], f"{where}: transformers registered no input-require-grads hook"
        assert m["loss_err"] <= TOL and m["grad_err"] <= TOL, (where, m["worst_grad"])
        assert m["missing_grads"] == [], where  # reentrant checkpoints still back-propagate into their layers
        assert m["kept_stock"], f"{where}: stock no longer keeps the leaf (the control differs from what was found)"
        assert not m["kept_cp"], f"{where}: under CP the embeddings' output is still kept through the step"
