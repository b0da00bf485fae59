"""What users call: manage(), and Managed, one class of the concerns' pieces (plan, hooks,
residency, streams, versions) with its public face (stats, close, a with block, its repr); what
manage() says of its steps as it takes them."""
from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .._units import format_bytes, format_exact, parse_size
from ..client import Client, connect
from ..lease import Lease
from .conversion import converter_for
from .errors import ManageError, _listed, _name
from .hooks import _forward_methods, _Hooks
from .lora import merged, module_index, read_loras, served_loras
from .plan import _Plan
from .streams import _Streams
from .unit import _Residency, _Room, _Unit
from .versions import _lora_item, _Versions

_log = logging.getLogger("vramd")


class _Told:
    """What manage() says of its steps as it takes them (a large model's lease and hooks take
    seconds): logged at INFO on the "vramd" logger, and with `progress` on standard error too,
    each with the seconds since manage() began."""

    def __init__(self, model: str, progress: bool | None):
        self.model = model
        self.started = time.perf_counter()
        self.shown = sys.stderr.isatty() if progress is None else progress

    def __call__(self, text: str) -> None:
        line = f"{self.model!r}: {text} ({time.perf_counter() - self.started:.2f} s)"
        _log.info(line)
        if self.shown:
            print(f"vramd.manage: {line}", file=sys.stderr, flush=True)


class Managed(_Plan, _Hooks, _Residency, _Streams, _Versions):
    """A module whose weights vramd manages; see manage(). `stats()` gives the figures, `close()`
    (or the end of a `with` block) takes the hooks away and ends the lease."""

    def __init__(self, module: nn.Module, lease: Lease, device: torch.device, dtype: torch.dtype, limit: int | None,
                 units: list[str] | None, strict: bool, prefetch: bool, room: _Room | None = None,
                 forward_methods: list[str] = (), told=lambda text: None, loras=()):
        self.module = module
        self._forward_methods = _forward_methods(module, forward_methods)
        self.lease = lease
        self.device = device
        self.dtype = dtype
        self._room = room = room or _Room(limit, device, lease)
        limit = room.limit
        # The room's, shared with every module sharing its limit.
        self._lock, self._freed, self._idle = room.lock, room.freed, room.idle
        self._running, self._waiting = room.running, room.waiting
        self._figures = {"bytes_moved": 0, "bytes_read": 0, "loads": 0, "prefetched": 0,
                         "prefetch_hits": 0, "waited_seconds": 0.0, "hook_seconds": 0.0, "pin_seconds": 0.0,
                         "pinned_bytes": 0}
        self._next: dict[_Unit, _Unit] = {}
        self._thread_local = threading.local()  # .previous: the unit this thread ran last
        self._loras = [_lora_item(lora) for lora in loras]
        self._index = module_index(module)
        self._own = read_loras(self._loras, module, index=self._index)  # weight name -> this process's own adapters' terms
        # The adapters the daemon's model leaves to its clients, applied before those.
        self._served, self._served_items = served_loras(lease, module, self._index), lease.loras
        self._lora = merged(self._served, self._own)
        self._units = self._plan(units, strict)
        unmanaged = sorted(set(self._lora) - {slot.name for unit in self._units for slot in unit.slots})
        if unmanaged:
            raise ManageError(f"loras=: {_listed(unmanaged)} changed by the adapters, which no unit manages")
        self._slots = {slot for unit in self._units for slot in unit.slots}
        self._least, nested = self._most_held_at_once()
        if limit is not None and self._least > limit:
            where = f"in {_name(dtype)} on {device}, more than the limit of {format_bytes(limit)}" + \
                (f" it shares with {_listed([m.lease.manifest['model'] for m in room.members])}" if room.members else "")
            if len(nested) == 1:
                raise ManageError(f"unit {nested[0].name!r} needs {format_exact(self._least)} {where}: raise the limit, or "
                                  "name smaller units")
            raise ManageError(f"units {_listed([u.name for u in nested])} run one inside another, so they need "
                              f"{format_exact(self._least)} at once {where}: raise the limit")
        largest = max((unit.bytes for unit in self._units), default=0)
        told(f"{len(self._units)} units, the largest {format_bytes(largest)} in {_name(dtype)} on {device}, limit "
             f"{format_bytes(limit) if limit is not None else 'none'}")
        for slot in self._slots:  # refused above, the module is as it was
            slot.put(slot.placeholder)
        self.prefetch = prefetch
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and prefetch else None
        self._consumers: dict[torch.cuda.Stream, None] = {}  # the streams that computed with prefetched copies
        on_cpu = device.type == "cpu" and prefetch
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vramd-prefetch") if on_cpu else None
        self._registered = self._pin() if device.type == "cuda" else []
        if self._registered:
            told(f"page-locked {format_bytes(self._figures['pinned_bytes'])} of the lease for {device}")
        self._wrapped: list[tuple] = []  # (module, method, its own before, ours)
        self._warned_autograd = False
        self._version = lease.version  # the version of the values its slots bring
        self._calls: dict[int, int] = {}  # threads inside the module's forward methods, and how deep
        self._taking = 0  # wait_update()s waiting for the forwards under way: new ones wait for them
        self._arrived: dict | None = None  # a version a wait_update() received but could not take in time
        self._hook()
        with self._lock:  # another thread may be making room from the units of the modules sharing it
            room.members.append(self)
        told(f"{type(module).__name__} managed")

    @property
    def limit(self) -> int | None:
        """The bytes its copies may hold on its device, with those of the modules sharing it."""
        return self._room.limit

    def stats(self) -> dict:
        """Bytes held now and at most on the device, bytes moved (the copies, in the computation
        dtype) and read (from the lease: its dtype, or GGUF blocks packed), loads, prefetches and
        their hits, and the host's seconds spent waiting for prefetches and in the hooks before
        units (the waits included: what the manager adds to a call on the host), and in page-locking
        the leased memory once (on a GPU, part of manage()), with the bytes page-locked; and the
        least limit the module runs under (its largest unit, or units running one inside another).
        Held, peak and limit are those of the limit, with the modules sharing it (manage(share=)),
        the rest this module's own."""
        with self._lock:
            return {**self._figures, "held": self._room.held, "peak": self._room.peak, "limit": self.limit,
                    "least_limit": self._least,
                    "device": str(self.device),
                    "dtype": _name(self.dtype), "units": len(self._units),
                    "ready_units": sum(unit.ready for unit in self._units)}

    def close(self) -> None:
        """Takes the hooks away, drops every copy and ends the lease (the module's weights are
        meta tensors again). The lease that reserved a shared limit ends with the last module
        sharing it."""
        self._unwrap()
        room = self._room
        with self._lock:
            for unit in self._units:
                if unit.pending is not None:
                    self._finish_prefetch(unit)
                if unit.ready:
                    unit.in_use = 0
                    self._drop(unit)
            for slot in self._slots:
                slot.put(slot.inert(torch.empty(slot.placeholder.shape, dtype=slot.dtype, device="meta")))
            if self in room.members:
                room.members.remove(self)
            ending = [self.lease] if self.lease is not room.lease else []
            if not room.members:
                ending.append(room.lease)
        if self._thread is not None:
            self._thread.shutdown()
        self._unpin()
        for lease in ending:
            lease.close()

    def __enter__(self) -> "Managed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<vramd.Managed {self.lease.manifest.get('model')!r} on {self.device} in "
                f"{_name(self.dtype)}, {len(getattr(self, '_units', []))} units, limit "
                f"{format_bytes(self.limit) if self.limit is not None else 'none'}>")


def manage(module: nn.Module, model: str, *, client: Client | None = None, device: str | torch.device | None = None,
           dtype: torch.dtype | None = None, limit: int | str | None = None, units: list[str] | None = None,
           strict: bool = True, prefetch: bool | None = None, share: Managed | None = None,
           follow: bool = False, forward_methods: list[str] = (), progress: bool | None = None,
           loras=(), convert: bool = True) -> Managed:
    """Fills `module` (built on the meta device) from a lease of vramd's model `model` and manages
    its weights: see the package's text (its __init__.py). `device`, `dtype` and `limit` default to the model's
    config ([vram] computation and limit), else the CPU, the leased dtype and no limit. `prefetch`
    (bring the next unit in while one computes) defaults to on a GPU only. `share`: a module
    managed already, whose limit (and device, and reservation) this one shares: their copies
    count together under it, and each drops the other's idle units to make room, as a pipeline's
    models run one after another. `follow`: take each new version of the weights an update makes,
    with Managed.wait_update() between forwards. `forward_methods`: the module's methods other than
    forward that run it as a forward does ("decode", "encode" of a VAE; "decoder.forward" for a
    submodule's), as FSDP's register_fsdp_forward_method names them: wait_update() takes a version
    between their calls too (any other call is waited for unit by unit only). `progress`: say each
    step on standard error as it is taken (the lease, the units planned, the page-locking, the
    hooks; default: when standard error is a terminal); they are logged at INFO on the "vramd"
    logger either way. Raises ManageError naming what does not fit, and vramd.DaemonError for the
    daemon's refusals (507 when the limit does not fit the device's budget). `loras`: LoRA
    adapters this process applies itself, (path, scale) or a path (scale 1.0) each, PEFT folders
    or .safetensors files (PEFT, diffusers or kohya keys): added to each weight they name as its
    unit is brought to the device, in float32 there, the leased weights unchanged (so processes
    leasing one model can each run it under adapters of their own); Managed.set_loras() replaces
    them between forwards. `convert`: when `module` is a transformers model whose names are what
    transformers' own load-time conversion (transformers.conversion_mapping: renames, experts stored
    one tensor each merged into one) makes of the leased ones, have the daemon apply it: it derives a
    model of `model`'s config with that conversion as its converter (Client.derive), converted once
    in its memory and shared by every process asking for the same, and this leases that one."""
    room = _shared_room(share, device, limit) if share is not None else None
    own_client = client is None
    client = client or connect()
    told = _Told(model, progress)
    try:
        told(f"leasing from vramd at {client.socket_path}")
        # The names and plan a lease would carry, from the config's check: the model is loaded
        # only by the lease below, and only the one this module takes (a derived one, converted).
        answer = client.plan(model)
        plan = answer.get("plan") or {}
        device = room.device if room else _device(device or plan.get("device") or "cpu")
        limit = room.limit if room else parse_size(limit) if limit is not None else plan.get("limit")
        # The limit is held in the daemon's budget for the device while the lease lasts (a shared
        # one by the lease of the module that set it).
        reserve = (str(device), limit) if limit is not None and room is None else None
        converter = converter_for(module, answer["names"], model) if convert else None
        if converter is not None:
            told(f"{type(module).__name__} takes transformers' conversion of {model!r}'s names: deriving a "
                 "model that applies it")
            derived = client.derive(model, converter)
            model = derived["name"]
            told(f"{'derived' if derived['created'] else 'found'} {model!r}")
        lease = client.lease(model, device="cpu", reserve=reserve, follow=follow, adapters=True)
        told(f"leased {len(lease.state_dict)} tensors, {format_bytes(lease.manifest['bytes'])} resting in the daemon's "
             "memory" + (f", {format_bytes(limit)} of {device} reserved" if reserve else ""))
        if dtype is None:
            floating = {t.dtype for t in lease.state_dict.values() if t.is_floating_point()}
            dtype = getattr(torch, plan["dtype"]) if plan.get("dtype") else floating.pop() if len(floating) == 1 else None
            if dtype is None:
                lease.close()
                raise ManageError(f"model {model!r} rests in {len(floating)} floating dtypes and names no computation "
                                  "dtype: give dtype=")
        try:
            return Managed(module, lease, device, dtype, limit, units, strict,
                           device.type == "cuda" if prefetch is None else prefetch, room, forward_methods, told, loras)
        except BaseException:
            lease.close()
            raise
    finally:
        if own_client:
            client.close()


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def _shared_room(share, device, limit) -> _Room:
    """The limit `share` (what manage() returned) set, for another module to join."""
    if not isinstance(share, Managed):
        raise ManageError(f"share= takes a module managed already (what vramd.manage returned), not a "
                          f"{type(share).__name__}")
    room = share._room
    if share not in room.members:
        raise ManageError(f"share=: {share!r} has been closed, and its limit with it")
    if limit is not None:
        raise ManageError(f"give limit= or share=, not both: a module sharing the limit of {share!r} "
                          "counts its copies under that limit")
    if device is not None and _device(device) != room.device:
        raise ManageError(f"share=: the limit of {share!r} is on {room.device}, not {_device(device)}: a shared "
                          "limit holds the copies of modules computing on one device")
    return room
