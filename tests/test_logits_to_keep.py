"""`logits_to_keep` in a training forward (ms-swift passes it by default with transformers 5) runs under CP and equals
stock at P=1: an int (0, 1, inside one rank's slice, across slices, beyond the row), a tensor of positions (1D, out
of order and repeated; 2D per row; a boolean mask, ms-swift's one-row form, and a 2D one), on Qwen3-VL with images
(two cases on Qwen3.5), a padded pair and a packed row, contiguous slices and a ring's two chunks per rank; with the
package's fused head and with the model's own head. Loss, the gradients summed over the group and the kept logits
(returned without labels, and with them in a tuple) within 1e-5 (fp32, CPU, gloo); what cannot run (labels that do
not pair with the kept logits, as stock's loss refuses; positions outside the row; a target at padding;
`token_log_probs`, which scores every position) raises on every rank. docs/inputs.md."""

from __future__ import annotations

import math

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.keep_cases import CASES, run_keep_cases
from tests.helpers.parity import TOL

REFUSALS = {
    "labels_of_every_position": ("ValueError", "logits_to_keep keeps 9 logits"),
    "positions_outside_the_row": ("IndexError", "logits_to_keep=[3, 99] cannot slice tokens of shape (1, 55)"),
    "target_at_padding": ("CPInputError", "labels of kept logits at padding positions"),
    "token_log_probs": ("UnsupportedSetupError", "logits_to_keep is supported under CP by the model's own forward"),
}


def keep_run(cp_size: int):
    return run_distributed(run_keep_cases, cp_size, list(CASES), timeout=400)


def _assert_parity(per_rank: list[dict], case: str, cp_size: int) -> None:
    for rank, res in enumerate(per_rank):
        m, where = res[case], f"{case}, P={cp_size}, rank {rank}"
        if case == "int_1_ignored":  # no target: stock's loss is 0 / 0 and its gradients zeros
            assert math.isnan(m["loss"]) and math.isnan(m["ref_loss"]), where
        else:
            assert m["loss_err"] <= TOL, (where, m)
        assert m["grad_err"] <= TOL and m["missing_grads"] == [], (where, m)
        assert m["logits_shape"] == m["ref_logits_shape"] and m["tuple_shapes_ok"], (where, m)
        assert m["logits_err"] <= TOL, (where, m)
        assert m["tuple_err"] <= TOL or case == "int_1_ignored", (where, m)
    assert len({str(res[case]["loss"]) for res in per_rank}) == 1, "loss differs between ranks"


def _assert_refusals(per_rank: list[dict]) -> None:
    for rank, res in enumerate(per_rank):
        for name, (error, phrase) in REFUSALS.items():
            got = res["refusals"][name]
            assert got[0] == error and phrase in got[1], (rank, name, got)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_to_keep_equals_stock_at_p2(case, once):
    _assert_parity(once(keep_run, 2), case, 2)


def test_what_cannot_run_raises_on_every_rank_at_p2(once):
    _assert_refusals(once(keep_run, 2))


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_logits_to_keep_equals_stock_at_p4(case, once):
    _assert_parity(once(keep_run, 4), case, 4)


@pytest.mark.integration
def test_what_cannot_run_raises_on_every_rank_at_p4(once):
    _assert_refusals(once(keep_run, 4))
