"""What a rank allocates under CP: every tensor created during one forward + backward, against the lengths of the
whole row (tokens, vision tokens, vision patches). Run inside the spawned ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmcp_patch.fixtures.data import Segment, make_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config
from vlmcp_patch.layout import kv_replication_factor, round_up

S = Segment
# One image-heavy row (two thirds vision tokens) of 22 pictures of three sizes, and a video beside two pictures and
# text. The video row's vision lengths exceed 64 (the delta rule of transformers before 5.18 builds every (i x i)
# block up to its chunk of 64), no rank's slice holds all of a modality's tokens, and the merged token counts are
# not multiples of P (a rank's share of the patches would equal them).
IMAGES = [S(text=6)] + [piece for i in range(22) for piece in (S(image=[(32, 24), (40, 32), (24, 24)][i % 3]),
                                                                  S(text=5 + i % 4))]
VIDEO = [S(text=40), S(image=(56, 80)), S(text=20), S(video=(3, 56, 72)), S(text=30), S(image=(48, 64)),
         S(text=25)]

CONFIGS = {
    "qwen3_vl": lambda: tiny_qwen3_vl_config(),
    # Four attention heads and four DeltaNet value heads: at P=4 every head-sharded tensor is narrower per token
    # than a hidden state, so a whole-row hidden state cannot pass for one.
    "qwen3_5": lambda: tiny_qwen3_5_config(num_attention_heads=4, linear_num_value_heads=4),
}


def head_sharded_width(text, size: int) -> int:
    """The widest per-token tensor a rank holds for the whole row: an exchanged tensor's heads (q; k, v after KV
    replication; the DeltaNet conv channels), divided over the ranks."""
    widths = [text.num_attention_heads * text.head_dim,
              text.num_key_value_heads * kv_replication_factor(text.num_attention_heads, text.num_key_value_heads,
                                                               size) * text.head_dim]
    if getattr(text, "linear_num_value_heads", None):
        keys = text.linear_num_key_heads * kv_replication_factor(text.linear_num_value_heads,
                                                                 text.linear_num_key_heads, size)
        values = text.linear_num_value_heads * text.linear_value_head_dim
        widths += [2 * keys * text.linear_key_head_dim + values]
    return max(widths) // size


def whole_row_lengths(batch: dict, size: int, merge: int = 2) -> dict[str, int]:
    """The lengths no float tensor of a rank may have (beyond head-sharded widths): the row, the row padded to a
    multiple of P, each modality's vision tokens, all of them, and each modality's patches."""
    seq = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].shape[1]
    lengths = {"tokens": seq, "padded tokens": round_up(seq, size)}
    for modality, grid_key in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
        if batch.get(grid_key) is not None:
            patches = int(batch[grid_key].prod(-1).sum())
            lengths[f"{modality} patches"] = patches
            lengths[f"{modality} tokens"] = patches // merge**2
    tokens = [n for k, n in lengths.items() if k.endswith("image tokens") or k.endswith("video tokens")]
    if len(tokens) > 1:
        lengths["vision tokens"] = sum(tokens)
    return lengths


def gathered_route(local, held, owner, cp):
    """The control: every rank first gathers every rank's features (all of the row's vision tokens), then keeps
    its own — the features are right, but each rank holds all of them."""
    from vlmcp_patch.collectives.differentiable import gather_keep_local_grad

    counts = [h.numel() for h in held]
    padded = F.pad(local, (0, 0, 0, max(counts) - local.shape[0]))
    everything = gather_keep_local_grad(padded, 0, cp.group, cp.size, cp.rank)
    rows = torch.cat([torch.arange(r * max(counts), r * max(counts) + n) for r, n in enumerate(counts)])
    by_token = everything.index_select(0, rows)[torch.argsort(torch.cat(held))]
    return by_token.index_select(0, (owner == cp.rank).nonzero().flatten())


def allocations(rank: int, world_size: int, family: str, sample: str, control: bool = False) -> dict:
    """Under CP with gradient checkpointing (decoder layers and vision blocks): the float tensors created during
    one forward + backward that have a whole-row length and are wider per token than a head-sharded tensor."""
    import vlmcp_patch
    from vlmcp_patch.fixtures.probes import CreatedTensors
    from vlmcp_patch.forward import vision

    model = build_model(CONFIGS[family](), seed=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = make_batch([IMAGES if sample == "images" else VIDEO], seed=3)
    text = model.config.get_text_config()
    limit = head_sharded_width(text, world_size)
    lengths = whole_row_lengths(batch, world_size)
    vlmcp_patch.enable(cp_size=world_size)
    original = vision.route_to_owners
    if control:
        vision.route_to_owners = gathered_route
    try:
        with CreatedTensors() as probe:
            model(**batch).loss.backward()
    finally:
        vision.route_to_owners = original
        vlmcp_patch.enable(cp_size=1)
    offending = sorted({(shape, str(dtype), op) for shape, dtype, op in probe.created
                        if dtype.is_floating_point and any(
                            n == length and torch.Size(shape).numel() > limit * length
                            for n in shape for length in lengths.values())})
    return {
        "offending": offending,
        "created": len(probe.created),
        "limit": limit,
        "lengths": lengths,
        "hidden": text.hidden_size,
        "pixel_width": batch[next(k for k in ("pixel_values", "pixel_values_videos") if k in batch)].shape[-1],
        "local": round_up(lengths["tokens"], world_size) // world_size,
    }
