"""Hostile input against a real vramd on a real socket and folder: bytes no client should send,
files no user should drop, clients that never read, and servers that are not vramd. After each
attack the daemon is alive, answers /v1/health within 2 s, a loaded model's outputs are
unchanged, and a valid config dropped next becomes usable. No answer is ever a 500: a 500 is a
fault of vramd's own.

One daemon serves the whole module (it must survive everything anyway)."""
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load, load_file, save

from daemon_support import ROOT, Daemon, model, raw, request, squatter, vramctl, wait_for
import hf_models

sys.path.insert(0, str(ROOT / "python"))
import vramd  # noqa: E402


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    gpt2 = hf_models.make("gpt2", "float32", tmp_path_factory.mktemp("gpt2"))
    llama = hf_models.make("llama", "float32", tmp_path_factory.mktemp("llama"))
    d = Daemon(folder, extra='[limits]\nidle_timeout = "3s"\nrequest_timeout = "2s"\nmax_unsent_size = "1MiB"')
    (d.models / "gpt2.toml").write_text(f'checkpoint = "{gpt2 / "model"}"\n[residency]\npreload = true\n')
    # Fewer positions than the checkpoint's config.json: set in [arch], as the refusal says.
    (d.models / "llama.toml").write_text(f'checkpoint = "{llama / "model"}"\n[arch]\nmax_position_embeddings = 64\n')
    with d.start():
        inputs = load_file(gpt2 / "inputs.safetensors")
        wait_for(lambda: model(d.sock, "gpt2")["state"] == "ready", what="gpt2 to preload")
        d.gpt2_inputs = inputs
        d.gpt2_expected = load_file(gpt2 / "expected.safetensors")["logits"]
        d.llama_dir = llama
        d.dropped = 0
        yield d


def forward(d, name, inputs):
    return request(d.sock, "POST", f"/v1/models/{name}/forward", save(inputs))


def assert_unharmed(d, drop_config=False):
    """The daemon serves: health within 5 s, gpt2's outputs as transformers', and optionally a
    config dropped now becomes usable."""
    assert d.process.poll() is None, f"vramd died:\n{d.log.read_text()[-4000:]}"
    started = time.monotonic()
    status, _ = request(d.sock, "GET", "/v1/health", timeout=5)
    assert status == 200 and time.monotonic() - started < 5  # at once, with a margin for a busy machine
    status, body = forward(d, "gpt2", d.gpt2_inputs)
    assert status == 200, body
    assert hf_models.close(load(body)["logits"], d.gpt2_expected)
    if drop_config:
        d.dropped += 1
        name = f"fresh{d.dropped}"
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{d.llama_dir / "model"}"\n')
        wait_for(lambda: name in {m["name"] for m in json.loads(request(d.sock, "GET", "/v1/models")[1])["models"]},
                 timeout=10, what=f"{name} to be picked up")
        status, body = forward(d, name, {"input_ids": torch.tensor([[1, 2, 3]])})
        assert status == 200, body
        request(d.sock, "POST", f"/v1/models/{name}/unload")


def answer_of(data):
    """(status, JSON body) of one raw HTTP answer; the body must be valid UTF-8 JSON."""
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    status = int(head.split()[1])
    return status, json.loads(body.decode("utf-8"))


BAD_TEXT_REQUESTS = [
    b"GET /v1/models/%ff%fe HTTP/1.1\r\n\r\n",
    b"GET /v1/models/%c0%ae HTTP/1.1\r\n\r\n",
    b"GET /v1/models/\xff\xfe HTTP/1.1\r\n\r\n",
    b"GET /%ff HTTP/1.1\r\n\r\n",
    b"GET /v1/%ed%a0%80 HTTP/1.1\r\n\r\n",
    b"POST /v1/models/%ff/load HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"POST /v1/models/gpt2/nope%ff%00 HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"POST /v1/models/gpt2/load?keep_alive=%ff HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"POST /v1/models/gpt2/load?keep_alive=%f0%9f%98 HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"GET /v1/models/gpt2?%ff=%fe HTTP/1.1\r\nX-\xff: \xfe\xfd\r\nUser-Agent: \xc0\xae\r\n\r\n",
    b"DELETE /v1/models/%ff%fe HTTP/1.1\r\n\r\n",
    b"GET /v1/models/%00 HTTP/1.1\r\n\r\n",
]


@pytest.mark.parametrize("data", BAD_TEXT_REQUESTS, ids=range(len(BAD_TEXT_REQUESTS)))
def test_text_that_is_not_utf8_gets_a_valid_json_refusal(hostile, data):
    status, body = answer_of(raw(hostile.sock, data.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)))
    assert 400 <= status < 500 or status == 200, body
    assert "error" in body or status == 200
    assert_unharmed(hostile)


def test_a_client_mistake_is_a_4xx_naming_the_input(hostile):
    ids = [[5, 6, 7, 8]]
    expected = load(forward(hostile, "gpt2", {"input_ids": torch.tensor(ids)})[1])["logits"]
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.uint16, torch.uint32, torch.uint64):
        status, body = forward(hostile, "gpt2", {"input_ids": torch.tensor(ids).to(dtype)})
        assert status == 200, (dtype, body)
        assert torch.equal(load(body)["logits"], expected), dtype
    # 2^63 + 5 as uint64, made from int64's same bits: torch before 2.15 cannot assign it directly.
    huge = torch.tensor([[1, 2**63 + 5 - 2**64]], dtype=torch.int64).view(torch.uint64)
    for bad, words in [({"input_ids": huge}, b"2^63"),
                       ({"input_ids": torch.tensor([[70000, 1]], dtype=torch.uint32)}, b"70000"),
                       ({"input_ids": torch.tensor([[1.0, 2.0]])}, b"float32"),
                       ({"input_ids": torch.tensor([[True, False]])}, b"bool"),
                       ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, b"input_ids")]:
        status, body = forward(hostile, "gpt2", bad)
        assert status == 400 and words in body and b"input_ids" in body, body
    # Longer than the positions, for every family: the length, the limit and the key.
    status, body = forward(hostile, "llama", {"input_ids": torch.ones(1, 80, dtype=torch.long)})
    assert status == 400 and b"80 tokens" in body and b"at most 64" in body, body
    assert b"max_position_embeddings" in body and b"[arch]" in body
    status, body = forward(hostile, "gpt2", {"input_ids": torch.ones(1, 65, dtype=torch.long)})
    assert status == 400 and b"65 tokens" in body and b"n_positions" in body, body
    assert forward(hostile, "llama", {"input_ids": torch.ones(1, 64, dtype=torch.long)})[0] == 200
    request(hostile.sock, "POST", "/v1/models/llama/unload")
    assert_unharmed(hostile)


def invalid_reason(d, name, timeout=5):
    found = {}

    def check():
        status, body = request(d.sock, "GET", "/v1/models")
        assert status == 200, body
        for m in json.loads(body)["models"]:
            if m["name"] == name and m["state"] == "invalid":
                found["reason"] = m["reason"]
                return True
        return False
    wait_for(check, timeout=timeout, what=f"{name} to be invalid")
    return found["reason"]


def test_files_that_are_not_regular_files_are_invalid_within_a_second(hostile, tmp_path):
    models = hostile.models
    os.symlink("loop.toml", models / "loop.toml")
    os.symlink("/dev/zero", models / "zero.toml")
    os.symlink(tmp_path / "nowhere", models / "dangling.toml")
    os.mkfifo(models / "fifo.toml")
    (models / "folder.toml").mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(models / "sock.toml"))
    rss_before = hostile.rss()
    started = time.monotonic()
    assert "symbolic links" in invalid_reason(hostile, "loop")
    assert "character device" in invalid_reason(hostile, "zero")
    assert "No such file" in invalid_reason(hostile, "dangling")
    assert "a FIFO" in invalid_reason(hostile, "fifo")
    assert "a folder" in invalid_reason(hostile, "folder")
    assert "a socket" in invalid_reason(hostile, "sock")
    assert time.monotonic() - started < 3  # each within a second of the folder event settling
    if "ASAN_OPTIONS" not in os.environ:  # see the pipelining test
        assert hostile.rss() - rss_before < 32 << 20
    # The FIFO never blocks the loop, however often the folder changes around it.
    for i in range(3):
        (models / f"touch{i}.txt").write_text("x")
        assert request(hostile.sock, "GET", "/v1/health", timeout=2)[0] == 200
    # A config whose checkpoint is a FIFO: invalid at once, the folder's other files still validated.
    os.mkfifo(tmp_path / "checkpoint.safetensors")
    (models / "fifock.toml").write_text(f'checkpoint = "{tmp_path / "checkpoint.safetensors"}"\n')
    assert "not a regular file" in invalid_reason(hostile, "fifock")
    assert time.monotonic() - started < 5
    listener.close()
    for name in ["loop", "zero", "dangling", "fifo", "sock", "fifock"]:
        os.unlink(models / f"{name}.toml")
    (models / "folder.toml").rmdir()
    assert_unharmed(hostile, drop_config=True)


def test_names_sizes_and_nesting_that_are_not_configs(hostile):
    models = hostile.models
    odd = os.path.join(os.fsencode(models), b"\xff\xfe.toml")
    with open(odd, "w") as f:
        f.write(f'checkpoint = "{hostile.llama_dir / "model"}"\n')
    (models / "huge.toml").write_text("# " + "x" * (2 << 20) + "\n")
    (models / "nested.toml").write_text("a = " + "[" * 20000 + "]" * 20000 + "\n")
    (models / "-dash.toml").write_text(f'checkpoint = "{hostile.llama_dir / "model"}"\n')
    os.link(models / "gpt2.toml", models / "hardlink.toml")
    assert "\\xff\\xfe" in invalid_reason(hostile, "\\xff\\xfe")
    assert "larger than 1.00 MiB" in invalid_reason(hostile, "huge")
    assert "nested" in invalid_reason(hostile, "nested")
    assert "starting with a letter or digit" in invalid_reason(hostile, "-dash")
    status, body = request(hostile.sock, "GET", "/v1/models")  # the odd name, escaped, in valid JSON
    assert status == 200 and "\\xff\\xfe" in {m["name"] for m in json.loads(body.decode("utf-8"))["models"]}
    wait_for(lambda: request(hostile.sock, "GET", "/v1/models/hardlink")[0] == 200, what="the hard link")
    assert forward(hostile, "hardlink", hostile.gpt2_inputs)[0] == 200
    for name in [odd, models / "huge.toml", models / "nested.toml", models / "-dash.toml", models / "hardlink.toml"]:
        os.unlink(name)
    assert_unharmed(hostile, drop_config=True)


def test_what_the_log_and_vramctl_show_of_a_hostile_config_is_printable(hostile):
    # A file name and a config's text can carry escape sequences and newlines; the log gives each
    # problem a line of its own with its prefix, and neither it nor vramctl passes on a control byte.
    name = b"esc\x1b[2J"
    path = os.path.join(os.fsencode(hostile.models), name + b".toml")
    with open(path, "w") as f:
        f.write('checkpoint = "\\u001b]0;pwned\\u0007"\nsize = 1\n[arch]\n"\\u001b[31m" = 1\n')
    (hostile.models / "lua.lua").write_bytes(b'error("\\27[2J\\255")\n')
    (hostile.models / "lua.toml").write_text(f'checkpoint = "{hostile.llama_dir / "model"}"\nconverter = "lua.lua"\n')
    reason = invalid_reason(hostile, "esc\\x1b[2J")
    assert reason.count("\n") == 1 and {c for c in reason if ord(c) < 0x20} == {"\n"}, reason  # two problems
    assert "[2J" in invalid_reason(hostile, "lua")
    listed = vramctl(hostile.sock, "list").stdout
    metrics = request(hostile.sock, "GET", "/metrics")[1].decode()
    log = hostile.log.read_bytes()
    for name in [path, hostile.models / "lua.toml", hostile.models / "lua.lua"]:
        os.unlink(name)
    assert {c for c in listed if ord(c) < 0x20} == {"\n"}, repr(listed)
    assert [line for line in listed.splitlines() if "esc" in line][1:] == [
        f"    {line}" for line in reason.splitlines()]
    assert not {b for b in log if b < 0x20} - {0x0a}, [line for line in log.splitlines() if b"[2J" in line]
    assert log.decode("utf-8")
    # Prometheus' text format: a label value escapes only a backslash, a double quote and a newline.
    sample = re.compile(r'[a-z_]+(\{[a-z_]+="(?:[^"\\\n]|\\[\\"n])*"(?:,[a-z_]+="(?:[^"\\\n]|\\[\\"n])*")*\})? \S+')
    assert all(line.startswith("# ") or sample.fullmatch(line) for line in metrics.splitlines()), metrics
    assert 'vramd_model_state{model="esc\\\\x1b[2J",state="invalid"} 1' in metrics
    problems = [line for line in log.decode().splitlines() if "esc\\x1b[2J.toml:" in line]
    assert len(problems) == 2 and all(line.startswith("vramd: warn: ") for line in problems), problems
    assert_unharmed(hostile)


def test_a_converter_that_catches_its_time_limit_holds_nothing_up(hostile):
    (hostile.models / "evil.lua").write_text("while true do pcall(function() while true do end end) end\n")
    (hostile.models / "evil.toml").write_text(f'checkpoint = "{hostile.llama_dir / "model"}"\nconverter = "evil.lua"\n')
    assert "ran past its time limit" in invalid_reason(hostile, "evil", timeout=30)
    for name in ["evil.toml", "evil.lua"]:
        (hostile.models / name).unlink()
    assert_unharmed(hostile, drop_config=True)


def test_a_file_that_changes_while_it_is_read(hostile):
    path = hostile.models / "churn.toml"
    good = f'checkpoint = "{hostile.llama_dir / "model"}"\n'
    stop = time.monotonic() + 3

    def churn():
        i = 0
        while time.monotonic() < stop:
            path.write_text(good if i % 2 else "checkpoint = [" + "1," * 50000)
            i += 1
    writer = threading.Thread(target=churn)
    writer.start()
    while writer.is_alive():
        request(hostile.sock, "POST", "/v1/reload")
        assert request(hostile.sock, "GET", "/v1/health", timeout=2)[0] == 200
    writer.join()
    path.write_text(good)
    wait_for(lambda: request(hostile.sock, "GET", "/v1/models/churn")[0] == 200 and
             model(hostile.sock, "churn")["state"] != "invalid", what="the last version to be valid")
    assert forward(hostile, "churn", {"input_ids": torch.tensor([[1, 2]])})[0] == 200
    path.unlink()
    assert_unharmed(hostile)


@pytest.mark.parametrize("target", ["GET /v1/status", "GET /v1/models", "GET /metrics", "POST /v1/models/gpt2/forward"])
def test_a_client_that_pipelines_and_never_reads_cannot_swell_the_daemon(hostile, target):
    method, path = target.split()
    body = save(hostile.gpt2_inputs) if method == "POST" else b""
    one = f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    baseline = hostile.rss()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(hostile.sock))
    s.setblocking(False)
    sent, deadline, closed = 0, time.monotonic() + 6, False
    data = one * 3000
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += s.send(data[sent:sent + (1 << 20)])
        except BlockingIOError:  # the daemon stopped reading: its answers wait for us
            time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):  # it gave up on us after idle_timeout
            closed = True
            break
    time.sleep(0.5)
    grown = hostile.rss() - baseline
    started = time.monotonic()
    assert request(hostile.sock, "GET", "/v1/health", timeout=5)[0] == 200
    assert time.monotonic() - started < 5
    s.close()
    # AddressSanitizer's quarantine holds freed memory (up to 256 MiB): the bound means nothing there.
    if "ASAN_OPTIONS" not in os.environ:
        assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB with {sent} bytes of requests unanswered"
    if closed:
        assert "it took none of its" in hostile.log.read_text()
    assert_unharmed(hostile)


def test_half_closed_and_abandoned_connections(hostile):
    answer = raw(hostile.sock, b"GET /v1/health HTTP/1.1\r\n\r\n", shutdown=True)
    assert answer.startswith(b"HTTP/1.1 200 ")
    answer = raw(hostile.sock, b"POST /v1/models/gpt2/forward HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc",
                 shutdown=True)
    assert answer == b""
    for _ in range(20):  # a forward whose client is gone before the answer
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(hostile.sock))
        payload = save(hostile.gpt2_inputs)
        s.sendall(b"POST /v1/models/gpt2/forward HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        s.close()
    assert_unharmed(hostile)


def test_a_connection_that_keeps_a_memfd_is_not_closed_for_being_idle(hostile):
    with vramd.connect(hostile.sock) as client:
        with client.lease("gpt2") as state_dict:
            name, value = next(iter(state_dict.items()))
            value = value.clone()  # gpt2's own values: its outputs stay as they are
        assert client.update("gpt2", {name: value}, keep=True)["updated"]["kept"]["memfd"] == "mapped"
        # A connection asked later, with nothing kept, is closed once idle_timeout (3 s) is over,
        # after the kept connection's idle_timeout would have been.
        idle = socket.socket(socket.AF_UNIX)
        idle.settimeout(60)
        idle.connect(str(hostile.sock))
        idle.sendall(b"GET /v1/health HTTP/1.1\r\n\r\n")
        received = b""
        while chunk := idle.recv(65536):
            received += chunk
        idle.close()
        assert received.startswith(b"HTTP/1.1 200 ")
        # The client that keeps a memfd still has its connection: the daemon maps the memfd still.
        assert client.update("gpt2", {name: value}, keep=True)["updated"]["kept"]["memfd"] == "reused"
    assert_unharmed(hostile)


FAKE_BODY = b'{"models": [{"name": "evil", "state": "ready", "devices": 7, "bytes": "many"}]}'
FAKE_ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(FAKE_BODY)
               + FAKE_BODY)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_socket_served_by_another_user_is_refused(hostile, tmp_path):
    nobody = 65534
    with squatter(nobody, FAKE_ANSWER) as sock:
        refused = vramctl(sock, "list", check=False)
        assert refused.returncode != 0
        assert f"served by uid {nobody}" in refused.stderr and str(sock) in refused.stderr, refused.stderr
        assert "evil" not in refused.stdout
        # Trusted on purpose: its answer is not what the API documents, and that is said plainly.
        trusted = subprocess.run([os.environ["VRAMCTL"], "list"], capture_output=True, text=True, timeout=30,
                                 env={**os.environ, "VRAMD_SOCKET": str(sock), "VRAMD_TRUST_UIDS": str(nobody)})
        assert trusted.returncode != 0 and "not what docs/api.md documents" in trusted.stderr, trusted.stderr
        assert "json.exception" not in trusted.stderr
        # A daemon never serves from a folder another user holds...
        d = Daemon(tmp_path / "second", sock=sock)
        d.start(wait=False)
        assert d.process.wait(30) != 0 and f"belongs to uid {nobody}" in d.log.read_text()
        d.log_file.close()
        assert sock.exists()
    # ...nor removes a socket of another user's, even a stale one in its own folder.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(mine / "vramd.sock"))
    stale.close()
    os.chown(mine / "vramd.sock", nobody, nobody)
    d = Daemon(tmp_path / "third", sock=mine / "vramd.sock")
    d.start(wait=False)
    assert d.process.wait(30) != 0 and f"a socket of uid {nobody} is in the way" in d.log.read_text()
    d.log_file.close()
    assert (mine / "vramd.sock").exists()
    assert_unharmed(hostile)


def test_a_socket_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    d = Daemon(tmp_path / "daemon", sock=shared / "vramd.sock")
    d.start(wait=False)
    assert d.process.wait(30) != 0
    log = d.log.read_text()
    assert str(shared) in log and "others may write the socket's folder (mode 1777)" in log, log
    assert not (shared / "vramd.sock").exists()
    d.log_file.close()


def test_the_default_socket_lives_in_a_private_folder(tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    d = Daemon(tmp_path / "daemon")
    d.config.write_text('models = "models"\n')  # no socket: the default
    d.sock = runtime / "vramd" / "vramd.sock"
    with d.start(env={"XDG_RUNTIME_DIR": str(runtime)}):
        info = os.stat(runtime / "vramd")
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        listed = subprocess.run([os.environ["VRAMCTL"], "health"], capture_output=True, text=True, timeout=30,
                                cwd=tmp_path, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
        assert listed.returncode == 0, listed.stderr
        assert d.stop() == 0
