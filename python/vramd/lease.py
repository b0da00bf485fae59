"""Leases: a model's weights, as the daemon holds them, mapped read-only into this process:
host memory (sealed memfds, checkpoint files) with mmap, GPU memory through the CUDA driver.

One connection is one lease. The client sends `POST /v1/models/NAME/lease` with
{"device": ..., "wait": ...}; the daemon answers an HTTP error, or `101 Switching Protocols`
(`Upgrade: vramd-lease/1`) and one line of JSON, the manifest, with one file descriptor per
region passed beside those bytes (SCM_RIGHTS). The lease lasts as long as the connection."""
from __future__ import annotations

import json
import math
import mmap
import os
import socket
import sys
import warnings
from urllib.parse import quote

import torch

from . import _shape
from ._errors import ProtocolError
from ._gguf import Packed, packed_shape
from ._http import Reader, as_daemon_error, read_body, read_head, refusal, send_request
from ._safetensors import TORCH_DTYPES

UPGRADE = "vramd-lease/1"
MANIFEST_LIMIT = 256 << 20
# Before Python 3.13 every mmap object keeps a duplicate of its descriptor until it is freed.
_UNTRACKED = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class Lease:
    """A model's weights leased from vramd: `state_dict` maps each tensor's name (in the
    manifest's order) to a zero-copy, read-only view of the daemon's memory.

    Writing to one of these tensors faults (SIGSEGV: the pages are mapped read-only; on a GPU an
    illegal-address error, where the driver maps read-only: `read_only` tells); `.clone()` gives a
    writable copy. The daemon counts the leased memory in its budgets and keeps it from
    being freed or changed only while the lease is open: after close() the tensors still read the
    mapped pages (they keep the mappings alive), but the daemon may then unload or reload the
    model, and what they hold is no longer its weights' promise.

    A lease taken with `follow=True` is sent the manifest of each new version of the weights
    after an update (POST /v1/models/NAME/weights); wait_update() takes it. Until then, and for
    a lease that does not follow, `state_dict` keeps the values it had. The daemon sends a
    version only once the one before has been taken, the newest at that time: a client slower
    than the updates skips versions rather than queueing them.

    A lease of GPU memory taken with `in_place=True` follows updates in place: each update writes
    its values into the memory this lease maps, so `state_dict` keeps its tensors and their
    addresses and its values change at the update (the rollout case of reinforcement learning).
    The daemon's writes are complete on the device before the update's answer and before the
    line saying the new version, which wait_update() waits for; kernels of this process that
    read the weights while an update writes them may see a mix of versions, so pause them
    (between rollouts) until wait_update() returns.

    Used as a context manager, `with client.lease("minilm") as state_dict:` closes at the end."""

    def __init__(self, sock: socket.socket, manifest: dict, state_dict: dict[str, torch.Tensor], regions: list,
                 reader: Reader | None = None, fds: list[int] | None = None, where: str = "vramd",
                 in_place: bool = False, identities: list | None = None):
        self._sock = sock
        self._regions = [region for region in regions if region is not None]
        self._identities = identities  # of the regions mapped (host memory), to know a version in the same ones
        self._reader, self._fds, self._where = reader, fds, where
        self.manifest = manifest
        self.state_dict = state_dict
        self.in_place = in_place

    @property
    def packed(self) -> dict[str, Packed]:
        """The tensors held as GGUF blocks (a model that rests packed for the clients that manage
        it): name -> Packed(type, shape). Their `state_dict` tensors are the blocks' bytes, uint8;
        vramd.unpack(tensor, *lease.packed[name], dtype, device) gives the values."""
        return {t["name"]: Packed(t["packed"]["type"], tuple(t["packed"]["shape"]))
                for t in self.manifest["tensors"] if "packed" in t}

    @property
    def version(self) -> int:
        """The version of the weights in `state_dict` (the daemon's count of updates, from 1)."""
        return self.manifest.get("version", 0)

    @property
    def loras(self) -> list[tuple[str, float]]:
        """The LoRA adapters the client is to add to these weights, (path, scale) in order: those of
        a "weights" model served with fuse_lora = false, whose clients apply them (a lease taken
        with adapters=True; vramd.manage does). [] where the weights are handed over adapted."""
        return [(lora["path"], float(lora["scale"])) for lora in self.manifest.get("loras", [])]

    def wait_update(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Waits for the daemon to send a new version's manifest (a lease taken with follow=True),
        maps it and makes `state_dict` its tensors; returns it (the same `state_dict` where the new
        version lists the same tensors in the regions held already: a switch of the adapters a
        model leaves to its clients). The tensors of the version
        before stay readable for as long as something holds them. For a lease taken with
        in_place=True, waits for the line saying that an update has written its values into
        `state_dict`'s memory, and returns the same `state_dict`. Raises TimeoutError after
        `timeout` seconds, DaemonError when the lease has ended."""
        if self._sock is None or self._reader is None:
            raise ValueError("the lease is closed" if self._sock is None else "this lease does not follow updates")
        request = f"lease {self.manifest.get('lease')} of {self.manifest.get('model')!r}"
        previous = self._sock.gettimeout()
        self._sock.settimeout(timeout)
        try:
            if self.in_place:
                self.manifest = {**self.manifest, "version": _receive_in_place(self._reader, self._fds, self.version)}
                mappings = None
            else:
                self.manifest, self.state_dict, mappings, self._identities = _receive_manifest(
                    self._reader, self._fds, (self.manifest, self.state_dict, self._identities))
        except TimeoutError:
            raise
        except BaseException as e:
            failure = as_daemon_error(e, self._where, request, timeout)
            if failure is e:
                raise
            raise failure from None
        finally:
            if self._sock is not None:
                self._sock.settimeout(previous)
        if mappings is not None:
            self._regions = [region for region in mappings if region is not None]
        # Taken: the daemon sends the next version only now, so that none pile up unread.
        self._sock.sendall(json.dumps({"taken": self.version}).encode() + b"\n")
        return self.state_dict

    @property
    def read_only(self) -> bool:
        """Whether every region is mapped read-only (host memory always is; a driver may refuse
        read-only mappings of GPU memory, which then come writable)."""
        return all(getattr(region, "read_only", True) for region in self._regions)

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Ends the lease (closes its connection). The tensors stay readable."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> dict[str, torch.Tensor]:
        return self.state_dict

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<vramd.Lease {self.manifest.get('model')!r} #{self.manifest.get('lease')} "
                f"{len(self.state_dict)} tensors{' closed' if self.closed else ''}>")


def request_lease(sock: socket.socket, name: str, device: str = "cpu", wait: bool = True,
                  where: str = "vramd", reserve: tuple[str, int] | None = None, follow: bool = False,
                  in_place: bool = False, adapters: bool = False) -> Lease:
    """Asks for a lease of model `name` on `sock`, a fresh connection to a trusted server, which
    the Lease then owns (closed here on any error). `where` names the server in messages."""
    target = f"/v1/models/{quote(name, safe='')}/lease"
    request = f"POST {target}"
    fds: list[int] = []
    try:
        body = {"device": device, "wait": wait}
        if reserve is not None:
            body["reserve"] = {"device": reserve[0], "bytes": int(reserve[1])}
        if follow:
            body["follow"] = True
        if in_place:
            body["in_place"] = True
        if adapters:
            body["adapters"] = True
        send_request(sock, "POST", target, json.dumps(body).encode(), "application/json")
        reader = Reader(sock, fds)  # every read from here on keeps the descriptors passed beside the bytes
        response = read_head(reader)
        if response.status != 101:
            read_body(reader, response)
            raise refusal(response, request)
        if response.headers.get("upgrade", "").lower() != UPGRADE:
            raise ProtocolError(f"switched to {response.headers.get('upgrade')!r}, not {UPGRADE!r}")
        manifest, state_dict, mappings, identities = _receive_manifest(reader, fds)
    except BaseException as e:
        for fd in fds:  # passed beside a refusal
            os.close(fd)
        timeout = sock.gettimeout()
        sock.close()
        failure = as_daemon_error(e, where, request, timeout)
        if failure is e:
            raise
        raise failure from None
    if follow or in_place:
        return Lease(sock, manifest, state_dict, mappings, reader, fds, where, in_place, identities)
    return Lease(sock, manifest, state_dict, mappings)


def _receive_manifest(reader: Reader, fds: list[int], held: tuple | None = None) -> tuple:
    """The next manifest line and its descriptors (which `reader` collects into `fds`), checked
    and mapped: the manifest, its state dict, the mappings and the regions' identities (host
    memory: device, inode and length; None on a GPU). The descriptors are closed. `held`: the
    manifest, state dict and identities of the version the lease holds; where the new one lists
    the same tensors in the same regions (a switch of the adapters a model leaves to its
    clients writes no weight), its state dict is that one and nothing is mapped again (the
    mappings None)."""
    try:
        line = reader.until(b"\n", MANIFEST_LIMIT)
        try:
            manifest = json.loads(line)
        except ValueError as e:
            raise ProtocolError(f"sent a lease manifest that is not JSON: {e}") from None
        # The tensors of the version held, checked then: compared once, here.
        known = held is not None and isinstance(manifest, dict) and manifest.get("tensors") == held[0]["tensors"]
        regions, tensors, ordinal = _check_manifest(manifest, tensors_checked=known)
        if len(fds) != len(regions):
            raise ProtocolError(f"sent {len(fds)} file descriptors for a manifest of {len(regions)} regions")
        lengths = [_length(region, fd, i) for i, (region, fd) in enumerate(zip(regions, fds))]
        identities = None if ordinal is not None else \
            [(info.st_dev, info.st_ino, length) for info, length in zip(map(os.fstat, fds), lengths)]
        if known and identities is not None and identities == held[2] and manifest["device"] == held[0]["device"]:
            return manifest, held[1], None, identities
        for t in tensors:  # every check before the first mapping
            _check_bounds(t, lengths)
        mappings = _map_all(regions, fds, lengths, ordinal)
        return manifest, {t["name"]: _view(t, mappings, manifest["device"]) for t in tensors}, mappings, identities
    finally:
        for fd in fds:  # a mapping outlives its descriptor
            os.close(fd)
        fds.clear()


def _receive_in_place(reader: Reader, fds: list[int], version: int) -> int:
    """The next line of a lease that follows updates in place: the new version, after `version`,
    whose values the daemon has written into the lease's memory."""
    try:
        line = reader.until(b"\n", 4096)
        try:
            said = json.loads(line)
        except ValueError as e:
            raise ProtocolError(f"sent a line that is not JSON to a lease that follows updates in place: {e}") from None
        if not isinstance(said, dict) or said.get("in_place") is not True:
            raise _shape.NotAsDocumented("sent a lease that follows updates in place a line without \"in_place\": true")
        if fds:
            raise ProtocolError(f"sent {len(fds)} file descriptors with an update written in place")
        new = _shape.natural(said, "version", "sent an in-place update whose ")
        if new <= version:
            raise ProtocolError(f"sent version {new} in place after version {version}")
        return new
    finally:
        for fd in fds:
            os.close(fd)
        fds.clear()


def _check_manifest(manifest, tensors_checked: bool = False) -> tuple[list[dict], list[dict], int | None]:
    """The manifest's regions and tensors, each field checked (dtype names made torch dtypes), and
    the CUDA device's ordinal (None for host memory). `tensors_checked`: its tensors equal those of
    a manifest checked before, and are not checked again."""
    if not isinstance(manifest, dict):
        raise _shape.NotAsDocumented("sent a lease manifest that is not a JSON object")
    where = "sent a lease manifest whose "
    for key in ("model", "device"):
        _shape.field(manifest, key, str, where)
    for key in ("lease", "bytes"):
        _shape.natural(manifest, key, where)
    device = manifest["device"]
    ordinal = int(device[5:]) if device.startswith("cuda:") and device[5:].isdigit() else None
    if device != "cpu" and ordinal is None:
        raise _shape.NotAsDocumented(f"{where}device {device!r} is neither 'cpu' nor 'cuda:N'")
    regions = _shape.objects(manifest, "regions", where)
    for i, region in enumerate(regions):
        at = f"{where}region {i}'s "
        kind = _shape.field(region, "kind", str, at)
        if ordinal is not None and kind != "cuda":
            raise _shape.NotAsDocumented(f"{at}kind {kind!r} is not 'cuda', on {device}")
        if ordinal is None and kind not in ("memfd", "file"):
            raise _shape.NotAsDocumented(f"{at}kind {kind!r} is neither 'memfd' nor 'file'")
        _shape.natural(region, "size", at)
        if kind == "file":
            _shape.field(region, "path", str, at)
    tensors = _shape.objects(manifest, "tensors", where)
    names = set()
    for t in () if tensors_checked else tensors:
        name = _shape.field(t, "name", str, f"{where}tensor ")
        at = f"{where}tensor {name!r}'s "
        if name in names:
            raise _shape.NotAsDocumented(f"{where}tensor {name!r} appears twice")
        names.add(name)
        dtype = _shape.field(t, "dtype", str, at)
        if dtype not in TORCH_DTYPES:
            raise _shape.NotAsDocumented(f"{at}dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        shape, strides = _shape.naturals(t, "shape", at), _shape.naturals(t, "strides", at)
        if len(strides) != len(shape):
            raise _shape.NotAsDocumented(f"{at}strides {strides} do not match its shape {shape}")
        if t.get("region") is None and math.prod(shape) == 0:
            pass  # a tensor with no elements lies nowhere
        elif _shape.natural(t, "region", at) >= len(regions):
            raise _shape.NotAsDocumented(f"{at}region {t['region']} is not one of the {len(regions)} regions")
        _shape.natural(t, "offset", at)
        if "packed" in t:
            _check_packed(t, at)
    if "loras" in manifest:
        for i, lora in enumerate(_shape.objects(manifest, "loras", where)):
            _shape.field(lora, "path", str, f"{where}loras[{i}]'s ")
            if not isinstance(lora.get("scale"), (int, float)) or isinstance(lora.get("scale"), bool):
                raise _shape.NotAsDocumented(f"{where}loras[{i}]'s scale is not a number")
    return regions, tensors, ordinal


def _check_packed(tensor: dict, at: str) -> None:
    """Raises unless a tensor held as GGUF blocks is the uint8 bytes of its type's blocks of its values' shape."""
    packed = tensor["packed"]
    kind = _shape.field(packed, "type", str, f"{at}packed ")
    shape = _shape.naturals(packed, "shape", f"{at}packed ")
    try:
        expected = list(packed_shape(kind, shape))
    except ValueError as e:
        raise _shape.NotAsDocumented(f"{at}packed: {e}") from None
    if tensor["dtype"] != "uint8" or tensor["shape"] != expected:
        raise _shape.NotAsDocumented(f"{at}{kind} blocks of {shape} are {tensor['dtype']} {tensor['shape']}, "
                                     f"not uint8 {expected}")


def _describe(region: dict, index: int) -> str:
    return f"region {index} ({region['kind']}{' ' + region['path'] if region['kind'] == 'file' else ''})"


def _length(region: dict, fd: int, index: int) -> int:
    """How many bytes of region `index` to map: its size, or the whole file when that is larger."""
    what = _describe(region, index)
    if region["kind"] == "cuda":
        return region["size"]  # the driver checks it against the allocation when mapping
    try:
        held = os.fstat(fd).st_size
    except OSError as e:
        raise ProtocolError(f"sent a descriptor for {what} that cannot be read: {e.strerror}") from None
    if held < region["size"]:
        raise ProtocolError(f"sent {what} holding {held} bytes, fewer than its size {region['size']}")
    return max(held, region["size"]) if region["kind"] == "file" else region["size"]


def _check_bounds(tensor: dict, lengths: list[int]) -> None:
    """Raises unless every element of `tensor` lies inside its region."""
    shape, strides = tensor["shape"], tensor["strides"]
    if math.prod(shape) == 0:
        return
    itemsize = TORCH_DTYPES[tensor["dtype"]].itemsize
    end = tensor["offset"] + _span(shape, strides) * itemsize
    if end > lengths[tensor["region"]]:
        raise _shape.NotAsDocumented(f"sent a lease manifest whose tensor {tensor['name']!r} ends at byte {end} "
                                     f"of region {tensor['region']}, which holds {lengths[tensor['region']]}")


def _span(shape: list[int], strides: list[int]) -> int:
    """Elements from a strided tensor's first to its last, both included."""
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


def _map_all(regions: list[dict], fds: list[int], lengths: list[int], ordinal: int | None) -> list:
    """Each region mapped read-only and shared: the daemon's pages or GPU memory, not a copy (None
    when empty)."""
    if ordinal is not None:
        from . import _cuda  # ctypes and the CUDA driver only for a lease of GPU memory
        return [_cuda.Region(fd, length, ordinal) for fd, length in zip(fds, lengths)]
    mappings: list[mmap.mmap | None] = []
    try:
        for fd, length in zip(fds, lengths):
            mappings.append(mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_UNTRACKED)
                            if length else None)
    except (OSError, ValueError) as e:
        for mapping in mappings:
            if mapping is not None:
                mapping.close()
        failed = len(mappings)
        raise ProtocolError(f"sent {_describe(regions[failed], failed)}, which cannot be mapped: {e}") from None
    return mappings


def _view(tensor: dict, mappings: list, device: str) -> torch.Tensor:
    """A tensor of the manifest (bounds checked) as a strided view of its region's mapping; the
    view keeps the mapping alive."""
    dtype, shape, strides = TORCH_DTYPES[tensor["dtype"]], tensor["shape"], tensor["strides"]
    if math.prod(shape) == 0:
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)
    if device != "cpu":
        return mappings[tensor["region"]].view(dtype, shape, strides, tensor["offset"])
    with warnings.catch_warnings():  # read-only on purpose: a write faults instead of reaching the daemon
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        flat = torch.frombuffer(mappings[tensor["region"]], dtype=dtype, count=_span(shape, strides),
                                offset=tensor["offset"])
    return flat.as_strided(shape, strides)
