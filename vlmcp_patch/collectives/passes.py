"""The ring's passes: point-to-point sends and receives, started in one batch and waited for apart (no autograd).

`start_pass` posts the sends to the next member and the receives from the previous one and returns a `PendingPass`:
one communication of the rank's sequence (recorded and ordered as issued there, `communication.communicate`); its
wait raises `CollectiveError` on a failure or, given one, past the timeout (`communication.raising`). The ring's
autograd functions (`attention/ring.py`) call it in forward and backward and decide whether the transfer runs
behind the compute that follows (`overlap`, from `SETTINGS.ring_overlap` where the ring is built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .communication import communicate, raising


@dataclass
class PendingPass:
    """A ring pass in flight (`start_pass`): `wait()` returns the tensors received, once. The sent tensors are held
    until then (a send buffer must outlive its request)."""

    received: list[torch.Tensor]
    requests: list
    sent: list[torch.Tensor]
    group: object
    timeout: object

    def wait(self) -> list[torch.Tensor]:
        def run():
            for request in self.requests:
                request.wait() if self.timeout is None else request.wait(self.timeout)

        if self.requests:
            raising("ring pass", self.group, run)
        self.requests, self.sent = [], []
        return self.received


def start_pass(tensors: list[torch.Tensor], group, next_rank: int, prev_rank: int, tag: int = 0,
               timeout=None, overlap: bool = True) -> PendingPass:
    """Post the sends of `tensors` to `next_rank` and the receives of the same shapes from `prev_rank` (global ranks
    of `group`, a ring) in one batch: one communication of the rank's sequence (recorded and ordered as issued
    here), its completion awaited by `PendingPass.wait`. `tag` keeps two rings on the same ranks apart (the keys and
    their gradients in backward); `timeout` bounds the wait (None: the backend's own). With `overlap` this returns at
    once and the caller waits after computing; without, the pass is complete when this returns (the schedule before
    the overlap, kept for benchmarks/ring_overlap.py to compare) — the same collectives in the same order either
    way."""
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    sent = [t.contiguous() for t in tensors]
    ops = [dist.P2POp(dist.isend, t, next_rank, group=group, tag=tag) for t in sent]
    ops += [dist.P2POp(dist.irecv, r, prev_rank, group=group, tag=tag) for r in received]
    requests = communicate("ring pass", group, sum(t.numel() for t in tensors), lambda: dist.batch_isend_irecv(ops))
    pending = PendingPass(received, requests, sent, group, timeout)
    if not overlap:
        pending.wait()
    return pending
