"""The daemon's endpoints (docs/api.md) as methods of one client."""
from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import quote

import torch

from . import _shape
from ._cuda import host_register, host_unregister
from ._errors import DaemonError
from ._http import Connection, Response, refusal
from ._safetensors import dumps, loads, metadata
from ._socket import open_socket, socket_path
from .lease import Lease, request_lease


class Client:
    """One connection to vramd, kept alive between requests; not to be shared between threads.

    socket: the daemon's socket; else $VRAMD_SOCKET, else the default vramctl uses
        ($XDG_RUNTIME_DIR/vramd/vramd.sock, else /tmp/vramd-UID/vramd.sock).
    timeout: seconds to wait for any one read or write (None: as long as it takes).

    Connects at once and checks who serves the socket (SO_PEERCRED) before sending a byte: the
    server must run as this user, root, or a uid in $VRAMD_TRUST_UIDS. Raises DaemonUnreachable
    (a ConnectionError) when nothing answers, DaemonError when the server is refused. Every
    method raises DaemonError with the daemon's message and status when it refuses."""

    def __init__(self, socket: str | os.PathLike | None = None, timeout: float | None = None):
        self.socket_path = socket_path(socket)
        self.timeout = timeout
        self._connection = Connection(self.socket_path, timeout)
        self._connection.open()
        self._kept: dict[str, _KeptMemfd] = {}  # update(keep=True)'s, by model

    def close(self) -> None:
        self._connection.close()
        for kept in self._kept.values():
            kept.close()
        self._kept.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<vramd.Client {self.socket_path}>"

    # The daemon.

    def health(self) -> dict:
        """{"status": "ok", "version": ..., "pid": ...}."""
        return self._json("GET", "/v1/health", lambda body: _shape.field(body, "status", str))

    def status(self, name: str | None = None) -> dict:
        """Model `name`'s object (state, devices, residency, ...), or without a name the daemon's
        status: budgets and use per device, every model's residency."""
        if name is not None:
            return self._json("GET", _model_path(name), _check_model)
        return self._json("GET", "/v1/status", _check_status)

    def list(self) -> list[dict]:
        """Every model's object, as `status(name)` gives one."""
        return self._json("GET", "/v1/models", _check_models)["models"]

    def reload(self) -> list[dict]:
        """Re-reads the model folder now; every model's object once each config is validated."""
        return self._json("POST", "/v1/reload", _check_models)["models"]

    # A model's life.

    def load(self, name: str, keep_alive: str | None = None,
             progress: Callable[[dict], None] | None = None) -> dict:
        """Loads model `name` (at once when it is loaded); its object once ready.

        keep_alive: how long it stays loaded after its last use ("5m", "0", "-1": forever).
        progress: called with each progress line as the load streams them: {"status":
            "loading", "bytes_done", "bytes_total", "tensors_done", "tensors_total"}, or
            {"status": "queued", "position"}."""
        if progress is None:
            return self._json("POST", _model_path(name, "load", keep_alive=keep_alive), _check_model)
        target = _model_path(name, "load", keep_alive=keep_alive, stream="true")
        request = f"POST {target}"
        pending = bytearray()
        last = None

        def on_chunk(chunk):
            nonlocal last
            pending.extend(chunk)
            *complete, rest = pending.split(b"\n")
            pending[:] = rest
            for line in complete:
                if line.strip():
                    last = self._documented(line, _check_load_line, request)
                    if last["status"] in ("queued", "loading"):
                        progress(last)

        self._call("POST", target, on_chunk=on_chunk)
        on_chunk(b"\n")  # a last line without its newline
        if last is not None and last["status"] == "ready":
            del last["status"]
            return last
        error = last.get("error") if last is not None else None
        raise DaemonError(error if isinstance(error, str) else "the load did not finish", request=request)

    def unload(self, name: str, wait: bool = True) -> dict:
        """Frees model `name`'s weights once the requests queued before are done and its leases
        have ended; its object. `wait=False`: refuse at once (409, naming the holders) while leased."""
        return self._json("POST", _model_path(name, "unload", wait=None if wait else "false"), _check_model)

    def offload(self, name: str, wait: bool = True) -> dict:
        """Puts model `name` to sleep (weights to its offload state) once its leases have ended; its
        object with `moved`. `wait=False` as for unload."""
        return self._json("POST", _model_path(name, "offload", wait=None if wait else "false"), _check_model)

    def onload(self, name: str) -> dict:
        """Wakes model `name` (weights back to its computation state); its object with `moved`."""
        return self._json("POST", _model_path(name, "onload"), _check_model)

    def forward(self, name: str, inputs: Mapping[str, torch.Tensor], keep_alive: str | None = None, *,
                with_version: bool = False) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], int]:
        """Runs one forward of model `name` (loading or waking it first) on named input tensors
        (any device, dtype among those safetensors names); its named outputs, on the CPU.
        with_version: (outputs, the version of the weights the forward ran on) instead."""
        target = _model_path(name, "forward", keep_alive=keep_alive)
        response = self._call("POST", target, dumps(inputs), "application/octet-stream")
        try:
            outputs = loads(response.body)
            if not with_version:
                return outputs
            return outputs, int(metadata(response.body)["version"])
        except (ValueError, KeyError) as e:
            raise DaemonError(f"vramd at {self.socket_path} answered with a safetensors file that is "
                              f"malformed: {e}", request=f"POST {target}") from None

    def update(self, name: str, values: Mapping[str, torch.Tensor] | str | os.PathLike, via: str = "memfd",
               keep: bool = False) -> dict:
        """Gives loaded model `name` new values for some or all of its weights; its object, with
        `version` (one more than before) and `updated` ({"tensors", "bytes", "seconds"}).

        values: tensors named as the model's parameters (as a lease names them; any device and
            floating dtype, cast as a load casts); or the path of a checkpoint the daemon reads as
            the model's config reads its own (prefix, converter).
        via: how tensors travel. "memfd": written once into a sealed memfd that the daemon maps
            where it lies (it opens /proc/PID/fd/N of this process, so it must run as this user or
            root), and keeps as the weights where every tensor has its weight's dtype and the
            model holds them in host memory; "body": serialised into the request.
        keep (tensors, via "memfd"): the memfd is kept, by this client and by the daemon for as
            long as this client's connection is open, and the next update of `name` with keep and
            the same tensors (names, dtypes, shapes, in the same order) is written into it again.
            The daemon maps it once and, for a model with weights on a GPU, page-locks it there
            once, so that the updates after the first are copied to the device at the bus's speed
            (`updated["kept"]` says {"memfd": "mapped" or "reused", "page_locked": [GPUs]}). Its
            values are copied into the weights, never kept as them; send them in the weights'
            dtype, or they are cast on the host first. It holds host memory of the update's size
            until close(), or an update of `name` without keep.
        Forwards queued before it run on the old values, those after on the new; leases taken
        before keep the old values. Checked whole first: a name that is not the model's, a shape
        that differs, a file it cannot read raise DaemonError (400) and change nothing."""
        target = _model_path(name, "weights")
        if keep and (via != "memfd" or isinstance(values, (str, os.PathLike))):
            raise ValueError("keep=True keeps a memfd of tensors: give tensors, via='memfd'")
        if not keep and name in self._kept:
            self._kept.pop(name).close()  # the daemon lets its mapping go with this update
        if isinstance(values, (str, os.PathLike)):
            body = json.dumps({"path": os.path.abspath(os.fspath(values))}).encode()
            response = self._call("POST", target, body, "application/json")
        elif keep:
            kept = self._kept.get(name)
            layout = tuple((key, tensor.dtype, tuple(tensor.shape)) for key, tensor in values.items())
            if kept is None or kept.layout != layout:
                if kept is not None:
                    kept.close()
                kept = self._kept[name] = _KeptMemfd(layout)
            kept.cuda = kept.cuda or any(tensor.is_cuda for tensor in values.values())
            dumps(values, kept.allocate)
            body = json.dumps({"fd": kept.fd, "keep": True}).encode()
            with _tensors_named_as_given(kept.fd):
                response = self._call("POST", target, body, "application/json")
        elif via == "memfd":
            fd = _sealed_memfd(values)
            try:
                with _tensors_named_as_given(fd):
                    response = self._call("POST", target, json.dumps({"fd": fd}).encode(), "application/json")
            finally:
                os.close(fd)
        elif via == "body":
            response = self._call("POST", target, dumps(values), "application/octet-stream")
        else:
            raise ValueError(f"via={via!r}: expected 'memfd' or 'body'")
        return self._documented(response.body, _check_update, f"POST {target}")

    def set_loras(self, name: str, loras: Sequence[tuple[str | os.PathLike, float] | str | os.PathLike]) -> dict:
        """Puts LoRA adapters in force on loaded model `name` instead of the ones it has (its
        config's [[lora]] at load), without a reload; [] removes them all, which gives the
        checkpoint's own weights bit for bit. Each is a PEFT folder or a .safetensors file, with
        its scale: (path, scale), or a path alone (scale 1.0). Returns the model's object: its
        `loras` now in force, `version` one more than before (a forward runs wholly on one set),
        `updated` ({"tensors", "bytes", "seconds"}: the weights written).
        Every adapter is read and checked whole first: a missing or truncated file, a module the
        model lacks, a rank mismatch or an unsupported format raise DaemonError (400) naming it,
        and the adapters in force stay; weights that cannot take it (layers streamed from disk, a
        partitioned model) raise DaemonError (409)."""
        items = []
        for lora in loras:
            path, scale = (lora, 1.0) if isinstance(lora, (str, os.PathLike)) else lora
            items.append({"path": os.path.abspath(os.fspath(path)), "scale": float(scale)})
        target = _model_path(name, "loras")
        response = self._call("POST", target, json.dumps({"loras": items}).encode(), "application/json")
        return self._documented(response.body, _check_update, f"POST {target}")

    def derive(self, name: str, converter: str) -> dict:
        """A model of model `name`'s config with `converter` (a Lua converter's text:
        scripts/converters/README.md) as its converter, reading the names `name` serves (the
        checkpoint's own, or those of the converter its config names, chained before it):
        named NAME.derived-HASH, made once and shared by every client sending the same text, and
        removed when `name`'s config changes or goes. vramd.manage sends transformers' own
        load-time conversion this way. Returns the model's object, with `created` (whether this
        call made it) and `derived_from`; a converter that fails on the checkpoint raises
        DaemonError (400) with its error."""
        target = _model_path(name, "derive")
        response = self._call("POST", target, json.dumps({"converter": converter}).encode(), "application/json")
        return self._documented(response.body, _check_model, f"POST {target}")

    def remove(self, name: str) -> dict:
        """Removes model `name`, made by derive(), once the requests queued before it are done and
        its leases have ended: {"name": name, "state": "removed"}. A model of a config file raises
        DaemonError (409): remove its file instead."""
        return self._json("DELETE", _model_path(name), _check_model)

    def lease(self, name: str, device: str = "cpu", wait: bool = True,
              reserve: tuple[str, int] | None = None, follow: bool = False, in_place: bool = False,
              adapters: bool = False) -> Lease:
        """Leases model `name`'s weights on `device` as read-only, zero-copy tensors, on a
        connection of its own; see Lease. `wait`: wait for the model to load rather than refuse.
        `reserve`: (device, bytes) this process will use there, held in the daemon's budget for
        that device (which makes room as for its own models, or refuses with 507) until the lease
        ends. `follow`: the daemon sends each new version of the weights after an update, which
        Lease.wait_update() takes. `in_place` (on cuda:N): updates write into the memory this
        lease maps, at the same addresses, and Lease.wait_update() says when; refused (409) while
        a lease that keeps its values is held, and the other way round. `adapters`: this process adds
        the LoRA adapters Lease.loras lists, which a "weights" model served with fuse_lora = false
        leaves to its clients (its leases are refused, 409, without it); vramd.manage does."""
        sock = open_socket(self.socket_path, self.timeout)
        return request_lease(sock, name, device, wait, where=f"vramd at {self.socket_path}", reserve=reserve,
                             follow=follow, in_place=in_place, adapters=adapters)

    def plan(self, name: str) -> dict:
        """What a lease of model `name` would hand over, from its config's check, loading nothing
        (GET /v1/models/NAME/plan): {"model", "names" (every tensor a lease's manifest lists, in
        its order), "plan" (for a model that rests for the clients that manage it, else None)}."""
        return self._json("GET", _model_path(name, "plan"), _check_plan)

    def lease_plan(self, name: str) -> dict:
        """The `plan` a lease of model `name` would carry (for a model that rests for the clients
        that manage it), or {}: from plan(), so nothing is loaded."""
        return self.plan(name).get("plan") or {}

    # One boundary for every request.

    def _call(self, method: str, target: str, body: bytes = b"", content_type: str | None = None,
              on_chunk=None) -> Response:
        """The daemon's 200 answer; any other status raises its refusal."""
        response = self._connection.request(method, target, body, content_type, on_chunk)
        if response.status != 200:
            raise refusal(response, f"{method} {target}")
        return response

    def _json(self, method: str, target: str, check: Callable) -> dict:
        """The JSON object of a 200 answer, passed through `check`."""
        return self._documented(self._call(method, target).body, check, f"{method} {target}")

    def _documented(self, text: bytes, check: Callable, request: str):
        try:
            body = json.loads(text)
            check(body)
            return body
        except ValueError:
            raise DaemonError(f"vramd at {self.socket_path} answered with a body that is not JSON: "
                              f"{bytes(text[:200]).decode('utf-8', 'replace')}", request=request) from None
        except _shape.NotAsDocumented as e:
            raise DaemonError(f"the server at {self.socket_path} answered with JSON that is not what "
                              f"docs/api.md documents ({e}); is it a vramd of this version?",
                              request=request) from None


def connect(socket: str | os.PathLike | None = None, timeout: float | None = None) -> Client:
    """A Client connected to vramd; see Client."""
    return Client(socket, timeout)


@contextlib.contextmanager
def _tensors_named_as_given(fd: int):
    """The daemon names the memfd it opened (/proc/PID/fd/N of this process); its refusal names
    what the caller gave instead: the tensors."""
    try:
        yield
    except DaemonError as error:
        path = f"/proc/{os.getpid()}/fd/{fd}"
        message = error.message.replace(f"the update's kept memfd '{path}'", "the update's tensors") \
                               .replace(f"the update's memfd '{path}'", "the update's tensors")
        if message == error.message:
            raise
        raise DaemonError(message, error.status, error.request) from None


def _sealed_memfd(tensors: Mapping[str, torch.Tensor]) -> int:
    """A memfd holding `tensors` as a safetensors file, sealed so that nobody can change it."""
    fd = os.memfd_create("vramd-update", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        mappings = []

        def allocate(size):
            os.ftruncate(fd, size)
            mappings.append(mmap.mmap(fd, size))
            return mappings[-1]

        dumps(tensors, allocate)
        for mapping in mappings:
            mapping.close()  # a writable mapping left would keep the kernel from sealing
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd
    except BaseException:
        os.close(fd)
        raise


class _KeptMemfd:
    """The memfd update(keep=True) writes each update of one model into: sealed against shrinking
    and growing, never against writes, and mapped writable here for as long as it is kept. Where
    the tensors are on a GPU (a trainer's), the mapping is page-locked once, so that their copies
    into it run at the bus's speed too."""

    def __init__(self, layout: tuple):
        self.layout = layout
        self.fd = os.memfd_create("vramd-update-kept", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.mapping: mmap.mmap | None = None
        self.cuda = False          # its tensors come from a GPU
        self.registered: int | None = None  # the page-locked mapping's address

    def allocate(self, size: int) -> mmap.mmap:
        if self.mapping is None:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.mapping = mmap.mmap(self.fd, size)
        elif len(self.mapping) != size:  # the same layout is the same size
            raise AssertionError(f"a kept memfd of {len(self.mapping)} bytes asked for {size}")
        if self.cuda and self.registered is None:
            address = torch.frombuffer(self.mapping, dtype=torch.uint8).data_ptr()
            if host_register(address, size, 0) == 0:  # else copied as pageable memory
                self.registered = address
        return self.mapping

    def close(self) -> None:
        if self.registered is not None:
            host_unregister(self.registered)
            self.registered = None
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _model_path(name: str, action: str | None = None, **query: str | None) -> str:
    path = f"/v1/models/{quote(name, safe='')}" + (f"/{action}" if action else "")
    pairs = [f"{key}={quote(value, safe='')}" for key, value in query.items() if value is not None]
    return path + ("?" + "&".join(pairs) if pairs else "")


def _check_model(body) -> None:
    _shape.field(body, "name", str)
    _shape.field(body, "state", str)


def _check_update(body) -> None:
    _check_model(body)
    _shape.field(body, "version", int)
    _shape.field(body, "updated", dict)


def _check_load_line(body) -> None:
    if _shape.field(body, "status", str) == "ready":
        _check_model(body)


def _check_models(body) -> None:
    for model in _shape.objects(body, "models"):
        _check_model(model)


def _check_plan(body) -> None:
    _shape.field(body, "model", str)
    if not all(isinstance(name, str) for name in _shape.field(body, "names", list)):
        raise _shape.NotAsDocumented("'names' is not a list of strings")
    if body.get("plan") is not None:
        _shape.field(body, "plan", dict)


def _check_status(body) -> None:
    _shape.field(body, "devices", dict)
    _shape.objects(body, "models")
