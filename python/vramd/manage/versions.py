"""Following the daemon's updates: each new version of the weights taken between forwards
(manage(..., follow=True), then Managed.wait_update())."""
from __future__ import annotations

import os
import threading
import time

from .._units import format_bytes, format_exact
from .errors import ManageError, _listed, _name
from .lora import merged, read_loras, served_loras


def _lora_item(lora) -> tuple[str, float]:
    path, scale = (lora, 1.0) if isinstance(lora, (str, os.PathLike)) else lora
    return os.path.abspath(os.fspath(path)), float(scale)


class _Versions:
    """Managed's version of the weights, and the taking of the next one; its LoRA adapters, and the
    taking of another set (set_loras), between forwards alike."""

    def _between_forwards(self, deadline, timeout, what: str, after: str) -> None:
        """Under the lock: waits for the module's forwards under way on other threads, and its units
        called outside them (a VAE's decode not named in forward_methods), to end; forwards that
        would begin meanwhile wait for the lock to be let go. TimeoutError past `deadline`."""
        me = threading.get_ident()
        self._taking += 1
        self._waiting.add(me)
        try:
            while self._calls or any(unit.in_use for unit in self._units):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{what} the forwards under way on other threads did not end within {timeout} s: "
                                       f"{after}")
                self._freed.wait(left)
        finally:
            self._waiting.discard(me)
            self._taking -= 1
            self._freed.notify_all()  # forwards waiting to begin: they do once the lock is let go

    def _drop_copies(self, units) -> None:
        """Under the lock: the units' copies (and prefetches) dropped, to be brought anew."""
        for unit in units:
            if unit.pending is not None:
                self._cancel_prefetch(unit)
            if unit.ready:
                self._drop(unit)

    @property
    def loras(self) -> list[tuple[str, float]]:
        """The LoRA adapters this process applies of its own (manage(..., loras=), set_loras):
        (path, scale) each."""
        return list(self._loras)

    @property
    def served_loras(self) -> list[tuple[str, float]]:
        """The adapters the served model leaves to its clients ("weights" with fuse_lora = false: its
        config's [[lora]], or the set Client.set_loras put in force), which this process applies
        before its own, as of the version its units bring."""
        return list(self._served_items)

    def set_loras(self, loras, timeout: float | None = None) -> None:
        """Replaces the LoRA adapters this process applies ([] for none: the leased weights as they
        are), between forwards as wait_update() takes a version: the new set is read and checked
        whole first (a ManageError naming the adapter and key leaves the set in force), then, once
        the forwards under way on other threads have ended, the units holding a weight either set
        changes drop their copies and bring the new values when they next run. A weight that
        computes in place from the lease (on the CPU, in the leased dtype) has no copy to adapt:
        manage it with that adapter in loras= from the start. TimeoutError after `timeout`."""
        me = threading.get_ident()
        if self._calls.get(me) or self._running.get(me):
            raise ManageError(f"set_loras() of {self!r} from inside its forward: call it between forwards")
        items = [_lora_item(lora) for lora in loras]
        own = read_loras(items, self.module, index=self._index)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._between_forwards(deadline, timeout, "set_loras:", "the adapters in force are kept")
            self._adapt(merged(self._served, own), "set_loras:", "the adapters in force are kept")
            self._loras, self._own = items, own

    def _adapt(self, terms: dict, what: str, kept: str) -> None:
        """Under the lock, between forwards: the slots whose terms change take `terms`, the units
        holding them dropping their copies; where that would need more than the limit, or changes
        a weight no unit manages, ManageError, the terms in force kept."""
        slots = {slot.name: slot for slot in self._slots}
        unmanaged = sorted(set(terms) - set(slots))
        if unmanaged:
            raise ManageError(f"{what} {_listed(unmanaged)} changed by the adapters, which no unit manages")
        changed = {slots[name] for name in set(terms) | {n for n, slot in slots.items() if slot.lora}}
        units = [unit for unit in self._units if changed & set(unit.slots)]
        self._drop_copies(units)
        before = {slot: slot.lora for slot in changed}
        self._take_loras({slot: terms.get(slot.name) for slot in changed}, units)
        if self.limit is not None and self._least > self.limit:  # an adapted weight viewed in place before
            least = self._least
            self._take_loras(before, units)
            raise ManageError(f"{what} the adapted weights need copies, {format_exact(least)} at once, more than the "
                              f"limit of {format_bytes(self.limit)}: {kept}")

    def _take_loras(self, terms: dict, units) -> None:
        """Under the lock: each slot's terms, and the units' bytes and the least limit they make."""
        for slot, lora in terms.items():
            slot.set_lora(lora)
        for unit in units:
            unit.bytes = sum(slot.bytes for slot in unit.slots)
        self._least = self._most_held_at_once()[0]

    @property
    def version(self) -> int:
        """The version of the weights its units bring (the daemon's count of updates)."""
        return self._version

    def wait_update(self, timeout: float | None = None) -> int:
        """Waits for the daemon's next version of the model's weights (manage(..., follow=True))
        and takes it between forwards: once the module's forwards (and calls of its forward_methods)
        under way on other threads have ended (those that would begin meanwhile wait for it), the
        units' copies of the version before are dropped and each unit brings the new values when it
        next runs. So each forward runs on one version. Returns the version. Raises TimeoutError
        after `timeout` seconds (where the version came but the forwards under way did not end in
        time, the next call takes it), ManageError from inside a forward or for a module managed
        without follow=True, vramd.DaemonError when the lease has ended."""
        me = threading.get_ident()
        if self._calls.get(me) or self._running.get(me):
            raise ManageError(f"wait_update() of {self!r} from inside its forward: call it between forwards")
        if self.lease._reader is None:
            raise ManageError(f"{self!r} does not follow updates: manage it with follow=True")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._arrived is None:
            self._arrived = self.lease.wait_update(timeout)
        state_dict = self._arrived
        what = f"version {self.lease.version} of {self.lease.manifest['model']!r}"
        # A switch of the adapters the model leaves to its clients: read whole first.
        served_items = self.lease.loras
        served = self._served if served_items == self._served_items else served_loras(self.lease, self.module, self._index)
        # The tensors held already (a switch of the served adapters writes no weight): only the
        # units the adapters change drop their copies, and the memory stays page-locked.
        same = not self.lease.in_place and all(state_dict[slot.name] is slot.rest for slot in self._slots)
        with self._lock:
            self._between_forwards(deadline, timeout, f"{what} came, but", "the next wait_update() takes it")
            if not same:
                self._drop_copies(self._units)
                changed = [f"{slot.name!r} is {list(new.shape)} {_name(new.dtype)}, {list(slot.rest.shape)} "
                           f"{_name(slot.rest.dtype)} before" for slot in self._slots
                           if ((new := state_dict[slot.name]).shape, new.dtype) != (slot.rest.shape, slot.rest.dtype)]
                if changed:  # never from an update, which keeps shapes and dtypes
                    raise ManageError(f"{what}: {', '.join(changed)}")
            if served is not self._served:
                self._adapt(merged(served, self._own), f"{what}:", "the version before is kept")
                self._served, self._served_items = served, served_items
            if not same:
                self._unpin()  # before the version before is unmapped
                for slot in self._slots:
                    slot.rest = state_dict[slot.name]
                if self.device.type == "cuda":
                    self._registered = self._pin()
            self._arrived = None
            self._version = self.lease.version
        return self._version
