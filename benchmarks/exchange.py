"""Bytes the CP exchanges move per layer and token, counted at the collectives, against the formula.

    python -m benchmarks.exchange [--sizes 2 4 3 6] [--tokens 301] [--models qwen3-vl qwen3.5] [--scale 1]

One forward + backward of a text-only row (so no vision exchange) through models with the released models' heads.
Per decoder layer and token of the row (padded), summed over the ranks' send buffers, forward and backward, for the
layout the package chooses (P = U x R: U ranks exchange sequence for heads, R subgroups form a ring; `python -m
vlmcp_patch --model ...` prints it):

* softmax attention, all-to-all among U (U > 1): q and the output (H x D each), k and v (H_kv' x D each, KV heads
  replicated to a multiple of U when fewer): 2 x (2H + 2H_kv') x D elements;
* softmax attention, ring of R (R > 1): k and v passed on R-1 times forward (2 H_kv' D each time), and k, v and their
  gradients R-1 times backward plus the gradients once more to their owner: (6(R-1) + 2) x H_kv' x D — R-1
  steps each way, each pass behind a block's compute (benchmarks/ring_overlap.py);
* gated DeltaNet, all-to-all among U: q and k (H_k' x d_k), v and the output (H_v x d_v), and the two gate inputs
  (H_v each): 2 x (2H_k' d_k + 2H_v d_v + 2H_v); across a ring its conv halos and state transfers move a fixed
  amount per layer, whatever the length (printed apart).

The ratio measured / formula must be 1.00.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import build_benchmark_model
from tests.helpers.harness import run_distributed
from vlmcp_patch.attention.heads import ulysses_of
from vlmcp_patch.fixtures.probes import GATHERS, SCATTERS, CollectiveProbe
from vlmcp_patch.layout import Split, kv_replication_factor


def formula_per_token(config, size: int) -> dict[str, float]:
    """Elements per token of the row, forward + backward, summed over the layers of each kind."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    ulysses = ulysses_of(text, size)
    ring = size // ulysses
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    kv_local = kv * kv_replication_factor(heads, kv, ulysses)
    out = {"all_to_all": 0, "ring": 0}
    if ulysses > 1:
        out["all_to_all"] += kinds.count("full_attention") * 2 * (2 * heads + 2 * kv_local) * text.head_dim
    if ring > 1:
        out["ring"] += kinds.count("full_attention") * (6 * (ring - 1) + 2) * kv_local * text.head_dim
    if "linear_attention" in kinds and ulysses > 1:
        hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
        hk_local = hk * kv_replication_factor(hv, hk, ulysses)
        deltanet = 2 * (2 * hk_local * text.linear_key_head_dim + 2 * hv * text.linear_value_head_dim + 2 * hv)
        out["all_to_all"] += kinds.count("linear_attention") * deltanet
    return out


def measure(rank: int, world_size: int, model_name: str, tokens: int, scale: int = 1) -> dict:
    import vlmcp_patch

    model = build_benchmark_model(model_name, scale=scale)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 120, (1, tokens), generator=g)
    vlmcp_patch.enable(cp_size=world_size)
    with CollectiveProbe(dtype=next(model.parameters()).dtype) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    element = next(model.parameters()).element_size()
    padded = Split(tokens, world_size, ulysses_of(model.config.get_text_config(), world_size)).padded_len
    gathered = sum(probe.bytes[name] for name in GATHERS)
    scattered = sum(probe.bytes[name] for name in SCATTERS)
    return {"all_to_all": probe.bytes["all_to_all_single"] / element / padded,
            "ring": probe.bytes["batch_isend_irecv"] / element / padded,
            "fixed": (gathered + scattered + probe.bytes["all_reduce"]) / world_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 3, 6])
    parser.add_argument("--tokens", type=int, default=301)
    parser.add_argument("--models", nargs="+", default=["qwen3-vl", "qwen3.5"])
    parser.add_argument("--scale", type=int, default=1, choices=[1, 4, 16],
                        help="widths and vocabulary divided by this (4: Qwen3.5 at P=6 within 24 GiB)")
    args = parser.parse_args()
    from benchmarks.common import MODELS

    print(f"{'model':10s} {'P':>2} {'U x R':>6} {'exchange':>11} {'elements/token measured':>24} {'formula':>9} "
          f"{'ratio':>6}")
    for name in args.models:
        for size in args.sizes:
            per_rank = run_distributed(measure, size, name, args.tokens, args.scale, timeout=3600)
            config = MODELS[name](scale=args.scale)
            formula = formula_per_token(config, size)
            ulysses = ulysses_of(config.get_text_config(), size)
            for exchange in ("all_to_all", "ring"):
                measured = sum(r[exchange] for r in per_rank)
                if formula[exchange] or measured:
                    ratio = measured / formula[exchange] if formula[exchange] else float("inf")
                    print(f"{name:10s} {size:>2} {f'{ulysses}x{size // ulysses}':>6} {exchange:>11} "
                          f"{measured:>24.1f} {formula[exchange]:>9d} {ratio:>6.2f}")
            if size // ulysses > 1:
                print(f"{name:10s} {size:>2} {'':>6} {'ring fixed':>11} {per_rank[0]['fixed'] / 1024:>21.1f} KiB "
                      "per rank, whatever the length (DeltaNet halos and state transfers; the loss's sum)")


if __name__ == "__main__":
    main()
