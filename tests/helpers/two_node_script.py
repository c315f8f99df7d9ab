"""One rank of a two-"node" launch on one host (`tests/test_nodes.py`): two torchrun agents of 2 processes each, so
that every process sees LOCAL_WORLD_SIZE=2 and its node's GROUP_RANK. CP over all 4 ranks on the tiny Qwen3.5 (8
query heads, 8 DeltaNet value heads: the heads alone would allow U = 4, an all-to-all across both nodes).

With `VLMCP_TEST_LAUNCHER` set to another launcher (`tests/helpers/launcher_envs.py`), each rank first rewrites its
environment to hold only that launcher's node variables; `none` keeps none of them and gives each "node" a host name
of its own (what two machines would report), so the node size can only come from the host names.

Writes `rank<r>.json` into the folder given as its argument: the node size the ranks agreed on and its source, U,
this rank's node,
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


def simulate_launcher() -> int:
    """This rank's node (its torchrun agent's GROUP_RANK), after its environment was rewritten to hold only the node
    variables of VLMCP_TEST_LAUNCHER (default: torchrun's own)."""
    from tests.helpers.launcher_envs import as_launched_by

    node = int(os.environ["GROUP_RANK"])
    launcher = os.environ.get("VLMCP_TEST_LAUNCHER", "torchrun")
    as_launched_by(launcher, per_node=int(os.environ["LOCAL_WORLD_SIZE"]))
    if launcher == "none":  # two machines: each node's ranks report their own host
        import socket

        socket.gethostname = lambda: f"simulated-node-{node}"
    return node


def main() -> None:
    node = simulate_launcher()
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
        "node": node,
        "node_size": distributed.node_size(),
        "node_source": distributed.node_source(),
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
