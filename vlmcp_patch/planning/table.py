"""The plan: a PlanRow per P and U x R, priced, with its marks (the smallest P that fits, the fastest layout that
fits) and why each row wins or loses."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .dims import model_dims
from .hardware import GIB, Hardware, hardware
from .layouts import candidate_sizes, layouts, package_ulysses
from .host import allowance_bytes
from .memory import Memory, activation_memory, may_park_features, offloaded_optimizer, static_memory
from .rows import Row
from .timing import Time, step_time
from .training import CALIBRATED, Constants, Training


@dataclass
class PlanRow:
    """One (P, U x R) of the plan. `fits`: the predicted peak within the GPU's usable memory less the margin
    (`device_fits`) and the node's host memory holding its ranks' part (`host_fits`); `chosen`: the layout the package
    picks at this P; `smallest` / `fastest`: the marks of the table; `why`: why it loses (or wins)."""

    size: int
    ulysses: int
    ring: int
    nodes: int
    tokens_per_rank: int
    memory: Memory
    time: Time
    fits: bool = False
    chosen: bool = False
    smallest: bool = False
    fastest: bool = False
    why: str = ""
    other_checkpointing_gib: float = 0.0  # the peak with gradient checkpointing switched the other way
    ranks_per_node: int = 1  # this plan's ranks on one node (P x dp, at most the node's GPUs)
    device_fits: bool = False
    host_fits: bool = False
    device_budget_gib: float = 0.0  # what the peak may reach: usable memory less the margin
    host_budget_gib: float = 0.0  # the node's host memory
    host_allowance_gib: float = 0.0  # of the node's host, what is not priced part by part (`host.allowance_bytes`)

    @property
    def peak_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def host_gib_per_node(self) -> float:
        """Host memory one node needs: its ranks' checkpoint pools as allocated, offloaded optimizer and batches, and
        the allowance for the rest."""
        return self.memory.host_total * self.ranks_per_node / GIB + self.host_allowance_gib

    @property
    def binds(self) -> str:
        """What the row overflows: "device", "host", "device and host", or "" when it fits."""
        return " and ".join(k for k, ok in (("device", self.device_fits), ("host", self.host_fits)) if not ok)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_rank / self.time.total if self.time.total else 0.0



def plan(model="qwen3-vl-8b", row: Row | int = 131072, gpu: str | Hardware = "h100", gpus_per_node: int = 8,
         memory_gib: float | None = None, training: Training | None = None, sizes=None, max_gpus: int = 128,
         all_layouts: bool = True, constants: Constants | None = None, **rates) -> list[PlanRow]:
    """The table: a PlanRow per P and per U x R the heads allow (only the package's choice if not `all_layouts`).

    `row`: a Row, or a token count (one text sample). `gpu`: "h100", "h200" or a Hardware; `memory_gib` and
    `rates` (matmul_tflops, attention_tflops, deltanet_tflops, nvlink_gbs, ib_gbs, latency_s; also host_memory_gib,
    margin, usable) override its fields.
    Marks: `smallest` on the package's layout at the smallest P that fits; `fastest` on the row of highest tokens/s
    per GPU among all rows that fit (any P, any layout); every row's `why` says why it wins or loses."""
    dims = model_dims(model)
    row = Row.text(row) if isinstance(row, int) else row
    hw = hardware(gpu, memory_gib, **rates)
    t = training or Training()
    c = constants or CALIBRATED
    rows: list[PlanRow] = []
    flipped = replace(t, gradient_checkpointing=not t.gradient_checkpointing)
    for size in sizes or candidate_sizes(gpus_per_node, max_gpus):
        chosen = package_ulysses(dims, size, gpus_per_node)
        weights, grads, optimizer = static_memory(dims, t, size * t.dp)
        for ulysses, ring in layouts(dims, size):
            if not all_layouts and ulysses != chosen:
                continue
            stepped = features_by_need(dims, row, t, c, size, ulysses, weights + grads + optimizer, hw.device_budget)
            memory = activation_memory(dims, row, stepped, c, size, ulysses)
            memory.weights, memory.gradients, memory.optimizer = weights, grads, optimizer
            memory.host_optimizer = offloaded_optimizer(dims, t, size * t.dp)
            per_node = min(size * t.dp, gpus_per_node)
            allowance = allowance_bytes(per_node, hw.host_memory_gib) / GIB
            other = activation_memory(dims, row, replace(flipped, park_features=stepped.park_features), c, size,
                                      ulysses)
            other.weights, other.gradients, other.optimizer = weights, grads, optimizer
            time = step_time(dims, row, stepped, hw, size, ulysses, gpus_per_node)
            device_fits = memory.total <= hw.device_budget
            host_fits = memory.host_total * per_node / GIB + allowance <= hw.host_memory_gib
            rows.append(PlanRow(size=size, ulysses=ulysses, ring=ring, nodes=-(-size // gpus_per_node),
                                tokens_per_rank=row.tokens // size, memory=memory, time=time,
                                fits=device_fits and host_fits, chosen=ulysses == chosen,
                                other_checkpointing_gib=other.total / GIB, ranks_per_node=per_node,
                                device_fits=device_fits, host_fits=host_fits,
                                device_budget_gib=hw.device_budget / GIB, host_budget_gib=hw.host_memory_gib,
                                host_allowance_gib=allowance))
    mark(rows)
    return rows


def features_by_need(dims, row: Row, t: Training, c: Constants, size: int, ulysses: int, static: float,
                     budget: float) -> Training:
    """`t` with `park_features` decided as the package decides it by need: parked only where the row does not fit the
    device with its features there (parking costs host memory and synchronous copies); as set otherwise."""
    if not may_park_features(t, size):
        return t
    kept = activation_memory(dims, row, replace(t, park_features=False), c, size, ulysses)
    return replace(t, park_features=kept.total + static > budget)


def mark(rows: list[PlanRow]) -> None:
    """The smallest P that fits (the package's layout), the fastest layout that fits, and why each other loses."""
    fitting = [r for r in rows if r.fits and r.chosen]
    smallest = min(fitting, key=lambda r: r.size) if fitting else None
    fastest = max((r for r in rows if r.fits), key=lambda r: r.tokens_per_s_per_gpu, default=None)
    if smallest:
        smallest.smallest = True
    if fastest:
        fastest.fastest = True
    picked = {r.size: r.ulysses for r in rows if r.chosen}
    for r in rows:
        r.why = _why(r, smallest, fastest, picked.get(r.size))


def _why(r: PlanRow, smallest: PlanRow | None, fastest: PlanRow | None, picked: int | None = None) -> str:
    """Why a row wins or loses: what overflows memory, or how much slower per GPU than the fastest and which
    exchange costs it that, and whether the package would pick this layout at this P."""
    if not r.fits and r.device_fits:
        return (f"does not fit the host: {r.host_gib_per_node:.0f} GiB per node of {r.host_budget_gib:.0f}")
    if not r.fits:
        m = r.memory
        parts = {"weights+grads+optimizer": m.weights + m.gradients + m.optimizer,
                 "activations": m.activations + m.forward_only + m.working, "head": m.head,
                 "exchange buffers": m.exchange, "kernel scratch": m.scratch}
        return f"does not fit: {max(parts, key=parts.get)} dominate"
    notes = []
    if r is smallest:
        notes.append("smallest P that fits")
    if r is fastest:
        notes.append("fastest per GPU")
    elif fastest is not None:
        loss = 1 - r.tokens_per_s_per_gpu / fastest.tokens_per_s_per_gpu
        tm = r.time
        parts = {"all-to-all": tm.all_to_all, "ring": tm.ring_overlapped if tm.overlap else tm.ring,
                 "DeltaNet state": tm.deltanet_state,
                 "ZeRO-3 gathers": tm.sharding}
        worst = max(parts, key=parts.get)
        if loss < 0.005:
            notes.append("as fast per GPU as the fastest")
        elif parts[worst] > 0.01 * tm.total:
            notes.append(f"{loss:.0%} slower per GPU: {worst} {parts[worst] / tm.total:.0%} of its step")
        else:
            notes.append(f"{loss:.0%} slower per GPU")
    if not r.chosen:
        notes.append(f"not the package's layout at this P (it takes U={picked})" if picked else
                     "not the package's layout at this P")
    return "; ".join(notes)


def price(model, row: Row | int, size: int, gpu: str | Hardware = "h100", gpus_per_node: int = 8,
          training: Training | None = None, memory_gib: float | None = None, constants: Constants | None = None,
          **rates) -> PlanRow:
    """The one row that answers "what does this row need at P = `size`": the package's layout, its device peak
    (`peak_gib`, by part in `memory`) against the budget (`device_budget_gib`: usable memory less the margin),
    the host per node (`host_gib_per_node`, by part in `memory.host_*` per rank and `host_allowance_gib`) against
    the node's (`host_budget_gib`), `device_fits`, `host_fits`, `binds`. `rates` as `plan`'s (`margin=`,
    `host_memory_gib=`, and at run time `usable=1.0` with `memory_gib` the free memory)."""
    return plan(model, row, gpu=gpu, gpus_per_node=gpus_per_node, memory_gib=memory_gib, training=training,
                sizes=[size], all_layouts=False, constants=constants, **rates)[0]
