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


def _stepped(optimizer) -> str:
    import vlmcp_patch

    try:
        optimizer.step()
        return "stepped"
    except vlmcp_patch.UnsummedGradientsError as error:
        return f"raised: {error}"


def _last_hidden(model, batch: dict) -> torch.Tensor:
    """This rank's slice of the last hidden state (the whole row with CP off)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, output_hidden_states=True).hidden_states[-1]


def _gathered_loss(hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """The same loss on every rank of a group from the hidden state the script gathers (`gather_sequence`): its
    backward keeps each rank's share."""
    import vlmcp_patch

    return vlmcp_patch.gather_sequence(hidden, length=batch["input_ids"].shape[1]).pow(2).mean()


def _policy_then_reference(name: str, batch: dict, cp_size: int):
    """A policy's forward, then a reference model's forward without gradients, then the loss from the policy's
    gathered hidden state: the shares are the policy's, whatever ran last. `name` ends with `_summed` when the loop
    sums them."""
    import vlmcp_patch

    policy, reference = build_model(tiny_qwen3_vl_config(), seed=1), build_model(tiny_qwen3_vl_config(), seed=2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    before = _weights(policy)
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        hidden = _last_hidden(policy, batch)
        with torch.no_grad():
            _last_hidden(reference, batch)
        _gathered_loss(hidden, batch).backward()
        if name.endswith("_summed"):
            vlmcp_patch.sum_over_cp_group(p.grad for p in policy.parameters())
        outcome = _stepped(optimizer)
    finally:
        vlmcp_patch.enable(cp_size=1)
    return outcome, _changed(before, policy), policy


def _p1_hidden_step(batch: dict) -> dict:
    import vlmcp_patch

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with vlmcp_patch.disabled():
        _gathered_loss(_last_hidden(model, batch), batch).backward()
    optimizer.step()
    return _weights(model)


def _two_models(batch: dict, cp_size: int) -> dict:
    """Two models trained side by side, each with its own optimizer; the loop sums the first one's gradients only.
    Per model: what its step did and whether its weights changed."""
    import vlmcp_patch

    models = {k: build_model(tiny_qwen3_vl_config(), seed=seed) for k, seed in (("first", 1), ("second", 2))}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    before = {k: _weights(m) for k, m in models.items()}
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        for model in models.values():
            model(**batch).loss.backward()
        vlmcp_patch.sum_over_cp_group(p.grad for p in models["first"].parameters())
        outcomes = {k: _stepped(optimizers[k]) for k in models}
    finally:
        vlmcp_patch.enable(cp_size=1)
    return {k: {"outcome": outcomes[k], "changed": _changed(before[k], models[k])} for k in models}


def _replica_groups(world_size: int, cp_size: int) -> list:
    """Every data-parallel group: the ranks at one position of their CP groups, one per replica (each rank creates
    all of them, in the same order)."""
    import torch.distributed as dist

    return [dist.new_group(list(range(position, world_size, cp_size))) for position in range(cp_size)]


def _ddp_over_replicas(batch: dict, replicas, cp_size: int):
    """A script's own DDP over the data-parallel group `replicas` only (its W/P replicas), the loss scaled by P as for
    a DDP over all W ranks: it averages over the replicas and sums nothing over CP."""
    import vlmcp_patch

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=replicas)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _weights(model)
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        (wrapped(**batch).loss * vlmcp_patch.cp_size()).backward()
        outcome = _stepped(optimizer)
    finally:
        vlmcp_patch.enable(cp_size=1)
    return outcome, _changed(before, model), model


def _full_weights(model) -> dict:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _own_fsdp2(batch: dict, mesh, cp_size: int):
    """A script's own FSDP2 over `mesh`, the loss scaled by P: (outcome, weights changed, the full weights after)."""
    from torch.distributed.fsdp import fully_shard

    import vlmcp_patch

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _full_weights(model)
    vlmcp_patch.enable(cp_size=cp_size)
    try:
        (model(**batch).loss * vlmcp_patch.cp_size()).backward()
        outcome = _stepped(optimizer)
    finally:
        vlmcp_patch.enable(cp_size=1)
    after = _full_weights(model)
    return outcome, any(not torch.equal(before[n], after[n]) for n in after), after


LOOPS = ("unsummed", "summed", "accumulated_summed_once", "accumulated_summed_too_early", "own_ddp_loss_times_p")


def run_step_cases(rank: int, world_size: int, cp_size: int) -> dict:
    """Per loop of `LOOPS`, the policy-then-reference loops, DDP over the replicas only and FSDP2 (over all ranks, over
    the replicas only): what the step did, whether any weight changed, and for the loops that stepped the worst
    relative error of the weights against one process's step on the same batch (every replica gets the same batch);
    `two_models`: each model's step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from vlmcp_patch.fixtures.compare import state_dict_error

    batch = build_batch(MULTI_IMAGE, seed=7)
    results = {}
    references = {scale: _p1_step(batch, scale) for scale in (1, 2)}  # one backward, or two accumulated
    for name in LOOPS:
        outcome, changed, model = _loop(name, batch, cp_size)
        reference = references[2 if name.startswith("accumulated") else 1]
        error = state_dict_error(_weights(model), reference) if outcome == "stepped" else None
        results[name] = {"outcome": outcome, "changed": changed, "weights_err": error}
    for name in ("policy_then_reference", "policy_then_reference_summed"):
        outcome, changed, model = _policy_then_reference(name, batch, cp_size)
        error = state_dict_error(_weights(model), _p1_hidden_step(batch)) if outcome == "stepped" else None
        results[name] = {"outcome": outcome, "changed": changed, "weights_err": error}
    replicas = _replica_groups(world_size, cp_size)[dist.get_rank() % cp_size]
    outcome, changed, _ = _ddp_over_replicas(batch, replicas, cp_size)
    results["ddp_over_replicas_only"] = {"outcome": outcome, "changed": changed, "weights_err": None}
    meshes = {"own_fsdp2_loss_times_p": init_device_mesh("cpu", (world_size,)),
              "fsdp2_over_replicas_only": DeviceMesh.from_group(replicas, "cpu")}
    for name, mesh in meshes.items():
        outcome, changed, weights = _own_fsdp2(batch, mesh, cp_size)
        error = state_dict_error(weights, references[1]) if outcome == "stepped" else None
        results[name] = {"outcome": outcome, "changed": changed, "weights_err": error}
    results["two_models"] = _two_models(batch, cp_size)
    # P=1: a raw loop needs no sum, and none is asked for
    outcome, changed, _ = _loop("unsummed", batch, 1)
    results["unsummed_at_p1"] = {"outcome": outcome, "changed": changed, "weights_err": None}
    return results
