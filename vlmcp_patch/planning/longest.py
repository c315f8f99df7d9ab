"""The longest row that fits one node: bisection over the row's length with the plan of the package's layout at P =
the node's GPUs (memory per rank only falls with P, so the whole node is where the longest row fits)."""

from __future__ import annotations

from dataclasses import dataclass

from .dims import model_dims
from .hardware import Hardware, hardware
from .rows import Row
from .table import PlanRow, plan
from .training import Training

STEP = 1024  # the answer's resolution, tokens


@dataclass(frozen=True)
class Longest:
    """The longest row of a kind that fits one node, and its plan row (None: not even STEP tokens fit)."""

    tokens: int
    row: PlanRow | None


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
    """The longest `kind` row (a multiple of STEP tokens) whose predicted peak fits every GPU of one node of
    `gpus_per_node` at P = gpus_per_node in the package's layout."""
    dims = model_dims(model)
    hw = hardware(gpu, memory_gib, **rates)

    def priced(tokens: int) -> PlanRow:
        return plan(dims, row_of(kind, tokens, dims), gpu=hw, gpus_per_node=gpus_per_node, training=training,
                    sizes=[gpus_per_node], all_layouts=False, constants=constants)[0]

    if not priced(STEP).fits:
        return Longest(0, None)
    low, high = 1, 2  # in STEPs: low fits, high is to be tried
    while priced(high * STEP).fits:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if priced(middle * STEP).fits else (low, middle)
    return Longest(low * STEP, priced(low * STEP))


def longest_lines(model, kind: str, training: Training, gpus_per_node: int = 8, gpus=("h100", "h200"),
                  **rates) -> list[str]:
    """One line per GPU kind: the longest row on one node, its peak and step, the host memory and the copies."""
    lines = []
    for gpu in gpus:
        best = longest_row(model, kind, gpu, gpus_per_node, training, **rates)
        name = f"one node of {gpus_per_node} {gpu.upper()}"
        if best.row is None:
            lines.append(f"longest {kind} row on {name}: under {STEP} tokens")
            continue
        r, tm = best.row, best.row.time
        copies = (f"; host {r.host_gib_per_node:.0f} GiB per node, copies {tm.offload_copies:.1f} s of which "
                  f"{tm.offload:.1f} s exposed" if r.memory.host_total else "")
        lines.append(f"longest {kind} row on {name}: {best.tokens:,} tokens ({best.tokens / 2**20:.2f}M) at "
                     f"U x R {r.ulysses} x {r.ring}, {r.peak_gib:.1f} GiB per GPU, step {tm.total:.0f} s{copies}")
    return lines
