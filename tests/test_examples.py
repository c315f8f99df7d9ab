"""The examples' data path for released checkpoints (conversations through the checkpoint's processor),
exercised with the stock Qwen3-VL processor logic over the tiny tokenizer: nothing can be downloaded here."""

from __future__ import annotations

import torch
from example_common import ChatCollator, chat_dataset  # examples/ is on pytest's pythonpath (pyproject.toml)

from vlmcp_patch.fixtures.data import IMAGE_TOKEN_ID
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
from vlmcp_patch.fixtures.processor import tiny_processor


def test_chat_collator_batches_conversations_the_model_trains_on():
    rows = chat_dataset(4)
    batch = ChatCollator(tiny_processor())(rows)
    merged = 4  # spatial_merge_size ** 2 patches per image token
    assert int((batch["input_ids"] == IMAGE_TOKEN_ID).sum()) == int(batch["image_grid_thw"].prod(-1).sum()) // merged
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    model = build_model(tiny_qwen3_vl_config(), seed=0)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
