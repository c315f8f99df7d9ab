"""Checkpoints in host memory (`VLMCP_OFFLOAD_CHECKPOINTS`): what gradient checkpointing keeps of every decoder layer
and vision block between forward and backward — its input — waits in a host pool instead of on the device.

With checkpointing, each checkpointed layer keeps its input for the recompute, and nothing else: `layers x tokens x
hidden` per rank, the bulk of what stays on the device at long rows. torch's checkpoint (reentrant or not) saves those
inputs through the saved-tensor hooks in effect when the checkpoint is entered (everything saved inside the layer goes
to the checkpoint's own hooks). A patch on each family's decoder layer and vision block (`models/base.py`) enters
`HOST_CHECKPOINTS.offloading(args)` around a checkpointed call: the hooks move exactly the call's positional tensors
(the hidden states; never the parameters or a tensor shared by all layers, like the rotary tables) and let everything
else through.

- **Copies behind compute.** On an accelerator the device-to-host copy runs on a side stream after the compute that
  made the tensor; the device memory returns to the allocator once the copy has run (`record_stream`).
- **The last layer stays.** The newest input is copied only when the next layer's arrives: the last checkpointed
  layer's input, the first one backward needs, never leaves the device.
- **Prefetch.** When backward unpacks a layer's input, the copy back of the layer before it starts on the side stream
  while this one recomputes; the compute stream waits for it only when it needs it.
- **One pool.** Host buffers (pinned on an accelerator) are allocated on first need and reused across steps: a buffer
  returns to the pool when autograd frees the saved input it held. `HOST_CHECKPOINTS.pool.reserved` is its size.
- **Without an accelerator** (CPU tensors) the same path runs with plain host buffers and synchronous copies (no
  pinning, no streams): the tests exercise it here.

The values come back bit for bit: the same bytes, the same shape and strides. Active whenever the switch is on, CP or
not (it is opted into and exact). transformers' own `activation_checkpointing_enable(offload=True)` and Accelerate's
`activation_checkpointing_offload` copy on the compute stream and pin per tensor: under CP they are refused before
compute (`foreign_offload_problem`), naming this switch.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from .patching import cp_size
from .settings import SETTINGS

MIN_BYTES = 1024  # a smaller input stays: its copy costs more than it frees
ROUND = 1 << 20  # host buffers are allocated in whole MiB, so rows of nearby lengths reuse them


class HostPool:
    """Host buffers (uint8), allocated on first need and reused: `take` gives the smallest free one that fits."""

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.reserved = 0  # bytes allocated, free or in use
        self.in_use = 0

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        fitting = [b for b in self.free if b.numel() >= nbytes and b.is_pinned() == pinned]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self.free.remove(buffer)
        else:
            size = -(-nbytes // ROUND) * ROUND
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self.reserved += size
        self.in_use += buffer.numel()
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self.in_use -= buffer.numel()
        self.free.append(buffer)

    def release(self) -> None:
        """Free the buffers not in use (the pool is allocated again on the next need)."""
        self.reserved -= sum(b.numel() for b in self.free)
        self.free.clear()


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pool_bytes_for(held_bytes: int, pinned: bool = True) -> int:
    """The host bytes the pool really allocates to hold `held_bytes` of checkpoints at steady state: its own rounding
    (whole MiB per buffer) and, when pinned, torch's caching host allocator's (every pinned block a power of two).
    Buffers are sized per input, so the pinned cost depends on how `held_bytes` splits: this prices the worst split
    (a buffer just over a power of two costs almost twice its size)."""
    if held_bytes <= 0:
        return 0
    own = -(-held_bytes // ROUND) * ROUND
    return 2 * own if pinned else own


@dataclass
class OffloadCounts:
    """What the hooks did since the last `drain` (telemetry for tests and benchmarks; no forward reads it)."""

    offloaded: int = 0  # inputs copied to the host
    kept: int = 0  # inputs unpacked in backward straight from the device (the last layer's)
    restored: int = 0  # inputs copied back to the device
    prefetched: int = 0  # of which started before they were needed

    def drain(self) -> dict:
        out = dict(vars(self))
        self.offloaded = self.kept = self.restored = self.prefetched = 0
        return out


class _Streams:
    """The side stream of one accelerator device, for the copies both ways."""

    def __init__(self, device: torch.device):
        self.module = torch.get_device_module(device.type)
        self.side = self.module.Stream(device=device)
        self.device = device

    def current(self):
        return self.module.current_stream(self.device)


class SavedInput:
    """One checkpointed layer's input, as autograd holds it between forward and backward: on the device (the newest
    one, or while its copy to the host runs), in a host buffer, and on its way back (prefetched)."""

    def __init__(self, tensor: torch.Tensor, previous: SavedInput | None):
        self.on_device: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None  # a view of a pool buffer, the tensor's bytes
        self.buffer: torch.Tensor | None = None
        self.back: torch.Tensor | None = None  # the prefetched device copy
        self.back_ready = None  # its event on the side stream
        self.shape, self.stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        self.previous = None if previous is None else weakref.ref(previous)  # the layer before: prefetched next


def _host_view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`buffer`'s first bytes as a contiguous tensor of `like`'s shape and dtype."""
    nbytes = like.numel() * like.element_size()
    return buffer[:nbytes].view(like.dtype).view(like.shape)


class HostCheckpoints:
    """The saved-tensor hooks that keep checkpointed layers' inputs in the host pool (module docstring)."""

    def __init__(self):
        self.pool = HostPool()
        self.counts = OffloadCounts()
        self._marked: dict[int, torch.Tensor] = {}
        self._newest: weakref.ref | None = None
        self._streams: dict[torch.device, _Streams] = {}

    def facts(self) -> dict:
        """`VLMCPCallback`'s log entry: the host pool's size in MiB (none while nothing was offloaded)."""
        return {"cp_host_pool_mib": self.pool.reserved / 2**20} if self.pool.reserved else {}

    # -- forward --------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def offloading(self, args: tuple):
        """Inside the block, the positional tensors `args` of a checkpointed call go to the host when the checkpoint
        saves them; everything else saved passes through."""
        previous = self._marked
        self._marked = {id(t): t for t in args if _worth_moving(t)}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._marked = previous

    def _pack(self, tensor: torch.Tensor):
        if not any(_same(tensor, marked) for marked in self._marked.values()):
            return tensor
        newest = None if self._newest is None else self._newest()
        saved = SavedInput(tensor.detach(), newest)
        if newest is not None and newest.on_device is not None and newest.host is None:
            self._to_host(newest)  # the newest input so far is no longer the last layer's
        self._newest = weakref.ref(saved)
        return saved

    def _to_host(self, saved: SavedInput) -> None:
        tensor = saved.on_device
        pinned = tensor.device.type != "cpu"
        saved.buffer = self.pool.take(tensor.numel() * tensor.element_size(), pinned)
        weakref.finalize(saved, self.pool.give_back, saved.buffer)
        saved.host = _host_view(saved.buffer, tensor)
        streams = self._streams_of(tensor.device)
        if streams is None:
            saved.host.copy_(tensor)
        else:
            streams.side.wait_stream(streams.current())  # after the compute that made it
            with streams.module.stream(streams.side):
                saved.host.copy_(tensor, non_blocking=True)
            tensor.record_stream(streams.side)  # its memory is reused only once the copy has run
        saved.on_device = None
        self.counts.offloaded += 1

    # -- backward -------------------------------------------------------------------------------------------------

    def _unpack(self, saved):
        if not isinstance(saved, SavedInput):
            return saved
        if saved.on_device is not None:  # never left: the last layer's input
            self.counts.kept += 1
            tensor = saved.on_device
        else:
            tensor = self._back_on_device(saved)
        previous = None if saved.previous is None else saved.previous()
        if previous is not None and previous.host is not None and previous.back is None:
            self._to_device(previous)  # the layer backward reaches next, copied while this one recomputes
        return tensor

    def _back_on_device(self, saved: SavedInput) -> torch.Tensor:
        """The offloaded input on its device again: the prefetched copy (the compute stream waits for it), or a copy
        made now."""
        if saved.back is None:
            self._to_device(saved)
        else:
            self.counts.prefetched += 1
        tensor, ready = saved.back, saved.back_ready
        saved.back = saved.back_ready = None  # a second unpack (retain_graph) copies again
        streams = self._streams_of(tensor.device)
        if streams is not None:
            streams.current().wait_event(ready)
            tensor.record_stream(streams.current())
        self.counts.restored += 1
        return tensor

    def _to_device(self, saved: SavedInput) -> None:
        back = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=saved.device)
        streams = self._streams_of(saved.device)
        if streams is None:
            back.copy_(saved.host)
        else:
            streams.side.wait_stream(streams.current())  # the memory's previous users are done
            with streams.module.stream(streams.side):
                back.copy_(saved.host, non_blocking=True)
                saved.back_ready = streams.side.record_event()
        saved.back = back

    def _streams_of(self, device: torch.device) -> _Streams | None:
        if device.type == "cpu":
            return None
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        return self._streams[device]


def _worth_moving(t) -> bool:
    """A tensor the checkpoint may keep on the host: a floating activation, dense (its bytes are the tensor), large
    enough to be worth a copy; never a parameter."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and not isinstance(t, torch.nn.Parameter)
            and t.is_contiguous() and t.numel() * t.element_size() >= MIN_BYTES)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether autograd's saved tensor `a` is the marked input `b` (the same bytes, the same view)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


HOST_CHECKPOINTS = HostCheckpoints()


def offload_applies(layer: torch.nn.Module) -> bool:
    """Whether this call of a checkpointable layer keeps its checkpoint on the host: the switch is on and the layer
    checkpoints now (as transformers decides: `gradient_checkpointing`, training, gradients on), not traced."""
    return (SETTINGS.offload_checkpoints and getattr(layer, "gradient_checkpointing", False) and layer.training
            and torch.is_grad_enabled() and not torch.compiler.is_compiling())


def offloaded_checkpoint_call(wrapped, instance, args, kwargs):
    """The wrapper (wrapt's convention) of a decoder layer's or vision block's `__call__`: its checkpoint's input waits
    on the host between forward and backward (module docstring); otherwise the call as it was."""
    if not offload_applies(instance):
        return wrapped(*args, **kwargs)
    with HOST_CHECKPOINTS.offloading(args):
        return wrapped(*args, **kwargs)


def _saves_on_cpu(fn) -> bool:
    """Whether a layer's checkpoint function runs torch's `save_on_cpu` (transformers' `offload=True`)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    code = getattr(fn, "__code__", None)
    return code is not None and "save_on_cpu" in code.co_names


def foreign_offload_problem(model) -> str | None:
    """Under CP: checkpoint offload that is not this package's — transformers' `activation_checkpointing_enable(
    offload=True)` (also through a Trainer) or Accelerate's FSDP2 `activation_checkpointing_offload` (torch's
    `OffloadWrapper`). Both are exact but copy on the compute stream and pin memory per tensor every step (a slow
    path), and raise on a machine without an accelerator: refused before compute, naming the package's switch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    if cp_size() == 1:  # a packed row at P=1: their offload runs as it does on stock
        return None
    for name, module in model.named_modules():
        theirs = "Accelerate's activation_checkpointing_offload (torch's OffloadWrapper)" \
            if isinstance(module, OffloadWrapper) else None
        if theirs is None and getattr(module, "gradient_checkpointing", False) and \
                _saves_on_cpu(getattr(module, "_gradient_checkpointing_func", None)):
            theirs = "transformers' activation_checkpointing_enable(offload=True)"
        if theirs is not None:
            return (
                f"{name or type(model).__name__} keeps its checkpoints on the host through {theirs}: its copies run "
                "on the compute stream, pinning memory every step. Under CP use the package's own switch instead, "
                "which keeps the same inputs in a reused host pool with the copies behind compute: enable "
                "checkpointing without offload and set VLMCP_OFFLOAD_CHECKPOINTS=1 (or "
                "vlmcp_patch.enable(offload_checkpoints=True)); or set VLMCP_CP_SIZE=1."
            )
    return None
