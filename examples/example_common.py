"""What the example scripts share: the model (the embedded tiny model or a released checkpoint), the data
(synthetic samples for the tiny models, conversations with pictures through a checkpoint's processor),
the trained weights gathered from a sharded engine, and a clean end of the process group.

The examples import it as a sibling module (`python examples/<script>.py` puts this folder on the path).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vlmcp_patch.fixtures.data import PaddingCollator, make_image, synthetic_dataset
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

TINY = {
    "tiny-qwen3-vl": tiny_qwen3_vl_config,
    "tiny-qwen3.5": tiny_qwen3_5_config,
    # Two query heads (and two DeltaNet value heads): four or eight ranks go beyond the heads, a Ulysses x ring layout.
    "tiny-qwen3-vl-2heads": lambda **kw: tiny_qwen3_vl_config(num_attention_heads=2, num_key_value_heads=1, **kw),
    "tiny-qwen3.5-2heads": lambda **kw: tiny_qwen3_5_config(num_attention_heads=2, num_key_value_heads=1,
                                                            linear_num_key_heads=1, linear_num_value_heads=2, **kw),
}

# Conversations for a released checkpoint: (question, answer, sizes (width, height) of the pictures shown)
CONVERSATIONS = [
    ("What is in the picture?", "A blue box on stripes.", [(320, 240)]),
    ("Compare the two images.", "The left one is wider; both have a box.", [(256, 256), (240, 400)]),
    ("Say hello.", "Hello! How can I help you today?", []),
    ("Describe the colors.", "Mostly red with a purple square.", [(256, 512)]),
]


def chat_dataset(n: int, seed: int = 0) -> list:
    rows = []
    for i in range(n):
        question, answer, sizes = CONVERSATIONS[i % len(CONVERSATIONS)]
        user = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": question}]
        rows.append({
            "images": [make_image(w, h, seed=seed + 10 * i + j) for j, (w, h) in enumerate(sizes)],
            "messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
        })
    return rows


class ChatCollator:
    """Conversations with pictures through a checkpoint's own processor (chat template, image processor).

    Labels are the tokens themselves with padding ignored (the model shifts them).
    """

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, rows):
        texts = [self.processor.apply_chat_template(row["messages"], tokenize=False) for row in rows]
        images = [image for row in rows for image in row["images"]] or None
        batch = dict(self.processor(text=texts, images=images, return_tensors="pt", padding=True))
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch


def load_model(name: str, attn: str):
    """The embedded tiny model, or a released checkpoint (e.g. Qwen/Qwen3-VL-2B-Instruct; bf16 on GPUs)."""
    if name in TINY:
        return build_model(TINY[name](attn_implementation=attn), seed=0)
    from transformers import AutoModelForImageTextToText

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForImageTextToText.from_pretrained(name, attn_implementation=attn, dtype=dtype)


def from_local_checkpoint(model, directory: str):
    """`model` saved and loaded back from `directory` (one per rank), so that trainers that build a reference
    model from the policy's name (TRL's GRPO, RLOO, DPO, KTO with a KL term) find its weights on disk."""
    import os

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = os.path.join(directory, f"policy-rank{os.environ.get('RANK', '0')}")
    model.save_pretrained(path)  # before the process group exists: every rank writes its own copy
    auto = AutoModelForImageTextToText if hasattr(model.config, "vision_config") else AutoModelForCausalLM
    return auto.from_pretrained(path, attn_implementation=model.config._attn_implementation, dtype=model.dtype)


def with_lora_and_frozen_vision(model):
    """PEFT LoRA on the text attention projections, the vision tower frozen (a common VLM recipe; needs peft)."""
    from peft import LoraConfig, get_peft_model

    model.model.visual.requires_grad_(False)
    torch.manual_seed(5)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    return get_peft_model(model, lora)


# Batch formats of the synthetic samples: right-padded rows, or the two formats of the official Qwen3-VL
# fine-tuning script (its own 3D positions and no mm_token_type_ids; padded, or flattened into one packed row).
DATA_FORMATS = ("padded", "official-padded", "official-flattened")


def data_collator(name: str, data_format: str = "padded", model=None):
    """How samples become batches: synthetic samples for the tiny models, the checkpoint's processor otherwise."""
    if name in TINY and data_format != "padded":
        from vlmcp_patch.fixtures.official import OfficialFlattenedCollator, OfficialPaddedCollator

        collator = OfficialPaddedCollator if data_format == "official-padded" else OfficialFlattenedCollator
        return collator(model.model.get_rope_index)
    if name in TINY:
        return PaddingCollator()
    from transformers import AutoProcessor

    return ChatCollator(AutoProcessor.from_pretrained(name))


def samples(name: str, n: int, seed: int = 0, layouts: str = "images") -> list:
    """`n` training samples: synthetic ones of `layouts` (`fixtures.data.LAYOUT_SETS`) for the tiny models, else
    chats."""
    return synthetic_dataset(n, seed, layouts) if name in TINY else chat_dataset(n, seed)


def token_accuracy(eval_pred) -> dict:
    """`compute_metrics`: next-token accuracy, and how many tokens were scored (each sample counted once)."""
    logits = eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
    predicted, target = logits[:, :-1].argmax(-1), eval_pred.label_ids[:, 1:]
    scored = target != -100
    return {"accuracy": float((predicted == target)[scored].mean()), "scored_tokens": int(scored.sum())}


def full_state_dict(model, accelerator=None) -> dict:
    """The trained weights on CPU, gathered where they are sharded (every rank calls this): ZeRO-3
    partitions through DeepSpeed, FSDP2 DTensors through the accelerator."""
    params = list(model.parameters())
    if accelerator is not None and any(isinstance(p, DTensor) for p in params):
        state = accelerator.get_state_dict(model)
        return {k: v.detach().cpu().clone() for k, v in (state or {}).items()}
    gathered = contextlib.nullcontext()
    if hasattr(params[0], "ds_id"):  # ZeRO-3
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def describe_wrapper(wrapped, model) -> str:
    """What really wraps the model (tests assert it: accelerate silently falls back to plain DDP on CPU)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return "FSDP2"
    if type(wrapped).__name__ == "DeepSpeedEngine":
        return f"DeepSpeed ZeRO-{wrapped.zero_optimization_stage()}"
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return "DDP"
    return "none"


def checkpoint_wrapped_modules(model) -> int:
    """How many modules torch's `checkpoint_wrapper` wraps (FSDP2's activation checkpointing through Accelerate)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())


def fsdp_units_in_vision(model) -> int:
    """How many FSDP2 units the vision tower holds (Accelerate's wrapping policy decides; the package tiles a tower
    FSDP2 gathers module by module untiled)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for name, m in model.named_modules() if ".visual" in f".{name}")


def report_run(trainer, save_weights: str | None, save_logs: str | None, logs: list[dict], line) -> None:
    """The end of an example: every rank gathers the weights when they are to be saved (ZeRO-3 / FSDP2 need all),
    rank 0 prints `line(entry)` for each logged entry and what wrapped the model, and saves the logs (with that
    and whether the package was installed) and the weights when asked."""
    import json
    import os

    import vlmcp_patch

    state = full_state_dict(trainer.model, trainer.accelerator) if save_weights else None
    wrapper = describe_wrapper(trainer.model_wrapped, trainer.model)
    checkpointed = checkpoint_wrapped_modules(trainer.model)
    vision_units = fsdp_units_in_vision(trainer.model)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for entry in logs:
        text = line(entry)
        if text:
            print(text)
    print(f"model wrapped by: {wrapper}")
    if save_logs:
        with open(save_logs, "w") as f:
            json.dump([*logs, {"wrapper": wrapper, "patched": vlmcp_patch.PATCHES.active,
                               "checkpoint_wrapped": checkpointed, "fsdp_vision_units": vision_units}], f)
    if save_weights:
        torch.save(state, save_weights)


def metrics_line(entry: dict) -> str:
    """One logged step: every number it holds."""
    return f"step {entry['step']}: " + " ".join(f"{k} {v:.6g}" for k, v in entry.items()
                                               if isinstance(v, (int, float)) and k != "step")


def finish_distributed() -> None:
    """End the process group cleanly: every rank reaches the end before any tears its connections down.

    Without the barrier a rank that exits first can close gloo connections another rank still uses, which
    then aborts at exit ("terminate called without an active exception") after the work is done.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
