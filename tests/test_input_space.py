"""The accepted input space, combination by combination (tests/helpers/input_space.py): at P=1 the import changes
nothing, bit for bit; under CP=2 every combination stock accepts runs and equals stock, and every one it
refuses fails under CP too. docs/inputs.md: "The input space"."""

from __future__ import annotations

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.input_space import CLASSES, combinations, refused_by_design, run_input_space
from tests.helpers.parity import TOL

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)


@pytest.fixture(scope="module")
def space():
    return run_distributed(run_input_space, 2, list(CLASSES), timeout=900)


@pytest.mark.parametrize("name", list(CLASSES))
def test_p1_with_the_import_is_stock_bit_for_bit(name, space):
    for combo in combinations(name):
        checked = [res[(name, combo)]["p1_identical"] for res in space]
        checked = [c for c in checked if c is not None]
        assert checked == [True], (name, combo)


@pytest.mark.parametrize("name", list(CLASSES))
def test_cp_equals_stock_wherever_stock_runs(name, space):
    ran = 0
    for combo in combinations(name):
        for rank, res in enumerate(space):
            entry = res[(name, combo)]
            where = (name, combo, rank)
            if entry["stock"] == "error":
                assert entry["cp"] == "error", where  # stock refuses it: so does CP
                continue
            if refused_by_design(name, combo[1]):
                assert entry["cp"] == "error" and entry["cp_error"][0] == "CPInputError", (where, entry)
                continue
            assert entry["cp"] == "ok", (where, entry["cp_error"])
            assert entry["loss_err"] <= TOL and entry["logits_err"] <= TOL, (where, entry)
            assert entry["grad_err"] <= TOL and entry["missing_grads"] == [], (where, entry)
            ran += 1
    assert ran >= len(combinations(name)) // 2, "most of the space must be accepted by stock"


def test_the_space_holds_stock_refusals_too(space):
    """The space is not just what runs: stock refuses some of it (images without token types and positions), and
    those fail under CP as well (above)."""
    refused = {combo for (name, combo), entry in space[0].items() if entry["stock"] == "error"}
    assert refused and all(combo[3] == "without" for combo in refused)
