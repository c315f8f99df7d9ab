"""One gated DeltaNet layer, head-split over the CP group, equals the stock layer (odd shapes)."""

from __future__ import annotations

import pytest

from tests.helpers.deltanet_cases import run_layer_cases
from tests.helpers.harness import run_distributed


@pytest.mark.parametrize("cp_size", [2, 4])
def test_deltanet_layer_matches_stock(cp_size):
    for rank, res in enumerate(run_distributed(run_layer_cases, cp_size, timeout=300)):
        for name, m in res.items():
            where = f"{name}, P={cp_size}, rank {rank}"
            assert m["out_err"] <= 1e-5, where
            assert m["input_grad_err"] <= 1e-5, where
            assert m["param_grad_err"] <= 1e-5, where
            # q, k, v, the two gate inputs and the output, forward and backward: the layer really exchanged heads.
            assert m["exchanges"] == 12, where
            assert m["a2a_bytes_per_token"] == m["a2a_bytes_formula"], where
