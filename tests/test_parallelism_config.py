"""Accelerate's own switches with a plain Accelerator: `ParallelismConfig(sp_backend="deepspeed", sp_size=P)`
and `ParallelismConfig(cp_size=P)` (FSDP2).

For a model this package supports they run as vlmcp CP (the ranks of a CP group share each batch, the
loss equals P=1, DeepSpeed's batch arithmetic uses the W/P replicas); for a linear-attention model the
package does not handle, accelerate's refusal stays. The HF Trainer's routes through the same switches are
trained to parity in test_trainer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.harness import ROOT, launch

pytestmark = pytest.mark.integration  # the second tier (docs/testing.md)

pytest.importorskip("deepspeed")


def run(mode: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{mode}.json"
    script = ROOT / "tests" / "helpers" / "parallelism_config_script.py"
    proc = launch(script, [mode, out], procs=2, env={"VLMCP_CP_SIZE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_switch_runs_qwen3_5_as_cp(tmp_path):
    r = run("qwen3.5", tmp_path)
    assert r["cp_size"] == 2 and r["accelerator_sp_size"] == 1
    assert r["train_batch_size"] == 2  # micro 2 x accumulation 1 x one data-parallel replica
    assert r["batches"][:2] == r["batches"][2:], "the two ranks of the CP group got different batches"
    assert abs(r["loss"] - r["p1_loss"]) <= 1e-5 * abs(r["p1_loss"])


def test_switch_keeps_accelerates_refusal_for_models_the_package_does_not_handle(tmp_path):
    r = run("qwen3-next", tmp_path)
    assert r["error"] == "ValueError" and "does not support attention layers of type" in r["message"]


def test_switch_needs_the_model_prepared_before_the_loaders(tmp_path):
    r = run("loader-first", tmp_path)
    assert r["error"] == "UnsupportedSetupError" and "together with, or before, the data loaders" in r["message"]


def test_context_parallel_switch_on_fsdp2_runs_qwen3_vl_as_cp(tmp_path):
    """Stock accelerate shards input_ids before the vision tower here ("Image features and image tokens do not
    match"); routed to vlmcp CP, the CP ranks share the batch and the loss is the P=1 loss."""
    r = run("fsdp2-cp", tmp_path)
    assert r["cp_size"] == 2 and r["accelerator_cp_size"] == 1 and r["wrapper"] == "FSDP2"
    assert r["batches"][:2] == r["batches"][2:], "the two ranks of the CP group got different batches"
    assert abs(r["loss"] - r["p1_loss"]) <= 1e-5 * abs(r["p1_loss"])


def test_a_backend_this_release_does_not_route_is_refused():
    from types import SimpleNamespace

    from vlmcp_patch.errors import UnsupportedSetupError
    from vlmcp_patch.integrations.parallelism_config import requested_cp

    assert requested_cp(SimpleNamespace(sp_size=2, sp_backend="deepspeed", cp_size=1)) == ("sp", 2)
    assert requested_cp(SimpleNamespace(sp_size=1, cp_size=4, cp_backend="torch")) == ("cp", 4)
    with pytest.raises(UnsupportedSetupError, match="sp_backend='ring'"):
        requested_cp(SimpleNamespace(sp_size=2, sp_backend="ring", cp_size=1))
