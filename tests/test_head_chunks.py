"""Attention by head chunks (`VLMCP_HEAD_CHUNKS`, `attention/head_chunks.py`): exact against the unchunked path and
against stock at P=1 (fp32, loss, logits and every gradient summed over the group <= 1e-5), at P=2 and P=4, with a
ring (U x R = 2 x 2), on the sdpa and the flash_attention_2 paths, Qwen3-VL and Qwen3.5 (its softmax layers); chunk
counts that do not divide the heads refused on every rank before any compute."""

from __future__ import annotations

import pytest

from tests.helpers.flash_standin import stock_flash_attention_works
from tests.helpers.harness import run_distributed
from tests.helpers.head_chunk_cases import refused, run_head_chunk_cases
from tests.helpers.parity import TOL

# (config, batch, chunks, U forced or 0) per P. 8 query / 2 KV heads: P=2 holds 4 heads a rank (2 chunks of 2, and 4
# of 1: a chunk smaller than its query group, the KV head copied into both); 4 query heads at P=2: 2 chunks of 1.
CASES = {
    2: [("qwen3_vl-8", "multi_image", 4, 0), ("qwen3_vl-4", "packed", 2, 0), ("qwen3_5-8", "padded_pair", 2, 0)],
    4: [("qwen3_vl-8", "packed", 2, 0), ("qwen3_vl-8", "multi_image", 2, 2), ("qwen3_5-8", "packed", 4, 2)],
}
FLASH_CASES = [("qwen3_vl-8", "packed", 2, 0), ("qwen3_vl-8", "multi_image", 2, 2)]


def _check(per_rank: list[dict], cp_size: int) -> None:
    for case in per_rank[0]:
        for rank, res in enumerate(per_rank):
            m, where = res[case], f"{case}, P={cp_size}, rank {rank}"
            stock, same = m["stock"], m["unchunked"]
            assert stock["loss_err"] <= TOL and stock["logits_err"] <= TOL, where
            assert stock["grad_err"] <= TOL, f"{where}: {stock['worst_grad']}"
            assert stock["missing_grads"] == [] and not stock["per_rank_grads_equal_reference"], where
            assert same["loss_err"] <= TOL and same["logits_err"] <= TOL, where
            assert same["grad_err"] <= TOL and same["missing"] == [], f"{where}: {same['worst_grad']}"
            unchunked, chunked = m["exchanges"]
            assert chunked > unchunked, f"{where}: the chunked path did not run ({m['exchanges']})"
            forced = case.split("U=")[1]
            if forced != "0":
                assert m["ulysses"] == int(forced) < cp_size, where  # a ring across the subgroups


@pytest.mark.integration
@pytest.mark.parametrize("cp_size", [2, 4])
def test_head_chunks_equal_unchunked_and_stock(cp_size):
    """The ranks also compare their collectives after each forward and backward (VLMCP_DEBUG_COLLECTIVES); at P=2 the
    first case runs in bf16 as well, no further from fp32 than the unchunked run."""
    per_rank = run_distributed(run_head_chunk_cases, cp_size, CASES[cp_size], "sdpa", cp_size == 2, timeout=900)
    _check(per_rank, cp_size)
    if cp_size == 2:
        for res in per_rank:
            bf16 = next(m["bf16"] for m in res.values() if "bf16" in m)
            for key in ("loss_err", "logits_err", "grad_err"):
                assert bf16["chunked"][key] <= bf16["unchunked"][key] * 1.01 + 1e-6, (key, bf16)


@pytest.mark.integration
@pytest.mark.skipif(not stock_flash_attention_works(), reason="stock flash_attention_2 fails in this transformers")
def test_head_chunks_on_the_flash_attention_2_path():
    _check(run_distributed(run_head_chunk_cases, 4, FLASH_CASES, "flash_attention_2", timeout=900), 4)


def test_chunks_that_do_not_divide_the_heads_are_refused_on_every_rank_before_compute():
    """8 query heads at P=2: 4 a rank, which 3 chunks do not divide. Every rank raises, naming the counts that fit,
    before the vision tower runs."""
    for res in run_distributed(refused, 2, 3, timeout=300):
        assert res["message"] is not None and "VLMCP_HEAD_CHUNKS=3" in res["message"], res
        assert "choose one of [1, 2, 4]" in res["message"], res
        assert res["vision_passes"] == 0, res
