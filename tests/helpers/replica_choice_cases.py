"""The by-need choice across replicas and across forwards (`vlmcp_patch/by_need.py`, `switches.py`), run inside 4
spawned ranks: 2 data-parallel replicas x CP=2, a tiny Qwen3-VL with non-reentrant gradient checkpointing.

The two replicas train different rows at one `VLMCP_DEVICE_MEMORY_GIB` budget: a short row that fits untiled and a
long one that needs the MLP tiles. Each rank records the switches its forward ran with, the order in which its
parameters' gradients were accumulated (the order ZeRO-1/2 fill their buckets in) and its gradients summed over the
world (the data-parallel sum of the replicas' rows). The test compares them with one process's stock run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SHORT, LONG = 512, 4096  # tokens: at P=2 the long row's slice makes two MLP tiles, the short one's one


def model_and_rows():
    """The tiny Qwen3-VL (gradient checkpointing, non-reentrant) and the two text rows (packed-row convention)."""
    from tests.helpers.cases import packed_text_batch
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config

    model = build_model(tiny_qwen3_vl_config(), seed=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, {"short": packed_text_batch([SHORT], seed=3), "long": packed_text_batch([LONG], seed=4)}


def budgets_gib(model, rows: dict, size: int) -> tuple[float, float]:
    """Two budgets, by the plan's own prices (`by_need_cases.prices`): one at which the long row needs the MLP tiles
    (it fits with them, not with the norms alone nor untiled) and the short one fits untiled; one at which the long
    row fits nowhere and the short one still fits untiled."""
    from tests.helpers.by_need_cases import budget_for, prices

    long, short = prices(model, rows["long"], size), prices(model, rows["short"], size)
    room = (long["sets"][("mlp",)] + long["sets"][("norms",)]) / 2
    assert long["sets"][("mlp",)] < room < min(long["sets"][()], long["sets"][("norms",)]), long["sets"]
    tight = 0.9 * min(long["sets"].values())
    assert short["sets"][()] < tight, short["sets"]
    return budget_for(room, long["pending"]), budget_for(tight, long["pending"])


def arrival_order(model) -> list[str]:
    """The names of the parameters in the order their gradients are accumulated (appended as it happens)."""
    order: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    return order


def old_global_read(name: str) -> bool:
    """The control of the forwards' case: `switches.in_effect` as it was, reading the last CP forward's choice."""
    from vlmcp_patch.patching import cp_size
    from vlmcp_patch.switches import STATE, explicit

    forced = explicit(name)
    if forced is not None:
        return forced
    return cp_size() > 1 and STATE.choice is not None and getattr(STATE.choice.switches, name)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _summed(grads: dict, group) -> dict:
    """`grads` summed over `group`, as numpy arrays (a tensor would travel back through shared memory, which the
    rank's exit closes)."""
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return {n: g.numpy() for n, g in grads.items()}


def _step(model, batches: list[dict], order: list[str]) -> dict:
    """Forwards of `batches` (one after the other, each with its graph), one backward of their losses' sum: the
    switches each forward ran with (its context's choice, `CPContext.choice`) and the accumulation order, or the
    error the backward raised."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.tiles import TILES

    model.zero_grad(set_to_none=True)
    order.clear()
    TILES.drain()
    losses, choices = [], []
    for batch in batches:
        with vlmcp_patch.data_parallel_step():  # the replicas reduce these gradients together (`_summed`)
            losses.append(model(**batch).loss)
        choices.append(by_need.STATE.choice.switches.on())
    try:
        sum(losses).backward()
    except Exception as error:  # noqa: BLE001 - the control's failure, reported
        return {"choices": choices, "error": f"{type(error).__name__}: {error}"[:300]}
    return {"choices": choices, "order": list(order), "tiles": TILES.drain()}


def replicas_and_forwards(rank: int, world_size: int) -> dict:
    """Per phase, this rank's choices, accumulation order and gradients (summed over the world, or over the CP group
    for the forwards' case):

    - agreed: replica 0 trains the short row, replica 1 the long one, at the budget (the package as it is);
    - per_group: the same with the switches agreed within each CP group only (the control: the old behaviour);
    - explicit: the same rows with `VLMCP_MLP_TILE_TOKENS=1024` set and no budget (one tile of the short row, two of
      the long one);
    - refused: the same rows at a budget the long row fits nowhere (the message each rank raised, or None);
    - two_forwards: every replica runs the long row's forward, then the short row's, then one backward of both;
    - two_forwards_global: the same with the switches read from the last forward (the control: the old behaviour).
    """
    import vlmcp_patch
    from vlmcp_patch import by_need, switches

    size = 2
    model, rows = model_and_rows()
    budget, too_tight = budgets_gib(model, rows, size)
    order = arrival_order(model)
    mine = rows["short" if rank // size == 0 else "long"]
    world = dist.new_group(list(range(world_size)))
    out = {"budget_gib": budget}
    agree = by_need.agreed_over_replicas
    in_effect = switches.in_effect
    try:
        vlmcp_patch.enable(cp_size=size, device_memory_gib=budget)
        result = _step(model, [mine], order)
        out["agreed"] = {**result, "grads": _summed(_grads(model), world)}
        by_need.agreed_over_replicas = lambda own, refused, device: (own, None)  # nothing asked of the others
        out["per_group"] = _step(model, [mine], order)
        by_need.agreed_over_replicas = agree

        vlmcp_patch.enable(device_memory_gib=0, mlp_tile_tokens=1024)
        result = _step(model, [mine], order)
        out["explicit"] = {**result, "grads": _summed(_grads(model), world)}
        vlmcp_patch.enable(device_memory_gib=too_tight, mlp_tile_tokens="auto")
        try:
            _step(model, [mine], order)
            out["refused"] = None
        except vlmcp_patch.UnsupportedSetupError as error:
            out["refused"] = str(error)
        vlmcp_patch.enable(device_memory_gib=budget)

        cp = vlmcp_patch.get_cp_group(size)
        result = _step(model, [rows["long"], rows["short"]], order)
        out["two_forwards"] = {**result, "grads": _summed(_grads(model), cp.group) if "order" in result else None}
        switches.in_effect = old_global_read
        out["two_forwards_global"] = _step(model, [rows["long"], rows["short"]], order)
    finally:
        by_need.agreed_over_replicas = agree
        switches.in_effect = in_effect
        vlmcp_patch.enable(cp_size=1, device_memory_gib=0, mlp_tile_tokens="auto")
    return out


def reference(rows: list[str]) -> dict:
    """One process's stock gradients (the package reverted) of the sum of `rows`' losses, each its own forward."""
    import vlmcp_patch

    model, batches = model_and_rows()
    vlmcp_patch.revert()
    try:
        model.zero_grad(set_to_none=True)
        sum(model(**batches[name]).loss for name in rows).backward()
    finally:
        vlmcp_patch.apply()
    return _grads(model)
