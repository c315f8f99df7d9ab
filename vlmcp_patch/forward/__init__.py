"""The CP forward shared by every supported family, split by concern.

* `arguments` — a patched call's arguments as one dict;
* `checks` — the one validation pass: every rule about a batch, returning its plan (or what to raise) before
  any compute;
* `agreement` — one small collective: every rank of the group checks it got the same batch and weights;
* `positions` — the positions stock computes for the caller's batch, when none are given;
* `rows` — the plan laid out as one packed row: packed rows as given, padding-free ordinary batches;
* `top_level` — the patched user-facing forward: the above, the backbone, the loss, the logits or the
  per-token log-probabilities;
* `decoder` — the patched text decoder: cut its inputs to this rank's slice;
* `vision` — vision data parallelism: each rank encodes its share of the images and video frames;
* `generate` — `generate()` with CP bypassed, or split over the group's ranks in a split rollout.
"""
