"""The LM head alone — stock's (whole logits, cross-entropy, autograd) against the package's fused chunked head —
by how many chunks the slice is cut into: what the chunk rule in `vlmcp_patch/loss.py` trades.

    python -m benchmarks.head [--vocab 151936] [--hidden 2048] [--tokens 256 1024] [--chunks 1 2 3 4 9]

One thread, fp32, a random head of the released proportions (Qwen3-VL-2B by default; Qwen3.5: --vocab 248320).
For each slice length it prints stock's forward + backward CPU time and, for each number of chunks, the fused
head's time over stock's and its fp32 logits per chunk as a multiple of the slice's hidden states (the
memory the rule bounds); then the chunks the package's rule picks. Each time is the least of `--repeats` steps.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from vlmcp_patch.loss import chunk_tokens, head_loss_sum


def least_cpu_time(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 4, 9])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=0.02)
    print(f"vocabulary {args.vocab}, hidden {args.hidden}: fused head CPU time / stock's (fp32 logits per chunk, "
          "x the slice's hidden states)")
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.hidden, requires_grad=True)
        labels = torch.randint(0, args.vocab, (tokens,))

        def stock():
            head.zero_grad(set_to_none=True)
            F.cross_entropy(head(hidden).float(), labels, reduction="sum").backward()

        def fused(chunk):
            head.zero_grad(set_to_none=True)
            head_loss_sum(hidden, head, labels, chunk).backward()

        base = least_cpu_time(stock, args.repeats)
        cells = []
        for count in args.chunks:
            chunk = math.ceil(tokens / count)
            ratio = least_cpu_time(lambda: fused(chunk), args.repeats) / base
            cells.append(f"{count} chunks {ratio:.3f} ({chunk * args.vocab / (tokens * args.hidden):.1f}x)")
        rule = chunk_tokens(tokens, args.hidden, args.vocab)
        print(f"{tokens:>6} tokens: stock {base:.4f} s | " + " | ".join(cells)
              + f" | the rule: {math.ceil(tokens / rule)} chunks of {rule}", flush=True)


if __name__ == "__main__":
    main()
