"""DeepSpeed under CP: the engine learns the CP groups through an `mpu`, the way it learns Ulysses SP.

DeepSpeed's sequence-parallel support already has the reduction CP needs: gradients are all-reduced
over the sequence-data-parallel group (all ranks) and divided by the data-parallel size W/P, i.e.
summed over each CP group and averaged over the replicas — at every ZeRO stage. Its batch arithmetic
(`train_batch_size = micro x accumulation x W/P`) and its own data loader (sharded over the W/P
replicas) follow from the same object. `deepspeed.initialize` is patched to pass it when CP is on
and the caller gave no `mpu` of its own.
"""

from __future__ import annotations

import torch.distributed as dist

from ..distributed import cp_requested, data_parallel_rank, data_parallel_world_size, get_cp_group, world_group
from ..flags import BATCH_SIZED_BY_ACCELERATE
from ..forward.arguments import call_arguments
from ..grad_shares import reduced_by_wrapper
from ..patching import Patch
from ..replica_step import DEEPSPEED_STEP, ZERO3_STEP, marked_step
from ..tiles import gather_whole_mlps_under_zero3
from ..vision_tiles import gather_whole_towers_under_zero3
from .setup import check_cp_setup, require_integration

# Digests of `DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`, which averages over all W ranks (its
# reduce-scatter over the sequence-data-parallel group) and ignores the sequence-parallel size; the patch
# multiplies by P on that assumption. Each release of the range was read (tools/check_integration_release.py): 0.17.2
# passes the communication dtype in, 0.19.2 casts back to the accumulation dtype, 0.19.3 reduces over the parameter's
# partition group (the same group without expert parallelism) and rescales expert parameters only, 0.19.8 drops the
# LoCo branch of ZeRO++'s quantized all-to-all: the average over the W ranks stays. The patch relies on no parameter
# but the first. If DeepSpeed starts scaling for sequence parallelism there itself, the digest changes and the patch
# refuses to install (gradients would otherwise silently be P times too large).
ZERO3_AVG_SCATTER_GRADS = {
    "5628d77ba6aefa8d": "deepspeed>=0.16.9,<0.17.2",
    "1081d9506165b1c9": "deepspeed>=0.17.2,<0.19.2",
    "2ae63ba51326f916": "deepspeed==0.19.2",
    "505ff82186b0a7ce": "deepspeed>=0.19.3,<0.19.8",
    "f392cb14952e5019": "deepspeed>=0.19.8,<0.20",
}


class CPParallelState:
    """The sequence-parallel `mpu` interface DeepSpeed queries, answered with the package's CP groups."""

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """Present so DeepSpeed treats this object as a sequence-parallel mpu; groups exist already."""

    def get_sequence_parallel_group(self):
        return get_cp_group().group

    def get_sequence_parallel_world_size(self) -> int:
        return get_cp_group().size

    def get_sequence_parallel_rank(self) -> int:
        return get_cp_group().rank

    def get_sequence_data_parallel_group(self):
        return world_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_group(self):
        """DeepSpeed < 0.17 asks the mpu for it (`groups._get_data_parallel_group`); newer releases take None for a
        sequence-parallel mpu without asking. None here too: the engine then reduces over the sequence-data-parallel
        group and divides by W/P, as on the newer releases (a method without a return statement: None)."""

    def get_data_parallel_world_size(self) -> int:
        return data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return data_parallel_rank()

    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def _size_batch_for_replicas(config) -> None:
    # accelerate and the HF Trainer fill an "auto" train_batch_size as micro x accumulation x W; under CP
    # there are W/P replicas (accelerate makes the same correction for its own SP at the last moment).
    if not isinstance(config, dict):
        return
    micro, accumulation = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    if not all(isinstance(v, int) for v in (micro, accumulation, config.get("train_batch_size"))):
        return
    if config["train_batch_size"] == micro * accumulation * dist.get_world_size():
        config["train_batch_size"] = micro * accumulation * data_parallel_world_size()


def cp_deepspeed_initialize(wrapped, instance, args, kwargs):
    require_integration("deepspeed")
    if cp_requested() and kwargs.get("mpu") is None:
        if not dist.is_initialized():
            import deepspeed

            deepspeed.init_distributed()
        model = call_arguments(wrapped, args, kwargs).get("model")
        check_cp_setup(model)
        reduced_by_wrapper(model)  # the engine sums its gradients over the CP groups given as its mpu
        gather_whole_mlps_under_zero3(model)  # before ZeRO-3 registers its hooks (tiles.py)
        gather_whole_towers_under_zero3(model)  # the same for the vision towers (vision_tiles.py)
        kwargs["mpu"] = CPParallelState()
        if BATCH_SIZED_BY_ACCELERATE.get():
            _size_batch_for_replicas(kwargs.get("config_params", kwargs.get("config")))
    return wrapped(*args, **kwargs)


def engine_forward_as_a_replica_step(wrapped, instance, args, kwargs):
    """The engine's forward is a data-parallel step (`replica_step`): every replica runs it, and its ZeRO optimizer
    reduces gradients in their arrival order (at ZeRO-3 its weights are gathered per call, too)."""
    step = ZERO3_STEP if instance.zero_optimization_partition_weights() else DEEPSPEED_STEP
    with marked_step(step):
        return wrapped(*args, **kwargs)


def cp_zero3_avg_scatter_grads(wrapped, instance, args, kwargs):
    # ZeRO-3's reduce-scatter path averages over all W ranks, while its all-reduce path (and ZeRO-1/2)
    # divide by W/P for sequence parallelism: put the missing factor P back.
    partitions = wrapped(*args, **kwargs)
    if cp_requested() and instance.sequence_parallel_size > 1:
        partitions = [p.mul_(instance.sequence_parallel_size) for p in partitions]
    return partitions


def sequence_parallel_mpu_without_model_parallelism(wrapped, instance, args, kwargs):
    """DeepSpeed < 0.17's ZeRO optimizers take any mpu for tensor model parallelism: a gradient norm counts the
    parameters on model-parallel rank 0 only and is summed over the model-parallel group — here the CP group, whose
    ranks each hold their own gradient partition under ZeRO, so the other CP ranks' partitions would be missed and
    clipping scale wrongly. 0.17 and later take a sequence-parallel mpu (one with `initialize_sequence_parallel`) for no
    model parallelism there; so do these optimizers once built."""
    result = wrapped(*args, **kwargs)
    if isinstance(call_arguments(wrapped, args, kwargs).get("mpu"), CPParallelState):
        instance.model_parallel_group, instance.model_parallel_rank = None, 0
        if hasattr(instance, "model_parallel_world_size"):  # ZeRO-1/2 (ZeRO-3 reads the group alone)
            instance.model_parallel_world_size = 1
    return result


def patches() -> list[Patch]:
    return [
        *(Patch(
            target=f"deepspeed.runtime.zero.{target}.__init__",
            wrapper=sequence_parallel_mpu_without_model_parallelism,
            reason="DeepSpeed < 0.17 under CP: the ZeRO optimizers would take the CP groups for tensor model "
            "parallelism in the gradient norm (counted on CP rank 0 only: a wrong clip); no model parallelism, as "
            "0.17+ decide for a sequence-parallel mpu",
            expects=("mpu",),
            requires="deepspeed",
            since="deepspeed<0.17",
        ) for target in ("stage_1_and_2.DeepSpeedZeroOptimizer", "stage3.DeepSpeedZeroOptimizer_Stage3")),
        Patch(
            target="deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3."
            "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
            wrapper=cp_zero3_avg_scatter_grads,
            reason="under CP: ZeRO-3's reduce-scatter averages gradients over all W ranks, ignoring the "
            "sequence-parallel size its other reduction paths divide by; multiply by P so it sums over CP",
            expects=("params_to_reduce",),
            mirrors=ZERO3_AVG_SCATTER_GRADS,
            requires="deepspeed",
        ),
        Patch(
            target="deepspeed.runtime.engine.DeepSpeedEngine.forward",
            wrapper=engine_forward_as_a_replica_step,
            reason="the engine's forward is the step every replica runs: the only forwards in which the replicas "
            "agree over the world (switches, placeholder passes), and ZeRO reduces gradients in their arrival order",
            requires="deepspeed",
        ),
        Patch(
            target="deepspeed.initialize",
            wrapper=cp_deepspeed_initialize,
            reason="under CP: give the engine the CP groups as a sequence-parallel mpu, so it reduces gradients "
            "over CP x DP divided by W/P, sizes batches and shards its data loader over the W/P replicas",
            expects=("model", "config", "mpu"),
            requires="deepspeed",
        )
    ]
