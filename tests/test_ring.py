"""CP sizes beyond, or not dividing, the heads: P = U x R, Ulysses subgroups of U ranks and a ring of R subgroups.

Parity against stock at P=1 (fp32, every gradient summed over the group, <= 1e-5) at P = 3 and 6 with 8 query heads
(U = 1 and 2, R = 3) and at P = 4 and 8 with 2 query heads and 2 DeltaNet value heads (U = 2; R = 2 and 4): the four
families, packed rows and padded batches whose samples and images straddle the ring's chunks. Each run shows the
layout chosen and the ring's point-to-point traffic. The ring's attention alone, on random tensors, equals attention
over the whole row — and does not with the blocks merged by a plain average (the control)."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL
from tests.helpers.ring_cases import CASES, ring_attention_alone, run_ring_cases

LAYOUT = {3: (1, 3), 6: (2, 3), 4: (2, 2), 8: (2, 4)}  # P -> (U, R)


def ring_run(cp_size: int):
    return run_distributed(run_ring_cases, cp_size, timeout=900)


@pytest.mark.parametrize("cp_size", [3, 4, 6, 8])
def test_every_family_beyond_its_heads_equals_stock(cp_size, once):
    per_rank = once(ring_run, cp_size)
    for case in per_rank[0]:
        for rank, res in enumerate(per_rank):
            m, where = res[case], f"{case}, P={cp_size}, rank {rank}"
            assert (m["ulysses"], cp_size // m["ulysses"]) == LAYOUT[cp_size], where
            assert m["loss_err"] <= TOL and m["logits_err"] <= TOL, where
            assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
            assert m["missing_grads"] == [] and not m["per_rank_grads_equal_reference"], where
            assert m["ring_sends"] > 0, f"{where}: the ring passed nothing"
        assert len({res[case]["loss"] for res in per_rank}) == 1, case
    assert {case.split()[0].split("-")[0] for case in per_rank[0]} >= (
        {"qwen3_vl", "qwen3_5"} if cp_size in (6, 8) else {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
    assert {c for _, c in CASES[cp_size]} & {"packed_multimodal", "padded_pair"}


@pytest.mark.parametrize("wrong_merge", [False, True])
def test_ring_attention_merges_its_blocks_by_log_sum_exp(wrong_merge):
    for res in run_distributed(ring_attention_alone, 2, wrong_merge, timeout=300):
        if wrong_merge:  # the control: the same blocks averaged
            assert res["out_err"] > 1e-2
        else:
            assert res["out_err"] <= 1e-6 and res["dq_err"] <= 1e-5 and res["dkv_err"] <= 1e-5, res
