"""Scoped flags shared across modules: each one is set for the duration of a `with scoped(FLAG, value):` block.

They carry "what the caller is doing right now" between a patch and the code it reaches (the user's
`disabled()` block, the Trainer's prediction step, accelerate's metrics gather, ...). They are
`contextvars`, so they follow threads and async tasks correctly. The state of one CP forward does not
live here: it travels in its `CPContext`.
"""

from __future__ import annotations

import contextlib
import contextvars

# Each flag has one setter (a `with scoped(...)` block) and names its readers.

# Forwards run as if CP were off. Set by: `distributed.disabled()` (the user's block, and generate()). Read by:
# `distributed.cp_requested`, `forward.top_level.cp_top_level_forward`, `integrations.trl`'s fused head.
BYPASS = contextvars.ContextVar("vlmcp_bypass", default=False)
# Forwards with labels return whole-row logits too. Set by: `integrations.trainer.cp_prediction_step` (the
# Trainer's evaluation keeps them). Read by: `forward.top_level.full_logits_requested`.
FULL_LOGITS = contextvars.ContextVar("vlmcp_full_logits", default=False)
# Gathers keep one copy per CP group. Set by: `integrations.accelerate.one_copy_per_cp_group_gathers` (around
# accelerate's gather_for_metrics and the Trainer's token count). Read by: `integrations.accelerate.cp_gather`.
ONE_COPY_PER_CP_GROUP = contextvars.ContextVar("vlmcp_one_copy_per_cp_group", default=False)
# Accelerate is preparing a DeepSpeed engine whose "auto" batch sizes it derived for all W ranks. Set by:
# `integrations.parallelism_config` (around accelerate's DeepSpeed preparation). Read by:
# `integrations.deepspeed.cp_deepspeed_initialize`.
BATCH_SIZED_BY_ACCELERATE = contextvars.ContextVar("vlmcp_batch_sized_by_accelerate", default=False)
# TRL's RL trainers see the data-parallel replicas, not the ranks. Set by: `integrations.trl_rl.replica_view`
# (around their batch building and loss). Read by: `integrations.trl_rl`'s accelerator properties and gathers.
REPLICA_VIEW = contextvars.ContextVar("vlmcp_replica_view", default=False)
# A rollout whose prompts are split over the ranks of the CP group. Set by:
# `integrations.trl_rl.generated_for_the_group` (with `split_rollouts`). Read by: `forward.generate`.
SPLIT_ROLLOUT = contextvars.ContextVar("vlmcp_split_rollout", default=False)
# Inside generate(): each rank decodes alone, its decoding steps not matched with other ranks'. Set by:
# `forward.generate.cp_bypassed_generate`. Read by: `integrations.vision_placeholder.matching_required`.
GENERATING = contextvars.ContextVar("vlmcp_generating", default=False)
# The forward returns per-token log-probabilities and entropies at this temperature (None: off). Set by:
# `logprobs.token_log_probs`. Read by: `forward.top_level`.
TOKEN_LOG_PROBS = contextvars.ContextVar("vlmcp_token_log_probs", default=None)
# The multimodal model is encoding videos (its `get_video_features` hands the pixels to `get_image_features`).
# Set by: `forward.vision.cp_video_features`. Read by: `forward.vision.cp_image_features`.
ENCODING_VIDEO = contextvars.ContextVar("vlmcp_encoding_video", default=False)
# Modalities ("image", "video") of the running forward that carry a placeholder, not real inputs. Set by:
# `integrations.vision_placeholder.matched_vision_forward`. Read by: the same module's mask and position patches.
VISION_PLACEHOLDERS = contextvars.ContextVar("vlmcp_vision_placeholders", default=frozenset())
# The batch (its pixel values maybe cut on the host) a trainer builds its model calls from, passing on chosen keys
# only. Set by: `integrations.trl.carrying_pixel_records` (TRL < 1.16's DPOTrainer). Read by:
# `forward.host_pixels.take_records`.
CARRIED_BATCH = contextvars.ContextVar("vlmcp_carried_batch", default=None)


@contextlib.contextmanager
def scoped(flag: contextvars.ContextVar, value):
    """Set `flag` to `value` inside the block; the previous value comes back afterwards, even on error."""
    token = flag.set(value)
    try:
        yield value
    finally:
        flag.reset(token)
