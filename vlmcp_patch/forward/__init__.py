"""The CP forward shared by every supported family, by job, in the order a forward walks them
(`top_level.enter_cp_forward`):

* `plan` — the forward's whole decision, once, before anything runs: the path, the row, the positions, each rank's
  slice and vision share, the attention layout, or a refusal (a frozen `ForwardPlan`). It asks
  `batch` (questions of the batch and the model, no judgement), applies `refusals` (every rule, each message word
  for word) and takes positions from `positions` (as stock computes them, or per sample);
* `agreement` — one small collective: every rank of the group checks it got the same batch and weights and made
  the same plan, and a refusal raises on every rank;
* `rows` — the plan laid out as one packed row, and its `CPContext`;
* `slicing` — the row cut to this rank's slice before the backbone runs;
* `vision` — each rank encodes its planned share of the images and video frames; features routed to their tokens;
* `decoder` — the patched text decoder: it runs this rank's slice;
* `top_level` — the patched user-facing forward: the above, the backbone, the loss, the logits or the
  per-token log-probabilities;
* `arguments` — a patched call's arguments as one dict, and the names of its keys;
* `generate` — `generate()` with CP bypassed, or split over the group's ranks in a split rollout.
"""
