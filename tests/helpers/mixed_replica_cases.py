"""Replicas holding different vision data, under every data-parallel wrapper (issue 65), run inside 4 spawned ranks:
CP = 2 x 2 replicas, a tiny Qwen3-VL, one backward per case. Each case gives replica 0 one row and replica 1 another
that differ in what the vision tower runs: one large image shared by patches beside two small ones shared by items
(vision tiles on), images beside a video, text beside images, text beside a video. The reduced gradients are compared
with one process's stock gradients averaged over the two rows, and each rank records the order in which its vision
weights' gradients arrived (the order ZeRO fills its buckets in)."""

from __future__ import annotations

import copy
import os

import torch

from tests.helpers.vision_replica_cases import stock_mean_grads
from vlmcp_patch.fixtures.data import Segment as S
from vlmcp_patch.fixtures.data import make_batch

TWO_IMAGES = [[S(text=5), S(image=(16, 16)), S(text=3), S(image=(16, 16)), S(text=4)]]
ONE_LARGE_IMAGE = [[S(text=5), S(image=(32, 32)), S(text=4)]]  # one image over two ranks: shared by patches
VIDEO = [[S(text=5), S(video=(4, 16, 16)), S(text=4)]]
TEXT = [[S(text=17)]]

# name: (replica 0's row, replica 1's row, VLMCP_VISION_TILE_PATCHES)
CASES = {
    "by patches beside by items, tiles on": (ONE_LARGE_IMAGE, TWO_IMAGES, 16),
    "images beside a video": (TWO_IMAGES, VIDEO, 0),
    "text beside images": (TEXT, TWO_IMAGES, 0),
    "text beside a video": (TEXT, VIDEO, 0),
}
WRAPPERS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
ARRIVAL_ORDER = ("zero1", "zero2", "zero3")  # the wrappers that fill their buckets in arrival order
CP = 2


def _record_vision_arrivals(model) -> list[str]:
    order: list[str] = []
    for name, p in model.named_parameters():
        if "visual" in name and p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    return order


def _deepspeed_step(model, stage: int, batch: dict):
    """(module whose parameters to read, full gradient of a parameter, cleanup) after the second backward of `batch`
    through a DeepSpeed engine at ZeRO `stage` (the package's mpu: summed over CP, averaged over replicas), a step of
    learning rate 0 between: ZeRO-3 checks at the second forward that every rank ran the same submodules."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)
    engine.backward(engine(**batch).loss)
    engine.step()
    engine.backward(engine(**batch).loss)
    return engine.module, deepspeed.utils.safe_get_full_grad, engine.destroy


def _ddp_step(model, batch: dict):
    """DDP over the world, the loss times P: its average over the W ranks is the CP sum averaged over replicas."""
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    (wrapped(**batch).loss * CP).backward()
    return model, lambda p: p.grad, lambda: None


def _fsdp2_step(model, batch: dict):
    """FSDP2 over the world (one unit per decoder layer and vision block, and the root), the loss times P."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in [*model.model.visual.blocks, *model.model.language_model.layers]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    (model(**batch).loss * CP).backward()
    return model, lambda p: None if p.grad is None else p.grad.full_tensor(), lambda: None


def _one_case(rank: int, wrapper: str, rows: tuple, tiles: int) -> dict:
    """One backward of this replica's row of `rows` through `wrapper` at `VLMCP_VISION_TILE_PATCHES=tiles`: the
    largest relative error of a reduced gradient against stock's mean over `rows` (and where), and the order in which
    the vision weights' gradients arrived (over every backward)."""
    import vlmcp_patch
    from tests.helpers.vision_tile_cases import _model_and_batch

    model, _ = _model_and_batch("qwen3_vl", False, rows[0])
    want = stock_mean_grads(model, list(rows))
    order = _record_vision_arrivals(model)
    replica = rank // CP
    batch = make_batch(rows[replica], seed=replica)
    vlmcp_patch.enable(cp_size=CP, vision_tile_patches=tiles)
    try:
        if wrapper == "ddp":
            module, full_grad, done = _ddp_step(model, batch)
        elif wrapper == "fsdp2":
            module, full_grad, done = _fsdp2_step(model, batch)
        else:
            module, full_grad, done = _deepspeed_step(model, int(wrapper[-1]), batch)
        worst, where = 0.0, None
        for n, p in module.named_parameters():  # the same order on every rank: one gather each
            grad = full_grad(p)
            if n not in want:
                continue
            err = float((grad - want[n]).norm() / want[n].norm().clamp_min(1e-12)) if grad is not None else float("inf")
            if err > worst:
                worst, where = err, n
        done()
    finally:
        vlmcp_patch.enable(cp_size=1, vision_tile_patches="auto")
    return {"grad_err": worst, "worst": where, "order": list(order)}


def run_mixed_replica_cases(rank: int, world_size: int, wrappers=WRAPPERS) -> dict:
    """{(wrapper, case): `_one_case`} for every wrapper of `wrappers` and every case of `CASES`."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    return {(wrapper, name): _one_case(rank, wrapper, (row0, row1), tiles)
            for wrapper in wrappers for name, (row0, row1, tiles) in CASES.items()}


def forward_on_one_replica(rank: int, world_size: int) -> dict:
    """After a DDP step over the world, replica 0 alone (ranks 0 and 1) runs forwards of the unwrapped model — with
    images and with a video, with and without gradients, and a backward of the one with gradients — while replica
    1 waits at a barrier: the losses, and stock's on the same rows (the package reverted). With a collective over
    the world in those forwards, replica 0 would wait for replica 1 until the collective's timeout."""
    import torch.distributed as dist

    import vlmcp_patch
    from tests.helpers.vision_tile_cases import _model_and_batch

    model, _ = _model_and_batch("qwen3_vl", False, TWO_IMAGES)
    rows = {"images": make_batch(TWO_IMAGES, seed=5), "video": make_batch(VIDEO, seed=6)}
    vlmcp_patch.revert()
    try:
        stock = {name: float(copy.deepcopy(model)(**batch).loss) for name, batch in rows.items()}
    finally:
        vlmcp_patch.apply()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    vlmcp_patch.enable(cp_size=CP)
    out = {"stock": stock}
    try:
        replica = rank // CP
        (wrapped(**make_batch([TWO_IMAGES, VIDEO][replica], seed=replica)).loss * CP).backward()
        model.zero_grad(set_to_none=True)
        if replica == 0:
            for name, batch in rows.items():
                with torch.no_grad():
                    out[f"{name}, no grad"] = float(model(**batch).loss)
                loss = model(**batch).loss
                loss.backward()
                out[f"{name}, with grad"] = float(loss)
        dist.barrier()
    finally:
        vlmcp_patch.enable(cp_size=1)
    return out


def one_replica_raises(rank: int, world_size: int) -> dict:
    """A DDP step over the world in which replica 1's ranks were handed different rows (its CP group's agreement
    refuses them) while replica 0's are fine: each rank's error (type, message) and the seconds it took to raise."""
    import time

    import vlmcp_patch
    from tests.helpers.vision_tile_cases import _model_and_batch

    model, _ = _model_and_batch("qwen3_vl", False, TWO_IMAGES)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    seed = 0 if rank < CP else rank  # replica 1: another row on each of its ranks
    vlmcp_patch.enable(cp_size=CP)
    start = time.monotonic()
    try:
        (wrapped(**make_batch(TWO_IMAGES, seed=seed)).loss * CP).backward()
        return {"error": None}
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return {"error": type(error).__name__, "message": str(error)[:600], "seconds": time.monotonic() - start}
    finally:
        vlmcp_patch.enable(cp_size=1)


def one_replica_alone(rank: int, world_size: int) -> dict:
    """`forward_on_one_replica`, then `one_replica_raises`, in one launch of the ranks."""
    return {"forward": forward_on_one_replica(rank, world_size), "raises": one_replica_raises(rank, world_size)}
