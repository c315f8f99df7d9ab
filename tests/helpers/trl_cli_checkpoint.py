"""A tiny Qwen3-VL checkpoint folder with its processor, and a local image-text data set, for TRL's `trl sft` CLI
(`tests/test_autowrapt.py`): what a CLI user has on disk, built from the package's fixtures (nothing downloaded).

The tiny processor has no video processor (the stock `Qwen3VLProcessor` would build one, which needs torchvision):
its class is saved beside the checkpoint and named in `auto_map`, so `AutoProcessor.from_pretrained(folder,
trust_remote_code=True)` — what the CLI does with `--trust_remote_code` — loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

PROCESSOR_CODE = '''from transformers import Qwen3VLProcessor


class TinyQwen3VLProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` with only `image_processor` and `tokenizer` as attributes (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
'''

# (question, answer, sizes (width, height) of the images shown before the question); some samples text-only
CONVERSATIONS = [
    ("What is in the picture?", "A blue box on stripes.", [(32, 24)]),
    ("Compare the two images.", "The left one is wider; both have a box.", [(16, 16), (24, 40)]),
    ("Say hello.", "Hello! How can I help you today?", []),
    ("Describe the colors.", "Mostly red with a purple square.", [(16, 32)]),
]


def write_checkpoint(folder: Path) -> Path:
    """The tiny random-init Qwen3-VL (sdpa) and its processor, saved into `folder`."""
    from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_vl_config
    from vlmcp_patch.fixtures.processor import tiny_processor

    build_model(tiny_qwen3_vl_config(attn_implementation="sdpa"), seed=0).save_pretrained(folder)
    tiny_processor().save_pretrained(folder)
    (folder / "processing_tiny.py").write_text(PROCESSOR_CODE)
    config = json.loads((folder / "processor_config.json").read_text())
    config["auto_map"] = {"AutoProcessor": "processing_tiny.TinyQwen3VLProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_dataset(folder: Path, n: int = 16) -> Path:
    """`n` conversations ("messages" + "images") as one parquet file: `load_dataset(folder)` gives its train split."""
    from datasets import Dataset

    from vlmcp_patch.fixtures.data import make_image

    rows = []
    for i in range(n):
        question, answer, sizes = CONVERSATIONS[i % len(CONVERSATIONS)]
        rows.append({"images": [make_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)],
                     "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    folder.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).to_parquet(str(folder / "train.parquet"))
    return folder
