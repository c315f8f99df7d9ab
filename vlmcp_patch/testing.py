"""Tiny random-init model configs and synthetic multimodal batches.

Used by the test suite, the examples and the README's demo job. Everything is built in code: no
weights, tokenizers or data sets are downloaded. Images are drawn with PIL and turned into
`pixel_values` by the real `Qwen2VLImageProcessorPil`, so the vision inputs have the exact layout a
real processor produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Token ids of the tiny vocabulary. The multimodal ids sit at the top of the vocabulary like in the
# released checkpoints; ordinary text tokens are drawn below them.
VOCAB_SIZE = 128
IMAGE_TOKEN_ID = 120
VIDEO_TOKEN_ID = 121
VISION_START_TOKEN_ID = 122
VISION_END_TOKEN_ID = 123
PAD_TOKEN_ID = 0
TEXT_TOKEN_RANGE = (1, 120)

PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2


def _vision_config(out_hidden_size: int) -> dict:
    return dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        in_channels=3,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    )


def _text_config(num_attention_heads: int, num_key_value_heads: int, head_dim: int) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        pad_token_id=PAD_TOKEN_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    )


def _multimodal_config(config_class, text: dict, vision: dict, attn_implementation: str):
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    return config


def tiny_qwen3_vl_config(
    *, moe: bool = False, num_attention_heads: int = 4, num_key_value_heads: int = 2, attn_implementation="sdpa"
):
    """A two-layer Qwen3-VL (or Qwen3-VL-MoE) config small enough for multi-process CPU tests."""
    head_dim = 8
    text = _text_config(num_attention_heads, num_key_value_heads, head_dim)
    if moe:
        from transformers import Qwen3VLMoeConfig as Config

        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    else:
        from transformers import Qwen3VLConfig as Config
    return _multimodal_config(Config, text, _vision_config(text["hidden_size"]), attn_implementation)


def tiny_qwen3_5_config(
    *,
    moe: bool = False,
    text_only: bool = False,
    num_attention_heads: int = 8,
    num_key_value_heads: int = 2,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 8,
    attn_implementation: str = "sdpa",
):
    """A three-layer Qwen3.5 (linear, full, linear attention); key heads != value heads in the DeltaNet layers."""
    text = _text_config(num_attention_heads, num_key_value_heads, head_dim=16)
    text.update(
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_hidden_layers=3,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
        },
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        from transformers import Qwen3_5MoeConfig as Config, Qwen3_5MoeTextConfig as TextConfig
    else:
        from transformers import Qwen3_5Config as Config, Qwen3_5TextConfig as TextConfig
    if text_only:
        config = TextConfig(**text)
        config._attn_implementation = attn_implementation
        return config
    vision = _vision_config(text["hidden_size"])
    vision.pop("deepstack_visual_indexes")
    return _multimodal_config(Config, text, vision, attn_implementation)


def build_model(config, seed: int = 0, dtype=torch.float32):
    """Instantiate the top-level class of `config` (image-text-to-text, or causal LM for a text config)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=config._attn_implementation)
    return model.to(dtype)


def image_processor():
    """The real Qwen2-VL PIL image processor, configured for the tiny vision tower."""
    from transformers import Qwen2VLImageProcessorPil

    factor = PATCH_SIZE * MERGE_SIZE
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": factor * factor, "longest_edge": 64 * factor * factor},
    )


def make_image(width: int, height: int, seed: int):
    """A deterministic RGB picture with some structure (gradients and a box), drawn with PIL."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (3,), generator=g).tolist()
    img = Image.new("RGB", (width, height), tuple(base))
    draw = ImageDraw.Draw(img)
    for i in range(0, width, 3):
        draw.line([(i, 0), (i, height)], fill=((base[0] + 7 * i) % 256, base[1], (base[2] + 3 * i) % 256))
    x0, y0 = width // 4, height // 4
    draw.rectangle([x0, y0, x0 + width // 3, y0 + height // 3], fill=(255 - base[0], 40, 200))
    return img


@dataclass
class Segment:
    """A piece of a synthetic sample: `text` tokens or one image of `size` (width, height)."""

    text: int = 0
    image: tuple[int, int] | None = None


@dataclass
class Sample:
    input_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    images: list = field(default_factory=list)


def build_sample(segments: list[Segment], seed: int = 0, processor=None) -> tuple[Sample, list]:
    """Token ids, modality ids and PIL images of one sample; image spans are sized by `processor`."""
    processor = processor or image_processor()
    g = torch.Generator().manual_seed(seed)
    ids, types, images = [], [], []
    for i, seg in enumerate(segments):
        if seg.image is None:
            ids += torch.randint(*TEXT_TOKEN_RANGE, (seg.text,), generator=g).tolist()
            types += [0] * seg.text
            continue
        img = make_image(*seg.image, seed=seed * 100 + i)
        grid = processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
        n = int(grid.prod()) // (MERGE_SIZE**2)
        ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * n + [VISION_END_TOKEN_ID]
        types += [0] + [1] * n + [0]
        images.append(img)
    return Sample(torch.tensor(ids), torch.tensor(types), images), images


def collate(samples: list[Sample], processor=None, *, labels: bool = True) -> dict:
    """Right-pad samples into a batch with `attention_mask` (omitted for a single sample)."""
    processor = processor or image_processor()
    length = max(len(s.input_ids) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), PAD_TOKEN_ID)
    types = torch.zeros((batch, length), dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[b, :n] = s.input_ids
        types[b, :n] = s.mm_token_type_ids
        mask[b, :n] = 1
    out = {"input_ids": input_ids, "mm_token_type_ids": types}
    if batch > 1 or not bool(mask.all()):
        out["attention_mask"] = mask
    images = [img for s in samples for img in s.images]
    if images:
        vision = processor(images=images, return_tensors="pt")
        out["pixel_values"] = vision["pixel_values"]
        out["image_grid_thw"] = vision["image_grid_thw"]
    if labels:
        lab = input_ids.clone()
        lab[mask == 0] = -100
        lab[types != 0] = -100
        out["labels"] = lab
    return out


def make_batch(layout: list[list[Segment]], seed: int = 0, *, labels: bool = True) -> dict:
    """A model-ready batch: one sample per entry of `layout`, right-padded when there are several."""
    processor = image_processor()
    samples = [build_sample(segs, seed=seed + i, processor=processor)[0] for i, segs in enumerate(layout)]
    return collate(samples, processor, labels=labels)


def make_packed_batch(layout: list[list[Segment]], seed: int = 0, *, return_cu_seq_lens: bool = False) -> tuple:
    """(packed row, per-sample batches): the samples of `layout` packed into one row, and each alone."""
    from .collator import MultimodalPackingCollator

    processor = image_processor()
    samples, alone = [], []
    for i, segs in enumerate(layout):
        sample, _ = build_sample(segs, seed=seed + i, processor=processor)
        item = {"input_ids": sample.input_ids, "mm_token_type_ids": sample.mm_token_type_ids}
        if sample.images:
            item.update({k: v for k, v in processor(images=sample.images, return_tensors="pt").items()})
        samples.append(item)
        alone.append(collate([sample], processor))
    row = MultimodalPackingCollator(return_cu_seq_lens=return_cu_seq_lens)(samples)
    return row, alone
