"""A raw loop that steps on gradients it never summed over the CP group raises on every rank, before any weight
changes; the loops that sum — once after accumulating, or through a data-parallel wrapper of their own with the loss
scaled by P — step as one process does (tests/helpers/step_cases.py). The shares are the model's whose parameters
received them, a sum clears only the gradients it summed, and a DDP or FSDP2 over the data-parallel replicas only
(W=4, P=2: over 2 ranks) sums nothing over CP. The Trainer, Accelerate, DeepSpeed, FSDP2 and TRL runs of the other
test modules step under CP with the same hook installed: none of them may see it."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.step_cases import run_step_cases


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(run_step_cases, 4, 2, timeout=600)  # 2 replicas of a CP group of 2


@pytest.mark.parametrize("loop", ["unsummed", "accumulated_summed_too_early", "policy_then_reference",
                                  "ddp_over_replicas_only", "fsdp2_over_replicas_only"])
def test_a_step_on_unsummed_shares_raises_on_every_rank_before_any_weight_changes(loop, per_rank):
    for rank, results in enumerate(per_rank):
        m = results[loop]
        assert m["outcome"].startswith("raised:"), (rank, m["outcome"])
        assert "sum_over_cp_group" in m["outcome"], m["outcome"]
        assert not m["changed"], f"rank {rank}: a weight changed before the error"


@pytest.mark.parametrize("loop", ["summed", "accumulated_summed_once", "own_ddp_loss_times_p",
                                  "policy_then_reference_summed", "own_fsdp2_loss_times_p"])
def test_loops_that_sum_step_as_one_process(loop, per_rank):
    for rank, results in enumerate(per_rank):
        m = results[loop]
        assert m["outcome"] == "stepped" and m["changed"], (rank, m["outcome"])
        assert m["weights_err"] <= 1e-5, (rank, m["weights_err"])


def test_at_p1_a_raw_loop_steps_without_a_sum(per_rank):
    assert all(results["unsummed_at_p1"]["outcome"] == "stepped" for results in per_rank)


def test_a_sum_clears_only_the_model_it_summed(per_rank):
    """Two models stepping separately, the first one's gradients summed: it steps, the second raises."""
    for rank, results in enumerate(per_rank):
        first, second = results["two_models"]["first"], results["two_models"]["second"]
        assert first["outcome"] == "stepped" and first["changed"], (rank, first["outcome"])
        assert second["outcome"].startswith("raised:"), (rank, second["outcome"])
        assert not second["changed"], f"rank {rank}: a weight of the second model changed before the error"
