"""Whether a data-parallel wrapper shards a module's weights: DeepSpeed ZeRO-3 partitions or FSDP2 units.

One rule for every reader: the gradient-share guard (`grad_shares`: a sharding wrapper reduces every gradient in
backward), the tiles (`tiles`, `vision_tiles`: work split into a rank's own number of tiles must not start gathers
per tile), the vision placeholder (`integrations/vision_placeholder`) and the agreement check of the weights
(`forward/agreement`, `is_partitioned`).

ZeRO-3 is told by its parameters (`ds_id`, set when it partitions them) and its leaf flags, read through DeepSpeed's
own API (`deepspeed.utils`), imported only when a parameter is partitioned (DeepSpeed is then in use). FSDP2 is told
by its modules (`FSDPModule`), not its parameters: while it has a module's weights gathered (in forward, in backward)
that module's parameters are plain tensors, not DTensors.
"""

from __future__ import annotations

import torch


def zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitions some of `module`'s parameters (it gathers them around module calls)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def fsdp2_units_within(module: torch.nn.Module) -> bool:
    """Whether `module` or one of its submodules is an FSDP2 unit (`fully_shard`): its weights are gathered when that
    unit is called."""
    if not torch.distributed.is_available():  # a torch built without distributed: no FSDP2
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def sharded(module: torch.nn.Module) -> bool:
    """Whether a data-parallel wrapper shards some of `module`'s weights (ZeRO-3 partitions or FSDP2 units): it then
    gathers them for compute and reduce-scatters their gradients in backward."""
    return zero3_partitioned(module) or fsdp2_units_within(module)


def is_partitioned(param: torch.Tensor) -> bool:
    """A parameter its data-parallel wrapper holds sharded across ranks now: a ZeRO-3 partition (`ds_id`) or an FSDP2
    `DTensor` (each rank holds a different piece; the wrapper keeps them consistent)."""
    from torch.distributed.tensor import DTensor

    return hasattr(param, "ds_id") or isinstance(param, DTensor)


def zero3_leaf(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitions `module`'s parameters and gathers them whole once per call of `module` (a leaf module,
    `make_zero3_leaf`)."""
    if not zero3_partitioned(module):
        return False
    from deepspeed.utils import z3_leaf_module

    return z3_leaf_module(module)


def _inside_zero3_leaf(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters belong to a ZeRO-3 leaf above it (ZeRO-3 marks a leaf's weights)."""
    from deepspeed.utils import z3_leaf_parameter

    params = list(module.parameters())
    return bool(params) and all(z3_leaf_parameter(p) for p in params)


def gathers_per_submodule_call(module: torch.nn.Module) -> bool:
    """Whether a sharding wrapper gathers `module`'s weights piece by piece, at the calls of its submodules (or, FSDP2,
    of the units at or inside it), rather than once for a whole call of `module` or not at all.

    Work inside one call of `module` split into tiles — a number that differs by rank — then starts one gather per
    tile and submodule: different collectives on different ranks, a hang. Such a module runs untiled. ZeRO-3: its
    parameters partitioned, some held by its children (which get hooks of their own), and neither `module` nor a
    module above it a leaf. FSDP2: `module` or a submodule is a unit (a unit above it gathers it whole)."""
    if fsdp2_units_within(module):
        return True
    if not zero3_partitioned(module):
        return False
    children_hooked = any(next(child.parameters(), None) is not None for child in module.children())
    return children_hooked and not (zero3_leaf(module) or _inside_zero3_leaf(module))


def make_zero3_leaf(module: torch.nn.Module) -> None:
    """Flag `module` a ZeRO-3 leaf before `deepspeed.initialize` registers its hooks: its weights are then gathered
    whole once per call and its submodules get no hooks (DeepSpeed's `set_z3_leaf_module`, in 0.16.9 through 0.19)."""
    from deepspeed.utils import set_z3_leaf_module

    set_z3_leaf_module(module, True)
