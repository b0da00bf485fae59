"""The copies ahead of their unit: a prefetch on a side CUDA stream (or on a thread on the CPU)
while another unit computes, and the page-locked host memory that copies to a GPU come from."""
from __future__ import annotations

import time
import warnings
from concurrent.futures import Future

import torch

from .._cuda import host_register, host_unregister
from .._units import format_bytes
from .unit import _Unit


class _Streams:
    """Managed's prefetches and page-locking."""

    def _pin(self) -> list[int]:
        """Page-locks the leased host memory once (again for each version taken), so that copies to
        the GPU run at the bus's speed."""
        started = time.perf_counter()
        registered, failed = [], {}
        self._figures["pinned_bytes"] = 0
        cudart = torch.cuda.cudart()
        for region in self.lease._regions:
            with warnings.catch_warnings():  # read-only on purpose
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
            error = host_register(address, len(region), 0x08)  # cudaHostRegisterReadOnly
            if error == 0:
                registered.append(address)
                self._figures["pinned_bytes"] += len(region)
            else:
                why = cudart.cudaGetErrorString(error)
                failed[why] = failed.get(why, 0) + len(region)
        self._figures["pin_seconds"] += time.perf_counter() - started
        if failed:  # copies from pageable memory hold the host until each is staged: slower, not wrong
            warnings.warn(f"vramd.manage: page-locking {format_bytes(sum(failed.values()))} of the lease of "
                          f"{self.lease.manifest['model']!r} failed ({', '.join(failed)}): their copies to {self.device} "
                          "wait for the host", stacklevel=4)
        return registered

    def _unpin(self) -> None:
        """Gives the page-locked memory back, once no copy from it is under way."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            for address in self._registered:
                host_unregister(address)
            self._registered = []

    def _prefetch(self, unit: _Unit, current: _Unit) -> None:
        if not self._make_room(unit, keep={unit, current}, prefetch=True):
            return
        wanted = [slot for slot in unit.slots if slot.users == 0]
        reserved = sum(slot.bytes for slot in wanted)
        self._room.held += reserved  # counted from now, so that nothing else takes the room
        self._count_peak()
        try:
            if self._side is not None:
                # The copies come from the side stream's pool, where a prefetched copy goes back as soon
                # as it is dropped (no record_stream, whose deferred frees count as allocated and cost
                # an event each): the side stream first waits for the work queued so far on the
                # streams that computed with such copies, which includes every kernel that read one.
                for stream in self._consumers:
                    self._side.wait_stream(stream)
                with torch.cuda.stream(self._side):
                    copies = {slot: slot.copy() for slot in wanted}
                    event = torch.cuda.Event()
                    event.record(self._side)
                unit.pending = (event, copies)
            else:
                unit.pending = self._thread.submit(lambda: {slot: slot.copy() for slot in wanted})
        except BaseException:  # out of memory, say: the room is not kept for a copy that never came
            self._room.held -= reserved
            raise
        self._figures["prefetched"] += 1

    def _cancel_prefetch(self, unit: _Unit) -> None:
        """Lets a prefetch's copies go unused. On a GPU no other stream has used them, so their
        memory goes back to the side stream's pool, in its order."""
        if isinstance(unit.pending, Future):
            copies = unit.pending.result()
        else:
            _, copies = unit.pending
        unit.pending = None
        self._room.held -= sum(slot.bytes for slot in copies)

    def _finish_prefetch(self, unit: _Unit) -> None:
        started = time.perf_counter()
        if isinstance(unit.pending, Future):
            copies = unit.pending.result()
        else:
            event, copies = unit.pending
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            self._consumers[stream] = None  # made on the side stream, used on this one: see _prefetch
        self._figures["waited_seconds"] += time.perf_counter() - started
        unit.pending = None
        self._room.held -= sum(slot.bytes for slot in copies)  # the room it kept; _bring counts what it puts
        self._bring(unit, copies)
