"""Data sharded by a program's own sampler, not by Accelerate's loader (issue 64).

Under CP the P ranks of a CP group must receive the same rows. Accelerate's loaders are sharded over the W/P
data-parallel replicas (integrations/accelerate.py: `data_parallel_rank()` of `data_parallel_world_size()`); a CLI
whose trainer builds its own sampler never passes through there, and its sampler splits by the global rank, so the
ranks of a group get different rows (refused at the first forward by the agreement). The same replica rule applies
here, under CP only (with CP off, or inside `vlmcp_patch.disabled()`, nothing changes):

* torch's `DistributedSampler`, and every sampler built on it: `num_replicas` / `rank` left unset default to the
  replicas (`data_parallel_world_size()` / `data_parallel_rank()`), not the world. Values given are kept:
  `num_replicas=W/P` given alone gets this rank's replica index; a sampler that would shard over the W ranks of the
  world (`num_replicas=W` given, or a rank given without `num_replicas`) is refused on every rank when it is built,
  naming the fix; any other explicit split is the caller's.
* ms-swift's `BatchSamplerShard` (ms-swift 4, `swift.dataloader.shard`: its trainer's loader of a data set with a
  length): its `rank` / `world_size` are the replica's. With DeepSpeed AutoTP (`tp_size > 1`) it is refused.
* ms-swift's `DataLoaderDispatcher` (a data set without a length, `--streaming true`) scatters the batches rank 0
  reads to every rank of the world, one each: refused under CP when it is built.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch.distributed as dist

from ..distributed import cp_running, data_parallel_rank, data_parallel_world_size
from ..errors import UnsupportedSetupError
from ..patching import Patch, PropertyPatch, cp_size

REPLICA_FIX = ("leave num_replicas and rank unset (under CP they default to the data-parallel replicas), or pass "
               "num_replicas=vlmcp_patch.data_parallel_world_size() ({replicas}) and "
               "rank=vlmcp_patch.data_parallel_rank() ({rank})")


def cp_distributed_sampler_init(wrapped, instance, args, kwargs):
    """`DistributedSampler.__init__(dataset, num_replicas=None, rank=None, ...)` under CP: the replica view where the
    caller left it to the defaults (module docstring)."""
    if not cp_running():
        return wrapped(*args, **kwargs)
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # stock's own error
    given = bound.arguments
    num_replicas, rank = given.get("num_replicas"), given.get("rank")
    replicas, replica = data_parallel_world_size(), data_parallel_rank()
    # decided by num_replicas and whether a rank was given (the same on every rank), so all ranks agree
    if num_replicas is None and rank is None:
        given["num_replicas"] = num_replicas = replicas
    if rank is None and num_replicas == replicas:
        given["rank"] = rank = replica
    world = dist.get_world_size()
    if (num_replicas if num_replicas is not None else world) == world:  # the world's split, given or defaulted
        raise UnsupportedSetupError(
            f"{type(instance).__name__}(num_replicas={num_replicas}, rank={rank}) shards the data over the {world} "
            f"ranks of the world, but under context parallelism (VLMCP_CP_SIZE={cp_size()}) the {cp_size()} ranks of "
            "each CP group must receive the same rows (they would be refused at the first forward). Fix: "
            + REPLICA_FIX.format(replicas=replicas, rank=replica)
            + "; a sampler that splits over the world on purpose, for work outside CP forwards, can be built inside "
            "`with vlmcp_patch.disabled():`."
        )
    return wrapped(*bound.args, **bound.kwargs)


def _swift_shard(view):
    """The getter of ms-swift's `BatchSamplerShard.rank` / `.world_size` under CP: the replica's."""

    def getter(original, instance):
        if not cp_running():
            return original(instance)
        tp_size = getattr(instance, "tp_size", 1) or 1
        if tp_size != 1:
            raise UnsupportedSetupError(
                f"ms-swift's BatchSamplerShard splits the data over DeepSpeed AutoTP groups (tp_size={tp_size}), "
                f"which context parallelism (VLMCP_CP_SIZE={cp_size()}) does not combine with: drop the "
                "tensor_parallel (autotp_size) section of the DeepSpeed config, or set VLMCP_CP_SIZE=1."
            )
        return view()

    return getter


def cp_swift_dispatcher_init(wrapped, instance, args, kwargs):
    if cp_running():
        raise UnsupportedSetupError(
            f"ms-swift's {type(instance).__name__} (its loader of a data set without a length: --streaming true, or "
            "an IterableDataset) sends each rank of the world its own batch, but under context parallelism "
            f"(VLMCP_CP_SIZE={cp_size()}) the {cp_size()} ranks of each CP group must receive the same rows. Use a "
            "data set with a length (--streaming false: ms-swift's BatchSamplerShard, which vlmcp_patch shards over "
            "the data-parallel replicas), or set VLMCP_CP_SIZE=1."
        )
    return wrapped(*args, **kwargs)


@dataclass(frozen=True)
class ReleasePropertyPatch(PropertyPatch):
    """A `PropertyPatch` declared for some releases of its package (`Patch.since`)."""

    since: str | None = None


# ms-swift 3 kept these classes elsewhere (swift.llm.data_loader) and pins transformers 4, which the package does not
# run; checked on ms-swift 4.6.0.
SWIFT = "ms-swift>=4"


def patches() -> list:
    return [
        Patch(
            target="torch.utils.data.distributed.DistributedSampler.__init__",
            wrapper=cp_distributed_sampler_init,
            reason="under CP: a DistributedSampler left to its defaults (a CLI's own sampler) shards over the "
            "data-parallel replicas, so the ranks of a CP group get the same rows; one that would split over the "
            "world is refused when it is built",
            expects=("num_replicas", "rank"),
            requires="torch",
        ),
        ReleasePropertyPatch(
            target="swift.dataloader.shard.BatchSamplerShard.rank",
            wrapper=_swift_shard(data_parallel_rank),
            reason="under CP: ms-swift's sampler shards by the global rank; shard by the data-parallel replica",
            requires="swift",
            since=SWIFT,
        ),
        ReleasePropertyPatch(
            target="swift.dataloader.shard.BatchSamplerShard.world_size",
            wrapper=_swift_shard(data_parallel_world_size),
            reason="under CP: ms-swift's sampler shards over the world; shard over the data-parallel replicas",
            requires="swift",
            since=SWIFT,
        ),
        Patch(
            target="swift.dataloader.dispatcher.DataLoaderDispatcher.__init__",
            wrapper=cp_swift_dispatcher_init,
            reason="under CP: ms-swift's loader of an iterable data set sends each rank of the world its own batch; "
            "refused when it is built",
            expects=("base_dataloader",),
            requires="swift",
            since=SWIFT,
        ),
    ]
