"""Switches chosen by need: the plan at run time.

The memory switches — a smaller chunk of the fused head, the RMSNorms recomputed, the vision tower in tiles, the MLPs
in tiles — are exact, but each costs time: on one H200 the MLP in tiles took x1.401 of its stock time and the RMSNorm
recomputed x1.415 of its own (docs/testing.md, sections 9 and 10). A row that fits without them should not pay that.

At every CP forward, before any compute (`choose_switches`, called by `forward.top_level.enter_cp_forward`):

1. the row is priced with the plan's own model (`planning.activation_memory`, what `python -m vlmcp_patch plan`
   prices on top of the weights and optimizer): the live model's dimensions (`planning.model_dims` of its config),
   the row's tokens and vision patches, P and this forward's U x R, gradient checkpointing as the model has it, the
   checkpoint offload as set;
2. the room is read: the free device memory (`torch.cuda.mem_get_info`, plus what torch's allocator holds unused),
   capped by `VLMCP_DEVICE_MEMORY_GIB` where set (on a CPU that budget is the only limit: without it nothing is
   switched on by need), less a margin (`MARGIN` of the device's memory) and less the parameter gradients still to
   come (trained parameters without a `.grad` yet: the backward allocates them beside the activations). The ranks
   agree on the smallest room in the group: one all-reduce of one number, issued by every rank at every CP forward,
   so no rank tiles alone;
3. among the sets the explicit settings allow (an explicit `VLMCP_MLP_TILE_TOKENS`, `VLMCP_RECOMPUTE_NORMS`,
   `VLMCP_VISION_TILE_PATCHES`, `VLMCP_LOSS_CHUNK` always wins), the cheapest whose predicted peak fits the room is
   taken: `SWITCHES` lists them cheapest first, and a set costs more than every set of cheaper switches only (the
   MLP tiles alone cost more than the other three together). A row that fits with none runs stock-fast, untiled.
   A row that does not fit with every allowed switch raises on every rank before compute, naming the longest row
   that fits and the P or settings that would fit this one.

Deciding at every forward with a graph (not only the first; a forward without one keeps the last choice, which a
pending backward's recomputation reads) costs one number's all-reduce and a few microseconds of arithmetic,
and follows what the first step cannot see: an optimizer that creates its states at its first step leaves less room
from the second forward on, and a longer row later is priced as itself. Every rank of a group has the same row (the
agreement checks it) and the same agreed room, so every rank takes the same decision.

Rank 0 of each CP group logs one line (logger "vlmcp_patch", WARNING: shown by Python's default handler, the HF
Trainer's and the CLIs' log configurations alike) at the first CP forward, and again only when the choice changes.
At P=1 nothing is decided: only explicit switches act there (`in_effect`), and the first that does logs one line.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from .errors import UnsupportedSetupError
from .patching import cp_size
from .settings import AUTO, ON, SETTINGS

LOGGER = logging.getLogger("vlmcp_patch")
GIB = 2**30
# The device memory kept free beyond the predicted peak, as a share of the device's memory: the plan's own margin
# (`planning.DEVICE_MARGIN`, 5 %), this value where the plan has none
MARGIN = 0.05
# Tokens per chunk of the fused head when the row needs a smaller one than the automatic rule's (docs/memory.md: at
# 256 tokens the head's chunk no longer sets the peak)
SMALL_LOSS_CHUNK = 256
# Cheapest first: a smaller head chunk (the same FLOPs in more matmuls), the RMSNorms recomputed (x1.415 on the norms,
# a few % of a step), the vision tower in tiles (one more forward of the tower without checkpointing, none with it:
# the tiles' recompute replaces the blocks'), the MLPs in tiles (x1.401 on the MLPs, most of a step's matmuls)
SWITCHES = ("loss_chunk", "norms", "vision", "mlp")
LABELS = {"loss_chunk": "small loss chunk", "norms": "norm recompute", "vision": "vision tiles", "mlp": "MLP tiles"}
VARIABLES = {"loss_chunk": "VLMCP_LOSS_CHUNK", "norms": "VLMCP_RECOMPUTE_NORMS", "vision": "VLMCP_VISION_TILE_PATCHES",
             "mlp": "VLMCP_MLP_TILE_TOKENS"}


@dataclass(frozen=True)
class Switches:
    loss_chunk: bool = False
    norms: bool = False
    vision: bool = False
    mlp: bool = False

    def on(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]

    def cost(self) -> int:
        """The order of cost: each switch costs more than all cheaper ones together (`SWITCHES`)."""
        return sum(2**i for i, name in enumerate(SWITCHES) if getattr(self, name))


@dataclass(frozen=True)
class Choice:
    """What a CP forward runs with and why: the switches in effect (explicit ones included), the predicted peak of the
    step's activations (bytes, beside what was allocated before it), the agreed room (None: no limit known), the row
    and the layout priced."""

    switches: Switches
    explicit: tuple[str, ...]
    why: str
    peak: float
    room: float | None
    tokens: int
    patches: int
    size: int
    ulysses: int
    ring: int
    replicas: int

    def line(self) -> str:
        """The one log line (module docstring)."""
        states = []
        for name in SWITCHES:
            state = "on" if getattr(self.switches, name) else "off"
            states.append(f"{LABELS[name]} {state}{' (set)' if name in self.explicit else ''}")
        room = "no limit known" if self.room is None else f"{size_text(self.room)} free after the margin"
        replicas = f"{self.replicas} data replica{'s' if self.replicas != 1 else ''}"
        return (f"vlmcp_patch: CP on, P={self.size} (U x R = {self.ulysses} x {self.ring}), {replicas}; "
                f"{', '.join(states)}: {self.why}; predicted peak {size_text(self.peak)} ({room}); row "
                f"{self.tokens:,} tokens, {self.patches:,} patches")


class _State:
    choice: Choice | None = None  # the last CP forward's
    logged: Switches | None = None  # what this process's line last said
    p1_logged: bool = False


STATE = _State()


# ---------------------------------------------------------------------------------------------------------------
# What the settings force, and what is in effect now


def explicit(name: str) -> bool | None:
    """What the settings force for switch `name`: True / False, or None (chosen by need)."""
    if name == "mlp":
        value = SETTINGS.mlp_tile_tokens
    elif name == "vision":
        value = SETTINGS.vision_tile_patches
    elif name == "norms":
        return None if SETTINGS.recompute_norms == AUTO else SETTINGS.recompute_norms
    else:  # a chunk set by hand is the chunk: no smaller one by need
        return False if SETTINGS.loss_chunk_tokens else None
    return None if value == AUTO else value != 0


def in_effect(name: str) -> bool:
    """Whether switch `name` acts now: as set, at any P; chosen by need under CP (the last CP forward's choice); off
    at P=1 unless set. An explicit switch acting at P=1 logs one line, once."""
    forced = explicit(name)
    if forced is not None:
        if forced and cp_size() == 1 and name != "loss_chunk":
            _log_p1_once(name)
        return forced
    return cp_size() > 1 and STATE.choice is not None and getattr(STATE.choice.switches, name)


def mlp_tiles_on() -> bool:
    return in_effect("mlp")


def norms_recompute_on() -> bool:
    return in_effect("norms")


def vision_tiles_on() -> bool:
    return in_effect("vision")


def loss_chunk_tokens() -> int:
    """Tokens per chunk of the fused head: as set, else the small chunk where the row needs it, else 0 (the
    automatic rule, `loss.chunk_tokens`)."""
    return SETTINGS.loss_chunk_tokens or (SMALL_LOSS_CHUNK if in_effect("loss_chunk") else 0)


def size_setting(configured: int | str) -> int | str:
    """A tile size setting as the size rules read it: `ON` and `AUTO` both size automatically."""
    return AUTO if configured == ON else configured


def size_text(nbytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _log_p1_once(name: str) -> None:
    if STATE.p1_logged or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    STATE.p1_logged = True
    LOGGER.warning("vlmcp_patch: CP off (P=1); %s on as set (%s=%s)", LABELS[name], VARIABLES[name],
                   {"mlp": SETTINGS.mlp_tile_tokens, "vision": SETTINGS.vision_tile_patches,
                    "norms": 1}[name])


# ---------------------------------------------------------------------------------------------------------------
# Pricing: the plan's model of the live model and row


def training_of(model, switches: Switches):
    """The plan's `Training` of this step: checkpointing as the model has it, the offload as set, the sharding the
    parameters show (ZeRO-3, FSDP2, else whole), the head frozen or not, and the switches (explicit sizes kept)."""
    from torch.distributed.fsdp import FSDPModule

    from .distributed import data_parallel_world_size
    from .planning import Training

    params = list(model.parameters())
    sharding = ("zero3" if any(hasattr(p, "ds_id") for p in params) else
                "fsdp" if any(isinstance(m, FSDPModule) for m in model.modules()) else "none")
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    head = getattr(model, "lm_head", None)
    frozen = head is not None and not any(p.requires_grad for p in head.parameters())
    sized = lambda value: value if isinstance(value, int) and value > 0 else None  # noqa: E731
    chunk = SETTINGS.loss_chunk_tokens or (SMALL_LOSS_CHUNK if switches.loss_chunk else 0)  # 0: the automatic rule
    return Training(
        sharding=sharding, gradient_checkpointing=checkpointing,
        dp=data_parallel_world_size(), bytes_per_value=params[0].element_size() if params else 2,
        offload_checkpoints=SETTINGS.offload_checkpoints, tiled_mlp=switches.mlp, tiled_vision=switches.vision,
        mlp_tile_tokens=sized(SETTINGS.mlp_tile_tokens), vision_tile_patches=sized(SETTINGS.vision_tile_patches),
        recompute_norms=switches.norms, frozen_head=frozen, loss_chunk=chunk,
        attention=getattr(model.config, "_attn_implementation", None) or "sdpa")


def row_of_call(call: dict, tokens: int, samples: list, merge: int):
    """The plan's `Row` of this forward: its real tokens, its vision tokens and patches from the grids, the longest
    temporal group (one vision attention), its samples."""
    from .planning import Row

    grids = [call[k] for k in ("image_grid_thw", "video_grid_thw") if torch.is_tensor(call.get(k))]
    patches = sum(int(g.prod(-1).sum()) for g in grids)
    per_item = max((int((g[:, 1] * g[:, 2]).max()) for g in grids if g.numel()), default=0)
    longest = max((b - a for a, b in samples), default=tokens)
    return Row(tokens=tokens, vision_tokens=patches // merge**2, sample_tokens=longest, patches_per_item=per_item,
               samples=max(1, len(samples)))


def predicted_peak(dims, row, training, size: int, ulysses: int) -> float:
    """Bytes of the step's activations on the busiest rank, by the plan (`planning.activation_memory`)."""
    from .planning import CALIBRATED, activation_memory

    return activation_memory(dims, row, training, CALIBRATED, size, ulysses).total


def candidates(helps_chunk: bool = True) -> list[Switches]:
    """The sets the explicit settings allow, cheapest first."""
    free = [n for n in SWITCHES if explicit(n) is None and (n != "loss_chunk" or helps_chunk)]
    forced = {n: bool(explicit(n)) for n in SWITCHES if explicit(n) is not None}
    sets = []
    for mask in range(2 ** len(free)):
        chosen = {n: bool(mask >> i & 1) for i, n in enumerate(free)}
        sets.append(Switches(**forced, **chosen))
    return sorted(sets, key=Switches.cost)


# ---------------------------------------------------------------------------------------------------------------
# The room


def local_room(model, device: torch.device) -> float | None:
    """Bytes this rank's step may use (module docstring, 2.), or None where no limit is known."""
    budget = SETTINGS.device_memory_gib * GIB
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free, total = (min(free, budget), budget) if budget else (free, total)
    elif budget:
        free, total = budget, budget
    else:
        return None
    pending = sum(_local_numel(p) * p.element_size() for p in model.parameters()
                  if p.requires_grad and p.grad is None)
    return free - margin() * total - (pending if torch.is_grad_enabled() else 0)


def _local_numel(param: torch.Tensor) -> int:
    """The elements this rank holds of a parameter (an FSDP2 DTensor's local shard; a ZeRO-3 partition has none)."""
    local = getattr(param, "to_local", None)
    return local().numel() if callable(local) else param.numel()


def margin() -> float:
    """The share of the device's memory kept free (`MARGIN`)."""
    from . import planning

    return getattr(planning, "DEVICE_MARGIN", MARGIN)


def agreed_room(room: float | None, cp) -> float | None:
    """The smallest room of the CP group (None on every rank where none knows a limit): one all-reduce of one number,
    through the package's collective wrapper."""
    from .collectives.communication import communicate

    value = torch.tensor([math.inf if room is None else room], dtype=torch.float64)
    if cp.group is not None and cp.size > 1:
        communicate("all-reduce", cp.group, 1,
                    lambda: dist.all_reduce(value, op=dist.ReduceOp.MIN, group=cp.group))
    least = float(value[0])
    return None if math.isinf(least) else least


# ---------------------------------------------------------------------------------------------------------------
# The choice


def choose(dims, row, base, size: int, ulysses: int, room: float | None) -> tuple[Switches, float, str]:
    """The cheapest allowed set whose predicted peak fits `room` (module docstring, 3.): (switches, peak, why)."""
    from .loss import chunk_tokens

    local = math.ceil(row.tokens / size)
    sets = candidates(chunk_tokens(local, dims.hidden, dims.vocab) > SMALL_LOSS_CHUNK)
    untiled = predicted_peak(dims, row, _with(base, sets[0]), size, ulysses)
    if room is None:
        return sets[0], untiled, "no memory limit known (on a CPU: VLMCP_DEVICE_MEMORY_GIB), nothing on by need"
    for s in sets:  # priced one after the other, cheapest first: a roomy row prices one set only
        peak = untiled if s is sets[0] else predicted_peak(dims, row, _with(base, s), size, ulysses)
        if peak <= room:
            by_need = [LABELS[n] for n in s.on() if explicit(n) is None]
            if not by_need:
                return s, peak, "the row fits without switches"
            return s, peak, (f"without them {size_text(untiled)} > {size_text(room)}: "
                             f"{', '.join(by_need)} on, the cheapest set that fits")
    raise UnsupportedSetupError(refusal(dims, row, base, size, ulysses, room, (sets[-1], peak)))


def _with(base, s: Switches):
    chunk = SETTINGS.loss_chunk_tokens or (SMALL_LOSS_CHUNK if s.loss_chunk else 0)
    return replace(base, tiled_mlp=s.mlp, tiled_vision=s.vision, recompute_norms=s.norms, loss_chunk=chunk)


def _scaled(row, factor: float):
    from .planning import Row

    tokens = max(1, int(row.tokens * factor))
    return Row(tokens=tokens, vision_tokens=int(row.vision_tokens * factor),
               sample_tokens=min(tokens, max(1, int(row.longest_sample * factor))),
               patches_per_item=row.patches_per_item, samples=row.samples)


def longest_fitting(dims, row, training, size: int, ulysses: int, room: float) -> int:
    """The longest row of this row's proportions (text and vision alike) that fits `room` with `training`: tokens,
    to within 1 %."""
    fits = lambda f: predicted_peak(dims, _scaled(row, f), training, size, ulysses) <= room  # noqa: E731
    low, high = 0.0, 1.0
    while low == 0.0 and high > 1e-6:
        if fits(high):
            low = high
        else:
            high /= 2
    if low == 0.0:
        return 0
    high = 2 * low
    while fits(high):
        low, high = high, 2 * high
    while high - low > 0.01 * low:
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return int(row.tokens * low)


def refusal(dims, row, base, size: int, ulysses: int, room: float, best: tuple[Switches, float]) -> str:
    """Why the row cannot run and what would: the longest row that fits as set, the switches or P that fit it."""
    from .planning import package_ulysses

    switches, peak = best
    everything = _with(base, best[0])
    ways = []
    blocked = [n for n in SWITCHES if explicit(n) is False]
    if blocked:
        opened = replace(switches, **{n: True for n in blocked})
        if predicted_peak(dims, row, _with(base, opened), size, ulysses) <= room:
            ways.append(" and ".join(f"{VARIABLES[n]}=auto" for n in blocked))
    if base.gradient_checkpointing and not base.offload_checkpoints:
        if predicted_peak(dims, row, replace(everything, offload_checkpoints=True), size, ulysses) <= room:
            ways.append("VLMCP_OFFLOAD_CHECKPOINTS=1")
    if not base.gradient_checkpointing:
        if predicted_peak(dims, row, replace(everything, gradient_checkpointing=True), size, ulysses) <= room:
            ways.append("gradient checkpointing (model.gradient_checkpointing_enable())")
    for larger in (2 * size, 4 * size, 8 * size, 16 * size, 32 * size, 64 * size):
        if predicted_peak(dims, row, everything, larger, package_ulysses(dims, larger)) <= room:
            ways.append(f"P={larger} (VLMCP_CP_SIZE={larger})")
            break
    longest = longest_fitting(dims, row, everything, size, ulysses, room)
    on = ", ".join(LABELS[n] for n in switches.on()) or "no switches"
    return (f"this row does not fit the device at P={size}: {row.tokens:,} tokens ({row.patches(dims):,} vision "
            f"patches) need {size_text(peak)} per rank for the step with {on}, and {size_text(room)} are free "
            f"after a {margin():.0%} margin and the gradients to come (the smallest room in the CP group; "
            f"VLMCP_DEVICE_MEMORY_GIB caps it). The longest row of its kind that fits as set: {longest:,} tokens. "
            + (f"This row would fit with {' or '.join(ways)}." if ways else "Nothing the package can switch fits it."))


def choose_switches(model, call: dict, ctx) -> Choice:
    """The switches of this CP forward (module docstring), in effect until the next CP forward; logged by rank 0 of
    the group at the first one and when they change. Raises `UnsupportedSetupError` on every rank when the row
    cannot fit. Called by every rank of the group at the same point (one all-reduce)."""
    from .distributed import data_parallel_world_size
    from .planning import dims_from_config

    if STATE.choice is not None and not torch.is_grad_enabled():
        # a forward without a graph (a reference model's, an evaluation) keeps the choice a training forward's backward
        # may still recompute with; the same on every rank of the group (the same code runs there), no all-reduce
        return STATE.choice
    room = agreed_room(local_room(model, _device_of(model)), ctx.cp)
    dims = _dims(model, dims_from_config)
    merge = dims.merge
    row = row_of_call(call, ctx.seq_len, ctx.segments, merge)
    split = ctx.split
    base = training_of(model, Switches())
    switches, peak, why = choose(dims, row, base, ctx.cp.size, split.ulysses, room)
    choice = Choice(switches=switches, explicit=tuple(n for n in SWITCHES if explicit(n) is not None), why=why,
                    peak=peak, room=room, tokens=row.tokens, patches=row.patches(dims), size=ctx.cp.size,
                    ulysses=split.ulysses, ring=split.ring, replicas=data_parallel_world_size())
    STATE.choice = choice
    if ctx.cp.rank == 0 and STATE.logged != switches:
        STATE.logged = switches
        LOGGER.warning("%s", choice.line())
    return choice


def _device_of(model) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _dims(model, dims_from_config):
    """The plan's dimensions of the live model, once per model (its config does not change)."""
    dims = getattr(model, "_vlmcp_plan_dims", None)
    if dims is None:
        dims = dims_from_config(model.config, getattr(model, "name_or_path", "") or "model")
        model._vlmcp_plan_dims = dims
    return dims


def facts() -> dict:
    """The choice for the HF Trainer's logs (`callback.py`): the switches on (1 / 0) and the predicted peak."""
    choice = STATE.choice
    if choice is None:
        return {}
    return {**{f"cp_{name}_on": int(getattr(choice.switches, name)) for name in SWITCHES},
            "cp_predicted_peak_gib": round(choice.peak / GIB, 3)}
