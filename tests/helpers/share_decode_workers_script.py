"""`ShareDecoding` in DataLoader workers: one worker started each way (fork, spawn, forkserver), each collating the row
of `share_decode_cases` with a collator built in the training process; each rank writes, per start method, the video
rows its batch holds and whether their share record is there, to OUT_DIR/workers.rankR.json.

    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 -m tests.helpers.run_script \
        tests/helpers/share_decode_workers_script.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import vlmcp_patch  # noqa: F401 - the package under test
from tests.helpers.share_decode_cases import RowCollator
from vlmcp_patch.forward.arguments import SHARE_RECORDS


def main(out: str) -> None:
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    held = {}
    for method in ("fork", "spawn", "forkserver"):
        loader = torch.utils.data.DataLoader([0], batch_size=1, collate_fn=RowCollator(), num_workers=1,
                                             multiprocessing_context=method)
        batch = next(iter(loader))
        held[method] = [batch["pixel_values_videos"].shape[0], SHARE_RECORDS["pixel_values_videos"] in batch]
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(out, f"workers.rank{rank}.json").write_text(json.dumps(held))


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
