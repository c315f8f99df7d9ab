"""A CP run in which rank 1 fails after a normal step, while rank 0 goes on into the CP collectives.

    torchrun --nproc-per-node 2 tests/helpers/fault_script.py {raise | exit | kill | hang}

The process group is created with a 10-second timeout; the CP groups must inherit it (a hung rank then
ends the job in seconds, not after the backend's 30-minute default).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch.distributed as dist

import vlmcp_patch
from vlmcp_patch.fixtures.data import Segment, make_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["raise", "exit", "kill", "hang"])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    mode = parser.parse_args().mode
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    vlmcp_patch.enable(cp_size=2)
    model = build_model(tiny_qwen3_vl_config(), seed=0)
    batch = make_batch([[Segment(text=5), Segment(image=(16, 24)), Segment(text=7)]], seed=3)
    model(**batch).loss.backward()
    print(f"rank {dist.get_rank()}: first CP step done", flush=True)
    if dist.get_rank() == 1:
        if mode == "raise":
            raise RuntimeError("injected fault on rank 1")
        if mode == "exit":
            os._exit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    model(**batch).loss.backward()  # rank 0 alone in the CP collectives


if __name__ == "__main__":
    main()
