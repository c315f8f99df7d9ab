"""The HF Trainer's own bookkeeping under CP: counts that assume every rank is a data-parallel replica.

The P ranks of a CP group train on the same micro-batches, so there are W/P replicas, not W. Two of
the Trainer's figures count per rank: the total train batch size (behind `train_samples_per_second`
and the samples count in the run summary) and `num_input_tokens_seen` (a sum over all W ranks). Both
are put back to the P=1 values; the loss and gradients never depend on them.
"""

from __future__ import annotations

from ..patching import Patch
from ..settings import SETTINGS
from .accelerate import cp_training


def cp_total_train_batch_size(wrapped, instance, args, kwargs):
    total = wrapped(*args, **kwargs)
    return total // SETTINGS.cp_size if cp_training() else total


def cp_track_num_input_tokens(wrapped, instance, args, kwargs):
    before = instance.state.num_input_tokens_seen
    result = wrapped(*args, **kwargs)
    if cp_training():
        counted = instance.state.num_input_tokens_seen - before
        instance.state.num_input_tokens_seen = before + counted // SETTINGS.cp_size
    return result


def patches() -> list[Patch]:
    return [
        Patch(
            target="transformers.trainer.Trainer.get_total_train_batch_size",
            wrapper=cp_total_train_batch_size,
            reason="under CP: the Trainer counts all W ranks as replicas; there are W/P (samples per second, "
            "samples in the run summary)",
            expects=("args",),
            requires="transformers.trainer",
        ),
        Patch(
            target="transformers.trainer.Trainer._track_num_input_tokens",
            wrapper=cp_track_num_input_tokens,
            reason="under CP: num_input_tokens_seen sums the batches of all W ranks, and the P ranks of a CP "
            "group hold the same batch; count it once per group",
            expects=("inputs",),
            requires="transformers.trainer",
        ),
    ]
