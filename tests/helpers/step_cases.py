"""Raw training loops under CP, inside the spawned ranks: an optimizer step on gradients no one summed over the CP
group raises on every rank before a weight changes; the loops that sum (or whose wrapper does) step as P=1 does."""

from __future__ import annotations

import torch

from tests.helpers.cases import MULTI_IMAGE, build_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(before: dict, model) -> bool:
    return any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def _p1_step(batch: dict, scale: int = 1) -> dict:
    """One SGD step of one process at P=1 on `batch`, `scale` backwards of it accumulated."""
    import vlmcp_patch

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with vlmcp_patch.disabled():
        for _ in range(scale):
            model(**batch).loss.backward()
    optimizer.step()
    return _weights(model)


def _loop(name: str, batch: dict, cp_size: int):
    """(outcome, weights changed, model) of the loop `name` at CP size `cp_size`."""
    import vlmcp_patch

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    wrapped = model
    if name == "own_ddp_loss_times_p":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _weights(model)
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        backwards = 2 if name.startswith("accumulated") else 1
        for i in range(backwards):
            loss = wrapped(**batch).loss
            (loss * vlmcp_patch.cp_size() if name == "own_ddp_loss_times_p" else loss).backward()
            if name in ("summed", "accumulated_summed_once") and i == backwards - 1 or \
                    name == "accumulated_summed_too_early" and i == 0:
                vlmcp_patch.sum_over_cp_group(p.grad for p in model.parameters())
        optimizer.step()
        outcome = "stepped"
    except vlmcp_patch.UnsummedGradientsError as error:
        outcome = f"raised: {error}"
    finally:
        vlmcp_patch.enable(cp_size=1)
    return outcome, _changed(before, model), model


LOOPS = ("unsummed", "summed", "accumulated_summed_once", "accumulated_summed_too_early", "own_ddp_loss_times_p")


def run_step_cases(rank: int, world_size: int, cp_size: int) -> dict:
    """Per loop of `LOOPS`: what the step did, whether any weight changed, and for the loops that stepped the worst
    relative error of the weights against one process's step on the same batch."""
    from vlmcp_patch.fixtures.compare import state_dict_error

    batch = build_batch(MULTI_IMAGE, seed=7)
    results = {}
    for name in LOOPS:
        outcome, changed, model = _loop(name, batch, cp_size)
        reference = _p1_step(batch, scale=2 if name.startswith("accumulated") else 1)
        error = state_dict_error(_weights(model), reference) if outcome == "stepped" else None
        results[name] = {"outcome": outcome, "changed": changed, "weights_err": error}
    # P=1: a raw loop needs no sum, and none is asked for
    outcome, changed, _ = _loop("unsummed", batch, 1)
    results["unsummed_at_p1"] = {"outcome": outcome, "changed": changed, "weights_err": None}
    return results
