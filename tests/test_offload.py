"""Checkpoints in host memory (`VLMCP_OFFLOAD_CHECKPOINTS`, `vlmcp_patch/offload.py`): bit-identical to checkpointing
without it, reentrant and not, at P=1 and under CP; the saved inputs really leave the device between forward and
backward; the host pool is reused across steps; transformers' and Accelerate's own offload refused under CP."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cases import build_batch
from tests.helpers.harness import run_distributed
from tests.helpers.offload_cases import (
    FOREIGN_CHECKPOINTS,
    LAYOUTS,
    MiB,
    backward_that_raises,
    backward_twice,
    pool_state,
    two_forwards_one_backward,
    play,
    random_leases,
    training_steps,
    checkpointed_layers,
    checkpointed_model,
    foreign_checkpointed_model,
    inputs_between_forward_and_backward,
    layer_calls,
    run_offload_cases,
    step,
)
from vlmcp_patch.offload import HOST_CHECKPOINTS, HostPool, pool_bytes_for


@pytest.fixture
def offloading(reapply):
    import vlmcp_patch

    vlmcp_patch.enable(offload_checkpoints=True)
    HOST_CHECKPOINTS.counts.drain()
    yield
    vlmcp_patch.enable(offload_checkpoints=False)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_offload_is_bit_identical_to_checkpointing(family, reentrant, reapply):
    import vlmcp_patch

    model, batch = checkpointed_model(family, reentrant), build_batch(LAYOUTS[family], seed=7)
    loss, grads = step(model, batch)
    vlmcp_patch.enable(offload_checkpoints=True)
    HOST_CHECKPOINTS.counts.drain()
    try:
        first = step(model, batch)
        reserved = HOST_CHECKPOINTS.pool.reserved
        second = step(model, batch)
    finally:
        vlmcp_patch.enable(offload_checkpoints=False)
    for offloaded_loss, offloaded_grads in (first, second):
        assert torch.equal(loss, offloaded_loss)
        assert grads.keys() == offloaded_grads.keys()
        assert all(torch.equal(grads[n], offloaded_grads[n]) for n in grads)
    counts, calls = HOST_CHECKPOINTS.counts.drain(), 2 * layer_calls(model, batch)
    # per step: every checkpointed call's input but the last one's to the host and back, prefetched in backward
    assert counts["kept"] == 2 and counts["offloaded"] == counts["restored"] == calls - 2
    assert 0 < counts["prefetched"] <= counts["restored"]
    assert HOST_CHECKPOINTS.pool.reserved == reserved > 0  # the second step reused the first one's buffers
    assert HOST_CHECKPOINTS.pool.in_use == 0


@pytest.mark.parametrize("offload", [True, False])
def test_saved_inputs_wait_on_the_host_between_forward_and_backward(offload, reapply):
    """Between forward and backward, only the last layer's input is still alive on the device; the others are bytes
    in the host pool, given back after backward. Without offload every input is alive (the control: this test fails
    when the switch does nothing)."""
    import vlmcp_patch

    model, batch = checkpointed_model("qwen3_5", reentrant=False), build_batch(LAYOUTS["qwen3_5"], seed=7)
    vlmcp_patch.enable(offload_checkpoints=offload)
    try:
        seen = inputs_between_forward_and_backward(model, batch)
    finally:
        vlmcp_patch.enable(offload_checkpoints=False)
    assert seen["inputs"] == layer_calls(model, batch) > 2
    if offload:
        assert seen["alive"] == 1
        assert seen["host_bytes"] > 0 and seen["host_bytes_after"] == 0
    else:
        assert seen["alive"] == seen["inputs"] and seen["host_bytes"] == 0


def test_offload_off_leaves_every_call_as_it_was(reapply):
    model, batch = checkpointed_model("qwen3_vl", reentrant=False), build_batch(LAYOUTS["qwen3_vl"], seed=7)
    HOST_CHECKPOINTS.counts.drain()
    step(model, batch)
    assert set(HOST_CHECKPOINTS.counts.drain().values()) == {0}


def offload_run(cp_size: int):
    return run_distributed(run_offload_cases, cp_size, timeout=600)


def test_offload_under_cp_is_bit_identical(once):
    """Checkpoints and vision features on the host under CP: the same bits as CP without the offload, per family and
    checkpointing kind."""
    for rank, per_case in enumerate(once(offload_run, 2)):
        for case, m in per_case.items():
            if "offload" in case:
                continue
            assert m["identical"], f"{case}, rank {rank}"
            # (a rank's placeholder vision pass, a few patches, is below offload.MIN_BYTES and stays)
            counts = m["counts"]
            assert counts["kept"] == 1 and 0 < counts["offloaded"] == counts["restored"] <= m["calls"] - 1, (case, m)
            # the vision features parked on the host too: the merged features and every deepstack level of each
            # modality in forward, their gradients handed back once per modality in backward (Qwen3-VL: images with
            # two deepstack levels; Qwen3.5: images and video, no deepstack)
            parked, unparked = (3, 1) if case.startswith("qwen3_vl") else (2, 2)
            assert (counts["parked"], counts["unparked"]) == (parked, unparked), (case, counts)


def test_accelerates_offload_is_refused_under_cp_before_compute(once):
    for per_case in once(offload_run, 2):
        assert "VLMCP_OFFLOAD_CHECKPOINTS=1" in per_case["accelerate offload"], per_case["accelerate offload"]


def test_transformers_offload_runs_under_cp_as_stock_and_one_offload_acts_when_both_are_asked(once):
    """transformers' own `offload=True` (5.23+) under CP: alone it runs as on stock (on a machine without an
    accelerator both raise its pinning error, the same one); asked beside `VLMCP_OFFLOAD_CHECKPOINTS`, the package's
    pool keeps the checkpoints — as many as over plain checkpointing, the step bit for bit the same — transformers'
    `save_on_cpu` is set aside, and the log says so and the CP line names who keeps them (issue 65). Before, it was
    refused under CP."""
    for rank, per_case in enumerate(once(offload_run, 2)):
        theirs = per_case["transformers offload"]
        if theirs == "not in this transformers":
            pytest.skip("transformers' activation_checkpointing_enable(offload=True) arrived in 5.23")
        assert theirs["alone"][0] == theirs["stock"][0], theirs  # the same outcome: ran, or the same error
        if theirs["stock"][0] != "ran":
            assert theirs["alone"] == theirs["stock"], theirs
        assert theirs["both identical"], theirs
        assert theirs["both counts"]["offloaded"] == theirs["plain counts"]["offloaded"] > 0, theirs
        assert sum("transformers' save_on_cpu is set aside" in line for line in theirs["lines"]) <= 1, theirs
        if rank == 0:
            assert any("checkpoints on the host by VLMCP_OFFLOAD_CHECKPOINTS (transformers' offload=True set aside)"
                       in line for line in theirs["lines"]), theirs["lines"]


# -- the pool without waste (issue 53) ---------------------------------------------------------------------------------


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pool_allocates_at_most_1_05x_what_it_holds(seed):
    """Realistic steps (vision blocks and decoder layers of other sizes, rows of nearby lengths): the pool's bytes stay
    within 1.05x of the peak it held and within `pool_bytes_for`'s price; every slab is a power of two, so torch's
    pinned allocator (which rounds each block up to one) allocates exactly the pool's bytes."""
    steps = training_steps(seed)
    out = play(HostPool(), steps)
    assert out["peak_held"] == max(sum(step) for step in steps)
    assert out["reserved"] / out["peak_held"] <= 1.05, out
    assert out["reserved"] <= pool_bytes_for(out["peak_held"])
    assert all(_is_pow2(size) for size in out["slabs"])
    # the control: one pinned buffer per checkpoint, as the pool had, costs its power-of-two ceiling (~1.6x here)
    per_buffer = max(sum(1 << (n - 1).bit_length() for n in step) for step in steps)
    assert per_buffer / out["peak_held"] > 1.3


def test_pool_steady_state_allocates_nothing_more():
    pool = HostPool()
    steps = training_steps(3)
    play(pool, steps)
    reserved, slabs = pool.reserved, set(pool.slabs)
    play(pool, steps)
    assert pool.reserved == reserved and set(pool.slabs) == slabs


@pytest.mark.parametrize("seed", [0, 1])
def test_pool_never_hands_out_bytes_still_held(seed):
    pool = HostPool()
    random_leases(pool, seed)
    assert pool.reserved <= pool_bytes_for(pool.peak_held)  # the price holds in any order of takes and releases


def test_a_give_back_while_the_pool_is_busy_never_waits():
    """A finalizer can give a checkpoint back in the middle of a `take` (a garbage collection there) or from
    autograd's thread: it must not wait for the lock the taker holds, and the extents come back all the same."""
    import threading

    pool = HostPool()
    lease = pool.take(3 * MiB, pinned=False)
    with pool._lock:  # a take in progress
        giver = threading.Thread(target=pool.give_back, args=(lease,))
        giver.start()
        giver.join(timeout=10)
        assert not giver.is_alive()
    assert pool.in_use == pool.held == 0
    pool.check()
    reserved = pool.reserved
    pool.take(3 * MiB, pinned=False)
    assert pool.reserved == reserved


def test_pool_release_frees_only_whole_free_slabs():
    pool = HostPool()
    kept = pool.take(3 * MiB, pinned=False)
    pool.give_back(pool.take(40 * MiB, pinned=False))
    pool.release()
    pool.check()
    assert pool.in_use >= 3 * MiB and 0 < pool.reserved < 40 * MiB
    pool.give_back(kept)
    pool.release()
    pool.check()
    assert pool.reserved == 0 and not pool.slabs


@pytest.mark.parametrize("held", [1, 3 * MiB, 100 * MiB + 7, 4_746_000_000, 150 * 2**30 + 12345])
def test_pool_bytes_for_is_tight_and_within_5_percent_at_scale(held):
    price = pool_bytes_for(held)
    assert price >= held and price % MiB == 0
    if held >= 64 * MiB:
        assert price / held <= 1.05


# -- out-of-order paths (issue 54): values exact, nothing leaked, nothing reused while held ----------------------------


@pytest.fixture(params=[False, True], ids=["non-reentrant", "reentrant"])
def checkpointed(request):
    # Qwen3.5: stock Qwen3-VL itself keeps its vision tower's graph alive after a backward that raised (deepstack)
    return checkpointed_model("qwen3_5", request.param), build_batch(LAYOUTS["qwen3_5"], seed=7)


def test_a_backward_that_raises_midway_leaves_the_pool_whole(checkpointed, offloading):
    model, batch = checkpointed
    assert backward_that_raises(model, batch) == "stopped midway"
    counts = HOST_CHECKPOINTS.counts.drain()
    # it stopped with checkpoints still on the host, the first layer's prefetched and never used
    assert counts["kept"] == 1 and 0 < counts["restored"] == counts["prefetched"] < counts["offloaded"], counts
    state = pool_state()
    assert state["in_use"] == state["held"] == 0 < state["reserved"]
    # and the pool serves the next step, exactly
    vlmcp_patch_off_step = _without_offload(model, batch)
    assert _identical(step(model, batch), vlmcp_patch_off_step)
    assert pool_state()["reserved"] == state["reserved"]


def test_retain_graph_and_a_second_backward(checkpointed, offloading):
    model, batch = checkpointed
    _, expected = _without_offload(model, batch)
    first, second, between = backward_twice(model, batch)
    assert between["in_use"] > 0  # the retained graph still holds its checkpoints on the host
    for grads in (first, second):
        assert grads.keys() == expected.keys() and all(torch.equal(grads[n], expected[n]) for n in grads)
    counts = HOST_CHECKPOINTS.counts.drain()
    assert counts["restored"] == 2 * counts["offloaded"] > 0  # each backward copied every checkpoint back
    assert pool_state()["in_use"] == 0


def test_two_forwards_before_one_backward(checkpointed, offloading, reapply):
    import vlmcp_patch

    model, batch = checkpointed
    batches = [batch, build_batch(LAYOUTS["qwen3_5"], seed=8)]
    vlmcp_patch.enable(offload_checkpoints=False)
    expected = two_forwards_one_backward(model, batches)
    vlmcp_patch.enable(offload_checkpoints=True)
    HOST_CHECKPOINTS.counts.drain()
    assert _identical(two_forwards_one_backward(model, batches), expected)
    counts = HOST_CHECKPOINTS.counts.drain()
    # the first graph's last input went to the host when the second forward began: one input kept in all
    assert counts["kept"] == 1 and counts["offloaded"] == counts["restored"] == 2 * layer_calls(model, batch) - 1
    assert pool_state()["in_use"] == 0


def _without_offload(model, batch):
    import vlmcp_patch

    vlmcp_patch.enable(offload_checkpoints=False)
    try:
        return step(model, batch)
    finally:
        vlmcp_patch.enable(offload_checkpoints=True)


def _identical(a, b) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return bool(torch.equal(loss_a, loss_b)) and grads_a.keys() == grads_b.keys() and \
        all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


# -- checkpointing that is not transformers' own (issue 54): never silent ---------------------------------------------


def transformers_older_than(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


@pytest.mark.parametrize("how", FOREIGN_CHECKPOINTS)
def test_offload_under_another_checkpointing_is_refused_before_the_layer_computes(how, reapply):
    """With the switch on, a decoder layer checkpointed by torch's checkpoint_wrapper (FSDP2, Accelerate), a
    hand-written torch.utils.checkpoint or DeepSpeed's checkpointing raises, naming the supported way, before the layer
    computes; without the switch the same model trains (the control), and inference with the switch on is untouched."""
    import vlmcp_patch
    from vlmcp_patch.errors import UnsupportedSetupError

    model, batch = foreign_checkpointed_model(how), build_batch(LAYOUTS["qwen3_vl"], seed=7)
    try:
        loss, grads = step(model, batch)  # the control: runs without the switch
    except torch.utils.checkpoint.CheckpointError:
        if transformers_older_than("5.6.0"):
            # on 5.2.0 this control's non-reentrant recompute sees the layer at twice its length (55 -> 110 tokens),
            # with or without the switch: found 2026-12-04 in CI's oldest environment, not yet traced
            pytest.xfail("transformers < 5.6: a foreign non-reentrant checkpoint recomputes the layer at another length")
        raise
    assert grads
    vlmcp_patch.enable(offload_checkpoints=True)
    try:
        with torch.no_grad():
            model(**batch)
        calls = []
        hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in checkpointed_layers(model)
                 if "Text" in type(m).__name__]
        with pytest.raises(UnsupportedSetupError, match="gradient_checkpointing_enable") as error:
            step(model, batch)
        for hook in hooks:
            hook.remove()
    finally:
        vlmcp_patch.enable(offload_checkpoints=False)
    assert "VLMCP_OFFLOAD_CHECKPOINTS=1" in str(error.value)
    assert ("checkpoint_wrapper" if how == "checkpoint_wrapper" else
            "DeepSpeed" if how == "deepspeed" else "torch.utils.checkpoint") in str(error.value)
    assert calls == []  # no decoder layer computed


def test_transformers_checkpointing_is_not_refused(offloading):
    model, batch = checkpointed_model("qwen3_vl", reentrant=True), build_batch(LAYOUTS["qwen3_vl"], seed=7)
    step(model, batch)
    assert HOST_CHECKPOINTS.counts.drain()["offloaded"] > 0
