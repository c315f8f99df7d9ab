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
  made the tensor; the device memory returns to the allocator once the copy has run (`record_stream`). Everything the
  side stream touches is recorded on it or given back after its event, so a checkpoint freed early (a backward that
  raises, `retain_graph`, a graph never backwarded, two forwards before one backward) never has its memory reused
  mid-copy (`HostCheckpoints`).
- **The last layer stays.** The newest input is copied only when the next layer's arrives: the last checkpointed
  layer's input, the first one backward needs, never leaves the device.
- **Prefetch.** When backward unpacks a layer's input, the copy back of the layer before it starts on the side stream
  while this one recomputes; the compute stream waits for it only when it needs it.
- **One pool, no waste.** Host memory (pinned on an accelerator) is allocated on first need, in power-of-two slabs
  that torch's caching host allocator takes without rounding them up, and reused across steps: a checkpoint holds
  extents of the slabs (spanning several if need be), given back when autograd frees it. The pool allocates at most
  `pool_bytes_for(held)` < 1.032 x the bytes it holds (above 64 MiB); one pinned buffer per checkpoint cost up to 2x.
  `HOST_CHECKPOINTS.pool.reserved` is its size.
- **Without an accelerator** (CPU tensors) the same path runs with plain host buffers and synchronous copies (no
  pinning, no streams): the tests exercise it here.

The values come back bit for bit: the same bytes, the same shape and strides. Active whenever the switch is on, CP or
not (it is opted into and exact). transformers' own `activation_checkpointing_enable(offload=True)` (torch's
`save_on_cpu` around each layer's checkpoint: copies on the compute stream, pinned per tensor) runs under CP as it
does on stock — exact, priced by the plan as checkpoints on the host — unless this switch is on too: then this pool
keeps the checkpoints and transformers' `save_on_cpu` is set aside for the call (`one_offload`), said once in the log
and in the CP line. Never both (each would hold its own copy), never silently neither. Accelerate's
`activation_checkpointing_offload` is refused under CP before compute (`foreign_offload_problem`), naming this
switch. The switch acts through transformers' own checkpointing
(`gradient_checkpointing_enable()`); a layer checkpointed otherwise (torch's `checkpoint_wrapper`, which FSDP2 and
Accelerate apply, a hand-written `torch.utils.checkpoint`, DeepSpeed's) is refused with the switch on, before it
computes (`foreign_checkpoint_problem`): never a switch that silently does nothing.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from .errors import UnsupportedSetupError
from .patching import cp_size
from .settings import SETTINGS
from .switches import features_on_host

MIN_BYTES = 1024  # a smaller input stays: its copy costs more than it frees

# The pool's allocation rule (`HostPool`). Every slab is a power of two, so torch's caching host allocator, which rounds
# each pinned block up to one, allocates exactly the slab; a checkpoint lives in extents carved out of the slabs.
ALIGN = 512  # an extent's start and length (DMA-friendly, and any dtype's alignment)
MIN_SLAB = 2 << 20
MAX_SLAB = 1 << 30
GROWTH_SHARE = 32  # the pool grows in granules of at most 1/32 of what it already holds (or MIN_SLAB)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _granule(reserved: int) -> int:
    """The unit the pool grows by when it already has `reserved` bytes: a power of two, MIN_SLAB..MAX_SLAB."""
    return min(MAX_SLAB, max(MIN_SLAB, _pow2_floor(reserved // GROWTH_SHARE)))


def pool_bytes_for(held_bytes: int, pinned: bool = True) -> int:
    """The host bytes the pool really allocates to hold `held_bytes` of checkpoints at steady state (the peak bytes
    held at once), pinned or not: an upper bound over every order of takes and releases.

    The pool grows only by what it lacks, rounded up to one granule (`_granule`: at most 1/32 of what it holds, or
    2 MiB), in power-of-two slabs that torch's pinned allocator takes as they are; a checkpoint may span extents of
    several slabs, so no free byte is out of reach. Hence allocated < held + granule: at most 1.032 x held above
    64 MiB. (Each checkpoint's extents are rounded to 512 bytes, not counted here: under 1e-6 of a checkpoint worth
    moving at the sizes this prices.) `pinned` does not change the rule: the slabs need no rounding either way."""
    if held_bytes <= 0:
        return 0
    return _round_up(held_bytes + _granule(held_bytes), MIN_SLAB)


class Lease:
    """The extents of the pool that hold one checkpoint: `pieces`, uint8 views of the slabs in order, whose first
    `nbytes` bytes are the checkpoint's; `wait` the events after which they may be written (their previous use by
    another stream)."""

    def __init__(self, extents: list[tuple[int, int, int]], pieces: list[torch.Tensor], nbytes: int, wait: list):
        self.extents, self.pieces, self.nbytes, self.wait = extents, pieces, nbytes, wait

    def spans(self):
        """(piece, offset in the checkpoint's bytes, bytes) for each piece the checkpoint's bytes occupy."""
        offset = 0
        for piece in self.pieces:
            n = min(piece.numel(), self.nbytes - offset)
            if n <= 0:
                return
            yield piece, offset, n
            offset += n


class HostPool:
    """Host memory for checkpoints, allocated on first need and reused across steps, pinned or not (two arenas).

    - **Slabs** of a power-of-two size (MIN_SLAB..MAX_SLAB) are the only allocations: torch's caching host allocator
      rounds a pinned block up to a power of two, so a slab costs exactly its size.
    - **Extents** (slab, start, stop), multiples of ALIGN, are what a checkpoint holds: `take` gives the smallest free
      extent that holds it whole, or else the largest free extents until they do (a checkpoint may span slabs), and
      grows the arena only by what it lacks (`pool_bytes_for`). `give_back` returns them, merged with their free
      neighbours, with the event after which they may be written again (their last copy on a side stream).
    - `reserved`: the slabs' bytes; `in_use`: the extents' bytes given out; `held`: the bytes asked for by those
      still given out, `peak_held` its peak. `check()` states the invariants the tests hold it to.

    Thread-safe: a checkpoint is given back when autograd frees it, on whichever thread runs the backward, or by a
    garbage collection in the middle of a `take`: a give-back never waits for the lock (`give_back`)."""

    def __init__(self):
        self.slabs: dict[int, torch.Tensor] = {}
        self._pinned: dict[int, bool] = {}
        self._free: dict[bool, list[list]] = {False: [], True: []}  # [slab, start, stop, events], sorted
        self._given: dict[tuple[int, int, int], list] = {}  # each extent given out -> its lease's extents
        self._next_slab = 0
        self.reserved = self._in_use = self._held = self.peak_held = 0
        self._lock = threading.Lock()
        self._returned: collections.deque = collections.deque()  # give-backs not yet merged into the free lists

    @property
    def in_use(self) -> int:
        self._merge_returned()
        return self._in_use

    @property
    def held(self) -> int:
        self._merge_returned()
        return self._held

    def take(self, nbytes: int, pinned: bool) -> Lease:
        need = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            self._merge_returned_locked()
            free = self._free[pinned]
            lacking = need - sum(stop - start for _, start, stop, _ in free)
            if lacking > 0:
                self._grow(lacking, pinned)
            chosen = self._carve(free, need)
            extents = [(slab, start, stop) for slab, start, stop, _ in chosen]
            wait = [event for *_, events in chosen for event in events]
            self._in_use += need
            self._held += nbytes
            self.peak_held = max(self.peak_held, self._held)
            lease = Lease(extents, [self.slabs[slab][start:stop] for slab, start, stop in extents], nbytes, wait)
            for extent in extents:
                self._given[extent] = lease.extents
            return lease

    def give_back(self, lease: Lease, ready=None) -> None:
        """Return `lease`'s extents; `ready`: an event after which they may be written again (None: now). Called by
        finalizers, which may run inside a `take` (a garbage collection) or on autograd's thread: it only queues the
        lease, merged into the free lists now if the pool is not busy, else by the next call that holds the lock."""
        self._returned.append((lease, ready))
        self._merge_returned()

    def _merge_returned(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the holder merges them before it carves (`take`) or counts (`check`)
        try:
            self._merge_returned_locked()
        finally:
            self._lock.release()

    def _merge_returned_locked(self) -> None:
        while self._returned:
            lease, ready = self._returned.popleft()
            for extent in lease.extents:
                del self._given[extent]
                slab, start, stop = extent
                self._insert_free(self._free[self._pinned[slab]], [slab, start, stop, [] if ready is None else [ready]])
                self._in_use -= stop - start
            self._held -= lease.nbytes

    def release(self) -> None:
        """Free the slabs nothing holds a byte of (the pool is allocated again on the next need)."""
        with self._lock:
            self._merge_returned_locked()
            for pinned, free in self._free.items():
                whole = [e for e in free if e[1] == 0 and e[2] == self.slabs[e[0]].numel()]
                for slab, *_ in whole:
                    self.reserved -= self.slabs.pop(slab).numel()
                    del self._pinned[slab]
                self._free[pinned] = [e for e in free if e not in whole]

    def check(self) -> None:
        """The pool's invariants: the free extents and those given out tile every slab exactly once (nothing lost,
        nothing given twice), free neighbours are merged, and the counters agree."""
        with self._lock:
            self._merge_returned_locked()
            covered = sorted([tuple(e[:3]) for free in self._free.values() for e in free] + list(self._given))
            by_slab: dict[int, int] = {}
            for slab, start, stop in covered:
                assert start == by_slab.get(slab, 0) and stop > start and start % ALIGN == 0, (slab, start, stop)
                by_slab[slab] = stop
            assert by_slab == {slab: t.numel() for slab, t in self.slabs.items()}, "extents do not tile the slabs"
            for free in self._free.values():
                for a, b in zip(free, free[1:]):
                    assert not (a[0] == b[0] and a[2] == b[1]), "free neighbours not merged"
            assert self.reserved == sum(t.numel() for t in self.slabs.values())
            assert self._in_use == sum(stop - start for slab, start, stop in self._given)

    # -- inside the lock --------------------------------------------------------------------------------------------

    def _grow(self, lacking: int, pinned: bool) -> None:
        """New slabs of at least `lacking` bytes: one granule's multiple, in powers of two."""
        arena = sum(t.numel() for s, t in self.slabs.items() if self._pinned[s] == pinned)
        remaining = _round_up(lacking, _granule(arena))
        while remaining:
            size = min(MAX_SLAB, _pow2_floor(remaining))
            slab, self._next_slab = self._next_slab, self._next_slab + 1
            self.slabs[slab] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self._pinned[slab] = pinned
            self._insert_free(self._free[pinned], [slab, 0, size, []])
            self.reserved += size
            remaining -= size

    @staticmethod
    def _carve(free: list[list], need: int) -> list[list]:
        """Remove `need` bytes from `free` (which has them): the smallest extent that holds them whole, or else the
        largest extents, the last one split."""
        whole = [e for e in free if e[2] - e[1] >= need]
        order = [min(whole, key=lambda e: e[2] - e[1])] if whole else sorted(free, key=lambda e: e[1] - e[2])
        chosen = []
        for extent in order:
            slab, start, stop, events = extent
            free.remove(extent)
            if stop - start > need:  # the rest stays free (its events still guard it)
                HostPool._insert_free(free, [slab, start + need, stop, list(events)])
                stop = start + need
            chosen.append([slab, start, stop, events])
            need -= stop - start
            if need == 0:
                return sorted(chosen)  # in slab order: a checkpoint's bytes in a stable order
        raise AssertionError("the pool carved more than it had")

    @staticmethod
    def _insert_free(free: list[list], extent: list) -> None:
        """Insert a free extent in (slab, start) order, merged with free neighbours; completed events dropped."""
        index = bisect.bisect_left(free, extent[:3], key=lambda e: e[:3])
        before = free[index - 1] if index and free[index - 1][0] == extent[0] and free[index - 1][2] == extent[1] \
            else None
        after = free[index] if index < len(free) and free[index][0] == extent[0] and free[index][1] == extent[2] \
            else None
        events = extent[3] + (before[3] if before else []) + (after[3] if after else [])
        events = [e for e in events if not e.query()]
        start = before[1] if before else extent[1]
        stop = after[2] if after else extent[2]
        if after:
            free.pop(index)
        if before:
            free[index - 1] = [extent[0], start, stop, events]
        else:
            free.insert(index, [extent[0], start, stop, events])


@dataclass
class OffloadCounts:
    """What the hooks did since the last `drain` (telemetry for tests and benchmarks; no forward reads it)."""

    offloaded: int = 0  # inputs copied to the host
    kept: int = 0  # inputs unpacked in backward straight from the device (the last layer's)
    restored: int = 0  # inputs copied back to the device
    prefetched: int = 0  # of which started before they were needed
    parked: int = 0  # vision feature tensors parked on the host in forward (`park_features`)
    unparked: int = 0  # their gradients handed back to the device in backward

    def drain(self) -> dict:
        out = dict(vars(self))
        for name in out:
            setattr(self, name, 0)
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
    one, or while its copy to the host runs), in host extents of the pool, and on its way back (prefetched)."""

    def __init__(self, tensor: torch.Tensor, previous: SavedInput | None):
        self.on_device: torch.Tensor | None = tensor
        self.lease: Lease | None = None  # the pool's extents holding the tensor's bytes
        self.back: torch.Tensor | None = None  # the prefetched device copy
        self.back_ready = None  # its event on the side stream
        self.shape, self.stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        self.previous = None if previous is None else weakref.ref(previous)  # the layer before: prefetched next


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes as a flat uint8 view (the same memory)."""
    return tensor.reshape(-1).view(torch.uint8)


class HostCheckpoints:
    """The saved-tensor hooks that keep checkpointed layers' inputs in the host pool (module docstring).

    Stream safety: everything the side stream touches is either recorded on it or given back after an event on it.
    A device tensor read by a copy to the host, and a prefetch buffer written by a copy back, are `record_stream`ed
    on the side stream, so the caching allocator reuses neither before the copy ran, whatever frees them (a partial
    backward, an exception, a graph never backwarded); host extents return to the pool with the side stream's event,
    and whoever takes them next waits for it before writing."""

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
        if newest is not None and newest.on_device is not None and newest.lease is None:
            self._to_host(newest)  # the newest input so far is no longer the last layer's
        self._newest = weakref.ref(saved)
        return saved

    def _to_host(self, saved: SavedInput) -> None:
        tensor = saved.on_device
        streams = self._streams_of(tensor.device)
        saved.lease = lease = self.pool.take(tensor.numel() * tensor.element_size(), pinned=streams is not None)
        weakref.finalize(saved, self._give_back, lease, streams)
        source = _bytes_of(tensor)
        if streams is None:
            for piece, offset, n in lease.spans():
                piece[:n].copy_(source[offset:offset + n])
        else:
            streams.side.wait_stream(streams.current())  # after the compute that made it
            with streams.module.stream(streams.side):
                for event in lease.wait:  # the extents' last copies, if another stream made them
                    streams.side.wait_event(event)
                for piece, offset, n in lease.spans():
                    piece[:n].copy_(source[offset:offset + n], non_blocking=True)
            tensor.record_stream(streams.side)  # its memory is reused only once the copy has run
        saved.on_device = None
        self.counts.offloaded += 1

    def _give_back(self, lease: Lease, streams: _Streams | None) -> None:
        """A freed checkpoint's extents back to the pool: writable again once the side stream's copies have run."""
        self.pool.give_back(lease, None if streams is None else streams.side.record_event())

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
        if previous is not None and previous.lease is not None and previous.back is None:
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
            tensor.record_stream(streams.current())  # (a no-op unless backward runs on another stream than forward)
        self.counts.restored += 1
        return tensor

    def _to_device(self, saved: SavedInput) -> None:
        back = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=saved.device)
        target = _bytes_of(back)
        streams = self._streams_of(saved.device)
        if streams is None:
            for piece, offset, n in saved.lease.spans():
                target[offset:offset + n].copy_(piece[:n])
        else:
            streams.side.wait_stream(streams.current())  # the memory's previous users are done
            with streams.module.stream(streams.side):
                for piece, offset, n in saved.lease.spans():
                    target[offset:offset + n].copy_(piece[:n], non_blocking=True)
                saved.back_ready = streams.side.record_event()
            back.record_stream(streams.side)  # freed unused (an exception, a partial backward): reused after the copy
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
    on the host between forward and backward (module docstring); otherwise the call as it was. With the switch on, a
    layer checkpointed by another mechanism is refused here (`foreign_checkpoint_problem`)."""
    if SETTINGS.offload_checkpoints and instance.training:
        problem = foreign_checkpoint_problem(instance, args)
        if problem is not None:
            raise UnsupportedSetupError(problem)
    if not offload_applies(instance):
        return wrapped(*args, **kwargs)
    with HOST_CHECKPOINTS.offloading(args), one_offload(instance):
        return wrapped(*args, **kwargs)


def transformers_offload(layer: torch.nn.Module) -> bool:
    """Whether `layer` checkpoints through transformers' `offload=True` (its checkpoint inside torch's
    `save_on_cpu`)."""
    return getattr(layer, "gradient_checkpointing", False) and \
        _saves_on_cpu(getattr(layer, "_gradient_checkpointing_func", None))


def offload_in_effect(model: torch.nn.Module) -> str | None:
    """Who keeps `model`'s checkpoints on the host, for the CP line and the plan: this pool
    ("VLMCP_OFFLOAD_CHECKPOINTS", saying so where transformers' offload is set aside), transformers' `offload=True`,
    or nobody (None)."""
    theirs = any(transformers_offload(m) for m in model.modules())
    if SETTINGS.offload_checkpoints:
        return "VLMCP_OFFLOAD_CHECKPOINTS" + (" (transformers' offload=True set aside)" if theirs else "")
    return "transformers' offload=True" if theirs else None


@contextlib.contextmanager
def one_offload(layer: torch.nn.Module):
    """Inside this pool's offloading of `layer`'s call (module docstring): where transformers' `offload=True` is on
    too, the layer checkpoints without its `save_on_cpu` for the call — whose hooks, entered inside ours, would
    otherwise take the checkpoint and leave this pool nothing (the same checkpoint and keywords, and the choice
    carried as before)."""
    function = getattr(layer, "_gradient_checkpointing_func", None)
    if not transformers_offload(layer):
        yield
        return
    _say_once_which_offload_acts()
    layer._gradient_checkpointing_func = _without_save_on_cpu(function)
    try:
        yield
    finally:
        layer._gradient_checkpointing_func = function


def _without_save_on_cpu(function):
    """transformers' offload function (`partial(checkpoint_func, **kwargs)`, `checkpoint_func` entering `save_on_cpu`
    around torch's checkpoint; maybe inside the package's `CheckpointUnderTheChoice`) as torch's checkpoint with the
    same keywords, inside the same wrapper."""
    from torch.utils.checkpoint import checkpoint

    from .switches import CheckpointUnderTheChoice

    inner = function.checkpoint if isinstance(function, CheckpointUnderTheChoice) else function
    plain = functools.partial(checkpoint, *inner.args, **inner.keywords)
    return CheckpointUnderTheChoice(plain) if inner is not function else plain


_SAID: list = []


def _say_once_which_offload_acts() -> None:
    if _SAID:
        return
    _SAID.append(True)
    from .switches import LOGGER

    LOGGER.warning("vlmcp_patch: checkpoints on the host asked twice, by VLMCP_OFFLOAD_CHECKPOINTS and by "
                   "transformers' offload=True: the package's pool keeps them (copies behind compute, one reused "
                   "pool); transformers' save_on_cpu is set aside, so no checkpoint is copied twice")


@functools.cache
def _foreign_checkpoints(deepspeed_checkpointing) -> dict:
    """The code objects of the checkpoint functions the switch does not act through, and their names: torch's
    `checkpoint` (hand-written, or inside torch's `checkpoint_wrapper`, which FSDP2 and Accelerate's
    `activation_checkpointing` apply), and DeepSpeed's (`deepspeed_checkpointing`: its module, once imported)."""
    import inspect

    import torch.utils.checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    codes = {
        CheckpointWrapper.forward.__code__: "torch's checkpoint_wrapper (FSDP2's or Accelerate's "
                                            "activation_checkpointing, apply_activation_checkpointing)",
        inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__: "torch.utils.checkpoint.checkpoint",
    }
    for name in ("checkpoint", "non_reentrant_checkpoint"):
        fn = getattr(deepspeed_checkpointing, name, None)
        if fn is not None:
            codes[inspect.unwrap(fn).__code__] = \
                f"DeepSpeed's activation checkpointing (deepspeed.checkpointing.{name})"
    return codes


def foreign_checkpoint_problem(layer: torch.nn.Module, args: tuple) -> str | None:
    """With `VLMCP_OFFLOAD_CHECKPOINTS`: a checkpointable layer called, in a training forward, inside a checkpoint that
    is not transformers' own (`gradient_checkpointing_enable`), whose hooks the switch acts through. Its checkpoint
    would stay on the device, the switch silently doing nothing: refused at the first such layer, on every rank (each
    calls the same layers), before its compute. A reentrant checkpoint runs its function without gradients, so its
    inputs requiring one tell a training forward from an inference one."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return None
    codes = _foreign_checkpoints(sys.modules.get("deepspeed.runtime.activation_checkpointing.checkpointing"))
    found, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            found.append(codes[frame.f_code])
        frame = frame.f_back
    if not found:
        return None
    found = next((name for name in found if "checkpoint_wrapper" in name), found[0])  # the wrapper over its checkpoint
    return (
        f"VLMCP_OFFLOAD_CHECKPOINTS=1 keeps on the host the checkpoints of transformers' own gradient checkpointing, "
        f"but this {type(layer).__name__} is checkpointed by {found}: its checkpoint would stay on the device and the "
        "switch would do nothing. Checkpoint through transformers instead: model.gradient_checkpointing_enable() (the "
        "Trainer's gradient_checkpointing=True; with Accelerate's FSDP2 plugin, activation_checkpointing=False), or "
        "unset VLMCP_OFFLOAD_CHECKPOINTS."
    )


def _saves_on_cpu(fn) -> bool:
    """Whether a layer's checkpoint function runs torch's `save_on_cpu` (transformers' `offload=True`)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    code = getattr(fn, "__code__", None)
    return code is not None and "save_on_cpu" in code.co_names


def foreign_offload_problem(model) -> str | None:
    """Under CP: Accelerate's FSDP2 `activation_checkpointing_offload` (torch's `OffloadWrapper` around the
    checkpoint wrapper): exact, but it copies on the compute stream and pins memory per tensor every step (a slow
    path), and it checkpoints outside transformers, where the package's switch cannot act: refused before compute,
    naming the package's switch. (transformers' own `offload=True` runs: module docstring.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    if cp_size() == 1:  # a packed row at P=1: their offload runs as it does on stock
        return None
    for name, module in model.named_modules():
        if isinstance(module, OffloadWrapper):
            theirs = "Accelerate's activation_checkpointing_offload (torch's OffloadWrapper)"
            return (
                f"{name or type(model).__name__} keeps its checkpoints on the host through {theirs}: its copies run "
                "on the compute stream, pinning memory every step. Under CP use the package's own switch instead, "
                "which keeps the same inputs in a reused host pool with the copies behind compute: enable "
                "checkpointing without offload and set VLMCP_OFFLOAD_CHECKPOINTS=1 (or "
                "vlmcp_patch.enable(offload_checkpoints=True)); or set VLMCP_CP_SIZE=1."
            )
    return None


# -- the vision features parked on the host (issue 53) -----------------------------------------------------------------


class HostFeatures:
    """The vision features `park_features` keeps on the host: their counts live in `HOST_CHECKPOINTS.counts`;
    `observers` are called with every host tensor the parking makes — the parked features in forward, their gradients
    as they arrive in backward — for the memory benchmark, which leaves them out of a device's peak (on a CPU the host
    is the device)."""

    def __init__(self):
        self.observers: list = []

    def observe(self, tensor: torch.Tensor) -> None:
        for observer in self.observers:
            observer(tensor)


HOST_FEATURES = HostFeatures()


def parks_features() -> bool:
    """Whether a CP forward parks its vision features on the host (`park_features`): as set
    (`VLMCP_OFFLOAD_FEATURES`), or by need (`switches.features_on_host`: the row does not fit the device without it,
    with the checkpoint offload on); gradients on, not traced."""
    return features_on_host() and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy (pageable: its exact bytes, no power-of-two pinned block) of a device tensor."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)


class _ParkedFeatures(torch.autograd.Function):
    """Forward: `joined` (merged tokens, the columns of every feature kind side by side; on the device) -> one
    contiguous host tensor per width of `widths`. Backward: those tensors' gradients (on the host) -> `joined`'s (on
    its device), made only when the last of them has arrived."""

    @staticmethod
    def forward(ctx, joined: torch.Tensor, widths: list[int]):
        ctx.set_materialize_grads(False)
        ctx.rows, ctx.widths, ctx.dtype, ctx.device = joined.shape[0], list(widths), joined.dtype, joined.device
        # backward runs on the CPU's queue (its inputs are host tensors): it writes `joined`'s gradient on the stream
        # the forward ran on, which the tower's backward then reads on
        ctx.stream = torch.get_device_module(joined.device).current_stream(joined.device) \
            if joined.device.type != "cpu" else None
        parked = tuple(_host_copy(part) for part in joined.detach().split(widths, dim=-1))
        HOST_CHECKPOINTS.counts.parked += len(parked)
        for tensor in parked:
            HOST_FEATURES.observe(tensor)
        return parked

    @staticmethod
    def backward(ctx, *grads):
        on_stream = contextlib.nullcontext() if ctx.stream is None else \
            torch.get_device_module(ctx.device).stream(ctx.stream)
        with on_stream:
            joined = torch.empty(ctx.rows, sum(ctx.widths), dtype=ctx.dtype, device=ctx.device)
            for part, grad in zip(joined.split(ctx.widths, dim=-1), grads):
                if grad is None:  # a feature kind the forward did not read
                    part.zero_()
                else:
                    part.copy_(grad)
        HOST_CHECKPOINTS.counts.unparked += 1
        return joined, None


def park_features(joined: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """The vision features of this rank's slice parked in host memory between the tower and the decoder.

    `joined` (merged tokens, sum(widths)): the features routed to this rank, the merged features and each deepstack
    level side by side, on the device. Returns one contiguous host tensor per width (the merged features, then each
    level), in `joined`'s dtype. The stock forwards of the four families move each feature to the device where they
    read it (`masked_scatter` of the merged features into the embeddings; a deepstack level added after its decoder
    layer: `.to(hidden_states.device)`), and nothing saves those copies for backward: on the device a level then lives
    only while its layer adds it, where it lived through the whole decoder's forward. In backward each feature's
    gradient arrives on the host (the move's backward) as the layer that reads it runs, and waits there; when the
    last has arrived (the merged features', at the embeddings) they go to the device together, as `joined`'s gradient,
    for the tower's backward. So the deepstack gradients are not on the device beside the first layers' recomputes.
    The values are copied, never changed: bit-identical. With `HOST_FEATURES.observers` set, each gradient is reported
    as it arrives."""
    parked = list(_ParkedFeatures.apply(joined, list(widths)))
    if HOST_FEATURES.observers:
        for tensor in parked:
            if tensor.requires_grad:  # a frozen tower's features have no gradient to report
                tensor.register_hook(_observed)
    return parked


def _observed(grad: torch.Tensor) -> None:
    HOST_FEATURES.observe(grad)
