"""The official Qwen3-VL fine-tuning script's packed mode, as the tests run it: flash-attn installed (the CPU
stand-in), `import vlmcp_patch`, the script's own attention patch (`fixtures.official.install_packing_attention`),
then the HF Trainer example on the script's flattened batches. Arguments are hf_trainer_sft.py's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from tests.helpers import flash_standin  # noqa: E402

flash_standin.install()  # flash-attn is installed: vlmcp_patch wraps its entry points at import

import transformers.models.qwen3_vl.modeling_qwen3_vl as modeling  # noqa: E402

import vlmcp_patch  # noqa: E402, F401
from vlmcp_patch.fixtures.official import install_packing_attention  # noqa: E402

install_packing_attention(modeling)

import hf_trainer_sft  # noqa: E402
from example_common import finish_distributed  # noqa: E402

hf_trainer_sft.main(sys.argv[1:])
finish_distributed()
