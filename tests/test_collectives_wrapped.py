"""Every call of the package into torch.distributed that communicates goes through its wrapper
(`collectives/communication.communicate`, or `raising` for the wait of a communication started there). A collective
outside would hang silently on a failed peer, name no site, and be missing from the ranks' debug comparison.

Checked at run time, not read from the source: each rank of the suite's CP runs (`harness.run_distributed`, and every
script launched through `run_script`) installs `tests/helpers/wrapped_check.py` first, so every CP test of the suite
fails when the package calls torch.distributed around the wrapper, however the call is spelled. Here, the check
itself: a module executed as the package's (`tests/helpers/bypass_spellings.py`) sums a tensor over a real gloo group
of two ranks in twelve spellings that bypass the wrapper, each flagged naming the callable and the function, and in
six that go through it, none flagged; all in one launch, with a tiny CP step whose own calls the check sees.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.bypass_spellings import BYPASSES, WRAPPED
from tests.helpers.harness import free_port, launch, run_distributed

RANKS = 2
EXPECTED_SUM = float(sum(range(1, RANKS + 1)))  # rank r contributes r + 1


def _summed(function, rank, group):
    from tests.helpers import wrapped_check

    total = float(function(torch.tensor([float(rank + 1)]), group))
    flagged = wrapped_check.take_violations()
    return {"sum": total, "flagged": sorted({spelled for spelled, *_ in flagged}),
            "functions": sorted({function_name for _, file, _, function_name, _ in flagged}),
            "files": sorted({os.path.basename(file) for _, file, *_ in flagged})}


def _every_spelling(rank, world_size):
    """Each spelling run once on every rank of a gloo group: its sum and what the check flagged."""
    import torch.distributed as dist

    from tests.helpers import bypass_spellings, wrapped_check
    from vlmcp_patch.fixtures.probes import CollectiveProbe

    spellings = bypass_spellings.load_as_package_module()
    group = dist.group.WORLD
    seen = {"installed": wrapped_check.installed()}
    for name in BYPASSES:
        seen[name] = _summed(spellings.BYPASSES[name][0], rank, group)
    for name in WRAPPED:
        seen[name] = _summed(spellings.WRAPPED[name], rank, group)
    # the tests' own probe wraps torch.distributed's functions too: the call through it is still the package's
    with CollectiveProbe() as probe:
        seen["probed bypass"] = _summed(spellings.full_path, rank, group)
        seen["probed wrapped"] = _summed(spellings.communicated, rank, group)
    seen["probed calls"] = probe.calls["all_reduce"]
    # a package module that bound torch's function before the check was installed (the package is imported when a
    # spawned rank unpickles its function): installing gives it the checker
    spellings.all_reduce = wrapped_check.original(dist.all_reduce)
    wrapped_check.install()
    seen["bound before the check"] = _summed(spellings.from_import, rank, group)
    seen["cp step"] = _cp_step(world_size)
    return seen


def _cp_step(cp_size: int) -> dict:
    """A CP forward and backward of a tiny Qwen3-VL: the package's own calls, as the check saw them."""
    import vlmcp_patch
    from tests.helpers import wrapped_check
    from vlmcp_patch.fixtures.data import Segment as S
    from vlmcp_patch.fixtures.data import make_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config())
    batch = make_batch([[S(text=5), S(image=(16, 16)), S(text=6)]], seed=1)
    before = wrapped_check.through_the_wrapper()
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        model(**batch).loss.backward()
    finally:
        vlmcp_patch.enable(cp_size=1)
    after = wrapped_check.through_the_wrapper()
    return {"through": {name: calls - before.get(name, 0) for name, calls in after.items()
                        if calls > before.get(name, 0)},
            "flagged": wrapped_check.take_violations()}


def every_spelling():
    return run_distributed(_every_spelling, RANKS, timeout=120)


@pytest.fixture
def spelled(once):
    return once(every_spelling)


@pytest.mark.parametrize("spelling", list(BYPASSES))
def test_a_bypass_in_each_spelling_is_flagged(spelled, spelling):
    function, names = BYPASSES[spelling]
    for rank, seen in enumerate(spelled):
        assert seen["installed"]
        got = seen[spelling]
        assert got["sum"] == EXPECTED_SUM, (rank, got)  # a real collective ran
        assert got["flagged"] == sorted(names), (rank, got)
        assert got["functions"] == [function.__name__] and got["files"] == ["bypass_spellings.py"], (rank, got)


@pytest.mark.parametrize("spelling", list(WRAPPED))
def test_a_call_through_the_wrapper_is_not_flagged(spelled, spelling):
    for rank, seen in enumerate(spelled):
        assert seen[spelling] == {"sum": EXPECTED_SUM, "flagged": [], "functions": [], "files": []}, rank


def test_the_tests_probes_pass_the_check_on(spelled):
    for seen in spelled:
        assert seen["probed calls"] == 2  # both calls went through the probe
        assert seen["probed bypass"]["flagged"] == ["torch.distributed.all_reduce"]
        assert seen["probed bypass"]["functions"] == ["full_path"]
        assert seen["probed wrapped"]["flagged"] == []


def test_a_function_bound_before_the_check_is_checked(spelled):
    for seen in spelled:
        assert seen["bound before the check"]["flagged"] == ["torch.distributed.all_reduce"]
        assert seen["bound before the check"]["functions"] == ["from_import"]


def test_the_check_sees_the_packages_own_calls(spelled):
    """Not vacuous: a CP step's exchanges, group creation and agreement reach the check, through the wrapper."""
    for seen in spelled:
        step = seen["cp step"]
        assert step["flagged"] == []
        assert step["through"].get("torch.distributed.all_to_all_single", 0) >= 4, step  # forward and backward
        assert step["through"].get("torch.distributed.new_group", 0) >= 1, step


def _bypass_left_unread(rank, world_size):
    from tests.helpers import bypass_spellings

    bypass_spellings.load_as_package_module().module_alias(torch.ones(1), None)


def test_a_spawned_rank_that_bypassed_the_wrapper_fails():
    with pytest.raises(RuntimeError, match=r"outside its wrapper.*torch\.distributed\.all_reduce at .*"
                                           r"bypass_spellings\.py:\d+ in module_alias \(1 call\)"):
        run_distributed(_bypass_left_unread, 1, timeout=120)


@pytest.mark.integration  # one launched process: importing the package costs seconds (the spawned ranks preload it)
def test_a_launched_script_that_bypassed_the_wrapper_fails():
    """`run_script` (every launched run of the suite) ends a rank that bypassed with exit code 1, naming the site;
    the same script's call through the wrapper is not named."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    out = launch("tests/helpers/bypass_spellings.py", procs=1, launcher="python", env=env, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "summed 1.0 and 1.0" in out.stdout, out.stdout  # the script ran both calls to the end
    named = [line for line in out.stderr.splitlines() if "outside its wrapper" in line]
    assert len(named) == 1 and "in full_path (1 call)" in named[0], out.stderr[-3000:]
    assert "communicated" not in named[0]
