"""examples/trl_grpo.py with TRL's vLLM rollouts (`--vllm-mode server|colocate`), vLLM replaced by in-process stand-ins
that record the prompts reaching the engine: the plumbing of vLLM rollouts under CP, on CPU.

    VLMCP_CP_SIZE=2 torchrun --nproc-per-node 2 -m tests.helpers.run_script tests/helpers/vllm_standin_script.py \
        --vllm-mode server ...

The stand-ins answer deterministically from the prompt's token ids (so one process and every CP layout draw the
same completions), with the log-probability of a uniform draw over the tiny vocabulary for every token.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

RECORD = os.environ.get("VLLM_STANDIN_RECORD")  # each engine call appends its prompt count here (RANK added)


def _record(prompts: list) -> None:
    if RECORD:
        with open(f"{RECORD}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps([list(p) for p in prompts]) + "\n")


def _completion(prompt: list[int], index: int, length: int) -> list[int]:
    """Deterministic tokens from the prompt; the first completion of a prompt draws letters more often than the
    next ones (ids 40-99 are mostly letters, 4-39 punctuation and digits), so their rewards differ."""
    low = 40 if index == 0 else 4
    return [low + (sum(prompt) * 31 + j * 7 + index * 13) % 50 for j in range(length)]


class StandInClient:
    """TRL's `VLLMClient` (server mode)."""

    def __init__(self, *args, **kwargs):
        pass

    def init_communicator(self, device=None):
        pass

    def update_named_params(self, metadata, named_params):
        for _ in named_params:
            pass

    def reset_prefix_cache(self):
        pass

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def close_communicator(self):
        pass

    def image_features(self, images):
        return [None for _ in images]

    def generate(self, prompts, features=None, n=1, max_tokens=8, **kwargs):
        _record(prompts)
        completions = [_completion(p, i, max_tokens) for p in prompts for i in range(n)]
        logprobs = [[[-4.85] for _ in c] for c in completions]
        return {"prompt_ids": prompts, "completion_ids": completions, "logprobs": logprobs,
                "logprob_token_ids": [[[t] for t in c] for c in completions]}


class StandInSamplingParams(SimpleNamespace):
    """vLLM's `SamplingParams` (colocate mode)."""


class StandInLLM:
    """vLLM's `LLM` (colocate mode)."""

    def __init__(self, *args, **kwargs):
        pass

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        ids = [p["prompt_token_ids"] for p in prompts]
        _record(ids)
        lp = SimpleNamespace(rank=1, logprob=-4.85)
        # one completion per request: a prompt's copies in the batch get different ones
        drawn = [_completion(p, i % 2, sampling_params.max_tokens) for i, p in enumerate(ids)]
        return [SimpleNamespace(prompt_token_ids=p,
                                outputs=[SimpleNamespace(token_ids=c, logprobs=[{t: lp} for t in c])])
                for p, c in zip(ids, drawn)]

    def reset_prefix_cache(self):
        pass


def install() -> None:
    import trl.generation.vllm_generation as generation
    import trl.trainer.grpo_trainer  # noqa: F401 - loads the generation module's users

    generation.is_vllm_available = lambda: True
    generation.VLLMClient = StandInClient
    generation.LLM, generation.SamplingParams = StandInLLM, StandInSamplingParams
    generation.StructuredOutputsParams = SimpleNamespace
    generation.VLLMGeneration._fix_param_name_to_vllm = lambda self, name, *a, **k: name
    # colocate mode loads the weights into the engine: the stand-in keeps none
    generation.VLLMGeneration.sync_weights = _sync_without_engine(generation.VLLMGeneration.sync_weights)


def _sync_without_engine(sync):
    def sync_weights(self):
        if self.mode == "server":
            return sync(self)
        for _ in self._iter_named_params():  # the gathers every rank takes part in
            pass
    return sync_weights


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    install()
    import trl_grpo

    trl_grpo.main()
    from example_common import finish_distributed

    finish_distributed()
