"""The switches chosen by need (`vlmcp_patch/by_need.py`), run inside the spawned ranks: a row of the memory benchmark's
model (Qwen3-VL's proportions, widths / 16, gradient checkpointing) at budgets set from the plan's own prices, each
step's choice, its log lines and its measured device peak."""

from __future__ import annotations

import logging
import time

import torch

GIB = 2**30
TOKENS, LAYERS = 8192, 2  # an image-heavy row whose switches change its predicted peak by more than half


class Lines(logging.Handler):
    """The records of the package's logger."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def model_and_row(tokens: int = TOKENS, layers: int = LAYERS):
    """The memory benchmark's model and image-heavy row (`benchmarks.memory`), checkpointing on."""
    from benchmarks.common import build_benchmark_model
    from benchmarks.memory import row_of

    torch.manual_seed(0)
    model = build_benchmark_model("qwen3-vl", layers=layers, scale=16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, row_of("image-heavy", tokens, model.config.vision_config.patch_size)


def prices(model, batch: dict, size: int) -> dict:
    """The plan's predicted peak of each allowed set of switches for this row at P=`size` (bytes), and the gradients
    still to come: what `by_need.choose_switches` prices."""
    from vlmcp_patch import by_need
    from vlmcp_patch.planning import dims_from_config, package_ulysses

    dims = dims_from_config(model.config)
    tokens = batch["input_ids"].shape[1]
    row = by_need.row_of_call(batch, tokens, [(0, tokens)], dims.merge)
    base = by_need.training_of(model, by_need.Switches())
    sets = {tuple(s.on()): by_need.predicted_peak(dims, row, by_need._with(base, s), size, package_ulysses(dims, size))
            for s in by_need.candidates()}
    pending = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"sets": sets, "pending": pending}


def budget_for(room: float, pending: float) -> float:
    """GiB of `VLMCP_DEVICE_MEMORY_GIB` that leave `room` bytes to the step (`by_need.local_room` on a CPU)."""
    from vlmcp_patch.by_need import margin

    return (room + pending) / (1 - margin()) / GIB


def rooms(priced: dict) -> dict[str, float]:
    """The room of each named budget: roomy (every set fits), medium (some set but not the untiled one), tight (only
    the smallest peaks), refused (none)."""
    untiled, least = priced["sets"][()], min(priced["sets"].values())
    return {"roomy": 1.25 * untiled, "medium": (untiled + least) / 2, "tight": 1.02 * least, "refused": 0.9 * least}


def measured_step(model, batch: dict, world_size: int) -> dict:
    """One forward + backward: its loss and its device peak as the memory benchmark counts it (`benchmarks.memory`:
    every storage created in the step, the parameter gradients included here, plus the batch's integer tensors the
    host loop leaves on the device; the pixels' share copied in the step)."""
    from benchmarks.common import LiveBytes
    from benchmarks.memory import HostPixels, batch_device_bytes

    model.zero_grad(set_to_none=True)
    inputs = [v for v in batch.values() if torch.is_tensor(v)]
    live = LiveBytes([*model.parameters(), *model.buffers(), *inputs])
    start = time.perf_counter()
    with live, HostPixels(batch):
        loss = model(**batch).loss
        loss.backward()
    seconds = time.perf_counter() - start
    return {"loss": float(loss), "peak": live.peak() + batch_device_bytes(batch, world_size, "host"),
            "seconds": seconds}


def budgets(rank: int, world_size: int, names=("roomy", "medium", "tight", "refused")) -> dict:
    """At each named budget (`rooms`): the choice, the tiles that ran, the measured peak and the log lines of this
    rank, or the refusal's message."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.errors import UnsupportedSetupError
    from vlmcp_patch.tiles import NORMS, TILES
    from vlmcp_patch.vision_tiles import VISION_TILES

    model, batch = model_and_row()
    priced = prices(model, batch, world_size)
    lines = Lines()
    logging.getLogger("vlmcp_patch").addHandler(lines)
    out = {"prices": {"+".join(k) or "none": v for k, v in priced["sets"].items()}, "pending": priced["pending"]}
    try:
        for name in names:
            budget = budget_for(rooms(priced)[name], priced["pending"])
            vlmcp_patch.enable(cp_size=world_size, device_memory_gib=budget)
            for counts in (TILES, NORMS, VISION_TILES):
                counts.drain()
            lines.lines.clear()
            result = {"budget": budget * GIB}
            by_need.STATE.choice = by_need.STATE.logged = None  # each budget a run of its own: its first forward logs
            try:
                result.update(measured_step(model, batch, world_size))
                if name == "roomy":  # a second step at the same budget: the same choice, no second line
                    result["again"] = measured_step(model, batch, world_size)["loss"]
            except UnsupportedSetupError as error:
                result["refused"] = str(error)
            choice = by_need.STATE.choice
            if choice is not None:
                result.update(switches=choice.switches.on(), predicted=choice.peak, room=choice.room)
            result.update(lines=list(lines.lines), mlp_tiles=TILES.drain()["calls"], norm_calls=NORMS.drain()["calls"],
                          vision_tiles=VISION_TILES.drain()["calls"])
            out[name] = result
    finally:
        logging.getLogger("vlmcp_patch").removeHandler(lines)
        vlmcp_patch.enable(cp_size=1, device_memory_gib=0)
    return out



def _features_left_to_the_need(model, batch: dict, world_size: int) -> tuple[dict, float, float]:
    """CP on with the checkpoint offload, the tiles on, the norms off and the head's chunk at its automatic size, so
    the features on the host are the only switch left to the need: (`prices`, the peak with the features kept, with
    them parked)."""
    import vlmcp_patch
    from vlmcp_patch.loss import chunk_tokens

    config = model.config.text_config
    chunk = chunk_tokens(TOKENS // world_size, config.hidden_size, config.vocab_size)
    vlmcp_patch.enable(cp_size=world_size, offload_checkpoints=True, mlp_tile_tokens="on", vision_tile_patches="on",
                       recompute_norms=False, loss_chunk_tokens=chunk)
    priced = prices(model, batch, world_size)
    return priced, priced["sets"][("vision", "mlp")], priced["sets"][("vision", "mlp", "features")]


def features_short_of_host(rank: int, world_size: int) -> dict:
    """`features_by_need`'s setup at the budget where only the parked features fit the device, with a host room
    (`VLMCP_HOST_MEMORY_GIB`, on rank 1 only: the group agrees on its smallest room) below what the pool and the
    features need: what each rank raises, and whether anything was parked; then the same step with the host room
    lifted on every rank, which parks them."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    model, batch = model_and_row()
    out = {}
    try:
        priced, kept, parked = _features_left_to_the_need(model, batch, world_size)
        vlmcp_patch.enable(device_memory_gib=budget_for((kept + parked) / 2, priced["pending"]))
        for name, host_gib in (("short", 1e-6 if rank == 1 else 0), ("lifted", 0)):
            vlmcp_patch.enable(host_memory_gib=host_gib)
            by_need.STATE.choice = None
            HOST_CHECKPOINTS.counts.drain()
            model.zero_grad(set_to_none=True)
            try:
                model(**batch).loss.backward()
                out[name] = {"error": None, "switches": by_need.STATE.choice.switches.on()}
            except Exception as error:  # noqa: BLE001 - reported to the test
                out[name] = {"error": f"{type(error).__name__}: {error}"}
            out[name]["counts"] = HOST_CHECKPOINTS.counts.drain()
    finally:
        vlmcp_patch.enable(cp_size=1, device_memory_gib=0, host_memory_gib=0, offload_checkpoints=False,
                           mlp_tile_tokens="auto", vision_tile_patches="auto", recompute_norms="auto",
                           loss_chunk_tokens=0)
    return out


def features_by_need(rank: int, world_size: int) -> dict:
    """The vision features parked on the host by need (`VLMCP_OFFLOAD_FEATURES=auto` with the checkpoint offload on):
    the tiles and norms set, the head's chunk set to its automatic size (so the features are the only switch left to
    the need), at a budget between the row's prices with the features on the device and on the host, and at a roomy
    one. For each: the switches chosen, the tensors parked, the loss and every gradient of this rank."""
    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    model, batch = model_and_row()
    out = {}
    try:
        priced, kept, parked = _features_left_to_the_need(model, batch, world_size)
        out["prices"] = (kept, parked)
        for name, room in (("needed", (kept + parked) / 2), ("roomy", 1.25 * kept)):
            vlmcp_patch.enable(device_memory_gib=budget_for(room, priced["pending"]))
            by_need.STATE.choice = None
            HOST_CHECKPOINTS.counts.drain()
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            out[name] = {"switches": by_need.STATE.choice.switches.on(), "counts": HOST_CHECKPOINTS.counts.drain(),
                         "loss": loss.item(),
                         "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
        needed, roomy = out["needed"].pop("grads"), out["roomy"].pop("grads")
        out["same_bits"] = needed.keys() == roomy.keys() and all(torch.equal(needed[n], roomy[n]) for n in roomy)
    finally:
        vlmcp_patch.enable(cp_size=1, device_memory_gib=0, offload_checkpoints=False, mlp_tile_tokens="auto",
                           vision_tile_patches="auto", recompute_norms="auto", loss_chunk_tokens=0)
    return out
