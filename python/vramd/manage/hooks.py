"""The hooks on the module: each unit's forward wrapped to bring its weights in before it runs
and let them go after, the module's forward methods counted (the per-thread call depths a new
version waits for), and the moves and casts the manager cannot honour refused."""
from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._units import format_bytes
from .errors import ManageError
from .slot import _Slot
from .unit import _Unit, _enclosing

# Every module under an open manager: a module managed twice would have each manager's copies and
# placeholders put in the other's place.
_MANAGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Hooks:
    """Managed's hooks, put on in manage() and taken away by close()."""

    def _hook(self) -> None:
        """Wraps each unit's forward: its weights come in before it runs and are let go after, even
        when it raises (a forward hook would not run on Ctrl-C, and a unit left in use could never
        be dropped again; a wrapper also costs less a call). Wraps _apply (what .to(), .half() and
        .cuda() call) of each module holding managed weights, so that a move or cast the manager
        cannot honour is refused before anything changes."""
        self._hooked = True
        for module in self.module.modules():
            _MANAGED[module] = self
        for unit in self._units:
            self._wrap(unit.module, "forward", functools.partial(self._managed_forward, unit))
        for module, method in self._forward_methods:
            self._wrap(module, method, self._module_forward)
        every = dict(self.module.named_modules(remove_duplicate=False))
        held: dict[nn.Module, set[_Slot]] = {}  # the slots of the units under each module, by any of their paths
        for unit in self._units:
            for path in unit.paths:
                for name in _enclosing(path) + [path]:
                    held.setdefault(every[name], set()).update(unit.slots)
        for module, slots in held.items():
            self._wrap(module, "_apply", functools.partial(self._guarded_apply, slots))

    def _wrap(self, module: nn.Module, method: str, make) -> None:
        """Gives `module` a `method` of its own, make(the one it has), as accelerate's and
        diffusers' hooks do; _unwrap() gives back what it had."""
        own = module.__dict__.get(method)  # an instance's own (another library's hook), else the class's
        ours = make(getattr(module, method))
        setattr(module, method, ours)
        self._wrapped.append((module, method, own, ours))

    def _unwrap(self) -> None:
        for module, method, own, ours in reversed(self._wrapped):
            if module.__dict__.get(method) is not ours:
                continue  # wrapped in turn by another library since: ours now passes calls through
            if own is None:
                delattr(module, method)
            else:
                setattr(module, method, own)
        self._wrapped = []
        self._hooked = False
        for module in self.module.modules():
            if _MANAGED.get(module) is self:
                del _MANAGED[module]

    def _managed_forward(self, unit: _Unit, inner):
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not self._hooked:  # closed, but wrapped in turn by another library: its forward as it was
                return inner(*args, **kwargs)
            if not self._warned_autograd and torch.is_grad_enabled():
                self._warn_autograd(unit, args, kwargs)
            self._acquire(unit)
            try:
                return inner(*args, **kwargs)
            finally:
                self._done(unit)
        return forward

    def _module_forward(self, inner):
        """The module's own forward (or a method named as one), counted: wait_update() takes a
        version between forwards."""
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not self._hooked:
                return inner(*args, **kwargs)
            self._begin_call()
            try:
                return inner(*args, **kwargs)
            finally:
                self._end_call()
        return forward

    def _begin_call(self) -> None:
        """A forward of the module begins on this thread: where a wait_update() waits for those
        under way, after it."""
        with self._lock:
            if not self._calls.get(threading.get_ident()):
                while self._taking:
                    self._freed.wait()
            _enter(self._calls)

    def _end_call(self) -> None:
        with self._lock:
            if _leave(self._calls) and self._waiting:
                self._freed.notify_all()

    def _warn_autograd(self, unit: _Unit, args, kwargs) -> None:
        """Once: autograd keeps what a backward needs (the weights, where an input requires grad)
        alive until that backward, out of the manager's reach."""
        if self.limit is None or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                         for t in tree_leaves((args, kwargs))):
            return
        self._warned_autograd = True
        warnings.warn(f"vramd.manage: unit {unit.name!r} runs under autograd with an input that requires grad, so "
                      f"autograd keeps the weights its backward needs until then, beyond the limit of "
                      f"{format_bytes(self.limit)} the manager counts: run under torch.no_grad() or "
                      "torch.inference_mode() for the limit to hold", stacklevel=3)

    def _guarded_apply(self, slots: set[_Slot], inner):
        def _apply(fn, *args, **kwargs):
            if self._hooked:
                for slot in slots:
                    fn(slot.placeholder)  # a placeholder moved or cast where it is not: ManageError, nothing changed
            return inner(fn, *args, **kwargs)
        return _apply

    def _acquire(self, unit: _Unit) -> None:
        started = time.perf_counter()
        with self._lock:
            previous = getattr(self._thread_local, "previous", None)
            if previous is not None and previous is not unit:
                self._next[previous] = unit  # the order the last call ran them in (each thread's own)
            self._thread_local.previous = unit
            if unit.pending is not None:
                self._figures["prefetch_hits"] += 1
                self._finish_prefetch(unit)
            elif not unit.ready:
                self._make_room(unit, keep={unit}, wait=True)
                # A wait let other threads run: one may have brought this unit in, or begun to.
                if unit.pending is not None:
                    self._finish_prefetch(unit)
                elif not unit.ready:
                    self._bring(unit, {slot: slot.copy() for slot in unit.slots if slot.users == 0})
            following = self._next.get(unit) if self.prefetch else None
            if following is not None and not following.ready and following.pending is None:
                self._prefetch(following, current=unit)
            unit.in_use += 1  # last: a unit whose hook raised is not in use
            _enter(self._running)
            self._idle.pop(unit, None)
            self._figures["hook_seconds"] += time.perf_counter() - started

    def _done(self, unit: _Unit) -> None:
        with self._lock:
            unit.in_use -= 1
            _leave(self._running)
            if unit.in_use == 0 and unit.ready:
                self._idle.pop(unit, None)
                self._idle[unit] = None
                if self._waiting:
                    self._freed.notify_all()


def _enter(depths: dict[int, int]) -> None:
    """This thread one level deeper in `depths` (the threads inside something, and how deep)."""
    me = threading.get_ident()
    depths[me] = depths.get(me, 0) + 1


def _leave(depths: dict[int, int]) -> bool:
    """This thread one level out of `depths`; True where it is out altogether."""
    me = threading.get_ident()
    if depths[me] > 1:
        depths[me] -= 1
        return False
    del depths[me]
    return True


def _forward_methods(module: nn.Module, names) -> list[tuple[nn.Module, str]]:
    """The module's forward and the methods `names` names ("decode", or "decoder.forward" for a
    submodule's), each once, as (module, method)."""
    if isinstance(names, str):
        raise ManageError(f"forward_methods= takes a list of method names, not the string {names!r}")
    found: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    for name in ["forward", *names]:
        path, _, method = name.rpartition(".")
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            raise ManageError(f"forward_methods: {type(module).__name__} has no module {path!r} (in {name!r})") from None
        if not callable(getattr(owner, method, None)) or method.startswith("__"):
            raise ManageError(f"forward_methods: {type(owner).__name__} " + (f"(module {path!r}) " if path else "") +
                              f"has no method {method!r}")
        found.setdefault((id(owner), method), (owner, method))
    return list(found.values())
