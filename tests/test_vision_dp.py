"""Vision data parallelism's pieces: a rank's pixel share (a view where a copy buys nothing), the feature exchange's
backward values, and a rank without any image (bf16)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.harness import run_distributed


def test_a_ranks_pixel_share_is_a_view_where_a_copy_buys_nothing():
    """Pixels already on the tower's device in its dtype: the share is a view (the caller holds the batch anyway).
    A cast (or a move from the host) copies that range only."""
    from vlmcp_patch.forward.vision import pixel_share

    pixels = torch.randn(40, 6)
    same = pixel_share(pixels, slice(8, 24), {"device": pixels.device, "dtype": pixels.dtype})
    assert torch.equal(same, pixels[8:24])
    assert same.untyped_storage().data_ptr() == pixels.untyped_storage().data_ptr()
    cast = pixel_share(pixels, slice(8, 24), {"device": pixels.device, "dtype": torch.float64})
    assert torch.equal(cast, pixels[8:24].double())
    assert cast.untyped_storage().nbytes() == 16 * 6 * 8  # the range, not the batch


def exchange_backward(rank: int, world_size: int) -> dict:
    """Rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 to rank 0 and none to itself. Each rank weighs
    the rows it received: the gradient of a sent row is the receiver's weight on it."""
    import torch.distributed as dist

    from vlmcp_patch.collectives.differentiable import exchange_rows

    send = [[1, 2], [1, 0]][rank]
    recv = [send_by[rank] for send_by in ([1, 2], [1, 0])]
    x = (torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2)[: sum(send)] + 10 * rank).requires_grad_(True)
    y = exchange_rows(x, send, recv, dist.group.WORLD)
    weights = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) + 100 * rank
    (y * weights).sum().backward()
    return {"forward": y.tolist(), "grad": x.grad.tolist()}


def one_image_in_bf16(rank: int, world_size: int) -> dict:
    """One image, two ranks, a vision tower with one head (its patches cannot be split by heads, so whole
    items are assigned): rank 1 encodes nothing and runs the placeholder; its vision gradients are exact
    zeros of the model's dtype, rank 0's are the whole vision gradient."""
    import torch.distributed as dist

    import vlmcp_patch
    from vlmcp_patch.fixtures.compare import rel_err
    from vlmcp_patch.fixtures.data import Segment, make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.stats import STATS

    config = tiny_qwen3_vl_config()
    config.vision_config.num_heads = 1
    model = build_model(config, seed=1, dtype=torch.bfloat16)
    batch = make_batch([[Segment(text=7), Segment(image=(16, 24)), Segment(text=9)]], seed=2)
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    vlmcp_patch.enable(cp_size=world_size)
    STATS.drain()
    try:
        model(**batch).loss.backward()
    finally:
        vlmcp_patch.enable(cp_size=1)
    grads = [p.grad for p in model.model.visual.parameters()]
    summed = [g.float().clone() for g in grads]
    for g in summed:
        dist.all_reduce(g)
    model.zero_grad(set_to_none=True)
    vlmcp_patch.revert()
    try:
        model(**batch).loss.backward()
    finally:
        vlmcp_patch.apply()
    reference = [p.grad.float() for p in model.model.visual.parameters()]
    # bf16's own rounding, as the scale: stock bf16 against stock fp32 of the same weights
    model.zero_grad(set_to_none=True)
    model.float()
    vlmcp_patch.revert()
    try:
        model(**{**batch, "pixel_values": batch["pixel_values"].float()}).loss.backward()
    finally:
        vlmcp_patch.apply()
    exact = [p.grad for p in model.model.visual.parameters()]
    return {
        "patches": STATS.vision_patches,
        "all_present": all(g is not None for g in grads),
        "dtypes": {str(g.dtype) for g in grads},
        "all_zero": all(bool((g == 0).all()) for g in grads),
        "cp_vs_fp32": max(rel_err(a, b) for a, b in zip(summed, exact)),
        "stock_vs_fp32": max(rel_err(a, b) for a, b in zip(reference, exact)),
    }


def bf16_run():
    return run_distributed(one_image_in_bf16, 2, timeout=300)


def test_feature_exchange_returns_each_rows_gradient_to_its_sender():
    rank0, rank1 = run_distributed(exchange_backward, 2, timeout=120)
    assert rank0["forward"] == [[0.0, 1.0], [10.0, 11.0]] and rank1["forward"] == [[2.0, 3.0], [4.0, 5.0]]
    assert rank0["grad"] == [[0.0, 1.0], [100.0, 101.0], [102.0, 103.0]] and rank1["grad"] == [[2.0, 3.0]]


@pytest.mark.integration
def test_a_rank_without_images_runs_a_zero_gradient_placeholder_in_the_models_dtype(once):
    rank0, rank1 = once(bf16_run)
    assert rank0["patches"] > 0 and rank1["patches"] == 0
    assert rank1["all_present"] and rank1["dtypes"] == {"torch.bfloat16"} and rank1["all_zero"]
    assert not rank0["all_zero"]
    # The same vision gradient as P=1 up to bf16 rounding: no further from fp32 than stock bf16 is, give or take
    # its own rounding (a missing or doubled contribution would be off by the whole gradient).
    assert rank0["cp_vs_fp32"] <= 2 * rank0["stock_vs_fp32"]


def deepstack_levels_the_decoder_adds(rank: int, world_size: int) -> dict:
    """Per batch (images only; images and a video), the storages of the deepstack levels the CP decoder adds, and
    the step's loss and gradients summed over the group against stock at P=1 (`parity.compare`)."""
    import vlmcp_patch
    from tests.helpers.cases import MULTI_IMAGE, VIDEO_AND_IMAGE, build_batch
    from tests.helpers.parity import compare
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    results = {}
    for name, layout in (("images", MULTI_IMAGE), ("images and a video", VIDEO_AND_IMAGE)):
        model, batch = build_model(tiny_qwen3_vl_config(), seed=1), build_batch(layout, seed=7)
        text = model.model.language_model
        storages = []

        def recorded(hidden_states, visual_pos_masks, visual_embeds, stock=text._deepstack_process):
            storages.append(visual_embeds.untyped_storage().data_ptr())
            return stock(hidden_states, visual_pos_masks, visual_embeds)

        text._deepstack_process = recorded
        metrics = compare(model, batch, world_size)
        del text._deepstack_process
        results[name] = {"storages": storages, **metrics}
    return results


def test_the_decoder_adds_the_routed_deepstack_levels_not_stocks_copies():
    """Stock's forward copies each deepstack level it is handed (`torch.cat` per item, transformers 5.18+) and keeps
    the levels alive to its end: through the decoder's forward the vision features lived twice. Under CP the decoder
    adds the levels the CP path returned, views of one routed tensor, and stock's copies go
    (`forward.vision.use_the_routed_deepstack_levels`); with images and a video stock joins the levels into new
    tensors, each its own. Exact against stock at P=1 either way."""
    from tests.helpers.parity import TOL
    from vlmcp_patch.fixtures.models import tiny_qwen3_vl_config

    levels = len(tiny_qwen3_vl_config().vision_config.deepstack_visual_indexes)
    for rank, by_batch in enumerate(run_distributed(deepstack_levels_the_decoder_adds, 2, timeout=600)):
        for name, m in by_batch.items():
            assert m["loss_err"] <= TOL and m["grad_err"] <= TOL, (name, rank, m["worst_grad"])
            # the forwards, in `compare`'s order: stock's step and logits at P=1, then CP's step and logits
            assert len(m["storages"]) == 4 * levels, (name, rank, m["storages"])
        stock_step, _, cp_step, cp_logits = (by_batch["images"]["storages"][i * levels:(i + 1) * levels]
                                             for i in range(4))
        assert len(set(stock_step)) == levels, (rank, stock_step)  # stock: each level its own tensor
        assert len(set(cp_step)) == 1 and len(set(cp_logits)) == 1, (rank, cp_step, cp_logits)  # one routed tensor
        mixed_cp_step = by_batch["images and a video"]["storages"][2 * levels:3 * levels]
        assert len(set(mixed_cp_step)) == levels, (rank, mixed_cp_step)  # stock's joint levels, left as they are


@pytest.mark.parametrize("cp_size", [2, pytest.param(4, marks=pytest.mark.integration)])
def test_image_tokens_on_padding_train_as_stock(cp_size):
    """LLaMA-Factory's fake image for a batch without images, its placeholder tokens padding: alone, and beside a real
    image. Under CP its features go to no rank (stock places them on padding, where they reach no loss): the loss,
    the logits at real tokens and every gradient summed over the group equal stock's, the tower's included (exactly
    zero from the fake image). Before, every rank raised an IndexError in the features' route (issue 64)."""
    from tests.helpers.padding_image_cases import run_padding_image_cases
    from tests.helpers.parity import TOL

    for rank, per_case in enumerate(run_distributed(run_padding_image_cases, cp_size, timeout=600)):
        for case, m in per_case.items():
            where = f"{case}, P={cp_size}, rank {rank}"
            assert m["loss_err"] <= TOL and m["logits_err"] <= TOL, (where, m["loss_err"], m["logits_err"])
            assert m["grad_err"] <= TOL, (where, m["worst_grad"], m["grad_err"])
            assert m["missing_grads"] == [], where
            assert not m["per_rank_grads_equal_reference"], where  # the ranks' shares, summed: CP ran
