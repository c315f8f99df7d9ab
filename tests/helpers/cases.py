"""The awkward batches every CP parity test runs, and the per-rank worker that runs them."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

from vlmcp_patch.fixtures.data import IMAGE_TOKEN_ID, Segment, make_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

S = Segment

# 55 tokens: not a multiple of 2 or 4; the shard edges at P=2 and P=4 fall inside image spans.
MULTI_IMAGE = [[S(text=5), S(image=(32, 24)), S(text=6), S(image=(16, 16)), S(text=4), S(image=(24, 40)), S(text=3)]]
TEXT_ONLY = [[S(text=23)]]
PADDED_PAIR = [
    [S(text=4), S(image=(16, 24)), S(text=9)],
    [S(text=7), S(image=(16, 16)), S(text=3), S(image=(24, 16)), S(text=2)],
]

# Vision data parallelism: one image (fewer than P), one big image beside small ones, a video of three
# temporal patch groups (larger than a rank's share: split by groups) beside an image.
ONE_IMAGE = [[S(text=7), S(image=(16, 24)), S(text=9)]]
BIG_AND_SMALL = [[S(text=3), S(image=(48, 40)), S(text=4), S(image=(16, 16)), S(image=(16, 16)), S(text=5)]]
VIDEO_AND_IMAGE = [[S(text=4), S(video=(3, 16, 16)), S(text=3), S(image=(24, 16)), S(text=2)]]

PACKED_TEXT = ("packed", [9, 14, 6])  # three text samples in one row, position_ids restarting at 0


def packed_text_batch(lengths: list[int], seed: int) -> dict:
    """One row of text samples in the DataCollatorWithFlattening convention (no attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    start = 0
    for n in lengths:
        labels[0, start] = -100
        start += n
    # use_cache=False: with a cache, stock sdpa ignores the packed boundaries (stock flash does not).
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}


def padded_text_batch(lengths: list[int], seed: int) -> dict:
    """Right-padded text rows with an attention_mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 120, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def with_positions(batch: dict, style: str) -> dict:
    """Explicit 2D position_ids for a right-padded batch, as RL stacks send them: cumsum of the mask, or
    HF's masked-fill (1 at padding)."""
    mask = batch["attention_mask"].long()
    positions = mask.cumsum(-1) - 1
    positions = positions.clamp(min=0) if style == "cumsum" else positions.masked_fill(mask == 0, 1)
    return {**batch, "position_ids": positions}


def build_batch(layout, seed: int) -> dict:
    if isinstance(layout, tuple) and layout[0] == "packed":
        return packed_text_batch(layout[1], seed)
    if isinstance(layout, tuple) and layout[0] == "padded":
        return padded_text_batch(layout[1], seed)
    if isinstance(layout, tuple) and layout[0] == "positions":
        return with_positions(build_batch(layout[2], seed), layout[1])
    return make_batch(layout, seed=seed)


QWEN3_VL_CASES = {
    "multi_image": ({}, MULTI_IMAGE),
    "text_only": ({}, TEXT_ONLY),
    "padded_pair": ({}, PADDED_PAIR),
    "one_kv_head": ({"num_key_value_heads": 1}, MULTI_IMAGE),
    "moe_multi_image": ({"moe": True}, MULTI_IMAGE),
    "moe_padded_pair": ({"moe": True}, PADDED_PAIR),
    "moe_text_only": ({"moe": True}, TEXT_ONLY),
    "packed_text": ({}, PACKED_TEXT),
    "grad_checkpointing": ({"gradient_checkpointing": True}, MULTI_IMAGE),
    "grad_checkpointing_reentrant": ({"gradient_checkpointing": "reentrant"}, MULTI_IMAGE),
    "moe_grad_checkpointing": ({"moe": True, "gradient_checkpointing": True}, VIDEO_AND_IMAGE),
    "lora_frozen_vision": ({"lora": True}, MULTI_IMAGE),
    "one_image": ({}, ONE_IMAGE),
    "big_and_small_images": ({}, BIG_AND_SMALL),
    "video_and_image": ({}, VIDEO_AND_IMAGE),
    "vision_replicated": ({"vision_dp": False}, MULTI_IMAGE),
    "padded_pair_masked_fill_positions": ({}, ("positions", "masked_fill", PADDED_PAIR)),
}

QWEN3_5_CASES = {
    "multi_image": ({}, MULTI_IMAGE),
    "text_only": ({}, TEXT_ONLY),
    "padded_pair": ({}, PADDED_PAIR),
    "one_key_head": ({"linear_num_key_heads": 1}, MULTI_IMAGE),
    "causal_lm": ({"text_only": True}, ("packed", [23])),
    "causal_lm_padded": ({"text_only": True}, ("padded", [19, 12])),
    "causal_lm_padded_cumsum_positions": ({"text_only": True}, ("positions", "cumsum", ("padded", [19, 12]))),
    "moe_multi_image": ({"moe": True}, MULTI_IMAGE),
    "moe_padded_pair": ({"moe": True}, PADDED_PAIR),
    "moe_causal_lm": ({"moe": True, "text_only": True}, ("packed", [23])),
    "one_image": ({}, ONE_IMAGE),
    "video_and_image": ({}, VIDEO_AND_IMAGE),
    "vision_grad_checkpointing": ({"gradient_checkpointing": True}, BIG_AND_SMALL),
    "grad_checkpointing_reentrant": ({"gradient_checkpointing": "reentrant"}, PADDED_PAIR),
    "moe_grad_checkpointing_reentrant": ({"moe": True, "gradient_checkpointing": "reentrant"}, VIDEO_AND_IMAGE),
}

FAMILIES = {
    "qwen3_vl": (tiny_qwen3_vl_config, QWEN3_VL_CASES),
    "qwen3_5": (tiny_qwen3_5_config, QWEN3_5_CASES),
}

# All-to-all calls of one forward+backward: Qwen3-VL's two attention layers exchange q, k, v and the
# output each way (2 x 8); gradient checkpointing replays the forward ones in backward (+8). Qwen3.5:
# one attention layer (8) and two DeltaNet layers exchanging q, k, v, the two gate inputs and the output
# (2 x 12); gradient checkpointing replays the 16 forward ones. With LoRA on q/v and everything below layer 0
# frozen, nothing needs the gradient of layer 0's keys (15).
EXCHANGES = {
    "qwen3_vl": {"default": 16, "grad_checkpointing": 24, "grad_checkpointing_reentrant": 24,
                 "moe_grad_checkpointing": 24, "lora_frozen_vision": 15},
    "qwen3_5": {"default": 32, "vision_grad_checkpointing": 48, "grad_checkpointing_reentrant": 48,
                "moe_grad_checkpointing_reentrant": 48},
}
VISION_BLOCKS = 2  # the tiny vision towers' depth


# transformers 5.2 without a cache (`use_cache=False`, or training with gradient checkpointing, which turns the cache
# off) reads a row's position ids as packed-sequence boundaries when building the causal mask; for one row of images
# and text without an attention mask, it takes the mRoPE temporal row for them and cuts the row at every image: stock
# masks the text after an image off the text before it (measured with the package reverted; with a cache, as by
# default in eval mode, stock attends over the whole row, and CP equals that). 5.6 builds the mask from the row; the
# releases between are not run.
STOCK_CUTS_ROWS_AT_IMAGES = Version(transformers.__version__) < Version("5.3")
ONE_ROW_OF_IMAGES_CHECKPOINTED = {("qwen3_vl", "grad_checkpointing"), ("qwen3_vl", "grad_checkpointing_reentrant"),
                                  ("qwen3_vl", "moe_grad_checkpointing"), ("qwen3_5", "vision_grad_checkpointing"),
                                  ("qwen3_5", "moe_grad_checkpointing_reentrant")}




def stock_cuts_the_row(family: str, case: str) -> bool:
    """Whether stock's reference for `case` of `family` is cut at its images on the installed release (above)."""
    return STOCK_CUTS_ROWS_AT_IMAGES and (family, case) in ONE_ROW_OF_IMAGES_CHECKPOINTED


def stock_cuts_this_row(batch: dict, without_cache) -> bool:
    """The same for any batch: one row with vision inputs and no attention mask, run without a cache (`use_cache=False`
    or gradient checkpointing in training), on a release that cuts such a row at its images (above)."""
    vision = any(batch.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))
    return (STOCK_CUTS_ROWS_AT_IMAGES and bool(without_cache) and vision and batch.get("attention_mask") is None
            and batch["input_ids"].shape[0] == 1)


def masked_where_stock_cuts(batch: dict, without_cache) -> dict:
    """`batch`, given an all-ones attention mask where stock cuts it at its images (`stock_cuts_this_row`): stock's
    reference then attends over the whole row, as CP and stock on other releases do."""
    if stock_cuts_this_row(batch, without_cache):
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def towers_take_patch_tables() -> bool:
    """Whether the installed transformers' vision towers take the per-patch tables (5.15 on), and so encode slices
    of all items' patches under CP (`forward/vision.py`)."""
    import importlib

    module = importlib.import_module("transformers.models.qwen3_vl.modeling_qwen3_vl")
    return hasattr(module, "get_vision_interpolation_indices_and_weights")


def vision_exchanges(batch: dict, cp_size: int, checkpointing: bool = False, frozen: bool = False,
                     patch_slices: bool | None = None) -> int:
    """All-to-alls of the vision passes: per modality, the one that routes each feature to the rank holding its
    token (and its reverse in backward, unless the tower is frozen); for the modalities that encode patch slices
    (items that do not balance over the ranks, where the tower takes the per-patch tables: `patch_slices`), also
    q, k, v and the output of every vision block, forward (replayed by gradient checkpointing) and backward (none for
    a frozen tower)."""
    from vlmcp_patch.layout import VisionShare

    patch_slices = towers_take_patch_tables() if patch_slices is None else patch_slices
    grids = [batch[key].tolist() for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None]
    per_block = 4 * (1 + (not frozen) + (checkpointing and not frozen))
    unbalanced = [grid for grid in grids if patch_slices and not VisionShare.of(grid, 2, cp_size).balanced()]
    return len(grids) * (1 + (not frozen)) + len(unbalanced) * VISION_BLOCKS * per_block


def image_spans(input_ids) -> list[tuple[int, int]]:
    spans, start = [], None
    row = input_ids[0].tolist() + [None]
    for i, tok in enumerate(row):
        if tok == IMAGE_TOKEN_ID and start is None:
            start = i
        elif tok != IMAGE_TOKEN_ID and start is not None:
            spans.append((start, i))
            start = None
    return spans


def crosses_shard_edge(input_ids, cp_size: int) -> bool:
    local = -(-input_ids.shape[1] // cp_size)
    edges = range(local, input_ids.shape[1], local)
    return any(a < e < b for a, b in image_spans(input_ids) for e in edges)


def with_lora_and_frozen_vision(model):
    """PEFT LoRA on the text attention projections, vision tower frozen (a common VLM recipe)."""
    from peft import LoraConfig, get_peft_model

    model.model.visual.requires_grad_(False)
    torch.manual_seed(5)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    return get_peft_model(model, lora)


def run_cases(rank: int, world_size: int, cp_size: int, family: str, names: list[str], attn: str = "sdpa") -> dict:
    """Parity metrics of each named case; with attn='flash_attention_2' through the CPU stand-in kernel."""
    import vlmcp_patch
    from tests.helpers import flash_standin
    from tests.helpers.parity import compare

    if attn == "flash_attention_2":
        flash_standin.install()
    results = {}
    for name in names:
        make_config, cases = FAMILIES[family]
        config_kwargs, layout = cases[name]
        config_kwargs = dict(config_kwargs)
        checkpointing = config_kwargs.pop("gradient_checkpointing", False)
        lora = config_kwargs.pop("lora", False)
        vision_dp = config_kwargs.pop("vision_dp", True)
        config = make_config(**config_kwargs)
        model = build_model(config, seed=1)
        if lora:
            model = with_lora_and_frozen_vision(model)
        if checkpointing:
            reentrant = checkpointing == "reentrant"
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.train()
        if attn == "flash_attention_2":
            flash_standin.use_flash(model)
        batch = build_batch(layout, seed=7)
        flash_standin.CALLS.clear()
        vlmcp_patch.enable(vision_dp=vision_dp)
        try:
            metrics = compare(model, batch, cp_size)
        finally:
            vlmcp_patch.enable(vision_dp=True)
        metrics["flash_calls"] = [c for c in flash_standin.CALLS if c["causal"]]
        metrics["seq_len"] = batch["input_ids"].shape[1]
        metrics["image_crosses_edge"] = crosses_shard_edge(batch["input_ids"], cp_size)
        metrics["num_layers"] = config.get_text_config().num_hidden_layers
        metrics["trainable"] = sum(p.requires_grad for p in model.parameters())
        metrics["num_kv_heads"] = config.get_text_config().num_key_value_heads
        metrics["linear_key_heads"] = getattr(config.get_text_config(), "linear_num_key_heads", None)
        grids = [batch.get(k) for k in ("image_grid_thw", "video_grid_thw") if batch.get(k) is not None]
        metrics["vision_patches"] = int(sum(int(g.prod(-1).sum()) for g in grids))
        metrics["vision_exchanges"] = vision_exchanges(batch, cp_size, checkpointing, lora) if vision_dp else 0
        results[name] = metrics
    return results
