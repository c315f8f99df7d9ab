"""A long CP training loop, inside the spawned ranks: a new batch every step (padded and packed, zero to three images
or a video), the debug switch on and off in turns, against one process's training of the same batches. It reports
the losses' largest relative difference, and the resident memory and live tensors at step `WARM` and at the end."""

from __future__ import annotations

import copy
import ctypes
import gc
import random
import warnings

import torch

from tests.helpers.order_cases import draw_case
from vlmcp_patch.fixtures.data import make_batch, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

WARM = 20  # steps before the first measurement: allocator pools and lazily built groups settle
DEBUG_TURN = 25  # the debug switch flips every this many steps
CONFIGS = {
    "qwen3_vl": lambda: tiny_qwen3_vl_config(),  # 4 query heads: P=2 is Ulysses only
    "qwen3_5-2heads": lambda: tiny_qwen3_5_config(num_attention_heads=2, num_key_value_heads=1,
                                                  linear_num_key_heads=1, linear_num_value_heads=2),  # P=4: a ring
}


def _batch(rng: random.Random, step: int) -> dict:
    case = draw_case(rng)
    if case["packed"]:
        return make_packed_batch(case["samples"], seed=step)[0]
    return make_batch(case["samples"], seed=step)


def _resident_bytes() -> int:
    """Resident memory after a collection and handing the allocator's free pages back (its slack is not growth)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated module attributes the collector holds warns
        warnings.simplefilter("ignore")
        return sum(isinstance(obj, torch.Tensor) for obj in gc.get_objects())


def run_soak(rank: int, world_size: int, config: str, steps: int) -> dict:
    import vlmcp_patch

    model = build_model(CONFIGS[config](), seed=1)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.02)
    rng = random.Random(11)  # the same batches on every rank of the group
    worst, measured = 0.0, {}
    for step in range(steps):
        batch = _batch(rng, step)
        vlmcp_patch.enable(cp_size=world_size, debug_collectives=(step // DEBUG_TURN) % 2 == 1)
        try:
            loss = model(**batch).loss
            loss.backward()
            vlmcp_patch.sum_over_cp_group(p.grad for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            vlmcp_patch.enable(cp_size=1, debug_collectives=False)
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        worst = max(worst, abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)))
        del loss, ref_loss, batch
        if step + 1 in (WARM, steps):
            measured[step + 1] = {"resident": _resident_bytes(), "tensors": _live_tensors()}
    from vlmcp_patch.collectives.record import collective_log

    return {"loss_err": worst, "warm": measured[WARM], "end": measured[steps],
            "debug_records": len(collective_log().pending), "issued": sum(collective_log().issued.values())}
