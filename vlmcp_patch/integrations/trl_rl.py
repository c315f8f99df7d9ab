"""TRL's RL trainers (`GRPOTrainer`, `RLOOTrainer`) under CP: each CP group builds its batches as one
data-parallel process would.

These trainers build their training batches themselves: each process samples its share of the prompts,
generates completions, scores them with the reward functions, gathers the rewards of all processes to
compute group-relative advantages, keeps its own slice and shuffles it. Under CP the P ranks of a group must
do all of this as one process — the same prompts, completions, rewards, advantages and order — so that the
fused head (integrations/trl.py) then scores the same sequences, split over the group:

* sizing: `GRPOConfig` / `RLOOConfig` derive the generation batch from the world size W; under CP there are
  W/P replicas. A `ParallelismConfig(cp_size / sp_size)` request is taken over here, before TRL's own
  refusal, and routed to CP when the trainer is built (for the models the package supports);
* seeds: `set_seed(seed, device_specific=True)` offsets the seed by the replica, not the rank, so the ranks of
  a group share their random state, as one process of a data-parallel run has it;
* a **replica view** around the trainers' batch preparation and loss: `accelerator.num_processes` and
  `process_index` report the replicas, and every gather keeps one copy per CP group — so TRL's per-process
  slices, reward gathers, loss normalisers and logged metrics are the data-parallel run's;
* rollouts: every rank of a group generates from the same random state and the group keeps its first rank's
  completions (and then its random state): reproducible, and what one process draws. With `split_rollouts`
  (`VLMCP_SPLIT_ROLLOUTS=1`) the group's prompts are split over its ranks instead: P times faster, other draws;
* rewards: every rank scores the same completions, and the group keeps its first rank's — computed once per
  group, whatever a reward function draws or whatever service it calls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..collectives.communication import communicate
from ..distributed import cp_running, data_parallel_rank, data_parallel_world_size, get_cp_group
from ..errors import UnsupportedSetupError
from ..flags import REPLICA_VIEW, SPLIT_ROLLOUT, scoped
from ..patching import Patch, PropertyPatch, cp_size
from ..settings import SETTINGS
from .accelerate import one_copy_per_cp_group, one_copy_per_cp_group_gathers
from .parallelism_config import requested_cp, without_cp

RL_TRAINERS = {"grpo": "GRPO", "rloo": "RLOO"}
# The TRL releases these patches were checked on, and apply to; under CP older ones refuse the RL trainers before the
# first step (integrations/releases.py, `TRL_TRAINERS`).
RL_SINCE = "trl>=1.16"
# Digests of TRL 1.16's GRPOConfig / RLOOConfig `__post_init__`, whose generation-batch arithmetic
# `_size_for_replicas` redoes with the W/P replicas (a different digest: re-check that arithmetic).
CONFIG_POST_INIT = {
    "grpo": {"e833cd8d6b4619ad": "trl>=1.16,<1.17"},
    "rloo": {"23dcee967b7e6f7d": "trl>=1.16,<1.17"},
}


# ---------------------------------------------------------------------------------------------------------
# The replica view


@contextlib.contextmanager
def replica_view():
    """Inside the block (under CP): the accelerator reports the data-parallel replicas, and gathers keep one copy
    per CP group."""
    if not cp_running():
        yield
        return
    with scoped(REPLICA_VIEW, True), one_copy_per_cp_group_gathers():
        yield


def replica_count(getter, accelerator):
    return data_parallel_world_size() if REPLICA_VIEW.get() else getter(accelerator)


def replica_index(getter, accelerator):
    return data_parallel_rank() if REPLICA_VIEW.get() else getter(accelerator)


def gather_per_replica(wrapped, instance, args, kwargs):
    gathered = wrapped(*args, **kwargs)
    if not REPLICA_VIEW.get():
        return gathered
    from accelerate.utils import recursively_apply

    return recursively_apply(one_copy_per_cp_group, gathered)


def gather_objects_per_replica(wrapped, instance, args, kwargs):
    if not REPLICA_VIEW.get():
        return wrapped(*args, **kwargs)
    objects = args[0] if args else kwargs["object"]
    everyone = [None] * dist.get_world_size()
    communicate("all-gather of TRL's objects", None, 1, lambda: dist.all_gather_object(everyone, objects))
    return [x for rank, part in enumerate(everyone) if rank % cp_size() == 0 for x in part]


def within_replica_view(wrapped, instance, args, kwargs):
    with replica_view():
        return wrapped(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Seeds, and what the group keeps of what its ranks computed


def seed_per_replica(wrapped, instance, args, kwargs):
    seed = args[0] if args else kwargs.pop("seed")
    device_specific = kwargs.pop("device_specific", args[1] if len(args) > 1 else False)
    if device_specific and cp_running():
        return wrapped(seed + data_parallel_rank(), False, *args[2:], **kwargs)
    return wrapped(seed, device_specific, *args[2:], **kwargs)


def _random_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_random_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _through_cpu(value):
    """`value` with its tensors on the CPU, and whether each was on an accelerator: a pickled CUDA tensor would
    unpickle onto the sender's device on every rank."""
    leaves, spec = tree_flatten(value)
    on_accelerator = [torch.is_tensor(x) and x.device.type != "cpu" for x in leaves]
    return tree_unflatten([x.cpu() if moved else x for x, moved in zip(leaves, on_accelerator)], spec), on_accelerator


def _onto_this_rank(value, on_accelerator: list[bool]):
    leaves, spec = tree_flatten(value)
    device = torch.device("cuda", torch.cuda.current_device()) if any(on_accelerator) else None
    return tree_unflatten([x.to(device) if moved else x for x, moved in zip(leaves, on_accelerator)], spec)


def from_group_leader(value, with_random_state: bool = False):
    """`value` (any picklable object) as the first rank of this CP group has it, on every rank of the group (its
    tensors on this rank's device); with `with_random_state`, that rank's torch random state too."""
    cp = get_cp_group()
    payload = [*_through_cpu(value), _random_state() if with_random_state else None]
    communicate("broadcast from the group's first rank", cp.group, len(payload),
                lambda: dist.broadcast_object_list(payload, src=dist.get_rank() - cp.rank, group=cp.group))
    if with_random_state:
        _set_random_state(payload[2])
    return _onto_this_rank(payload[0], payload[1])


def kept_from_group_leader(wrapped, instance, args, kwargs):
    """Every rank runs the call (it may hold collectives, e.g. ZeRO-3's weight gathers); the group keeps its first
    rank's result and random state."""
    result = wrapped(*args, **kwargs)
    return from_group_leader(result, with_random_state=True) if cp_running() else result


def generated_for_the_group(wrapped, instance, args, kwargs):
    """A rollout: the group's first rank's completions (default), or each rank its share of the prompts
    (`split_rollouts`)."""
    if not cp_running():
        return wrapped(*args, **kwargs)
    if SETTINGS.split_rollouts:
        with scoped(SPLIT_ROLLOUT, True):
            return wrapped(*args, **kwargs)
    return kept_from_group_leader(wrapped, instance, args, kwargs)


def colocated_engine_of_group_leader(wrapped, instance, args, kwargs):
    """vLLM colocated with training (one engine per process): under CP only the group's first rank's engine
    generates — one copy of each prompt per CP group reaches an engine — and the group receives its output."""
    if not cp_running() or instance.mode != "colocate":
        return wrapped(*args, **kwargs)
    if instance.tensor_parallel_size > 1:
        raise UnsupportedSetupError(
            f"vLLM colocate mode with vllm_tensor_parallel_size={instance.tensor_parallel_size} under CP: its tensor-"
            "parallel groups of consecutive ranks would span CP groups; use vllm_mode='server', or tensor-parallel "
            "size 1"
        )
    result = wrapped(*args, **kwargs) if get_cp_group().rank == 0 else None
    return from_group_leader(result)


def random_state_of_group_leader(wrapped, instance, args, kwargs):
    """After a generation batch is built: the group continues from its first rank's random state (TRL shuffles the
    batch next), whatever the ranks drew while building it."""
    result = wrapped(*args, **kwargs)
    if cp_running():
        from_group_leader(None, with_random_state=True)
    return result


# ---------------------------------------------------------------------------------------------------------
# Configuration: the generation batch of W/P replicas, and Accelerate's own switches


def _given_sizes(config) -> tuple:
    return config.generation_batch_size, config.steps_per_generation


def _size_for_replicas(config, given: tuple, replicas: int) -> None:
    """TRL's generation-batch arithmetic with `replicas` data-parallel processes instead of the world size."""
    generation_batch_size, steps = given
    global_batch = config.per_device_train_batch_size * replicas
    if generation_batch_size is None and steps is None:
        steps = config.gradient_accumulation_steps
    if steps is None:
        if generation_batch_size % global_batch:
            raise ValueError(f"generation_batch_size ({generation_batch_size}) must be divisible by the global batch "
                             f"size ({global_batch}: {replicas} data-parallel replicas of CP groups)")
        steps = generation_batch_size // global_batch
    config.generation_batch_size, config.steps_per_generation = global_batch * steps, steps
    if config.generation_batch_size % config.num_generations:
        raise ValueError(f"the generation batch ({config.generation_batch_size} = {replicas} replicas x "
                         f"{config.per_device_train_batch_size} x {steps}) must be a multiple of num_generations "
                         f"({config.num_generations})")


def rl_config_post_init(wrapped, instance, args, kwargs):
    request = requested_cp(instance.parallelism_config)
    if request is not None:  # routed to CP when the trainer is built (TRL itself would refuse it here)
        instance.parallelism_config = without_cp(instance.parallelism_config, request[0])
    given = _given_sizes(instance)
    result = wrapped(*args, **kwargs)
    size = request[1] if request is not None else cp_size()
    if request is not None:
        instance.vlmcp_requested_cp = request
    if size > 1:
        _size_for_replicas(instance, given, instance.world_size // size)
    return result


def patches() -> list:
    out = [
        PropertyPatch("accelerate.accelerator.Accelerator.num_processes", replica_count,
                      "inside TRL's RL batch building and loss under CP: the data-parallel replicas, not the ranks",
                      requires="accelerate"),
        PropertyPatch("accelerate.accelerator.Accelerator.process_index", replica_index,
                      "inside TRL's RL batch building and loss under CP: this rank's replica, not its rank",
                      requires="accelerate"),
        Patch("trl.generation.vllm_generation.gather_object", gather_objects_per_replica,
              "vLLM server rollouts under CP: one copy of each prompt per CP group reaches the engine",
              expects=("object",), requires="trl", since=RL_SINCE),
        Patch("trl.generation.vllm_generation.VLLMGeneration.generate", colocated_engine_of_group_leader,
              "vLLM colocate rollouts under CP: only the group's first rank's engine generates, the group receives it",
              expects=("prompts", "images", "num_generations"), requires="trl", since=RL_SINCE),
    ]
    for module, name in RL_TRAINERS.items():
        trainer = f"trl.trainer.{module}_trainer.{name}Trainer"
        out += [
            Patch(f"trl.trainer.{module}_config.{name}Config.__post_init__", rl_config_post_init,
                  "under CP: the generation batch of W/P replicas; Accelerate's cp/sp switches routed to CP",
                  mirrors=CONFIG_POST_INIT[module], requires="trl", since=RL_SINCE),
            Patch(f"trl.trainer.{module}_trainer.set_seed", seed_per_replica,
                  "under CP: per-device seeds per replica, so the ranks of a group share their random state",
                  expects=("seed", "device_specific"), requires="trl", since=RL_SINCE),
            Patch(f"trl.trainer.{module}_trainer.gather", gather_per_replica,
                  "inside the replica view: one copy per CP group of rewards, token counts and metrics",
                  expects=("tensor",), requires="trl", since=RL_SINCE),
            Patch(f"trl.trainer.{module}_trainer.gather_object", gather_objects_per_replica,
                  "inside the replica view: one copy per CP group of prompts, completions and logged text",
                  expects=("object",), requires="trl", since=RL_SINCE),
            Patch(f"{trainer}._prepare_inputs", within_replica_view,
                  "under CP: the group builds its generation batch as one data-parallel process",
                  expects=("generation_batch",), requires="trl", since=RL_SINCE),
            Patch(f"{trainer}.compute_loss", within_replica_view,
                  "under CP: the loss's normalisers and metrics count replicas, not ranks",
                  expects=("model", "inputs"), requires="trl", since=RL_SINCE),
            Patch(f"{trainer}._generate_single_turn", generated_for_the_group,
                  "under CP: the group's completions are its first rank's (or each rank generates its share)",
                  expects=("prompt_ids", "images", "multimodal_fields"), requires="trl", since=RL_SINCE),
            Patch(f"{trainer}._calculate_rewards", kept_from_group_leader,
                  "under CP: rewards computed once per group (the first rank's kept)",
                  expects=("inputs", "prompts", "completions"), requires="trl", since=RL_SINCE),
            Patch(f"{trainer}._generate_and_score_completions", random_state_of_group_leader,
                  "under CP: the group shuffles its batch from one random state",
                  expects=("inputs",), requires="trl", since=RL_SINCE),
        ]
    return out

