"""Vision data parallelism's pieces: the gather's backward values, and a rank without any image (bf16)."""

from __future__ import annotations

import torch

from tests.helpers.harness import run_distributed


def gather_backward(rank: int, world_size: int) -> dict:
    """Blocks of 3 and 1 rows; each rank weighs the gathered rows differently (as each rank places the features
    of its own sequence slice): the gradient of a block is the sum of every rank's weights on its rows."""
    import torch.distributed as dist

    from vlmcp_patch.collectives import gather_sum_grad

    counts = [3, 1]
    x = torch.full((counts[rank], 2), float(rank + 1), requires_grad=True)
    weights = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (10 ** rank)
    y = gather_sum_grad(x, 0, counts, dist.group.WORLD, rank)
    (y * weights).sum().backward()
    expected = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (1 + 10)
    start = sum(counts[:rank])
    return {"forward": y.tolist(), "grad_ok": torch.equal(x.grad, expected[start:start + counts[rank]])}


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


def test_gather_backward_sums_every_ranks_gradient_into_the_owner_block():
    for res in run_distributed(gather_backward, 2, timeout=120):
        assert res["forward"] == [[1.0, 1.0]] * 3 + [[2.0, 2.0]]
        assert res["grad_ok"]


def test_a_rank_without_images_runs_a_zero_gradient_placeholder_in_the_models_dtype(once):
    rank0, rank1 = once(bf16_run)
    assert rank0["patches"] > 0 and rank1["patches"] == 0
    assert rank1["all_present"] and rank1["dtypes"] == {"torch.bfloat16"} and rank1["all_zero"]
    assert not rank0["all_zero"]
    # The same vision gradient as P=1 up to bf16 rounding: no further from fp32 than stock bf16 is, give or take
    # its own rounding (a missing or doubled contribution would be off by the whole gradient).
    assert rank0["cp_vs_fp32"] <= 2 * rank0["stock_vs_fp32"]
