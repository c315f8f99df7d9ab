"""One rank of a two-"node" launch on one host (`tests/test_nodes.py`): two torchrun agents of 2 processes each, so
that every process sees LOCAL_WORLD_SIZE=2 and its node's GROUP_RANK. CP over all 4 ranks on the tiny Qwen3.5 (8
query heads, 8 DeltaNet value heads: the heads alone would allow U = 4, an all-to-all across both nodes).

Writes `rank<r>.json` into the folder given as its argument: the node size the ranks agreed on, U, this rank's node,
the global ranks of its Ulysses subgroup and of its ring, and the parity of loss, logits and every gradient (summed
over the group) with stock at P=1.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.cases import MULTI_IMAGE, build_batch
from tests.helpers.parity import compare


def main() -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=float(os.environ.get("VLMCP_TIMEOUT", "120")))
    dist.init_process_group("gloo", timeout=timeout)
    import vlmcp_patch
    from vlmcp_patch import distributed
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config

    world = dist.get_world_size()
    model = build_model(tiny_qwen3_5_config(), seed=1)
    metrics = compare(model, build_batch(MULTI_IMAGE, seed=7), world)
    text = model.config.get_text_config()
    from vlmcp_patch.attention.heads import ulysses_of

    ulysses = ulysses_of(text, world)
    if ulysses == world:  # all-to-all only (VLMCP_ULYSSES_SIZE=4): the CP group is the subgroup, no ring
        mine = {"ulysses_ranks": list(range(world)), "ring_ranks": [dist.get_rank()]}
    else:
        groups = distributed._HYBRID[(world, world, ulysses)]
        mine = {"ulysses_ranks": dist.get_process_group_ranks(groups["ulysses"]), "ring_ranks": groups["ring"][1]}
    result = {
        "rank": dist.get_rank(),
        "node": int(os.environ["GROUP_RANK"]),
        "node_size": distributed.node_size(),
        "ulysses": ulysses,
        **mine,
        **{k: metrics[k] for k in ("loss_err", "logits_err", "grad_err", "worst_grad", "missing_grads")},
    }
    Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    vlmcp_patch.enable(cp_size=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
