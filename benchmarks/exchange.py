"""Bytes the CP exchanges move per layer and token, counted at the collectives, against the Ulysses formula.

    python -m benchmarks.exchange [--sizes 2 4] [--tokens 301]

One forward + backward of a text-only row (so no vision gather) through models with the released models'
heads. Per decoder layer and token of the row (padded to a multiple of P), summed over the ranks' send
buffers of all-to-all and all-gather, forward and backward:

* softmax attention: q and the output (H x D each), k and v (H_kv' x D each, KV heads replicated to a
  multiple of P when fewer): 2 x (2H + 2H_kv') x D elements;
* gated DeltaNet: q and k (H_k' x d_k), v and the output (H_v x d_v), and the two gate inputs (H_v each):
  2 x (2H_k' d_k + 2H_v d_v + 2H_v) elements by all-to-all.

The ratio measured / formula must be 1.00.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import build_benchmark_model
from tests.helpers.harness import run_distributed
from vlmcp_patch.fixtures.probes import CollectiveProbe
from vlmcp_patch.layout import kv_replication_factor, round_up


def formula_per_token(config, size: int) -> dict[str, float]:
    """Elements per token of the row, forward + backward, summed over the layers of each kind."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    attention = 2 * (2 * heads + 2 * kv * kv_replication_factor(heads, kv, size)) * text.head_dim
    out = {"all_to_all": kinds.count("full_attention") * attention, "all_gather": 0}
    if "linear_attention" in kinds:
        hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
        hk_local = hk * kv_replication_factor(hv, hk, size)
        deltanet = 2 * (2 * hk_local * text.linear_key_head_dim + 2 * hv * text.linear_value_head_dim + 2 * hv)
        out["all_to_all"] += kinds.count("linear_attention") * deltanet
    return out


def measure(rank: int, world_size: int, model_name: str, tokens: int) -> dict:
    import vlmcp_patch

    model = build_benchmark_model(model_name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 120, (1, tokens), generator=g)
    vlmcp_patch.enable(cp_size=world_size)
    with CollectiveProbe(dtype=next(model.parameters()).dtype) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    element = next(model.parameters()).element_size()
    padded = round_up(tokens, world_size)
    gathered = sum(probe.bytes[name] for name in ("all_gather", "all_gather_into_tensor", "all_gather_single"))
    return {"all_to_all_single": probe.bytes["all_to_all_single"] / element / padded,
            "all_gather": gathered / element / padded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=301)
    args = parser.parse_args()
    from benchmarks.common import MODELS

    print(f"{'model':10s} {'P':>2} {'collective':>11} {'elements/token measured':>24} {'formula':>9} {'ratio':>6}")
    for name, make_config in MODELS.items():
        for size in args.sizes:
            per_rank = run_distributed(measure, size, name, args.tokens, timeout=3600)
            formula = formula_per_token(make_config(), size)
            for collective in ("all_to_all", "all_gather"):
                measured = sum(r.get(f"{collective}_single" if collective == "all_to_all" else collective, 0)
                               for r in per_rank)
                if formula[collective] or measured:
                    ratio = measured / formula[collective] if formula[collective] else float("inf")
                    print(f"{name:10s} {size:>2} {collective:>11} {measured:>24.1f} {formula[collective]:>9d} "
                          f"{ratio:>6.2f}")


if __name__ == "__main__":
    main()
