"""A rank that raises, dies or hangs ends the whole job within a bounded time, with the failing rank named,
under torchrun and the deepspeed launcher. docs/errors.md: "When a rank fails"."""

from __future__ import annotations

import time

import pytest

from tests.helpers.harness import ROOT, launch

INTEGRATION = pytest.mark.integration  # the second tier (docs/testing.md)

SCRIPT = ROOT / "tests" / "helpers" / "fault_script.py"
BOUND = 90  # seconds from launch to the end of the job: imports, one CP step, the fault, the 10 s timeout


def _run(mode: str, launcher: str):
    start = time.monotonic()
    # The launch may outlive the bound (then the assertion below fails with the job's output) before it is killed.
    # VLMCP_TIMEOUT unset: the CP groups must inherit the script's process-group timeout
    out = launch(SCRIPT, [mode], procs=2, launcher=launcher, timeout=BOUND + 60, env={"VLMCP_TIMEOUT": ""})
    return out, time.monotonic() - start, out.stdout + out.stderr


@INTEGRATION
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_rank_that_raises_ends_the_job_and_is_named(launcher):
    if launcher == "deepspeed":
        pytest.importorskip("deepspeed")
    out, elapsed, text = _run("raise", launcher)
    assert out.returncode != 0 and elapsed < BOUND, (elapsed, text[-3000:])
    assert "[rank1]: RuntimeError: injected fault on rank 1" in text, text[-3000:]


@INTEGRATION
def test_a_rank_that_is_killed_ends_the_job_and_is_named():
    out, elapsed, text = _run("kill", "torchrun")
    assert out.returncode != 0 and elapsed < BOUND, (elapsed, text[-3000:])
    assert "local_rank: 1" in text and "Signal 9 (SIGKILL)" in text, text[-3000:]


@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=INTEGRATION),
                                      pytest.param("deepspeed", marks=pytest.mark.extended)])
def test_a_hung_rank_ends_the_job_at_the_process_group_timeout(launcher):
    """Rank 0 waits in the CP group's collective; the group inherited the 10 s timeout of the process group."""
    if launcher == "deepspeed":
        pytest.importorskip("deepspeed")
    out, elapsed, text = _run("hang", launcher)
    assert out.returncode != 0 and elapsed < BOUND, (elapsed, text[-3000:])
    assert "[rank0]" in text and "Timed out waiting 10000ms" in text, text[-3000:]
