"""Padding per rank on a right-padded batch: contiguous slices of the padded rows against the padding-free row.

    python -m benchmarks.padding_per_rank [--lengths 1900 700 1300 420] [--sizes 2 4 8]

A right-padded batch of rows of mixed lengths, cut into contiguous slices of the padded width, leaves the
last ranks with mostly padding. Under CP the package lays the rows' real tokens back to back as one
packed row (their boundaries kept as samples), so a rank's slice holds at most the CP pad tail (< P
tokens of the whole row). Both columns come from the same batch: the first from the slices of its
attention mask, the second from the package's own layout (`forward.rows`, `CPContext`).
"""

from __future__ import annotations

import argparse

import torch

from vlmcp_patch.context import CPContext
from vlmcp_patch.distributed import CPGroup
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config
from vlmcp_patch.forward.plan import plan_forward
from vlmcp_patch.forward.rows import lay_out
from vlmcp_patch.layout import round_up, shard_slice


def padded_batch(lengths: list[int]) -> dict:
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": torch.randint(1, 100, (len(lengths), width)) * mask, "attention_mask": mask}


def contiguous_slices(mask: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """(padding, slots) of each rank when the padded rows are cut into contiguous slices of the width."""
    padded = torch.nn.functional.pad(mask, (0, round_up(mask.shape[1], size) - mask.shape[1]))
    out = []
    for rank in range(size):
        part = padded[:, shard_slice(mask.shape[1], size, rank)]
        out.append((int((part == 0).sum()), part.numel()))
    return out


def padding_free(batch: dict, size: int) -> list[tuple[int, int]]:
    call = dict(batch)
    plan = plan_forward(build_model(tiny_qwen3_5_config(text_only=True)), call, CPGroup(group=None, rank=0, size=size))
    assert plan.refusal is None, plan.refusal
    row = lay_out(call, plan)
    out = []
    for rank in range(size):
        ctx = CPContext(cp=CPGroup(group=None, rank=rank, size=size), segments=row.segments, rows=row.rows)
        out.append((ctx.local_pad_len, ctx.local_len))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1900, 700, 1300, 420])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    batch = padded_batch(args.lengths)
    print(f"right-padded batch of {len(args.lengths)} rows, lengths {args.lengths}: "
          f"{batch['attention_mask'].numel() - sum(args.lengths)} padding tokens of {batch['attention_mask'].numel()}")
    print(f"{'P':>2} {'rank':>4} {'contiguous slices: padding':>28} {'padding-free row: padding':>27}")
    for size in args.sizes:
        for rank, ((pad_c, all_c), (pad_f, all_f)) in enumerate(zip(contiguous_slices(batch["attention_mask"], size),
                                                                    padding_free(batch, size))):
            print(f"{size:>2} {rank:>4} {pad_c:>10d} of {all_c:>6d} ({pad_c / all_c:6.1%}) "
                  f"{pad_f:>8d} of {all_f:>5d} ({pad_f / all_f:6.1%})")


if __name__ == "__main__":
    main()
