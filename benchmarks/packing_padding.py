"""Padding fraction of the packing collator against padded batching, on a multimodal length mix.

    python -m benchmarks.packing_padding [--budget 16384] [--batch-size 4] [--samples 4000]

The length distribution imitates fine-tuning data for long multimodal context: short text-only chats
and agent traces with one to eight screenshots (each 256-1280 vision tokens) plus text. Both numbers
come from the same samples in one run; only ratios are meaningful, not timings.
"""

from __future__ import annotations

import argparse

import torch

from vlmcp_patch.collator import pack_into_bins


def padding_fraction_padded(lengths: list[int], batch_size: int) -> float:
    """Share of padding tokens when consecutive samples are batched and padded to the longest."""
    groups = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    return 1 - sum(lengths) / sum(max(g) * len(g) for g in groups)


def padding_fraction_packed(lengths: list[int], max_tokens: int) -> float:
    """Share of the token budget left empty when samples are packed into rows of `max_tokens`."""
    return 1 - sum(lengths) / (len(pack_into_bins(lengths, max_tokens)) * max_tokens)


def sample_lengths(n: int, budget: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(n):
        text = float(torch.distributions.LogNormal(6.2, 0.8).sample())
        if torch.rand((), generator=g) < 0.4:
            lengths.append(int(text))
            continue
        images = 1 + int(torch.randint(0, 8, (), generator=g))
        vision = int(torch.randint(256, 1281, (images,), generator=g).sum())
        lengths.append(int(text) + vision + 2 * images)
    return [max(16, min(budget, n)) for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16384, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per padded batch")
    parser.add_argument("--samples", type=int, default=4000)
    args = parser.parse_args()
    torch.manual_seed(0)
    lengths = sample_lengths(args.samples, args.budget)
    padded = padding_fraction_padded(lengths, args.batch_size)
    packed = padding_fraction_packed(lengths, args.budget)
    rows = len(pack_into_bins(lengths, args.budget))
    median = sorted(lengths)[len(lengths) // 2]
    print(f"{len(lengths)} samples, {sum(lengths)} tokens, median {median}, max {max(lengths)}")
    print(f"padded batches of {args.batch_size}: {padded:.1%} of computed tokens are padding")
    print(f"packed rows of {args.budget} tokens ({rows} rows): {packed:.1%} of the budget is empty")
    print(f"tokens computed per real token: padded {1 / (1 - padded):.3f}, packed {1 / (1 - packed):.3f}")


if __name__ == "__main__":
    main()
