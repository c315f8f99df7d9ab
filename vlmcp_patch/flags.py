"""Scoped flags shared across modules: each one is set for the duration of a `with scoped(FLAG, value):` block.

They carry "what the caller is doing right now" between a patch and the code it reaches (the user's
`disabled()` block, the Trainer's prediction step, accelerate's metrics gather, ...). They are
`contextvars`, so they follow threads and async tasks correctly. The state of one CP forward does not
live here: it travels in its `CPContext`.
"""

from __future__ import annotations

import contextlib
import contextvars

# Inside `vlmcp_patch.disabled()` (and generate()): forwards run as if CP were off.
BYPASS = contextvars.ContextVar("vlmcp_bypass", default=False)
# The Trainer's prediction step keeps whole-row logits: forwards with labels return them too.
FULL_LOGITS = contextvars.ContextVar("vlmcp_full_logits", default=False)
# Inside accelerate's gather_for_metrics / the Trainer's token count: keep one copy per CP group.
ONE_COPY_PER_CP_GROUP = contextvars.ContextVar("vlmcp_one_copy_per_cp_group", default=False)
# Accelerate is preparing a DeepSpeed engine: its "auto" batch sizes were derived for all W ranks.
BATCH_SIZED_BY_ACCELERATE = contextvars.ContextVar("vlmcp_batch_sized_by_accelerate", default=False)
# Modalities ("image", "video") of the running forward that carry a placeholder, not real inputs.
VISION_PLACEHOLDERS = contextvars.ContextVar("vlmcp_vision_placeholders", default=frozenset())


@contextlib.contextmanager
def scoped(flag: contextvars.ContextVar, value):
    """Set `flag` to `value` inside the block; the previous value comes back afterwards, even on error."""
    token = flag.set(value)
    try:
        yield value
    finally:
        flag.reset(token)
