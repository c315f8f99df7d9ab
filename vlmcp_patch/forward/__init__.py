"""The CP forward shared by every supported family, split by concern.

* `arguments` — a patched call's arguments as one dict;
* `checks` — what cannot run exactly under CP, found before any compute;
* `agreement` — one small collective: every rank of the group checks it got the same batch and weights;
* `rows` — the batch as one packed row: packed rows as given, padding-free ordinary batches, positions;
* `top_level` — the patched user-facing forward: the above, the stock forward, the loss and the logits;
* `decoder` — the patched text decoder: cut its inputs to this rank's slice;
* `vision` — vision data parallelism: each rank encodes its share of the images and video frames;
* `generate` — `generate()` runs with CP bypassed.
"""
