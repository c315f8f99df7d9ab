"""Accelerate (and so the HF Trainer and TRL) under CP.

Three things change when the ranks of a CP group share each micro-batch:

* data: batches are sharded over the W/P data-parallel replicas, not the W ranks, so that the ranks
  of one CP group receive the same micro-batches;
* gradients: DDP averages over all W ranks, while a CP step needs the sum over each CP group (each
  rank holds its slice's share) and the mean over the replicas — P times DDP's average. The loss is
  scaled by P inside `Accelerator.backward` only, so the loss the Trainer logs stays the P=1 loss.
  DeepSpeed gets the CP groups instead (integrations/deepspeed.py) and divides by W/P itself;
* metrics: `gather_for_metrics` collects one copy per replica, not P (the ranks of a group hold the
  same samples), before it trims the padded last batch.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch.distributed as dist

from ..context import cp_requested
from ..distributed import data_parallel_rank, data_parallel_world_size
from ..patching import Patch
from ..settings import SETTINGS


def cp_training() -> bool:
    return cp_requested() and dist.is_available() and dist.is_initialized()


def cp_prepare_data_loader(wrapped, instance, args, kwargs):
    if cp_training():
        kwargs["num_processes"] = data_parallel_world_size()
        kwargs["process_index"] = data_parallel_rank()
    return wrapped(*args, **kwargs)


def cp_backward(wrapped, instance, args, kwargs):
    # DeepSpeed divides by the data-parallel size W/P itself (see integrations/deepspeed.py).
    if cp_training() and instance.distributed_type != "DEEPSPEED":
        args = list(args)
        if args:
            args[0] = args[0] * SETTINGS.cp_size
        else:
            kwargs["loss"] = kwargs["loss"] * SETTINGS.cp_size
    return wrapped(*args, **kwargs)


# Set while `gather_for_metrics` runs: its gather then keeps one copy per CP group.
_GATHERING_FOR_METRICS = contextvars.ContextVar("vlmcp_gathering_for_metrics", default=False)


def _one_copy_per_cp_group(tensor):
    # gather concatenates the W ranks' equal-size chunks in rank order; CP groups are blocks of P
    # consecutive ranks holding the same batch: keep the first rank of each block.
    chunks = tensor.reshape(dist.get_world_size(), -1, *tensor.shape[1:])
    return chunks[:: SETTINGS.cp_size].reshape(-1, *tensor.shape[1:])


@contextlib.contextmanager
def one_copy_per_cp_group():
    """`Accelerator.gather` inside this block keeps one copy per CP group (when CP is training)."""
    token = _GATHERING_FOR_METRICS.set(cp_training())
    try:
        yield
    finally:
        _GATHERING_FOR_METRICS.reset(token)


def cp_gather_for_metrics(wrapped, instance, args, kwargs):
    with one_copy_per_cp_group():
        return wrapped(*args, **kwargs)


def cp_gather(wrapped, instance, args, kwargs):
    gathered = wrapped(*args, **kwargs)
    if not _GATHERING_FOR_METRICS.get():
        return gathered
    from accelerate.utils import recursively_apply

    return recursively_apply(_one_copy_per_cp_group, gathered)


def patches() -> list[Patch]:
    return [
        Patch(
            target="accelerate.accelerator.prepare_data_loader",
            wrapper=cp_prepare_data_loader,
            reason="under CP: shard batches over the W/P data-parallel replicas so the ranks of a CP group get "
            "the same micro-batches",
            expects=("dataloader", "num_processes", "process_index"),
            requires="accelerate",
        ),
        Patch(
            target="accelerate.accelerator.Accelerator.backward",
            wrapper=cp_backward,
            reason="under CP: gradients must be summed over the CP group and averaged over replicas, P times the "
            "all-rank average DDP / DeepSpeed compute; scale the backward (not the logged loss) by P",
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
