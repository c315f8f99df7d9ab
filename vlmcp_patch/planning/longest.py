"""The longest row that fits one node: bisection over the row's length with the plan of the package's layout at P =
the node's GPUs (memory per rank only falls with P, so the whole node is where the longest row fits)."""

from __future__ import annotations

from dataclasses import dataclass

from .dims import model_dims
from .hardware import GIB, Hardware, hardware
from .host import loader_text
from .rows import Row
from .table import PlanRow, plan
from .training import Training

STEP = 1024  # the answer's resolution, tokens


@dataclass(frozen=True)
class Longest:
    """The longest row of a kind that fits one node, and its plan row (None: not even STEP tokens fit); `binds`:
    what a row STEP tokens longer overflows ("device", "host" or both)."""

    tokens: int
    row: PlanRow | None
    binds: str = ""


def row_of(kind: str, tokens: int, dims) -> Row:
    """A text row (one sample) or a video row (448 x 448 frames and a question, `Row.video`) of `tokens`."""
    if kind == "video":
        return Row.video(tokens, patch=dims.patch, merge=dims.merge)
    if kind == "text":
        return Row.text(tokens)
    raise ValueError(f"row kind {kind!r}: video or text")


def longest_row(model, kind: str = "video", gpu: str | Hardware = "h100", gpus_per_node: int = 8,
                training: Training | None = None, memory_gib: float | None = None, constants=None,
                **rates) -> Longest:
    """The longest `kind` row (a multiple of STEP tokens) that fits one node of `gpus_per_node` at P = gpus_per_node
    in the package's layout: its predicted peak within every GPU's usable memory less the margin, and the node's host
    memory holding what its ranks keep there (`rates`: `margin=`, `host_memory_gib=` and the rates of `plan`)."""
    dims = model_dims(model)
    hw = hardware(gpu, memory_gib, **rates)

    def priced(tokens: int) -> PlanRow:
        return plan(dims, row_of(kind, tokens, dims), gpu=hw, gpus_per_node=gpus_per_node, training=training,
                    sizes=[gpus_per_node], all_layouts=False, constants=constants)[0]

    first = priced(STEP)
    if not first.fits:
        return Longest(0, None, first.binds)
    low, high = 1, 2  # in STEPs: low fits, high is to be tried
    while priced(high * STEP).fits:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if priced(middle * STEP).fits else (low, middle)
    return Longest(low * STEP, priced(low * STEP), priced(high * STEP).binds)


ALST_LONGEST = 3.7e6  # DeepSpeed ALST's longest row on one node of 8 H100: Llama-8B, 3.7M tokens (its paper)


def longest_lines(model, kind: str, training: Training, gpus_per_node: int = 8, gpus=("h100", "h200"),
                  breakdown: bool = False, **rates) -> list[str]:
    """One line per GPU kind: the longest row on one node, its device peak and host per node against their budgets,
    the phase the host's peak is in and the data loaders' part of it (`Memory.host_phase`, `host_terms`), which one
    binds, its step and the copies; ALST's published row beside it. `breakdown`: under each line, every host term
    per node the total counts (`host_breakdown`)."""
    lines = []
    for gpu in gpus:
        best = longest_row(model, kind, gpu, gpus_per_node, training, **rates)
        name = f"one node of {gpus_per_node} {gpu.upper()}"
        if best.row is None:
            lines.append(f"longest {kind} row on {name}: under {STEP} tokens ({best.binds} binds)")
            continue
        r, tm, margin = best.row, best.row.time, hardware(gpu, **rates).margin
        m = r.memory
        copies = (f"; copies {tm.offload_copies:.1f} s of which {tm.offload:.1f} s exposed"
                  if training.offload_checkpoints else "")
        if m.host_features:
            features = m.host_features * r.ranks_per_node / GIB
            counted = "parked features" in m.host_terms()
            copies += ("; vision features on the host (the row needs it)" if m.host_collation_beside_step else
                       f"; vision features on the host (the row needs it: {features:,.0f} GiB per node during the "
                       f"step, when no row is collating; {'counted' if counted else 'not counted'}: "
                       f"{'larger' if counted else 'smaller'} than what the data loader adds between steps)")
        lines.append(f"longest {kind} row on {name}: {best.tokens:,} tokens ({best.tokens / 1e6:.2f}M) at U x R "
                     f"{r.ulysses} x {r.ring}; device {r.peak_gib:.1f} of {r.device_budget_gib:.1f} GiB per GPU "
                     f"(usable less a {margin:.0%} margin); host {r.host_gib_per_node:,.0f} of "
                     f"{r.host_budget_gib:,.0f} GiB per node{_loader_text(r, training)}; {best.binds} "
                     f"binds; step {tm.total:.0f} s{copies}; ALST (Llama-8B, 8 H100): {ALST_LONGEST / 1e6:.1f}M")
        if breakdown:
            lines.append(host_breakdown(r))
    return lines


# The data loader's terms of `Memory.host_terms`
LOADER_TERMS = ("step's batches", "queued batches", "previous batches", "collation", "pinning")


def _loader_text(r: PlanRow, training: Training) -> str:
    """The phase the host total counts, what the node's data loaders hold of it there, and the loader priced
    (`host.loader_host`)."""
    terms = r.memory.host_terms()
    loader = sum(v for k, v in terms.items() if k in LOADER_TERMS) * r.ranks_per_node / GIB
    if not loader:
        return ""
    return f", at its peak {r.memory.host_phase} (the data loaders' {loader:,.0f} there: {loader_text(training)})"


def host_breakdown(r: PlanRow) -> str:
    """The host terms per node `PlanRow.host_gib_per_node` counts, in the phase it counts (`Memory.host_terms`),
    and the allowance: they add up to it."""
    terms = {k: v * r.ranks_per_node / GIB for k, v in r.memory.host_terms().items()}
    terms["allowance"] = r.host_allowance_gib
    parts = " + ".join(f"{k} {v:,.1f}" for k, v in terms.items())
    return f"  host per node, {r.memory.host_phase}: {parts} = {r.host_gib_per_node:,.1f} GiB"
