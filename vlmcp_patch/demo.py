"""The README's main job: a CP run of a tiny random-init Qwen3-VL on synthetic image-text samples.

    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 -m vlmcp_patch.demo

Every rank trains the same tiny model on the same synthetic batches, twice: once with each sequence
split over the CP group, once with CP bypassed (`vlmcp_patch.disabled()`, the P=1 reference). Rank 0
prints, per step, the sequence length, the tokens and vision patches its own slice computed, and both
losses; the last line says whether CP matched P=1. The two runs stay equal because the CP loss is the
P=1 loss and the gradients summed over the group are the P=1 gradients.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import vlmcp_patch
from vlmcp_patch.fixtures.data import Segment, make_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
from vlmcp_patch.stats import STATS

TOLERANCE = 1e-5

def synthetic_batches(steps: int, seed: int):
    """Image-text samples of varied shape: several images per sample, odd lengths."""
    layouts = [
        [[Segment(text=6), Segment(image=(32, 24)), Segment(text=9), Segment(image=(16, 16)), Segment(text=4)]],
        [[Segment(text=11), Segment(image=(24, 40)), Segment(text=7), Segment(image=(24, 24)), Segment(text=3)]],
        [[Segment(text=3), Segment(image=(16, 32)), Segment(text=5), Segment(image=(40, 16)), Segment(text=8)]],
    ]
    return [make_batch(layouts[i % len(layouts)], seed=seed + i) for i in range(steps)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("WORLD_SIZE", 1)))))

    model = build_model(tiny_qwen3_vl_config(), seed=args.seed)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    if rank == 0:
        print(f"vlmcp-patch demo: tiny Qwen3-VL, CP size {vlmcp_patch.cp_size()}")
        print(f"{'step':>4} {'seq':>4} {'tokens':>6} {'patches':>9}  {'CP loss':>12}  {'P=1 loss':>12}"
              f"  {'rel. diff':>9}")
    worst = 0.0
    for step, batch in enumerate(synthetic_batches(args.steps, args.seed)):
        STATS.drain()
        loss = model(**batch).loss
        facts = STATS.drain()  # what this rank's slice computed
        loss.backward()
        vlmcp_patch.sum_over_cp_group(p.grad for p in model.parameters())  # each rank held its slice's share
        opt.step()
        opt.zero_grad()

        with vlmcp_patch.disabled():
            ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        diff = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        worst = max(worst, diff)
        if rank == 0:
            seq = batch["input_ids"].shape[1]
            tokens = facts.get("cp_tokens_per_rank", seq)
            total = int(batch["image_grid_thw"].prod(-1).sum())
            patches = f"{facts.get('cp_vision_patches_per_rank', total):.0f}/{total}"
            print(f"{step:>4} {seq:>4} {tokens:>6.0f} {patches:>9}  {loss.item():>12.6f}  {ref_loss.item():>12.6f}"
                  f"  {diff:>9.2e}")
    if rank == 0:
        verdict = "matched" if worst <= TOLERANCE else "DID NOT match"
        print(f"CP={vlmcp_patch.cp_size()} {verdict} P=1 within {TOLERANCE:g} on all {args.steps} steps "
              f"(worst relative loss difference {worst:.1e})")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
