"""Every rank issues the same collectives in the same order (run inside the spawned ranks).

Each case runs a family on a batch at some P with `VLMCP_DEBUG_COLLECTIVES=1` — the ranks compare their collectives
after every forward and backward and raise on a difference — against stock at P=1 (`parity.compare`; a packed row:
its samples one by one, `packing_cases.compare_packed`), and reports how many collectives this rank issued and a
digest of their sequence, so that the test can compare the ranks itself.

The fixed cases are layouts that hung before the collectives were ordered; the sweep draws rows at random from a
seed (printed by the test, so a failure can be rerun): one to three samples, zero to three images or a video each
at the start, middle or end of a sample, sizes that straddle the shares and the ring's chunks, packed rows and
padded batches with a nearly empty row, and heads that give every U x R the CP size allows.
"""

from __future__ import annotations

import random

from tests.helpers.cases import build_batch
from vlmcp_patch.fixtures.data import Segment, make_packed_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment

# The row of the report: 5 text tokens, an image, 11 text tokens, and the row ends with a second image (148 tokens).
IMAGE_AT_THE_END = [[S(text=5), S(image=(64, 64)), S(text=11), S(image=(128, 128))]]
# A long text and a small image at the end: most ranks' slices hold no vision token.
SMALL_IMAGE_AT_THE_END = [[S(text=61), S(image=(16, 16))]]


def _qwen3_5_four_layers(**heads):
    """Qwen3.5 as reported: four layers, three of them DeltaNet."""
    config = tiny_qwen3_5_config(**heads)
    text = config.get_text_config()
    text.layer_types = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    text.num_hidden_layers = 4
    return config


REPORTED_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 2}
CONFIGS = {
    "qwen3_vl": lambda: tiny_qwen3_vl_config(**REPORTED_HEADS),
    "qwen3_5": lambda: _qwen3_5_four_layers(**REPORTED_HEADS, linear_num_key_heads=4, linear_num_value_heads=8),
    "qwen3_5_text": lambda: tiny_qwen3_5_config(text_only=True),
}

# (config, batch[, gradient checkpointing]) per P. At P=3 the second row of the padded batch starts exactly on the
# first token of the ring's last chunk: the rank holding chunks 0 and 5 used no state passed to it (it hung); with
# reentrant checkpointing each layer's collectives are ordered again when it is recomputed in backward.
FIXED = {
    3: [("qwen3_5_text", ("padded", [30, 6])), ("qwen3_5_text", ("padded", [30, 6]), "reentrant")],
    5: [("qwen3_5", IMAGE_AT_THE_END), ("qwen3_vl", SMALL_IMAGE_AT_THE_END)],
    6: [("qwen3_5", IMAGE_AT_THE_END), ("qwen3_vl", IMAGE_AT_THE_END)],
    7: [("qwen3_5", SMALL_IMAGE_AT_THE_END), ("qwen3_vl", IMAGE_AT_THE_END)],
    8: [("qwen3_5", IMAGE_AT_THE_END), ("qwen3_vl", SMALL_IMAGE_AT_THE_END)],
}


def _sequence_digest() -> tuple[int, int]:
    from vlmcp_patch.collectives.record import collective_log

    log = collective_log()
    return sum(log.issued.values()), log.digest


def _run(model, layout, world_size: int, packed: bool) -> dict:
    from tests.helpers.packing_cases import compare_packed
    from tests.helpers.parity import compare
    from vlmcp_patch.collectives.record import collective_log

    import vlmcp_patch

    collective_log().reset()
    vlmcp_patch.enable(debug_collectives=True)
    try:
        if packed:
            metrics = compare_packed(model, *make_packed_batch(layout, seed=5), world_size)
        else:
            metrics = compare(model, build_batch(layout, seed=7), world_size)
    finally:
        vlmcp_patch.enable(debug_collectives=False)
    count, digest = _sequence_digest()
    return {**metrics, "collectives": count, "sequence": digest}


def _model(name: str, checkpointing: str = ""):
    model = build_model(CONFIGS[name](), seed=1)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        model.train()
    return model


# Gradient checkpointing changes when the collectives run: reentrant recomputes a layer inside its one backward node
# (ordered within the layer by `run_ordered`), non-reentrant recomputes it at the first unpack of a tensor it saved,
# inside the main backward (torch's default, the HF default and FSDP2's `checkpoint_wrapper`).
CHECKPOINTING = ("", "reentrant", "non_reentrant")


def run_fixed(rank: int, world_size: int, checkpointing: str | None = None) -> dict:
    """The fixed cases of `FIXED[world_size]`, each against stock; with `checkpointing`, each under that gradient
    checkpointing instead of its own."""
    return {" ".join(map(str, case)): _run(_model(case[0], *(case[2:] if checkpointing is None else [checkpointing])),
                                           case[1], world_size, packed=False)
            for case in FIXED[world_size]}


# ---------------------------------------------------------------------------------------------------------
# The sweep

FAMILY_CONFIGS = {
    "qwen3_vl": lambda heads: tiny_qwen3_vl_config(**heads),
    "qwen3_vl_moe": lambda heads: tiny_qwen3_vl_config(moe=True, **heads),
    "qwen3_5": lambda heads: tiny_qwen3_5_config(**heads, **_deltanet_heads(heads)),
    "qwen3_5_moe": lambda heads: tiny_qwen3_5_config(moe=True, **heads, **_deltanet_heads(heads)),
}
HEADS = [(8, 2), (4, 2), (2, 1), (6, 2), (1, 1)]  # (query heads, KV heads): U = the largest divisor of P they allow
IMAGE_SIZES = [(16, 16), (16, 24), (24, 40), (32, 32), (48, 40)]


def _deltanet_heads(heads: dict) -> dict:
    return {"linear_num_key_heads": max(1, heads["num_key_value_heads"]),
            "linear_num_value_heads": heads["num_attention_heads"]}


def _sample(rng: random.Random) -> list[Segment]:
    """Text with zero to three images (or one video) at the start, middle or end."""
    pieces = [S(text=rng.randint(1, 14))]
    if rng.random() < 0.2:
        pieces.insert(rng.choice([0, 1]), S(video=(rng.randint(1, 3), 16, 16)))
    else:
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            pieces.insert(rng.randint(0, len(pieces)), S(image=rng.choice(IMAGE_SIZES)))
    if rng.random() < 0.5:
        pieces.append(S(text=rng.randint(1, 9)))
    return pieces


def draw_case(rng: random.Random) -> dict:
    """One sweep case: family, heads, layout (packed or padded) and its samples."""
    family = rng.choice(list(FAMILY_CONFIGS))
    queries, kv = rng.choice(HEADS)
    samples = [_sample(rng) for _ in range(rng.randint(1, 3))]
    packed = len(samples) > 1 and rng.random() < 0.5
    if not packed and len(samples) > 1 and rng.random() < 0.5:
        samples[-1] = [S(text=rng.randint(1, 2))]  # a nearly empty row of a padded batch
    return {"family": family, "heads": {"num_attention_heads": queries, "num_key_value_heads": kv},
            "samples": samples, "packed": packed}


def draw_sweep(seed: int, sizes: list[int], per_size: int) -> dict[int, list[dict]]:
    """`per_size` cases per CP size; the cases take no, reentrant and non-reentrant checkpointing in turn (the draws
    do not depend on it: a seed gives the same rows as before checkpointing was swept)."""
    rng = random.Random(seed)
    cases = {size: [draw_case(rng) for _ in range(per_size)] for size in sizes}
    for i, case in enumerate(c for size in sizes for c in cases[size]):
        case["checkpointing"] = CHECKPOINTING[i % len(CHECKPOINTING)]
    return cases


def run_sweep(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    from vlmcp_patch.attention.heads import ulysses_of

    out = []
    for case in cases:
        config = FAMILY_CONFIGS[case["family"]](case["heads"])
        model = build_model(config, seed=1)
        if case.get("checkpointing"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": case["checkpointing"] == "reentrant"})
            model.train()
        metrics = _run(model, case["samples"], world_size, case["packed"])
        metrics["ulysses"] = ulysses_of(config.get_text_config(), world_size)
        out.append(metrics)
    return out



# ---------------------------------------------------------------------------------------------------------
# Two forwards under one backward


def run_two_forwards(rank: int, world_size: int, checkpointing: str = "") -> dict:
    """`loss = model(a).loss + model(b).loss`, one backward (KTO's KL pass, a contrastive loss): two CP forwards, two
    chains of order tokens, whose backward collectives the engine interleaves by its own priority — the nodes of the
    later forward first, on every rank (they are created later, and none waits for the earlier forward's). Against
    stock, with the ranks' collectives compared after the backward (`VLMCP_DEBUG_COLLECTIVES=1`) and here."""
    import vlmcp_patch
    from vlmcp_patch.collectives.record import collective_log
    from vlmcp_patch.fixtures.compare import gradient_errors, rel_err, summed_over_group

    model = _model("qwen3_5_text", checkpointing)
    first, second = build_batch(("padded", [30, 6]), seed=7), build_batch(("padded", [11, 25]), seed=8)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(**first).loss + 0.5 * model(**second).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    vlmcp_patch.revert()
    try:
        ref_loss, ref_grads = loss_and_grads()
    finally:
        vlmcp_patch.apply()
    collective_log().reset()
    vlmcp_patch.enable(cp_size=world_size, debug_collectives=True)
    try:
        loss, grads = loss_and_grads()
    finally:
        vlmcp_patch.enable(cp_size=1, debug_collectives=False)
    summed = summed_over_group(grads, vlmcp_patch.get_cp_group(world_size).group)
    errors, _ = gradient_errors(summed, ref_grads)
    worst = max(errors, key=errors.get)
    count, digest = _sequence_digest()
    return {"loss": float(loss), "loss_err": rel_err(loss, ref_loss), "logits_err": 0.0, "grad_err": errors[worst],
            "worst_grad": worst, "missing_grads": sorted(set(ref_grads) - set(summed)), "collectives": count,
            "sequence": digest, "backward_collectives": collective_log().issued.get("backward", 0)}
