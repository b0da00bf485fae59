"""A unit of residency and the room under a limit: a unit's weights brought in and dropped (the
ready units no op uses, the most recently used first) so that the copies never pass the limit,
the threads that wait for room another frees, and the peak the daemon is told."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._units import format_bytes
from ..lease import Lease
from .errors import ManageError
from .slot import _Slot

if TYPE_CHECKING:
    from .api import Managed


class _Unit:
    def __init__(self, name: str, module: nn.Module, paths: list[str], slots: list[_Slot]):
        self.name = name
        self.module = module
        self.paths = paths          # wherever the module is, a module shared by several parents under each
        self.slots = slots
        self.bytes = sum(slot.bytes for slot in slots)
        self.shares = False         # a slot of another unit's too (a tied weight, or a module under two units)
        self.ready = False
        self.in_use = 0
        self.pending: Future | tuple | None = None  # a prefetch under way: a Future, or (event, tensors) on a GPU

    def missing(self) -> int:
        """The bytes it needs brought in, not ready: a slot another ready unit holds is there."""
        return sum(slot.bytes for slot in self.slots if slot.users == 0) if self.shares else self.bytes


class _Room:
    """A limit on one device and what counts against it: the copies of the managed modules that
    share it (manage(share=...)), the ready units no op uses, the threads running units; one lock
    for all of them. The lease that reserved the limit is told the peak, and ends with the last
    module."""

    def __init__(self, limit: int | None, device: torch.device, lease: Lease):
        self.limit = limit
        self.device = device
        self.lease = lease
        self.lock = threading.RLock()
        self.freed = threading.Condition(self.lock)
        # Threads running units: units in use by each, and those waiting for room one of them frees.
        self.running: dict[int, int] = {}
        self.waiting: set[int] = set()
        self.held = 0
        self.peak = 0
        self.told = 0  # the peak the daemon last heard
        # Ready units no op uses, the most recently used last: what _make_room drops from.
        self.idle: dict[_Unit, None] = {}
        self.members: list[Managed] = []

    def units(self):
        return (unit for member in self.members for unit in member._units)


def _enclosing(path: str) -> list[str]:
    """The names of the modules around module `path`, the outermost first: "", "a", "a.b" for "a.b.c"."""
    parts = path.split(".") if path else []
    return [".".join(parts[:depth]) for depth in range(len(parts))]


class _Residency:
    """Managed's moves of weights in and out of the room."""

    def _bring(self, unit: _Unit, copies: dict[_Slot, torch.Tensor]) -> None:
        """Puts a unit's copies in place and counts them. A slot another unit holds is shared, not
        copied twice; one that another unit let go of while this one's copies were made is made now."""
        for slot in unit.slots:
            if slot.users == 0:
                value = copies.get(slot)
                if value is None:
                    self._make_room(slot.bytes, keep={unit})
                    value = slot.copy()
                slot.put(value)
                self._room.held += slot.bytes
                self._figures["bytes_moved"] += slot.bytes
                self._figures["bytes_read"] += slot.read
            slot.users += 1
        unit.ready = True
        self._figures["loads"] += 1
        self._count_peak()

    def _count_peak(self) -> None:
        """The peak, told to the daemon (which shows it beside the lease's reservation) as it grows."""
        room = self._room
        if room.held <= room.peak:
            return
        room.peak = room.held
        if room.held >= room.told + max(1, (room.limit or 0) // 64):  # a line per 1/64 of the limit at most
            room.told = room.held
            try:
                room.lease._sock.sendall(b'{"peak": %d}\n' % room.held)
            except (OSError, AttributeError):  # the lease has ended: nobody to tell
                pass

    def _drop(self, unit: _Unit) -> None:
        for slot in unit.slots:
            slot.users -= 1
            if slot.users == 0:
                slot.put(slot.placeholder)
                self._room.held -= slot.bytes
        unit.ready = False
        self._idle.pop(unit, None)

    def _make_room(self, need: int | _Unit, keep: set, prefetch: bool = False, wait: bool = False) -> bool:
        """Drops ready units that no op uses (the most recently used first) until `need` more
        bytes fit the limit: a number, or what a unit misses, counted again as units go (one
        dropped may have held a weight the unit shares). False for a prefetch that would not fit.
        With `wait` (a unit's hook, before it changes anything), waits while another thread runs a
        unit that will free room; raises when none does. Units of the modules sharing the limit
        are dropped as this one's are."""
        room = self._room
        if room.limit is None:
            return True
        me = threading.get_ident()
        coming = need if isinstance(need, _Unit) else None
        while room.held + (more := coming.missing() if coming else need) > room.limit:
            dropped = next((u for u in reversed(self._idle) if u not in keep), None)
            if dropped is not None:
                self._drop(dropped)
                continue
            if prefetch:
                return False
            pending = next((u for u in room.units() if u.pending is not None and u not in keep), None)
            if pending is not None:  # room kept for a unit a thread may not run soon (or ever: it raised)
                self._cancel_prefetch(pending)
                continue
            if not wait or not any(thread != me and thread not in self._waiting for thread in self._running):
                in_use = [u.name for u in room.units() if u.in_use]
                raise ManageError(f"the limit of {format_bytes(room.limit)} cannot hold {format_bytes(more)} more beside "
                                  f"{format_bytes(room.held)} held by "
                                  f"units in use ({', '.join(map(repr, in_use))}): raise the limit")
            self._waiting.add(me)
            try:
                self._freed.wait()
            finally:
                self._waiting.discard(me)
        return True
