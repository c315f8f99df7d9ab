"""The data-parallel step: the forwards every replica runs together, the only place collectives over the world run.

Two things are agreed over the world, not only over a CP group: the memory switches that set when a parameter's
gradient arrives, with whether a replica stopped before compute (`agreed_over_replicas`), and the modalities some
replica encodes, so that the others run a
placeholder pass (`integrations.vision_placeholder`). Such a collective is matched only where every replica issues
it. A forward that some replicas run alone — an evaluation or a sample generation on rank 0, a callback, a logging
hook, a reference model — would wait in it forever. So it runs only inside a data-parallel step (`replica_step`):
a forward that every replica runs at the same point because the wrapper driving it needs them all there —

- `DistributedDataParallel`'s forward, with gradients (their reduction pairs every replica's buckets);
- a DeepSpeed engine's forward (`integrations.deepspeed` marks it), with gradients, and without at ZeRO-3;
- a model holding ZeRO-3 partitions or FSDP2 units, with or without gradients: its weights are gathered over the
  replicas at each call, so stock already needs every replica there;
- a block the user marks with `vlmcp_patch.data_parallel_step()`: a raw loop's own reduction over the replicas.

Outside one, a forward runs as its replica's own: nothing is matched across replicas and nothing needs to be (no
wrapper reduces or gathers for it), and its switches are its CP group's choice.

`arrival_order`: the wrapper reduces gradients in the order they arrive. DeepSpeed's ZeRO optimizers fill their
buckets that way and reduce each bucket's flat buffer across ranks, so every replica must deliver its parameters'
gradients in one order, whatever its row holds: the decoder's ordered switches are agreed, and every call of a vision
tower runs through one recomputed function (`vision_tiles.one_order_required`). DDP's buckets are fixed and reduced
in their own order, and FSDP2 reduces per unit: there the order does not matter.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .collectives.communication import all_reduced
from .distributed import data_parallel_rank, data_parallel_world_size, world_group
from .flags import scoped
from .sharding import fsdp2_units_within, zero3_partitioned
from .switches import Switches


@dataclass(frozen=True)
class ReplicaStep:
    """A data-parallel step (module docstring). `gathers`: the wrapper gathers weights per call (every replica runs
    the forward even without gradients); `arrival_order`: it reduces gradients in their arrival order."""

    gathers: bool
    arrival_order: bool


# The step marked by a wrapper's patched forward or by the user (`data_parallel_step`).
_MARKED: contextvars.ContextVar = contextvars.ContextVar("vlmcp_replica_step", default=None)

DEEPSPEED_STEP = ReplicaStep(gathers=False, arrival_order=True)
ZERO3_STEP = ReplicaStep(gathers=True, arrival_order=True)
DDP_STEP = ReplicaStep(gathers=False, arrival_order=False)
FSDP2_STEP = ReplicaStep(gathers=True, arrival_order=False)


@contextlib.contextmanager
def data_parallel_step(*, arrival_order: bool = True, gathers: bool = False):
    """Mark the forwards inside the block as a data-parallel step that every replica runs together (module
    docstring): a raw loop that reduces its gradients over the replicas itself. `arrival_order`: that reduction
    packs gradients in the order they arrive (the safe default); `gathers`: its weights are gathered per call."""
    with scoped(_MARKED, ReplicaStep(gathers=gathers, arrival_order=arrival_order)):
        yield


def marked_step(step: ReplicaStep):
    """A context in which the forwards belong to `step` (a wrapper's patched forward)."""
    return scoped(_MARKED, step)


def _active_ddp() -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module() is not None


def replica_step(model: torch.nn.Module) -> ReplicaStep | None:
    """The data-parallel step this forward of `model` belongs to, or None where it runs as its replica's own (module
    docstring). A step that gathers no weights counts only with gradients: without them nothing is reduced, and DDP
    and ZeRO-1/2 let a replica run such a forward alone."""
    step = _MARKED.get()
    if step is None:
        if fsdp2_units_within(model):
            step = FSDP2_STEP
        elif zero3_partitioned(model):
            step = ZERO3_STEP
        elif _active_ddp():
            step = DDP_STEP
    if step is None or (not step.gathers and not torch.is_grad_enabled()):
        return None
    return step


# The switches that set when a parameter's gradient arrives in backward (`by_need`'s module docstring, 4.): the
# replicas agree on them. Not the head's chunk, nor the vision tiles: where the order matters every tower call runs
# through one recomputed function, tiled or not (`vision_tiles.one_order_required`).
ORDERED = ("norms", "mlp")


# Why a replica stopped before compute, as the agreement's all-reduce carries it (the MAX of the codes): its row does
# not fit, or anything else raised in its forward before the agreement (a refused input, an error).
DOES_NOT_FIT, RAISED = 1, 2


@dataclass(frozen=True)
class Stopped:
    """A replica that stopped before compute (the last one, by index) and why (`DOES_NOT_FIT`, `RAISED`)."""

    replica: int
    cause: int


def agreed_over_replicas(switches: Switches, stopped: int, device: torch.device) -> tuple[Switches, Stopped | None]:
    """(`switches` with every `ORDERED` switch any replica runs, the last replica that stopped before compute or None)
    — `by_need`'s module docstring, 4. `stopped`: 0, or why this replica stops (`DOES_NOT_FIT`, `RAISED`). One
    all-reduce (MAX) of four numbers over the world (`distributed.world_group`: every rank, in a group of its own so it
    never interleaves with the wrappers' gradient reductions), through the package's collective wrapper, on
    `device`. Issued by every rank, stopped or not, at the same point; with one replica the CP group has agreed
    already: nothing to issue."""
    if data_parallel_world_size() == 1:
        return switches, Stopped(0, stopped) if stopped else None
    replica = data_parallel_rank() + 1 if stopped else 0  # 1 + the replica's index: the MAX names the last stopped
    flags = max_over_world([*(float(getattr(switches, n)) for n in ORDERED), float(replica), float(stopped)], device)
    union = replace(switches, **{n: bool(flags[i] > 0) for i, n in enumerate(ORDERED)})
    last, cause = int(flags[-2]), int(flags[-1])
    return union, Stopped(last - 1, cause) if last else None


def agrees_over_replicas(model) -> bool:
    """Whether this CP forward of `model` agrees with the other replicas over the world: in a data-parallel step
    (`replica_step`: a forward every replica runs) with a graph. Without a graph no gradient arrives, and a forward
    some replicas run alone (an evaluation on rank 0) would wait in a collective the others never reach."""
    return torch.is_grad_enabled() and data_parallel_world_size() > 1 and replica_step(model) is not None


def tell_the_replicas(model, device: torch.device) -> None:
    """This rank's CP forward of `model` raised before its switches were agreed (its whole group raises: a refused
    input, another batch on another rank, an error in the plan): where the replicas agree (`agrees_over_replicas`),
    issue the agreement the other replicas wait in, saying this replica stopped, so that every rank of every replica
    raises at once (`by_need.another_replica_stopped`) instead of waiting in a gradient reduction. The caller raises."""
    if agrees_over_replicas(model):
        agreed_over_replicas(Switches(), RAISED, device)


def max_over_world(values: list[float], device: torch.device) -> list[float]:
    """The MAX of `values` over every rank of the world (`distributed.world_group`: a group of its own, so it never
    interleaves with the wrappers' gradient reductions; `all_reduced`)."""
    return all_reduced(values, dist.ReduceOp.MAX, world_group(), device)
