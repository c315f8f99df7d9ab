"""CP sizes beyond, or not dividing, the heads: P = U x R, Ulysses subgroups of U ranks and a ring of R subgroups.

Parity against stock at P=1 (fp32, every gradient summed over the group, <= 1e-5) at P = 3 and 6 with 8 query heads
(U = 1 and 2, R = 3) and at P = 4 and 8 with 2 query heads and 2 DeltaNet value heads (U = 2; R = 2 and 4): the four
families, packed rows and padded batches whose samples and images straddle the ring's chunks. Each run shows the
layout chosen and the ring's point-to-point traffic. The ring's attention alone, on random tensors, equals attention
over the whole row — and does not with the blocks merged by a plain average (the control)."""

from __future__ import annotations

import pytest

from tests.helpers.flash_standin import stock_flash_attention_works
from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL
from tests.helpers.ring_cases import CASES, ring_attention_alone, run_ring_cases, script_flash_call_alone

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


@pytest.mark.parametrize("trains, passes", [("qkv", 2 * 3 - 1), ("q", 3 - 1), ("", 0)])
def test_the_rings_backward_runs_only_what_its_inputs_need(trains, passes):
    """R = 3: the backward passes the keys R-1 times and their gradients R times when k and v train; only the keys
    when q alone trains (LoRA on the query projection); nothing when no input trains (a frozen layer). Exact where it
    computes."""
    for res in run_distributed(ring_attention_alone, 3, "torch", False, 5, trains, timeout=300):
        assert res["backward_passes"] == passes, res
        assert res["untrained_grads"] == [] and res["out_err"] <= 1e-6, res
        assert ("q" not in trains or res["dq_err"] <= 1e-5) and ("k" not in trains or res["dkv_err"] <= 1e-5), res


@pytest.mark.skipif(not stock_flash_attention_works(), reason="stock flash_attention_2 fails in transformers 5.6.0")
def test_flash_attention_2_runs_flash_attn_on_every_block_of_the_ring():
    """The flash_attention_2 path at P=4 (U=2, R=2) with flash-attn's kernel (the CPU stand-in) on each block."""
    per_rank = run_distributed(run_ring_cases, 4, "flash_attention_2", timeout=900)
    for case in per_rank[0]:
        for rank, res in enumerate(per_rank):
            m, where = res[case], f"{case}, rank {rank}"
            assert m["ulysses"] == 2 and m["loss_err"] <= TOL and m["logits_err"] <= TOL, where
            assert m["grad_err"] <= TOL, f"{where}: {m['worst_grad']}"
            assert not m["per_rank_grads_equal_reference"], where
            kinds = {(c["kind"], c["causal"], c.get("lse", False)) for c in m["flash_calls"]}
            # the ring's blocks: forward with the log-sum-exp, backward through flash-attn's own, and the pieces of
            # samples straddling the chunks non-causal
            assert {("varlen", True, True), ("varlen", False, True), ("varlen_bwd", True, False),
                    ("varlen_bwd", False, False)} <= kinds, (where, kinds)


def test_a_scripts_own_flash_attn_call_runs_across_the_ring():
    """The official script's kind of attention (its own flash_attn_varlen_func call on the slice, with the row's
    boundaries) at P=4 over 4 query heads and 2 KV heads as U=2, R=2: equal to the kernel over the whole row."""
    for res in run_distributed(script_flash_call_alone, 4, timeout=300):
        assert res["ring_size"] == 2 and res["exchanged"], res
        assert res["out_err"] <= 1e-6 and res["dq_err"] <= 1e-5 and res["dkv_err"] <= 1e-5, res
        assert {c["kind"] for c in res["flash_calls"]} == {"varlen", "varlen_bwd"}, res["flash_calls"]


@pytest.mark.parametrize("kernel, ring_size", [("torch", 2), ("flash", 2), ("flash", 3)])
@pytest.mark.parametrize("wrong_merge", [False, True])
def test_ring_attention_merges_its_blocks_by_log_sum_exp(kernel, ring_size, wrong_merge):
    if wrong_merge and ring_size != 2:
        pytest.skip("one control per kernel")
    for res in run_distributed(ring_attention_alone, ring_size, kernel, wrong_merge, timeout=300):
        if wrong_merge:  # the control: the same blocks averaged
            assert res["out_err"] > 1e-2
            continue
        assert res["out_err"] <= 1e-6 and res["dq_err"] <= 1e-5 and res["dkv_err"] <= 1e-5, res
        calls = res["flash_calls"]
        if kernel == "torch":
            assert calls == []
            continue
        # flash-attn ran every block: causal within a member's own chunks, non-causal across a straddling sample,
        # forward with the log-sum-exp and backward through its internal varlen backward
        assert {(c["kind"], c["causal"]) for c in calls} == {(kind, causal) for kind in ("varlen", "varlen_bwd")
                                                             for causal in (True, False)}, calls
        assert all(c["lse"] for c in calls if c["kind"] == "varlen"), calls
        assert any(c["edges"] != c["key_edges"] for c in calls if not c["causal"]), calls


def test_flash_backward_is_called_by_the_names_its_release_uses():
    """flash-attn's internal varlen backward changed keywords within 2.x: the ring passes what the signature has."""
    from vlmcp_patch.attention.ring_flash import _backward_arguments
    from vlmcp_patch.errors import UnsupportedSetupError

    def release_2_6(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                    rng_state=None):
        pass

    def release_2_7(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                    alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
        pass

    def unknown(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sink_token_length):
        pass

    given = {name: name for name in ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                                     "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal")}
    old = _backward_arguments(release_2_6, given)
    assert old["window_size"] == (-1, -1) and "softcap" not in old and "window_size_left" not in old
    new = _backward_arguments(release_2_7, given)
    assert (new["window_size_left"], new["window_size_right"], new["softcap"]) == (-1, -1, 0.0)
    assert "window_size" not in new and new["dropout_p"] == 0.0
    with pytest.raises(UnsupportedSetupError, match="sink_token_length"):
        _backward_arguments(unknown, given)
