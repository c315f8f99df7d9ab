"""Per-rank memory of one training step (forward + backward) at P = 1, 2, 4, with the released models'
per-token proportions (fewer layers), on a packed row of two samples.

    python -m benchmarks.memory [--model qwen3-vl|qwen3.5] [--sample text-heavy|image-heavy] [--sizes 1 2 4]
        [--step sft|grpo]

For each P it prints, for the busiest rank: the bytes autograd saves for backward (saved-tensor hooks;
parameters left out) and the peak of live tensor bytes during forward + backward (every storage created
in the step, the parameter gradients left out: they do not depend on P), each as R = P x bytes(rank) /
bytes(P=1) (ideal 1.0); the vision patches the rank encoded per vision pass against a perfect split (1.0 =
total / P); the step's wall-clock (reported, not a target: the machine is shared). P=1 is the package's own path
(a packed row takes it at P=1 too); stock transformers on the same row is printed beside it. Then every module whose
saved bytes do not shrink with P (P x rank > 1.2 x P=1), with its share.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import MIB, LiveBytes, ModuleStack, SavedTensors, build_benchmark_model, packed_sample, timed
from tests.helpers.harness import run_distributed

NOT_SHRINKING = 1.2


def completion_targets(batch: dict, share: float = 0.25) -> torch.Tensor:
    """GRPO scores the completion: the last `share` of each sample's tokens are its targets (-100 elsewhere)."""
    targets = torch.full_like(batch["input_ids"], -100)
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    for a, b in zip(starts[:-1], starts[1:]):
        first = b - max(1, int((b - a) * share))
        targets[0, first - 1 : b - 1] = batch["input_ids"][0, first:b]
    return targets


def grpo_scoring_loss(model, reference, batch: dict, beta: float = 0.04) -> torch.Tensor:
    """What a GRPO step computes on one batch: the reference's log-probabilities of the completion tokens (no
    gradient), the policy's (with it), and the clipped-ratio loss with a KL term, per token."""
    import vlmcp_patch

    targets = completion_targets(batch)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ref = vlmcp_patch.token_log_probs(reference, targets=targets, **inputs).log_probs
    out = vlmcp_patch.token_log_probs(model, targets=targets, **inputs)
    scored = (targets != -100).float()
    advantage = torch.linspace(-1, 1, scored.shape[1])[None]
    ratio = torch.exp(out.log_probs - out.log_probs.detach())
    kl = torch.exp(ref - out.log_probs) - (ref - out.log_probs) - 1
    return ((-ratio * advantage + beta * kl) * scored).sum() / scored.sum()


def measure(rank: int, world_size: int, model_name: str, sample: str, stock: bool = False, step_kind: str = "sft"):
    """One forward + backward of the sample on this rank (`grpo`: a GRPO scoring step, policy and reference); its
    saved bytes by module, peak live bytes, time."""
    import vlmcp_patch
    from vlmcp_patch.stats import STATS

    torch.manual_seed(0)
    model = build_benchmark_model(model_name)
    reference = build_benchmark_model(model_name).requires_grad_(False) if step_kind == "grpo" else None
    batch = packed_sample(sample)
    if stock:
        vlmcp_patch.revert()
    vlmcp_patch.enable(cp_size=world_size)
    STATS.drain()
    modules = ModuleStack(model)
    saved = SavedTensors(model, modules)
    weights = [*model.parameters(), *model.buffers(), *(reference.parameters() if reference is not None else ())]
    live = LiveBytes([*weights, *(v for v in batch.values() if torch.is_tensor(v))])

    def step():
        with modules, saved.recording(), live:
            loss = model(**batch).loss if reference is None else grpo_scoring_loss(model, reference, batch)
            loss.backward()
        return loss

    _, seconds = timed(step)
    # per vision pass: a GRPO step encodes the pictures twice (reference and policy)
    vision = (STATS.vision_patches // STATS.vision_passes if STATS.vision_passes
              else int(batch["image_grid_thw"].prod(-1).sum()))
    grads = live.ids_of(p.grad for p in model.parameters())
    return {
        "saved": saved.total,
        "saved_by_module": dict(saved.by_module),
        "peak": live.peak(excluded=grads),
        "vision_patches": vision,
        "seconds": seconds,
        "tokens": batch["input_ids"].shape[1],
        "all_patches": int(batch["image_grid_thw"].prod(-1).sum()),
    }


def _busiest(per_rank: list[dict], key: str) -> float:
    return max(r[key] for r in per_rank)


def _layer_kind(name: str) -> str:
    """Group the modules of all layers: layers.3.self_attn -> layers.*.self_attn."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)


def not_shrinking(reference: dict, per_rank: list[dict], size: int) -> list[tuple[str, float, float, float]]:
    """(module kind, MiB at P=1, MiB on the busiest rank, P x rank / P=1) of the saved bytes that do not shrink."""
    def by_kind(result):
        out = {}
        for name, n in result["saved_by_module"].items():
            out[_layer_kind(name)] = out.get(_layer_kind(name), 0) + n
        return out

    base = by_kind(reference)
    ranks = [by_kind(r) for r in per_rank]
    rows = []
    for kind in sorted(set(base) | {k for r in ranks for k in r}):
        mine = max(r.get(kind, 0) for r in ranks)
        ratio = size * mine / base[kind] if base.get(kind) else float("inf")
        if ratio > NOT_SHRINKING and mine > 0.001 * reference["saved"]:
            rows.append((kind, base.get(kind, 0) / MIB, mine / MIB, ratio))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-vl", choices=["qwen3-vl", "qwen3.5"])
    parser.add_argument("--sample", default="text-heavy", choices=["text-heavy", "image-heavy"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--step", default="sft", choices=["sft", "grpo"],
                        help="sft: the loss of every token; grpo: a GRPO scoring step (policy and reference "
                        "log-probabilities of the completion tokens, vlmcp_patch.token_log_probs)")
    args = parser.parse_args()

    stock = None if args.step == "grpo" else run_distributed(measure, 1, args.model, args.sample, True,
                                                              timeout=3600)[0]
    results = {p: run_distributed(measure, p, args.model, args.sample, False, args.step, timeout=3600)
               for p in args.sizes}
    reference = results[1][0]
    print(f"{args.model}, {args.sample}: {reference['tokens']} tokens, {reference['all_patches']} vision patches")
    print(f"{'P':>9} {'saved MiB':>10} {'R saved':>8} {'peak MiB':>9} {'R peak':>7} {'patches':>8} {'patch ratio':>11}"
          f" {'step s':>7}")
    if stock is not None:
        print(f"{'1 stock':>9} {stock['saved'] / MIB:>10.1f} {'':>8} {stock['peak'] / MIB:>9.1f} {'':>7} "
              f"{stock['vision_patches']:>8d} {'':>11} {stock['seconds']:>7.1f}")
    for size, per_rank in results.items():
        saved, peak = _busiest(per_rank, "saved"), _busiest(per_rank, "peak")
        patches = _busiest(per_rank, "vision_patches")
        print(f"{size:>9} {saved / MIB:>10.1f} {size * saved / reference['saved']:>8.3f} {peak / MIB:>9.1f} "
              f"{size * peak / reference['peak']:>7.3f} {patches:>8d}"
              f" {size * patches / reference['all_patches']:>11.3f}"
              f" {_busiest(per_rank, 'seconds'):>7.1f}")
    for size, per_rank in results.items():
        if size == 1:
            continue
        rows = not_shrinking(reference, per_rank, size)
        print(f"saved tensors that do not shrink at P={size} (P x busiest rank > {NOT_SHRINKING} x P=1):"
              + ("" if rows else " none"))
        for kind, base, mine, ratio in rows:
            print(f"  {kind:60s} P=1 {base:8.2f} MiB  rank {mine:8.2f} MiB  ratio {ratio:5.2f}")


if __name__ == "__main__":
    main()
