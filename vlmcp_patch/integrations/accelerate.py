"""Accelerate (and so the HF Trainer and TRL) under CP.

Four things change when the ranks of a CP group share each micro-batch:

* setup: a model prepared under CP must be one the package runs under CP — anything else would train
  on P copies of each batch with P times the gradient — so `prepare` checks it before the first step;
* data: batches are sharded over the W/P data-parallel replicas, not the W ranks, so that the ranks
  of one CP group receive the same micro-batches, and each rank's pixel values are cut to its share as they are
  collated (integrations/placement.py);
* gradients: DDP and FSDP average over all W ranks, while a CP step needs the sum over each CP group
  (each rank holds its slice's share) and the mean over the replicas — P times their average. The loss
  is scaled by P inside `Accelerator.backward` only, so the loss the Trainer logs stays the P=1 loss.
  DeepSpeed gets the CP groups instead (integrations/deepspeed.py) and divides by W/P itself;
* metrics: `gather_for_metrics` collects one copy per replica, not P (the ranks of a group hold the
  same samples), before it trims the padded last batch.
"""

from __future__ import annotations

import torch.distributed as dist

from ..distributed import cp_running, data_parallel_rank, data_parallel_world_size
from ..flags import ONE_COPY_PER_CP_GROUP, scoped
from ..forward.host_pixels import this_ranks_cut
from ..grad_shares import reduced_by_wrapper
from ..patching import Patch, cp_size
from .placement import PixelShareCollator
from .setup import check_cp_setup, require_integration


def cp_prepare_model(wrapped, instance, args, kwargs):
    for package in ("accelerate", "transformers.trainer"):  # the Trainer's patches count only once it is imported
        require_integration(package)
    if cp_running():
        model = args[0] if args else kwargs["model"]
        check_cp_setup(model)
        reduced_by_wrapper(model)  # DDP / FSDP2 sum its gradients over CP (the backward's scale below)
    return wrapped(*args, **kwargs)


def cp_fsdp2_prepare_model(wrapped, instance, args, kwargs):
    """Accelerate's FSDP2 path (`Accelerator.prepare` with FSDP2) shards the model here, without `prepare_model`: the
    same check, and FSDP2 sums its gradients over CP as `prepare_model`'s wrappers do."""
    if cp_running():
        model = args[1] if len(args) > 1 else kwargs["model"]
        check_cp_setup(model)
        reduced_by_wrapper(model)
    return wrapped(*args, **kwargs)


def cp_prepare_data_loader(wrapped, instance, args, kwargs):
    if not cp_running():
        return wrapped(*args, **kwargs)
    kwargs["num_processes"] = data_parallel_world_size()
    kwargs["process_index"] = data_parallel_rank()
    kwargs["torch_device_mesh"] = None  # with a mesh, accelerate would derive its own sharding instead
    loader = wrapped(*args, **kwargs)
    cut_as_collated(loader)
    return loader


def cut_as_collated(loader) -> None:
    """Each batch of a prepared data loader cut to this rank's share of the pixel values as soon as it is collated
    (integrations/placement.py), in the loader a `DataLoaderShard` iterates. A loader that dispatches the main
    process's batches to the others is left as it is: each rank cuts what it receives (`send_to_device`)."""
    from accelerate.data_loader import DataLoaderDispatcher

    cut = this_ranks_cut()
    base = getattr(loader, "base_dataloader", loader)
    if cut is None or isinstance(loader, DataLoaderDispatcher) or not callable(getattr(base, "collate_fn", None)):
        return
    base.collate_fn = PixelShareCollator(base.collate_fn, cut)


def cp_backward(wrapped, instance, args, kwargs):
    # DeepSpeed divides by the data-parallel size W/P itself (see integrations/deepspeed.py).
    if cp_running() and instance.distributed_type != "DEEPSPEED":
        args = list(args)
        if args:
            args[0] = args[0] * cp_size()
        else:
            kwargs["loss"] = kwargs["loss"] * cp_size()
    return wrapped(*args, **kwargs)


def one_copy_per_cp_group(tensor):
    # gather concatenates the W ranks' equal-size chunks in rank order; CP groups are blocks of P
    # consecutive ranks holding the same batch: keep the first rank of each block.
    chunks = tensor.reshape(dist.get_world_size(), -1, *tensor.shape[1:])
    return chunks[:: cp_size()].reshape(-1, *tensor.shape[1:])


def one_copy_per_cp_group_gathers():
    """Inside the block, accelerate's gathers keep one copy per CP group (under CP; a no-op otherwise)."""
    return scoped(ONE_COPY_PER_CP_GROUP, cp_running())


def cp_gather_for_metrics(wrapped, instance, args, kwargs):
    with one_copy_per_cp_group_gathers():
        return wrapped(*args, **kwargs)


def cp_gather(wrapped, instance, args, kwargs):
    gathered = wrapped(*args, **kwargs)
    if not ONE_COPY_PER_CP_GROUP.get():
        return gathered
    from accelerate.utils import recursively_apply

    return recursively_apply(one_copy_per_cp_group, gathered)


def patches() -> list[Patch]:
    return [
        Patch(
            target="accelerate.accelerator.Accelerator.prepare_model",
            wrapper=cp_prepare_model,
            reason="under CP: only a model that runs CP may be prepared (the data sharding and the backward scale "
            "below assume it); check it, its configuration and the launch before the first step",
            expects=("model",),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.fsdp2_prepare_model",
            wrapper=cp_fsdp2_prepare_model,
            reason="under CP: Accelerate's FSDP2 path shards the model here, not through prepare_model; the same "
            "check, and its gradients are summed by FSDP2 (no UnsummedGradientsError)",
            expects=("accelerator", "model"),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.prepare_data_loader",
            wrapper=cp_prepare_data_loader,
            reason="under CP: shard batches over the W/P data-parallel replicas so the ranks of a CP group get "
            "the same micro-batches",
            expects=("dataloader", "num_processes", "process_index", "torch_device_mesh"),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.Accelerator.backward",
            wrapper=cp_backward,
            reason="under CP: gradients must be summed over the CP group and averaged over replicas, P times the "
            "all-rank average DDP / FSDP compute; scale the backward (not the logged loss) by P",
            expects=("loss",),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.Accelerator.gather_for_metrics",
            wrapper=cp_gather_for_metrics,
            reason="under CP: the P ranks of a CP group evaluate the same samples; metrics (eval losses, "
            "predictions, TRL's token counts) must see each sample once, before the last batch is trimmed",
            expects=("input_data", "use_gather_object"),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.Accelerator.gather",
            wrapper=cp_gather,
            reason="under CP, inside gather_for_metrics (and the Trainer's token count) only: keep one copy per CP "
            "group of what was gathered",
            expects=("tensor",),
            requires="accelerate",
        ),
    ]
