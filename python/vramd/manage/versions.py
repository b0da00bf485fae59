"""Following the daemon's updates: each new version of the weights taken between forwards
(manage(..., follow=True), then Managed.wait_update())."""
from __future__ import annotations

import threading
import time

from .errors import ManageError, _name


class _Versions:
    """Managed's version of the weights, and the taking of the next one."""

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
        with self._lock:
            self._taking += 1
            self._waiting.add(me)
            try:
                # Forwards of the module on other threads, and its units called outside them (a VAE's
                # decode not named in forward_methods).
                while self._calls or any(unit.in_use for unit in self._units):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"version {self.lease.version} of {self.lease.manifest['model']!r} came, but "
                                           f"the forwards under way on other threads did not end within {timeout} s: "
                                           "the next wait_update() takes it")
                    self._freed.wait(left)
            finally:
                self._waiting.discard(me)
                self._taking -= 1
                self._freed.notify_all()  # forwards waiting to begin: they do once this lock is let go
            for unit in self._units:
                if unit.pending is not None:
                    self._cancel_prefetch(unit)
                if unit.ready:
                    self._drop(unit)
            changed = [f"{slot.name!r} is {list(new.shape)} {_name(new.dtype)}, {list(slot.rest.shape)} "
                       f"{_name(slot.rest.dtype)} before" for slot in self._slots
                       if ((new := state_dict[slot.name]).shape, new.dtype) != (slot.rest.shape, slot.rest.dtype)]
            if changed:  # never from an update, which keeps shapes and dtypes
                raise ManageError(f"version {self.lease.version} of {self.lease.manifest['model']!r}: "
                                  f"{', '.join(changed)}")
            self._unpin()  # before the version before is unmapped
            for slot in self._slots:
                slot.rest = state_dict[slot.name]
            if self.device.type == "cuda":
                self._registered = self._pin()
            self._arrived = None
            self._version = self.lease.version
        return self._version
