"""Degenerate batches stock accepts give what stock gives under CP: its loss (NaN where stock's is NaN) and its
gradients, finite, element by element (tests/helpers/degenerate_cases.py). Before the fix, a batch without a
labelled token gave NaN gradients under CP, which the next optimizer step spread into every weight."""

from __future__ import annotations

import pytest

from tests.helpers.degenerate_cases import BATCHES, run_degenerate, run_trl_fused_head
from tests.helpers.harness import run_distributed
from tests.helpers.parity import TOL

ALL = list(BATCHES)


def degenerate_run(cp_size: int, families: tuple[str, ...], per_replica: tuple[str, ...] | None = None,
                   world_size: int | None = None):
    return run_distributed(run_degenerate, world_size or cp_size, cp_size, list(families), ALL,
                           None if per_replica is None else list(per_replica), timeout=600)


def assert_like_stock(per_rank: list[dict]) -> None:
    for rank, results in enumerate(per_rank):
        for case, m in results.items():
            where = f"{case}, rank {rank}"
            assert m["stock_grads_finite"], f"{where}: stock's own gradients are not finite"
            assert m["same_loss"], f"{where}: loss {m['loss']} vs stock's {m['ref_loss']}"
            assert m["not_finite"] == [], f"{where}: gradients not finite under CP: {m['not_finite'][:5]}"
            assert m["missing"] == [] and m["grad_err"] <= TOL, f"{where}: {m['grad_err']}"
            assert m["zeros_kept"], f"{where}: a gradient stock gives as zeros is not zeros under CP"
            assert m["exchanges"] > 0, f"{where}: CP exchanged nothing"


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_degenerate_batches_give_stocks_loss_and_gradients_at_p2(family, once):
    per_rank = once(degenerate_run, 2, (family,))
    assert_like_stock(per_rank)
    # the cases really are degenerate: stock's loss is NaN without a labelled token
    assert all(per_rank[0][f"{family} {name}"]["ref_loss"] != per_rank[0][f"{family} {name}"]["ref_loss"]
               for name in ("no_labelled_token", "no_labelled_token_num_items_0", "one_token"))


@pytest.mark.integration
@pytest.mark.parametrize("cp_size, families", [(4, ("qwen3_vl", "qwen3_5")), (3, ("qwen3_vl-8", "qwen3_5-8"))],
                         ids=["P4", "P3-ring"])
def test_degenerate_batches_give_stocks_loss_and_gradients_at_p4_and_across_a_ring(cp_size, families, once):
    assert_like_stock(once(degenerate_run, cp_size, families))


@pytest.mark.integration
def test_a_replica_without_labels_beside_one_with_them():
    """CP=2 x two data-parallel replicas: one replica's batch has labelled tokens and images, the other's none."""
    per_rank = degenerate_run(2, ("qwen3_vl", "qwen3_5"),
                              per_replica=("no_labelled_token_with_images", "first_token_then_padding"), world_size=4)
    assert_like_stock(per_rank)
    assert {case.split()[1] for res in per_rank for case in res} == {"no_labelled_token_with_images",
                                                                      "first_token_then_padding"}


def test_trls_fused_head_without_a_labelled_token_gives_finite_zero_gradients():
    """TRL's trainers score with its fused head; with num_items_in_batch = 0 its loss is NaN and its gradients zero."""
    pytest.importorskip("trl")
    assert_like_stock(run_distributed(run_trl_fused_head, 2, 2, timeout=300))
