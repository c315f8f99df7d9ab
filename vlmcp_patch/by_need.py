"""Switches chosen by need: the plan at run time.

The memory switches — a smaller chunk of the fused head, the vision features on the host (with the checkpoint offload
on), the RMSNorms recomputed, the vision tower in tiles, the MLPs
in tiles — are exact, but each costs time: on one H200 the MLP in tiles took x1.401 of its stock time and the RMSNorm
recomputed x1.415 of its own (docs/testing.md, sections 9 and 10). A row that fits without them should not pay that.

At every CP forward, before any compute (`choose_switches`, called by `forward.top_level.enter_cp_forward`):

1. the row is priced with the plan's own model (`planning.activation_memory`, what `python -m vlmcp_patch plan`
   prices on top of the weights and optimizer): the live model's dimensions (`planning.model_dims` of its config),
   the row's tokens and vision patches, P and this forward's U x R, gradient checkpointing as the model has it, the
   checkpoint offload as set;
2. the room is read: the free device memory (`torch.cuda.mem_get_info`, plus what torch's allocator holds unused),
   capped by `VLMCP_DEVICE_MEMORY_GIB` where set (on a CPU that budget is the only limit: without it nothing is
   switched on by need), less a margin (the plan's `DEVICE_MARGIN` of the device's memory) and less the parameter gradients still to
   come (trained parameters without a `.grad` yet: the backward allocates them beside the activations). Beside it the
   host's room for a set that parks the vision features (`local_host_room`: `VLMCP_HOST_MEMORY_GIB`, else on an
   accelerator the node's `MemAvailable` shared by its ranks plus what this rank's checkpoint pool already holds;
   on a CPU no limit), against the pool and the parked features that set asks (`host_need`). The ranks agree on the
   smallest rooms in the group: one all-reduce of two numbers, issued by every rank at every CP forward, so no rank
   tiles or parks alone;
3. among the sets the explicit settings allow (an explicit `VLMCP_MLP_TILE_TOKENS`, `VLMCP_RECOMPUTE_NORMS`,
   `VLMCP_VISION_TILE_PATCHES`, `VLMCP_LOSS_CHUNK` always wins), the cheapest whose predicted peak fits the room is
   taken: `SWITCHES` lists them cheapest first, and a set costs more than every set of cheaper switches only (the
   MLP tiles alone cost more than the other three together). A row that fits with none runs stock-fast, untiled.
   A set that parks the features where the host cannot hold them is passed over (the choice says so). A row that
   does not fit with every allowed switch raises on every rank before compute, naming the longest row that fits and
   the P or settings that would fit this one — or, where only the host is short, the host's need and room;
4. the replicas agree (`agreed_over_replicas`): a tiled MLP or a recomputed norm delivers its weights' gradients at
   other points of the backward than stock, and ZeRO-1/2 fill their buckets in that arrival order, so every rank
   whose gradients are reduced together must run the same of those switches (`ORDERED`; the vision tiles are not
   among them: `vision_tiles.one_order_required`). The union over the world (the data-parallel replicas of the CP
   groups: the ranks DDP, DeepSpeed and FSDP2 reduce over) is taken: one all-reduce (MAX) of four numbers, issued
   by every rank in every CP forward of a data-parallel step with a graph (`replica_step`: a wrapper's forward,
   which every replica runs together; a forward some replicas run alone agrees nothing over the world), after the
   group's room's (one collective could serve both — every rank's fit of every set at its group's slot, MIN over
   the world — but it would price every set at every forward, where the cheapest-first pricing stops at the first
   set that fits). A switch the union brings can raise a row's peak, so each replica prices its row under the union
   (`fit_the_union`: the cheapest allowed set with the union's ordered switches) and one more MAX over the world
   says whether any replica's does not fit: then every rank of every replica raises. A replica whose row is refused
   says so in the first all-reduce: every rank of every replica raises, none waits in a gradient reduction. The
   fused head's chunk is left per group: the head's gradient arrives at one point whatever its chunk, and a small
   chunk forced onto a row whose automatic chunk is smaller would cost memory. The tiled functions run whenever their
   switch is on, one tile included (`tiles.py`), so the switches alone set the arrival order, not the rows.

Deciding at every forward with a graph (not only the first; a forward without one runs with the last choice, no
collective) costs one all-reduce of two numbers (the rooms) in the group, four numbers' over the world (in a
data-parallel step) and a few microseconds of arithmetic, and follows what the first step cannot see: an optimizer
that creates its states at its first step leaves less room from the second forward on, and a longer row later is
priced as itself. Every rank of a group has the same row (the agreement checks it) and the same agreed room, so every
rank takes the same decision.

The choice returned is the forward's own: the forward freezes it into its `CPContext`, and everything that forward
built reads it there, in forward and in its recomputation in backward (`switches.py`), whatever a later forward chose.

Rank 0 of each CP group logs one line (logger "vlmcp_patch", WARNING: shown by Python's default handler, the HF
Trainer's and the CLIs' log configurations alike) at the first CP forward, and again at a change of the choice, at
most once per `LOG_EVERY` forwards, counting the changes (`ChoiceLog`).
At P=1 nothing is decided: only explicit switches act there (`in_effect`), and the first that does logs one line.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from .collectives.communication import all_reduced
from .errors import UnsupportedSetupError
from .offload import offload_in_effect
from .replica_step import (
    DOES_NOT_FIT,
    ORDERED,
    RAISED,
    Stopped,
    agreed_over_replicas,
    agrees_over_replicas,
    max_over_world,
)
from .settings import SETTINGS
from .switches import (  # noqa: F401 (the state and the switches' names, read through this module by its users)
    CHOOSER,
    GIB,
    LABELS,
    LOGGER,
    SMALL_LOSS_CHUNK,
    STATE,
    SWITCHES,
    VARIABLES,
    Choice,
    Switches,
    checkpoints_carry_the_choice,
    explicit,
    in_effect,
    loss_chunk_tokens,
    size_setting,
    size_text,
)

# ---------------------------------------------------------------------------------------------------------------
# Pricing: the plan's model of the live model and row


def training_of(model, switches: Switches):
    """The plan's `Training` of this step: checkpointing as the model has it, the checkpoint offload in effect (the
    package's or transformers' `offload=True`), the sharding the parameters show (ZeRO-3, FSDP2, else whole), the head
    frozen or not, and the switches (explicit sizes kept)."""
    from .distributed import data_parallel_world_size
    from .planning import Training
    from .sharding import fsdp2_units_within, zero3_partitioned

    params = list(model.parameters())
    sharding = "zero3" if zero3_partitioned(model) else "fsdp" if fsdp2_units_within(model) else "none"
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    head = getattr(model, "lm_head", None)
    frozen = head is not None and not any(p.requires_grad for p in head.parameters())
    sized = lambda value: value if isinstance(value, int) and value > 0 else None
    chunk = SETTINGS.loss_chunk_tokens or (SMALL_LOSS_CHUNK if switches.loss_chunk else 0)  # 0: the automatic rule
    return Training(
        sharding=sharding, gradient_checkpointing=checkpointing,
        dp=data_parallel_world_size(), bytes_per_value=_compute_bytes(params),
        offload_checkpoints=offload_in_effect(model) is not None, tiled_mlp=switches.mlp, tiled_vision=switches.vision,
        mlp_tile_tokens=sized(SETTINGS.mlp_tile_tokens), vision_tile_patches=sized(SETTINGS.vision_tile_patches),
        recompute_norms=switches.norms, frozen_head=frozen, loss_chunk=chunk, park_features=switches.features,
        attention=getattr(model.config, "_attn_implementation", None) or "sdpa")


def _compute_bytes(params: list) -> int:
    """Bytes per activation value: autocast's dtype where it is on (fp32 weights under bf16 mixed precision compute in
    bf16), else the weights'."""
    if not params:
        return 2
    kind = params[0].device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind).itemsize
    return params[0].element_size()


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


def predicted(dims, row, training, size: int, ulysses: int):
    """The plan's `Memory` of the step on the busiest rank (`planning.activation_memory`)."""
    from .planning import CALIBRATED, activation_memory

    return activation_memory(dims, row, training, CALIBRATED, size, ulysses)


def predicted_peak(dims, row, training, size: int, ulysses: int) -> float:
    """Bytes of the step's activations on the busiest rank, by the plan (`planning.activation_memory`)."""
    return predicted(dims, row, training, size, ulysses).total


def host_need(memory, switches: Switches) -> float:
    """Host bytes a set asks of this rank where it parks the vision features by need: the checkpoint pool as
    allocated and the parked features (`Memory.host_pool`, `Memory.host_features`); 0 for a set that keeps them on
    the device, or parks them because `VLMCP_OFFLOAD_FEATURES=1` says so (explicit settings win; the pool is the
    explicit checkpoint offload's)."""
    parked_by_need = switches.features and explicit("features") is None
    return memory.host_pool + memory.host_features if parked_by_need else 0.0


def _host_short(memory, switches: Switches, host_room: float | None) -> bool:
    return host_room is not None and host_need(memory, switches) > host_room


def candidates(helps_chunk: bool = True) -> list[Switches]:
    """The sets the explicit settings allow, cheapest first."""
    free = [n for n in SWITCHES if explicit(n) is None and (n != "loss_chunk" or helps_chunk)
            and (n != "features" or SETTINGS.offload_checkpoints)]  # by need, only where the host pool is opted in
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


def local_host_room(device: torch.device) -> float | None:
    """Host bytes this rank's checkpoint pool and parked features may take, or None where no limit is known:
    `VLMCP_HOST_MEMORY_GIB` where set; on an accelerator the node's available memory (`MemAvailable`) shared by its
    ranks (the launcher's count for this very node, `launcher.Launch.ranks_on_this_node`: on SLURM's uneven `8,4` a
    rank of the first node gets an eighth, not the quarter the layout's node size would give), plus what this rank's
    pool already holds (allocated, so not available); on a CPU none."""
    budget = SETTINGS.host_memory_gib * GIB
    if budget:
        return budget
    available = _mem_available() if device.type != "cpu" else None
    if available is None:
        return None
    from .distributed import distributed_ready, node_size
    from .launcher import launch
    from .offload import HOST_CHECKPOINTS

    # no launcher stating this node's count: the nodes the ranks' host names agreed on (equal, so the layout's node
    # size is this node's count); one host name: every rank of the world is on this node
    ranks = launch().ranks_on_this_node or node_size() or (dist.get_world_size() if distributed_ready() else 1)
    return available / max(1, ranks) + HOST_CHECKPOINTS.pool.reserved


def _mem_available() -> float | None:
    """Bytes available for new allocations without swapping: the kernel's estimate (`/proc/meminfo` `MemAvailable`),
    within this process's cgroup's limit where one is set (a container's: v2 `memory.max` less `memory.current`,
    v1 `memory.limit_in_bytes` less `memory.usage_in_bytes`); None where the kernel's cannot be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = float(line.split()[1]) * 1024
    except OSError:
        return None
    if available is None:
        return None
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                cap, used = f.read().strip(), g.read().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit():
            available = min(available, float(int(cap) - int(used)))
        break
    return available


def _local_numel(param: torch.Tensor) -> int:
    """The elements this rank holds of a parameter (an FSDP2 DTensor's local shard; a ZeRO-3 partition has none)."""
    local = getattr(param, "to_local", None)
    return local().numel() if callable(local) else param.numel()


def margin() -> float:
    """The share of the device's memory kept free: the plan's own margin, so `plan` and the run agree."""
    from .planning.hardware import DEVICE_MARGIN

    return DEVICE_MARGIN


def agreed_rooms(room: float | None, host_room: float | None, cp,
                 device: torch.device) -> tuple[float | None, float | None]:
    """The smallest device room and host room of the CP group (each None on every rank where none knows a limit):
    one all-reduce of two numbers (`all_reduced`)."""
    least = [math.inf if r is None else r for r in (room, host_room)]
    if cp.group is not None and cp.size > 1:
        least = all_reduced(least, dist.ReduceOp.MIN, cp.group, device)
    return tuple(None if math.isinf(r) else r for r in least)


# ---------------------------------------------------------------------------------------------------------------
# The choice


def choose(dims, row, base, size: int, ulysses: int, room: float | None,
           host_room: float | None = None) -> tuple[Switches, float, str]:
    """The cheapest allowed set whose predicted peak fits `room` and, where it parks the vision features, whose host
    need (`host_need`) fits `host_room` (module docstring, 3.): (switches, peak, why)."""
    from .loss import chunk_tokens

    local = math.ceil(row.tokens / size)
    sets = candidates(chunk_tokens(local, dims.hidden, dims.vocab) > SMALL_LOSS_CHUNK)
    first = predicted(dims, row, _with(base, sets[0]), size, ulysses)
    untiled = first.total
    if room is None and not _host_short(first, sets[0], host_room):  # sets[0] parks nothing by need: never short
        return sets[0], untiled, "no memory limit known (on a CPU: VLMCP_DEVICE_MEMORY_GIB), nothing on by need"
    short_of_host = None  # (host need, host room) of the cheapest set that fits the device but not the host
    for s in sets:  # priced one after the other, cheapest first: a roomy row prices one set only
        memory = first if s is sets[0] else predicted(dims, row, _with(base, s), size, ulysses)
        peak = memory.total
        if room is not None and peak > room:
            continue
        if _host_short(memory, s, host_room):
            short_of_host = short_of_host or (host_need(memory, s), host_room)
            continue
        by_need = [LABELS[n] for n in s.on() if explicit(n) is None]
        host = (f" ({LABELS['features']} would need {size_text(short_of_host[0])} of the host, whose room for "
                f"them is {size_text(short_of_host[1])})") if short_of_host else ""
        if not by_need:
            return s, peak, "the row fits without switches" + host
        return s, peak, (f"without them {size_text(untiled)} > {size_text(room)}: "
                         f"{', '.join(by_need)} on, the cheapest set that fits{host}")
    raise UnsupportedSetupError(refusal(dims, row, base, size, ulysses, room, (sets[-1], peak), short_of_host))


def _with(base, s: Switches):
    chunk = SETTINGS.loss_chunk_tokens or (SMALL_LOSS_CHUNK if s.loss_chunk else 0)
    return replace(base, tiled_mlp=s.mlp, tiled_vision=s.vision, recompute_norms=s.norms, loss_chunk=chunk,
                   park_features=s.features)


def _scaled(row, factor: float):
    from .planning import Row

    tokens = max(1, int(row.tokens * factor))
    return Row(tokens=tokens, vision_tokens=int(row.vision_tokens * factor),
               sample_tokens=min(tokens, max(1, int(row.longest_sample * factor))),
               patches_per_item=row.patches_per_item, samples=row.samples)


def longest_fitting(dims, row, training, size: int, ulysses: int, room: float) -> int:
    """The longest row of this row's proportions (text and vision alike) that fits `room` with `training`: tokens,
    to within 1 %."""
    fits = lambda f: predicted_peak(dims, _scaled(row, f), training, size, ulysses) <= room
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


def refusal(dims, row, base, size: int, ulysses: int, room: float | None, best: tuple[Switches, float],
            short_of_host: tuple[float, float] | None = None) -> str:
    """Why the row cannot run and what would: the longest row that fits as set, the switches or P that fit it; or,
    where the only sets that fit the device park the vision features and the host cannot hold them
    (`short_of_host`: their host need and the host's room), that."""
    from .planning import package_ulysses

    if short_of_host is not None:
        need, free = short_of_host
        source = ("VLMCP_HOST_MEMORY_GIB" if SETTINGS.host_memory_gib else
                  "the node's available memory shared by its ranks, within its cgroup's limit")
        return (f"this row fits the device at P={size} only with the vision features parked on the host "
                f"({LABELS['features']}), and the host cannot hold them: this rank's checkpoint pool and parked "
                f"features need {size_text(need)}, and the host's room for them is {size_text(free)} (the smallest "
                f"in the CP group; from {source}). Free host memory (fewer DataLoader workers, a smaller prefetch, "
                "the optimizer kept on the device), or raise P.")

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
        # any allowed set, not only all of them: a share of one tile at a larger P is cheaper untiled
        if any(predicted_peak(dims, row, _with(base, s), larger, package_ulysses(dims, larger)) <= room
               for s in candidates()):
            ways.append(f"P={larger} (VLMCP_CP_SIZE={larger})")
            break
    longest = longest_fitting(dims, row, everything, size, ulysses, room)
    on = ", ".join(LABELS[n] for n in switches.on()) or "no switches"
    return (f"this row does not fit the device at P={size}: {row.tokens:,} tokens ({row.patches(dims):,} vision "
            f"patches) need {size_text(peak)} per rank for the step with {on}, and {size_text(room)} are free "
            f"after a {margin():.0%} margin and the gradients to come (the smallest room in the CP group; "
            f"VLMCP_DEVICE_MEMORY_GIB caps it). The longest row of its kind that fits as set: {longest:,} tokens. "
            + (f"This row would fit with {' or '.join(ways)}." if ways else "Nothing the package can switch fits it."))


def fit_the_union(dims, row, base, size: int, ulysses: int, room: float | None, union: Switches,
                  host_room: float | None = None) -> tuple[Switches, float, bool]:
    """(switches, peak, whether they fit `room`) for this replica's row under the replicas' union of the `ORDERED`
    switches: the cheapest allowed set with exactly the union's `ORDERED` switches (the head's chunk and the features
    on the host free per group). A switch the union brings can raise this row's peak — a tower of one tile keeps its
    blocks' activations, where the untiled tower keeps only their checkpoints — so the union is priced, not assumed
    to fit."""
    ordered = {n: getattr(union, n) for n in ORDERED}
    sets = [s for s in candidates() if all(getattr(s, n) == v for n, v in ordered.items())] or [union]
    peak = math.inf
    for s in sets:
        memory = predicted(dims, row, _with(base, s), size, ulysses)
        peak = memory.total
        if (room is None or peak <= room) and not _host_short(memory, s, host_room):
            return s, peak, True
    return sets[-1], peak, False


def _replica(replica: int, size: int) -> str:
    """A data-parallel replica and its ranks (blocks of P consecutive ranks), for the messages."""
    return f"replica {replica} (ranks {replica * size}..{(replica + 1) * size - 1})"


def union_does_not_fit(replica: int, size: int, union: Switches, peak: float | None, room: float | None) -> str:
    where = (f": {size_text(peak)} for the step against {size_text(room)} free after the margin"
             if peak is not None and room is not None else "")
    together = ", ".join(LABELS[n] for n in ORDERED if getattr(union, n)) or "none"
    return (f"the switches every data-parallel replica must run together ({together}: their union, so that the "
            f"replicas' gradients arrive in one order) do not fit the row of {_replica(replica, size)}{where}. Every "
            "replica stops before compute. Set the switches the same on every replica (VLMCP_MLP_TILE_TOKENS, "
            "VLMCP_RECOMPUTE_NORMS, VLMCP_VISION_TILE_PATCHES), give that replica rows the switches suit, or raise P.")


def another_replica_stopped(stopped: Stopped, size: int) -> str:
    why = ("does not fit the device (its ranks raise with the longest row that fits and what would fit it)"
           if stopped.cause == DOES_NOT_FIT else "raised an error before compute (its ranks raise it: see their log)")
    return (f"the row of data-parallel {_replica(stopped.replica, size)} {why}: every replica stops before compute, "
            "as its gradients would be reduced with this replica's")


def choose_switches(model, call: dict, ctx, device: torch.device) -> Choice | None:
    """The switches of this CP forward (module docstring), returned for the forward to freeze into its context
    (`CPContext.choice`); logged by rank 0 of the group at the first one and when they change. Raises
    `UnsupportedSetupError` on every rank of every replica when a replica's row cannot fit (of its group only in a
    forward without a graph). Called by every rank of the world at the same point of each CP forward (one all-reduce
    over the group; one over the world with replicas and a graph; on `device`: the batch's, where the group's
    collectives run). None at P=1."""
    from .distributed import data_parallel_world_size
    from .planning import dims_from_config

    if ctx.cp.size == 1:
        return None  # a packed row at P=1 takes the package's path: no switch acts there by need, nothing to price
    checkpoints_carry_the_choice(model)  # a checkpointed layer is recomputed under its own forward's choice
    if STATE.choice is not None and not torch.is_grad_enabled():
        # a forward without a graph (a reference model's, an evaluation) runs with the last choice, agreed by every
        # replica; the same on every rank of the world (the same code runs there), no all-reduce
        return STATE.choice
    room, host_room = agreed_rooms(local_room(model, device), local_host_room(device), ctx.cp, device)
    dims = _dims(model, dims_from_config)
    merge = dims.merge
    row = row_of_call(call, ctx.seq_len, ctx.segments, merge)
    split = ctx.split
    base = training_of(model, Switches())
    refusal, stopped = None, 0
    try:
        own, peak, why = choose(dims, row, base, ctx.cp.size, split.ulysses, room, host_room)
    except Exception as error:  # said to the other replicas first, then raised
        own, peak, why, refusal = Switches(), math.inf, "", error
        stopped = DOES_NOT_FIT if isinstance(error, UnsupportedSetupError) else RAISED
    together = agrees_over_replicas(model)
    switches, other = agreed_over_replicas(own, stopped, device) if together else (own, None)
    if refusal is not None:
        raise refusal
    if other is not None:
        raise UnsupportedSetupError(another_replica_stopped(other, ctx.cp.size))
    if together:
        switches, peak = check_the_union_fits(dims, row, base, ctx, room, own, switches, peak, device, host_room)
    if switches != own:
        added = ", ".join(LABELS[n] for n in switches.on() if n not in own.on())
        why = (f"{why}; {added} on as another replica's row needs them (the replicas' gradients are reduced "
               "together, in one order)")
    choice = Choice(switches=switches, explicit=tuple(n for n in SWITCHES if explicit(n) is not None), why=why,
                    peak=peak, room=room, tokens=row.tokens, patches=row.patches(dims), size=ctx.cp.size,
                    ulysses=split.ulysses, ring=split.ring, replicas=data_parallel_world_size(),
                    offload=offload_in_effect(model))
    STATE.choice = choice
    if ctx.cp.rank == 0 and (note := CHOICE_LOG.note(switches)) is not None:
        LOGGER.warning("%s%s", choice.line(), note)
    return choice


# Forwards between two lines at most, once the first has been logged: rows of alternating lengths change the choice at
# every step, and a line per step would bury the run's log.
LOG_EVERY = 100


class ChoiceLog:
    """When rank 0 of a group logs the choice: at the first CP forward, then at a change of the switches once
    `LOG_EVERY` forwards have passed since the last line (a change sooner waits for that), the line then counting
    the changes since the last one. The Trainer's logs carry the switches of every logging step (`facts`)."""

    def __init__(self):
        self.since_line = 0  # forwards since the last line
        self.changes = 0  # changes of the switches since the last line
        self.seen: Switches | None = None  # the last forward's switches

    def note(self, switches: Switches) -> str | None:
        """Whether this forward, running `switches`, logs the line: None, or what follows the line ("" for the
        first; else the count of changes)."""
        first = STATE.logged is None
        self.since_line += 1
        if self.seen is not None and switches != self.seen:
            self.changes += 1
        self.seen = switches
        if not first and (self.changes == 0 or self.since_line < LOG_EVERY):
            return None
        note = "" if first else f" ({self.changes} change{'s' if self.changes != 1 else ''} of the switches in the " \
            f"last {self.since_line} CP forwards; at most one line per {LOG_EVERY})"
        STATE.logged, self.since_line, self.changes = switches, 0, 0
        return note


CHOICE_LOG = ChoiceLog()


def check_the_union_fits(dims, row, base, ctx, room: float | None, own: Switches, union: Switches, own_peak: float,
                         device: torch.device, host_room: float | None = None) -> tuple[Switches, float]:
    """(this replica's switches under the replicas' union, their predicted peak) (`fit_the_union`; `own` and
    `own_peak` where the union adds nothing), or `UnsupportedSetupError` on every rank of every replica when the union
    fits some replica's row nowhere: one more MAX over the world (1 + the index of a replica that overflows), issued
    by every rank after the agreement, whether its own set changed or not."""
    from .distributed import data_parallel_rank

    switches, peak, fits = (own, own_peak, True) if union == own else \
        fit_the_union(dims, row, base, ctx.cp.size, ctx.split.ulysses, room, union, host_room)
    (overflow,) = max_over_world([0.0 if fits else data_parallel_rank() + 1.0], device)
    if overflow:
        replica = int(overflow) - 1
        mine = replica == data_parallel_rank()
        raise UnsupportedSetupError(union_does_not_fit(replica, ctx.cp.size, union, peak if mine else None,
                                                       room if mine else None))
    return switches, peak


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


CHOOSER[:] = [choose_switches]  # the forward asks through `switches.choose_switches`
