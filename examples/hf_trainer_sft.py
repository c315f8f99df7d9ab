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

With `--deepspeed`, `--sp-size N` selects CP through Accelerate's own switch instead of VLMCP_CP_SIZE
(`ParallelismConfig(sp_backend="deepspeed", sp_size=N)`). Rank 0 prints the logged loss and grad_norm
of every step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import ParallelismConfig
from example_common import TINY, data_collator, finish_distributed, full_state_dict, load_model, samples, token_accuracy
from transformers import Trainer, TrainingArguments

import vlmcp_patch  # the one line that adds context parallelism


def main(argv=None) -> None:
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
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--output-dir", default="out/hf_trainer_sft")
    parser.add_argument("--save-weights", help="rank 0 saves the trained state dict here (for comparisons)")
    parser.add_argument("--save-logs", help="rank 0 saves the Trainer's log history here (json)")
    parser.add_argument("--eval-samples", type=int, default=0, help="evaluate on this many held-out samples")
    parser.add_argument("--save-steps", type=int, default=0, help="save a Trainer checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    parser.add_argument("--deepspeed", help="train with DeepSpeed, this config (e.g. examples/ds_trainer_zero2.json)")
    parser.add_argument("--sp-size", type=int, default=1,
                        help="instead of VLMCP_CP_SIZE: Accelerate's own switch, "
                        "ParallelismConfig(sp_backend='deepspeed', sp_size=N) (needs --deepspeed)")
    args = parser.parse_args(argv)

    on_cpu = not torch.cuda.is_available()
    if args.deepspeed and on_cpu:  # accelerate would otherwise run DeepSpeed on CPU as plain multi-CPU
        from vlmcp_patch.fixtures.cpu import configure_cpu_state

        configure_cpu_state("DEEPSPEED")
    model = load_model(args.model, args.attn)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        bf16=args.bf16,
        optim=args.optim,
        lr_scheduler_type="constant",
        logging_steps=1,
        include_num_input_tokens_seen="non_padding",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=on_cpu and not args.deepspeed,
        deepspeed=args.deepspeed,
        parallelism_config=(
            ParallelismConfig(sp_backend="deepspeed", sp_size=args.sp_size) if args.sp_size > 1 else None
        ),
        accelerator_config={"use_configured_state": True} if args.deepspeed and on_cpu else None,
        dataloader_drop_last=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=samples(args.model, args.samples),
        eval_dataset=samples(args.model, args.eval_samples, seed=10_000) if args.eval_samples else None,
        data_collator=data_collator(args.model),
        compute_metrics=token_accuracy if args.eval_samples else None,
        callbacks=[vlmcp_patch.VLMCPCallback()],  # optional: setup checks and CP facts in the logs
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.eval_samples:
        trainer.evaluate()
    state = full_state_dict(trainer.model) if args.save_weights else None
    if int(os.environ.get("RANK", "0")) == 0:
        logs = [entry for entry in trainer.state.log_history
                if "loss" in entry or "eval_loss" in entry or "train_samples_per_second" in entry]
        for entry in logs:
            if "train_samples_per_second" in entry:
                continue  # the run summary
            if "eval_loss" in entry:
                print(f"eval: loss {entry['eval_loss']:.6f}")
            else:
                print(f"step {entry['step']}: loss {entry['loss']:.6f} grad_norm {entry['grad_norm']:.6f}")
        if args.save_logs:
            with open(args.save_logs, "w") as f:
                json.dump(logs, f)
        if args.save_weights:
            torch.save(state, args.save_weights)


if __name__ == "__main__":
    main()
    finish_distributed()
