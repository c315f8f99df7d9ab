"""Fine-tune Qwen3-VL / Qwen3.5 with the HF Trainer: the script is stock except for `import vlmcp_patch`.

    # P=1 reference, one process
    python examples/hf_trainer_sft.py --save-weights p1.pt
    # the same training with each sequence split over 2 ranks (DDP over gloo on CPU, NCCL on GPUs)
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/hf_trainer_sft.py --save-weights cp2.pt

By default it trains the embedded tiny random-init Qwen3-VL (or `--model tiny-qwen3.5`) on synthetic
image-text samples, on CPU. On GPUs, a released checkpoint trains on conversations with pictures
through its own processor:

    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/hf_trainer_sft.py \
        --model Qwen/Qwen3-VL-2B-Instruct --attn flash_attention_2 [--deepspeed examples/ds_trainer_zero3.json]

Sharding: `--deepspeed CONFIG` (ZeRO-2 / ZeRO-3), or `--fsdp` (FSDP2: `fsdp_config={"fsdp_version": 2}`;
the same through `accelerate launch --config_file examples/accelerate_fsdp2.yaml`). Accelerate's own switches
select CP instead of VLMCP_CP_SIZE: `--sp-size N` with DeepSpeed
(`ParallelismConfig(sp_backend="deepspeed", sp_size=N)`), `--cp-size N` with FSDP2 (`ParallelismConfig(cp_size=N)`).
Rank 0 prints the logged loss and grad_norm of every step.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import ParallelismConfig
from example_common import (
    DATA_FORMATS,
    TINY,
    data_collator,
    finish_distributed,
    load_model,
    report_run,
    samples,
    token_accuracy,
    with_lora_and_frozen_vision,
)
from transformers import Trainer, TrainingArguments

import vlmcp_patch  # the one line that adds context parallelism


def parallelism_config(args):
    """Accelerate's own switches: DeepSpeed SP (`--sp-size`) or torch CP on FSDP2 (`--cp-size`)."""
    if args.sp_size > 1:
        return ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp_size)
    if args.cp_size > 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return ParallelismConfig(cp_size=args.cp_size, dp_shard_size=world // args.cp_size)
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3-vl",
                        help=f"{' | '.join(TINY)} | a checkpoint, e.g. Qwen/Qwen3-VL-2B-Instruct")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="per device")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (for checkpoints on GPUs)")
    parser.add_argument("--optim", default="adamw_torch", help="any TrainingArguments.optim, e.g. sgd")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradient norm at this")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--layouts", default="images", choices=["images", "mixed"],
                        help="the tiny models' synthetic samples: images and text, or mixed (a large image, small "
                        "ones, a video, text)")
    parser.add_argument("--data-format", default="padded", choices=DATA_FORMATS,
                        help="batches of the tiny models: right-padded rows, or the official Qwen3-VL fine-tuning "
                        "script's formats (its own 3D positions, no mm_token_type_ids; padded or one flattened row)")
    parser.add_argument("--answers-cut", action="store_true",
                        help="every sample's answer cut away, as truncation does: no labelled token in any batch "
                        "(the Trainer's num_items_in_batch is 0; the loss NaN, the gradients zero, as stock gives)")
    parser.add_argument("--output-dir", default="out/hf_trainer_sft")
    parser.add_argument("--save-weights", help="rank 0 saves the trained state dict here (for comparisons)")
    parser.add_argument("--save-logs", help="rank 0 saves the Trainer's log history here (json)")
    parser.add_argument("--eval-samples", type=int, default=0, help="evaluate on this many held-out samples")
    parser.add_argument("--save-steps", type=int, default=0, help="save a Trainer checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    parser.add_argument("--deepspeed", help="train with DeepSpeed, this config (e.g. examples/ds_trainer_zero2.json)")
    parser.add_argument("--fsdp", action="store_true", help="train with FSDP2 (parameters sharded over all ranks)")
    parser.add_argument("--fsdp-state-dict", default="FULL_STATE_DICT",
                        choices=["FULL_STATE_DICT", "SHARDED_STATE_DICT"], help="checkpoint format under FSDP2")
    parser.add_argument("--activation-checkpointing", action="store_true", help="FSDP2's activation checkpointing")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="the model's own gradient checkpointing")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA on the text attention, vision tower frozen")
    parser.add_argument("--ddp-find-unused-parameters", choices=["true", "false"],
                        help="DDP's find_unused_parameters (the Trainer's default otherwise)")
    parser.add_argument("--sp-size", type=int, default=1,
                        help="instead of VLMCP_CP_SIZE: Accelerate's own switch, "
                        "ParallelismConfig(sp_backend='deepspeed', sp_size=N) (needs --deepspeed)")
    parser.add_argument("--cp-size", type=int, default=1,
                        help="instead of VLMCP_CP_SIZE: Accelerate's own switch, ParallelismConfig(cp_size=N) "
                        "(needs FSDP2)")
    return parser.parse_args(argv)


def build_model(args):
    """The model, with LoRA when asked, configured for the run."""
    model = load_model(args.model, args.attn)
    if args.lora:
        model = with_lora_and_frozen_vision(model)
    if args.activation_checkpointing:  # recomputed layers must not append to a KV cache a second time
        model.config.use_cache = model.config.get_text_config().use_cache = False
    # The evaluation loop gathers every output field but these; transformers 5.24's vision outputs differ in size
    # between replicas with different images, and their gather fails (without CP too).
    model.config.keys_to_ignore_at_inference = ["past_key_values", "cache", "image_outputs", "video_outputs"]
    return model


def with_answers_cut(collator):
    """`collator`, its batches without a labelled token (samples whose answer truncation cut away)."""

    def collate(samples):
        batch = collator(samples)
        batch["labels"] = torch.full_like(batch["labels"], -100)
        return batch

    return collate


def training_arguments(args, sharded: bool, on_cpu: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        bf16=args.bf16,
        optim=args.optim,
        max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="constant",
        logging_steps=1,
        include_num_input_tokens_seen="non_padding",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=on_cpu and not sharded,
        deepspeed=args.deepspeed,
        fsdp=args.fsdp,
        fsdp_config={"fsdp_version": 2, "state_dict_type": args.fsdp_state_dict,
                     "activation_checkpointing": args.activation_checkpointing} if args.fsdp else None,
        parallelism_config=parallelism_config(args),
        accelerator_config={"use_configured_state": True} if sharded and on_cpu else None,
        gradient_checkpointing=args.gradient_checkpointing,
        ddp_find_unused_parameters=None if args.ddp_find_unused_parameters is None else
        args.ddp_find_unused_parameters == "true",
        dataloader_drop_last=True,
        seed=0,
    )


def report(args, trainer) -> None:
    """Rank 0 prints the logged steps and what wrapped the model, and saves the logs and weights when asked."""
    logs = [entry for entry in trainer.state.log_history
            if "loss" in entry or "eval_loss" in entry or "train_samples_per_second" in entry]

    def line(entry):
        if "eval_loss" in entry:
            return f"eval: loss {entry['eval_loss']:.6f}"
        if "train_samples_per_second" not in entry:  # not the run summary
            return f"step {entry['step']}: loss {entry['loss']:.6f} grad_norm {entry['grad_norm']:.6f}"
        return None

    report_run(trainer, args.save_weights, args.save_logs, logs, line)


def main(argv=None) -> None:
    args = parse_args(argv)
    on_cpu = not torch.cuda.is_available()
    fsdp = args.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"  # flag or accelerate launch
    sharded = bool(args.deepspeed) or fsdp
    if sharded and on_cpu:  # accelerate would otherwise run DeepSpeed / FSDP on CPU as plain multi-CPU
        from vlmcp_patch.fixtures.cpu import configure_cpu_state

        configure_cpu_state("DEEPSPEED" if args.deepspeed else "FSDP")
    model = build_model(args)
    training_args = training_arguments(args, sharded, on_cpu)
    if fsdp and on_cpu:
        from vlmcp_patch.fixtures.cpu import configure_cpu_fsdp_state

        configure_cpu_fsdp_state(training_args.fsdp_plugin_args, training_args.parallelism_config,
                                 training_args.mixed_precision)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=samples(args.model, args.samples, layouts=args.layouts),
        eval_dataset=samples(args.model, args.eval_samples, seed=10_000, layouts=args.layouts)
        if args.eval_samples else None,
        data_collator=with_answers_cut(data_collator(args.model, args.data_format, model)) if args.answers_cut else
        data_collator(args.model, args.data_format, model),
        compute_metrics=token_accuracy if args.eval_samples else None,
        callbacks=[vlmcp_patch.VLMCPCallback()],  # optional: setup checks and CP facts in the logs
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.eval_samples:
        trainer.evaluate()
    report(args, trainer)


if __name__ == "__main__":
    main()
    finish_distributed()
