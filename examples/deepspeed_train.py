"""A raw DeepSpeed training loop for Qwen3-VL / Qwen3.5: stock except for `import vlmcp_patch`.

    torchrun --nproc-per-node 1 examples/deepspeed_train.py --deepspeed examples/ds_zero2.json --save-weights p1.pt
    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 examples/deepspeed_train.py --deepspeed examples/ds_zero2.json
    VLMCP_CP_SIZE=2 deepspeed --num_gpus 2 examples/deepspeed_train.py --deepspeed examples/ds_zero2.json

DeepSpeed's own data loader (`deepspeed.initialize(training_data=...)`) shards over the W/P
data-parallel replicas under CP; a sampler of your own can use `vlmcp_patch.data_parallel_rank()` and
`vlmcp_patch.data_parallel_world_size()`. By default it trains the embedded tiny random-init model on
synthetic image-text samples (gloo on CPU, NCCL on GPUs); `--model Qwen/Qwen3-VL-2B-Instruct --attn
flash_attention_2` trains a released checkpoint (bf16 on GPUs; put `"bf16": {"enabled": true}` in the
config) on conversations with pictures through its processor.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
from example_common import TINY, data_collator, finish_distributed, full_state_dict, load_model, samples

import vlmcp_patch  # noqa: F401  - the one line that adds context parallelism


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed config (json)")
    parser.add_argument("--model", default="tiny-qwen3-vl",
                        help=f"{' | '.join(TINY)} | a checkpoint, e.g. Qwen/Qwen3-VL-2B-Instruct")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--save-weights", help="rank 0 saves the trained (gathered) state dict here")
    parser.add_argument("--save-logs", help="rank 0 saves per-step loss and grad norm here (json)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    with open(args.deepspeed) as f:
        config = json.load(f)
    model = load_model(args.model, args.attn)
    engine, _, loader, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        training_data=samples(args.model, args.samples),
        collate_fn=data_collator(args.model),
    )
    logs, micro_losses = [], []
    batches = iter(loader)
    while engine.global_steps < args.steps:
        # under CP the pixel values stay on the host: each rank copies its own share in the forward
        batch = vlmcp_patch.batch_to_device(next(batches), engine.device)
        loss = engine(**batch).loss
        engine.backward(loss)
        micro_losses.append(float(loss.detach()))
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            logs.append({"step": engine.global_steps, "loss": sum(micro_losses) / len(micro_losses),
                         "grad_norm": float(engine.get_global_grad_norm())})
            micro_losses = []

    state = full_state_dict(engine.module) if args.save_weights else None
    if int(os.environ.get("RANK", "0")) == 0:
        for entry in logs:
            print(f"step {entry['step']}: loss {entry['loss']:.6f} grad_norm {entry['grad_norm']:.6f}")
        if args.save_logs:
            with open(args.save_logs, "w") as f:
                json.dump(logs, f)
        if args.save_weights:
            torch.save(state, args.save_weights)


if __name__ == "__main__":
    main()
    finish_distributed()
