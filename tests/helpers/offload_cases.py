"""Checkpoints in host memory (`vlmcp_patch/offload.py`): steps with and without `offload_checkpoints`, in-process and
inside the spawned ranks."""

from __future__ import annotations

import torch

from tests.helpers.cases import MULTI_IMAGE, VIDEO_AND_IMAGE, build_batch
from vlmcp_patch.fixtures.models import build_model, tiny_qwen3_5_config, tiny_qwen3_vl_config

CONFIGS = {"qwen3_vl": tiny_qwen3_vl_config, "qwen3_5": tiny_qwen3_5_config}
LAYOUTS = {"qwen3_vl": MULTI_IMAGE, "qwen3_5": VIDEO_AND_IMAGE}


def checkpointed_model(family: str, reentrant: bool, offload: bool = False):
    """The tiny model of `family` with gradient checkpointing (transformers' own offload=True when `offload`: 5.23+),
    training."""
    model = build_model(CONFIGS[family](), seed=1)
    if offload:
        model.activation_checkpointing_enable({"use_reentrant": reentrant}, offload=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def refusal(model, batch: dict) -> str:
    """The UnsupportedSetupError a step raises (before any compute), or "ran"."""
    from vlmcp_patch.errors import UnsupportedSetupError

    try:
        step(model, batch)
    except UnsupportedSetupError as exc:
        return str(exc)
    return "ran"


def _outcome(run) -> tuple[str, str]:
    """("ran", the loss) of `run()`, or (the exception's type, its first line)."""
    try:
        return "ran", repr(float(run()[0]))
    except Exception as exc:  # noqa: BLE001 - the outcome compared with stock's
        return type(exc).__name__, str(exc).splitlines()[0][:300]


def transformers_offload_outcomes(batch: dict) -> dict:
    """Under CP (inside the spawned ranks), transformers' own `offload=True` (5.23+): alone, the step's outcome beside
    stock's at P=1 on the same batch (on a machine without an accelerator both raise its pinning error); asked with
    `VLMCP_OFFLOAD_CHECKPOINTS` too, whether the step is bit for bit the package's offload over plain checkpointing,
    the pool's counts of each, and the log's lines."""
    import logging

    import vlmcp_patch
    from vlmcp_patch import by_need
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    vlmcp_patch.revert()
    try:
        stock = _outcome(lambda: step(checkpointed_model("qwen3_vl", False, offload=True), batch))
    finally:
        vlmcp_patch.apply()
    alone = _outcome(lambda: step(checkpointed_model("qwen3_vl", False, offload=True), batch))
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vlmcp_patch").addHandler(handler)
    vlmcp_patch.enable(offload_checkpoints=True)
    try:
        HOST_CHECKPOINTS.counts.drain()
        plain_loss, plain_grads = step(checkpointed_model("qwen3_vl", False), batch)
        plain = HOST_CHECKPOINTS.counts.drain()
        by_need.STATE.logged = None  # the CP line again, at the next forward (a first one logs it)
        both_loss, both_grads = step(checkpointed_model("qwen3_vl", False, offload=True), batch)
        both = HOST_CHECKPOINTS.counts.drain()
    finally:
        vlmcp_patch.enable(offload_checkpoints=False)
        logging.getLogger("vlmcp_patch").removeHandler(handler)
    identical = torch.equal(plain_loss, both_loss) and plain_grads.keys() == both_grads.keys() and all(
        torch.equal(plain_grads[n], both_grads[n]) for n in plain_grads)
    return {"alone": alone, "stock": stock, "both identical": identical, "plain counts": plain, "both counts": both,
            "lines": lines}


def accelerate_offloaded_model():
    """The tiny Qwen3-VL as Accelerate's FSDP2 `activation_checkpointing_offload` leaves its decoder layers: torch's
    checkpoint wrapper inside its offload wrapper (`save_on_cpu` around each layer)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    model = build_model(CONFIGS["qwen3_vl"](), seed=1)
    layers = model.model.language_model.layers
    for i, layer in enumerate(layers):
        layers[i] = offload_wrapper(checkpoint_wrapper(layer, preserve_rng_state=False))
    return model.train()


def step(model, batch: dict) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def checkpointed_layers(model) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def layer_calls(model, batch: dict) -> int:
    """Calls of checkpointed layers in one forward (a tower runs once per modality)."""
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in checkpointed_layers(model)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return len(calls)


def inputs_between_forward_and_backward(model, batch: dict) -> dict:
    """After the forward, before the backward: how many of the checkpointed layers' inputs are still alive (on the
    device: on a CPU run, the tensors the layers were called with), and the host pool's bytes in use then and after
    the backward."""
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    from torch.multiprocessing.reductions import StorageWeakRef

    inputs = []  # weak references to the inputs' memory (not to the tensor objects: a view keeps the memory alive)
    hooks = [layer.register_forward_pre_hook(lambda _, args: inputs.append(StorageWeakRef(args[0].untyped_storage())))
             for layer in checkpointed_layers(model)]
    try:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        # counted before backward: some releases' checkpointing calls the layer's hooks again when it recomputes
        called, alive, in_use = len(inputs), sum(not ref.expired() for ref in inputs), HOST_CHECKPOINTS.pool.in_use
        loss.backward()
        del loss
    finally:
        for hook in hooks:
            hook.remove()
    return {"inputs": called, "alive": alive, "host_bytes": in_use,
            "host_bytes_after": HOST_CHECKPOINTS.pool.in_use}


def run_offload_cases(rank: int, world_size: int) -> dict:
    """Per family and checkpointing kind: the CP step with `offload_checkpoints` against the CP step without (bit for
    bit, on this rank), what the hooks did; and transformers' own offload under CP (refused before compute)."""
    import vlmcp_patch
    from vlmcp_patch.offload import HOST_CHECKPOINTS

    vlmcp_patch.enable(cp_size=world_size)
    results = {}
    try:
        for family in CONFIGS:
            for reentrant in (False, True):
                model, batch = checkpointed_model(family, reentrant), build_batch(LAYOUTS[family], seed=7)
                loss, grads = step(model, batch)
                vlmcp_patch.enable(offload_checkpoints=True, offload_features=True)
                HOST_CHECKPOINTS.counts.drain()
                try:
                    offloaded_loss, offloaded_grads = step(model, batch)
                finally:
                    vlmcp_patch.enable(offload_checkpoints=False, offload_features="auto")
                results[f"{family} reentrant={reentrant}"] = {
                    "identical": bool(torch.equal(loss, offloaded_loss)) and grads.keys() == offloaded_grads.keys()
                    and all(torch.equal(grads[n], offloaded_grads[n]) for n in grads),
                    "counts": HOST_CHECKPOINTS.counts.drain(),
                    "calls": layer_calls(model, batch),
                }
        batch = build_batch(MULTI_IMAGE, seed=7)
        has_offload = hasattr(build_model(CONFIGS["qwen3_vl"]()), "activation_checkpointing_enable")  # 5.23+
        results["transformers offload"] = transformers_offload_outcomes(batch) if has_offload \
            else "not in this transformers"
        results["accelerate offload"] = refusal(accelerate_offloaded_model(), batch)
    finally:
        vlmcp_patch.enable(cp_size=1)
    return results


# -- the pool's own accounting: sequences of takes and releases as training makes them ---------------------------------

MiB = 2**20


def layer_sizes(tokens: int, hidden: int, layers: int) -> list[int]:
    """One step's checkpoints of a decoder: `layers` inputs of `tokens x hidden` bf16."""
    return [tokens * hidden * 2] * layers


def training_steps(seed: int = 0) -> list[list[int]]:
    """Steps of a Qwen3-VL-like run at toy scale: rows of nearby lengths (±15 %) across steps, each step the vision
    tower's 24 blocks (patches x 1,152, bf16: another size) then 36 decoder layers (tokens x 4,096), all but the last
    input offloaded."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(8):
        tokens = int(5_000 * (0.85 + 0.3 * torch.rand((), generator=g).item()))
        patches = int(tokens * (0.55 + 0.2 * torch.rand((), generator=g).item()))
        steps.append(layer_sizes(patches, 1_152, 24) + layer_sizes(tokens, 4_096, 36)[:-1])
    return steps


def play(pool, steps: list[list[int]]) -> dict:
    """Each step's checkpoints taken in forward order and given back in backward's (reverse) order; the pool's
    invariants checked after every step. Returns the peak bytes held and the pool's size."""
    for sizes in steps:
        leases = [pool.take(n, pinned=False) for n in sizes]
        pool.check()
        for lease in reversed(leases):
            pool.give_back(lease)
        pool.check()
        assert pool.in_use == pool.held == 0
    return {"peak_held": pool.peak_held, "reserved": pool.reserved, "slabs": [t.numel() for t in pool.slabs.values()]}


def random_leases(pool, seed: int, rounds: int = 150) -> None:
    """Takes and give-backs in random order, each lease's bytes written with its own pattern and read back after every
    round: nothing given out is handed to another holder while held (the data would change)."""
    g = torch.Generator().manual_seed(seed)
    held: list[tuple] = []
    for i in range(rounds):
        if held and torch.rand((), generator=g).item() < 0.45:
            lease, _ = held.pop(int(torch.randint(len(held), (), generator=g)))
            pool.give_back(lease)
        else:
            nbytes = int(torch.randint(1, MiB // 2, (), generator=g))
            lease = pool.take(nbytes, pinned=False)
            pattern = i % 251
            for piece, _, n in lease.spans():
                piece[:n].fill_(pattern)
            held.append((lease, pattern))
        pool.check()  # extents disjoint (cheap: every round); the bytes themselves every 10th round
        if i % 10 == 9:
            for lease, pattern in held:
                assert all(bool((piece[:n] == pattern).all()) for piece, _, n in lease.spans()), "a held extent reused"
        assert sum(sum(n for *_, n in lease.spans()) for lease, _ in held) == pool.held
    pool.check()
    for lease, _ in held:
        pool.give_back(lease)
    pool.check()


# -- the paths that free checkpoints out of order (issue 54): the values and the pool's state after each ---------------


def grads_of(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def pool_state() -> dict:
    """The host pool after a path: what it still gives out (0 once the graphs are gone), checked invariants."""
    import gc

    from vlmcp_patch.offload import HOST_CHECKPOINTS

    gc.collect()  # a freed graph's checkpoints return through their finalizers
    HOST_CHECKPOINTS.pool.check()
    return {"in_use": HOST_CHECKPOINTS.pool.in_use, "held": HOST_CHECKPOINTS.pool.held,
            "reserved": HOST_CHECKPOINTS.pool.reserved}


class _StopsBackward(torch.autograd.Function):
    """The identity forward; its backward raises (a failure midway through a backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("stopped midway")


def backward_that_raises(model, batch: dict) -> str:
    """A backward stopped midway: the first decoder layer's output passes through `_StopsBackward`, so the backward
    raises after the last layer's backward ran (and prefetched the first one's input) and before the first layer's and
    the vision blocks'. Returns the error; the graph is gone on return."""
    layers = model.model.language_model.layers

    def stop_there(_module, _args, output):
        if isinstance(output, tuple):
            return (_StopsBackward.apply(output[0]), *output[1:])
        return _StopsBackward.apply(output)

    hook = layers[0].register_forward_hook(stop_there)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        try:
            loss.backward()
        except RuntimeError as exc:
            return str(exc)
        return "ran"
    finally:
        hook.remove()


def backward_twice(model, batch: dict) -> tuple[dict, dict, dict]:
    """`retain_graph=True` then a second backward of the same graph: the gradients of each, and the pool between."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward(retain_graph=True)
    first, between = grads_of(model), pool_state()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return first, grads_of(model), between


def two_forwards_one_backward(model, batches: list[dict]) -> tuple[torch.Tensor, dict]:
    """Two forwards (two graphs, checkpoints of both held at once), then one backward of the sum of their losses."""
    model.zero_grad(set_to_none=True)
    losses = [model(**batch).loss for batch in batches]
    total = losses[0] + losses[1]
    total.backward()
    return total.detach(), grads_of(model)


# -- checkpointing that is not transformers' own (issue 54): refused with the switch on -------------------------------


class HandCheckpointed(torch.nn.Module):
    """A decoder layer checkpointed by hand: `checkpoint(layer, hidden_states, ...)`, torch's or DeepSpeed's."""

    def __init__(self, layer: torch.nn.Module, how: str):
        super().__init__()
        self.layer, self.how = layer, how

    def forward(self, hidden_states, **kwargs):
        import functools

        call = functools.partial(self.layer, **kwargs)
        if self.how == "deepspeed":
            import deepspeed

            return deepspeed.checkpointing.checkpoint(call, hidden_states)
        return torch.utils.checkpoint.checkpoint(call, hidden_states, use_reentrant=self.how == "torch reentrant")


FOREIGN_CHECKPOINTS = ("checkpoint_wrapper", "torch reentrant", "torch non-reentrant", "deepspeed")


def foreign_checkpointed_model(how: str):
    """The tiny Qwen3-VL with transformers' checkpointing off and its decoder layers checkpointed by `how`: torch's
    `checkpoint_wrapper` (as FSDP2 / Accelerate's `activation_checkpointing` apply it), a hand-written
    `torch.utils.checkpoint` (reentrant or not), or DeepSpeed's `deepspeed.checkpointing.checkpoint`."""
    model = build_model(CONFIGS["qwen3_vl"](), seed=1)
    layers = model.model.language_model.layers
    for i, layer in enumerate(layers):
        if how == "checkpoint_wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layers[i] = checkpoint_wrapper(layer)
        else:
            layers[i] = HandCheckpointed(layer, how)
    return model.train()
