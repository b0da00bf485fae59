"""Updating a loaded model's weights through the real daemon, the Python package and vramctl: an
update from a checkpoint path and from tensors in the request equals a fresh load of the updated
checkpoint bit for bit; forwards running beside 50 updates each see one version whole and say
which; a lease taken before keeps its values; bad updates are refused naming the tensor with the
model still serving; an update past the budget is refused. One daemon serves the module."""
import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_support import ROOT, Daemon, UnixConnection, get_json, request, thread_held, vramctl, wait_for  # noqa: E402,E501

sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "parity"))
import hf_models  # noqa: E402
import vramd  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("update")
    witness = hf_models.make("llama", "float32", out)
    original = witness / "model" / "model.safetensors"
    state = load_file(original)
    changed = hf_models.perturbed(state)
    updated = hf_models.save_beside(witness, changed, out / "updated")
    head = "lm_head.weight"
    partial = hf_models.save_beside(witness, {**state, head: changed[head]}, out / "partial")
    d = Daemon(out, budgets='cpu = "4GiB"')
    for name, path, extra in [("m", original, ""), ("fresh", updated, ""), ("partial", partial, ""),
                              ("sleeper", original, '[vram]\noffload = { device = "disk" }\n'),
                              ("streamed", original, '[vram]\nlimit = "300KiB"\nonload = { device = "disk" }\noffload = { device = "disk" }\n')]:
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{path}"\n{extra}')
    inputs = load_file(witness / "inputs.safetensors")
    with d.start():
        with vramd.connect(d.sock) as client:
            before = client.forward("m", inputs)
            after = client.forward("fresh", inputs)
            after_partial = client.forward("partial", inputs)
        yield {"daemon": d, "inputs": inputs, "original": original, "updated": updated, "state": state,
               "changed": changed, "before": before, "after": after, "after_partial": after_partial, "out": out}
        assert d.stop() == 0


def equal(got, want):
    assert got.keys() == want.keys()
    return all(torch.equal(got[name], want[name]) for name in got)


def test_an_update_from_a_path_then_from_tensors_equals_a_fresh_load(served):
    with vramd.connect(served["daemon"].sock) as client:
        version = client.status("m")["version"]
        answer = client.update("m", served["updated"])
        assert answer["version"] == version + 1
        assert answer["updated"]["tensors"] == len(served["state"])
        assert answer["updated"]["bytes"] == sum(t.nbytes for t in served["state"].values())
        got, ran_on = client.forward("m", served["inputs"], with_version=True)
        assert ran_on == version + 1 and equal(got, served["after"])  # float32: bit for bit
        # Back to the original, in a sealed memfd the daemon maps (the default), then in the request.
        assert client.update("m", served["state"])["version"] == version + 2
        assert equal(client.forward("m", served["inputs"]), served["before"])
        assert client.update("m", served["changed"], via="body")["version"] == version + 3
        assert equal(client.forward("m", served["inputs"]), served["after"])
        assert client.update("m", served["state"], via="body")["version"] == version + 4
        assert equal(client.forward("m", served["inputs"]), served["before"])
        assert client.status("m")["stats"]["updates"] >= 4


def test_a_partial_update_changes_only_its_tensors(served):
    with vramd.connect(served["daemon"].sock) as client:
        answer = client.update("m", {"lm_head.weight": served["changed"]["lm_head.weight"].to(torch.bfloat16)
                                     .to(torch.float32)})
        assert answer["updated"]["tensors"] == 1
        # A bfloat16 value is cast to the model's float32, as a load casts it.
        client.update("m", {"lm_head.weight": served["changed"]["lm_head.weight"].to(torch.float64)})
        assert equal(client.forward("m", served["inputs"]), served["after_partial"])
        client.update("m", {"lm_head.weight": served["state"]["lm_head.weight"]})
        assert equal(client.forward("m", served["inputs"]), served["before"])


def test_forwards_beside_fifty_updates_each_see_one_version(served):
    sock = served["daemon"].sock
    with vramd.connect(sock) as client:
        first = client.status("m")["version"]
    # Versions first, first + 2, ... hold the original; first + 1, first + 3, ... the update.
    outputs = {0: served["before"], 1: served["after"]}
    seen, failures, done, answered = [], [], threading.Event(), threading.Condition()

    def forwards():
        try:
            with vramd.connect(sock) as client:
                while not done.is_set():
                    got, version = client.forward("m", served["inputs"], with_version=True)
                    with answered:
                        seen.append(version)
                        answered.notify_all()
                    if not equal(got, outputs[(version - first) % 2]):
                        failures.append(version)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(repr(e))
            with answered:
                answered.notify_all()

    threads = [threading.Thread(target=forwards) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        with vramd.connect(sock) as client:
            for i in range(50):
                # Each update waits for a forward on the version before it: forwards and updates
                # interleave, however the threads are scheduled (the bound only ends a stuck test).
                with answered:
                    assert answered.wait_for(lambda: first + i in seen or failures, timeout=60), seen
                values = served["changed"] if i % 2 == 0 else served["state"]
                assert client.update("m", values)["version"] == first + i + 1
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
    assert not failures, failures
    assert len(set(seen)) > 2, seen  # the forwards ran between updates, not only before or after
    with vramd.connect(sock) as client:
        assert equal(client.forward("m", served["inputs"]), served["before"])


def test_a_lease_taken_before_an_update_keeps_its_values(served):
    with vramd.connect(served["daemon"].sock) as client:
        with client.lease("m") as old:
            version = client.status("m")["version"]
            held = {name: tensor.clone() for name, tensor in old.items()}
            client.update("m", served["changed"])
            assert all(torch.equal(old[name], held[name]) for name in held)
            with client.lease("m") as new:  # the update's values, in a region of the daemon's memory
                assert new["lm_head.weight"].equal(served["changed"]["lm_head.weight"])
                manifest = json.loads(request(served["daemon"].sock, "GET", "/v1/models/m/lease")[1])
                assert manifest["version"] == version + 1
                client.update("m", served["state"])
                assert new["lm_head.weight"].equal(served["changed"]["lm_head.weight"])
            assert all(torch.equal(old[name], held[name]) for name in held)
        assert equal(client.forward("m", served["inputs"]), served["before"])


def test_a_following_lease_gets_each_new_version_on_its_connection(served):
    sock = served["daemon"].sock
    with vramd.connect(sock) as client:
        following, still = client.lease("m", follow=True), client.lease("m")
        with following, still:
            version = following.version
            assert version == client.status("m")["version"]
            with pytest.raises(TimeoutError):
                following.wait_update(timeout=0.2)  # nothing new yet
            old = following.state_dict["lm_head.weight"]
            client.update("m", served["changed"])
            new = following.wait_update(timeout=60)
            assert following.version == version + 1
            assert all(torch.equal(new[name], served["changed"][name]) for name in served["changed"])
            assert torch.equal(old, served["state"]["lm_head.weight"])  # the version before stays readable
            assert torch.equal(still.state_dict["lm_head.weight"], served["state"]["lm_head.weight"])  # not following
            client.update("m", served["state"])
            back = following.wait_update(timeout=60)
            assert following.version == version + 2
            assert all(torch.equal(back[name], served["state"][name]) for name in served["state"])
            # A follower is sent a version only once it has taken the one before, then the newest.
            client.update("m", served["changed"])
            client.update("m", served["state"])
            client.update("m", served["changed"])
            following.wait_update(timeout=60)
            assert following.version == version + 3
            latest = following.wait_update(timeout=60)
            assert following.version == version + 5  # version + 4 was skipped
            assert all(torch.equal(latest[name], served["changed"][name]) for name in served["changed"])
            with pytest.raises(TimeoutError):
                following.wait_update(timeout=0.2)
            client.update("m", served["state"])
        plain = client.lease("m")
        with plain, pytest.raises(ValueError, match="does not follow"):
            plain.wait_update()
        # In place is for GPU memory, which is not sealed: host memory never changes under a lease.
        with pytest.raises(vramd.DaemonError, match="in_place writes updates into the GPU memory a lease shares, "
                                                    "and 'cpu' is not a GPU") as refused:
            client.lease("m", in_place=True)
        assert refused.value.status == 400
    for method, body, why in [("POST", b'{"follow": "yes"}', "follow must be a boolean"),
                              ("GET", b'{"follow": true}', "GET holds none: POST it"),
                              ("POST", b'{"in_place": 1}', "in_place must be a boolean"),
                              ("GET", b'{"in_place": true, "device": "cuda:0"}', "in_place sends each new version"),
                              ("POST", b'{"in_place": true, "device": "cuda:0", "follow": false}',
                               "in_place follows updates: leave out follow=false"),
                              ("POST", b'{"adapters": "yes"}', "adapters must be a boolean"),
                              ("POST", b'{"adapter": true}', "unknown key 'adapter' (device, wait, follow, in_place, "
                                                             "adapters, reserve)")]:
        status, answer = request(sock, method, "/v1/models/m/lease", body)
        assert status == 400 and why in json.loads(answer)["error"], answer
    status, answer = request(sock, "GET", "/v1/models/m/lease?adapters=maybe")
    assert status == 400 and "lease: adapters='maybe': expected true or false" in json.loads(answer)["error"], answer
    with vramd.connect(sock) as client:
        assert equal(client.forward("m", served["inputs"]), served["before"])


def test_weights_prepared_in_a_dtype_of_their_own_take_an_update_in_it(served, tmp_path):
    # Managed by [vram]: prepared in bfloat16, computed in float32. The update is cast to the
    # prepared dtype where the weights rest, as a load casts the checkpoint.
    d = served["daemon"]
    prepared = '[vram]\npreparing = { dtype = "bfloat16" }\n'
    (d.models / "prepared.toml").write_text(f'checkpoint = "{served["original"]}"\n{prepared}')
    (d.models / "prepared-fresh.toml").write_text(f'checkpoint = "{served["updated"]}"\n{prepared}')
    with vramd.connect(d.sock) as client:
        client.reload()
        want = client.forward("prepared-fresh", served["inputs"])
        before = client.forward("prepared", served["inputs"])
        assert "bfloat16" in client.status("prepared")["weights"]["plan"]
        client.update("prepared", served["changed"])
        assert equal(client.forward("prepared", served["inputs"]), want)
        client.update("prepared", served["original"])  # a path: read whole and checked before it is written
        assert equal(client.forward("prepared", served["inputs"]), before)
        client.update("prepared", served["updated"])
        assert equal(client.forward("prepared", served["inputs"]), want)
        client.unload("prepared")
        client.unload("prepared-fresh")


def test_an_updated_model_offloaded_to_disk_wakes_with_its_update(served):
    with vramd.connect(served["daemon"].sock) as client:
        client.load("sleeper")
        client.update("sleeper", served["updated"])
        client.offload("sleeper")
        assert equal(client.forward("sleeper", served["inputs"]), served["after"])  # woken: re-read, then the update
        # Updating a sleeping model wakes it.
        client.offload("sleeper")
        client.update("sleeper", {"lm_head.weight": served["state"]["lm_head.weight"]})
        assert client.status("sleeper")["state"] == "ready"


def test_tied_weights_take_an_update_through_either_name(served, tmp_path):
    # LLaMA with tied embeddings: lm_head.weight is model.embed_tokens.weight, saved once.
    witness = hf_models.make("llama3", "float32", tmp_path)
    original = witness / "model" / "model.safetensors"
    state = load_file(original)
    embed = state["model.embed_tokens.weight"] * 1.5
    changed = hf_models.save_beside(witness, {**state, "model.embed_tokens.weight": embed}, tmp_path / "changed")
    d = served["daemon"]
    (d.models / "tied.toml").write_text(f'checkpoint = "{original}"\n')
    (d.models / "tied-fresh.toml").write_text(f'checkpoint = "{changed}"\n')
    inputs = load_file(witness / "inputs.safetensors")
    with vramd.connect(d.sock) as client:
        client.reload()
        want = client.forward("tied-fresh", inputs)
        client.load("tied")
        client.update("tied", {"lm_head.weight": embed})  # the tied name reaches the weight it shares
        assert equal(client.forward("tied", inputs), want)
        client.update("tied", {"model.embed_tokens.weight": state["model.embed_tokens.weight"]})
        assert not equal(client.forward("tied", inputs), want)
        # Both names at once: the weight's own name wins, as at load.
        client.update("tied", {"model.embed_tokens.weight": embed, "lm_head.weight": state["model.embed_tokens.weight"]})
        assert equal(client.forward("tied", inputs), want)
        client.unload("tied")
        client.unload("tied-fresh")


def test_vramctl_update_from_a_path_and_as_a_body(served):
    sock = served["daemon"].sock
    result = vramctl(sock, "update", "m", served["updated"])
    assert result.stdout.startswith("m: version ") and f"({len(served['state'])} tensors" in result.stdout, result.stdout
    body = served["out"] / "lm_head.safetensors"
    save_file({"lm_head.weight": served["state"]["lm_head.weight"]}, body)
    result = vramctl(sock, "update", "m", body, "--body", "--json")
    assert json.loads(result.stdout)["updated"]["tensors"] == 1
    vramctl(sock, "update", "m", served["original"])
    with vramd.connect(sock) as client:
        assert equal(client.forward("m", served["inputs"]), served["before"])


def refused(client, name, values, status, via="memfd", keep=False):
    """The refusal's message, without the request it names."""
    with pytest.raises(vramd.DaemonError) as caught:
        client.update(name, values, via=via, keep=keep)
    assert caught.value.status == status, caught.value
    return caught.value.message


def test_bad_updates_are_refused_naming_the_tensor_and_the_model_keeps_serving(served, tmp_path):
    head = served["state"]["lm_head.weight"]
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with vramd.connect(served["daemon"].sock) as client:
        version = client.status("m")["version"]
        message = refused(client, "m", {"lm_head.weight": head, "model.layers.9.mlp.up_proj.weight": head}, 400)
        assert "'model.layers.9.mlp.up_proj.weight'" in message and "nothing was updated" in message
        # Named as the caller gave them (tensors, never the memfd they travelled in), a near miss
        # with the name it likely meant, as a forward's misspelled input is.
        message = refused(client, "m", {"model.nrom.weight": served["state"]["model.norm.weight"]}, 400)
        assert message == ("the update's tensors does not fit model 'm' (llama): 1 not the model's: 'model.nrom.weight' "
                           "(did you mean 'model.norm.weight'?); nothing was updated"), message
        assert "/proc/" not in refused(client, "m", {"lm_head.weight": head[:10]}, 400)
        kept = refused(client, "m", {"model.nrom.weight": served["state"]["model.norm.weight"]}, 400, keep=True)
        assert kept.startswith("the update's tensors does not fit model 'm'"), kept  # the next update lets it go
        message = refused(client, "m", {"lm_head.weight": head[:10]}, 400)
        assert "'lm_head.weight' is [10, 64], the parameter is [1000, 64]" in message
        message = refused(client, "m", {"lm_head.weight": head.to(torch.int32)}, 400)
        assert "'lm_head.weight' is I32" in message
        assert "a FIFO" in refused(client, "m", fifo, 400)
        assert "no such file" in refused(client, "m", tmp_path / "missing.safetensors", 400).lower()
        client.load("streamed")
        message = refused(client, "streamed", served["updated"], 409)
        assert "streams layer" in message and "from disk" in message and "rest it in memory" in message
        client.unload("partial")
        assert "not loaded" in refused(client, "partial", served["updated"], 409)
        assert client.status("m")["version"] == version
        assert equal(client.forward("m", served["inputs"]), served["before"])
        # A NaN is data, not an error.
        client.update("m", {"lm_head.weight": torch.full_like(head, float("nan"))})
        assert torch.isnan(client.forward("m", served["inputs"])["logits"]).all()
        client.update("m", {"lm_head.weight": head})
    sock = served["daemon"].sock
    body = bytes(vramd._safetensors.dumps({"lm_head.weight": head}))
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.write(unsealed, body)
    reader, writer = os.pipe()
    try:
        for bad, why in [(body[:-10], "not a safetensors file"), (b"", "needs a request body"),
                         (b'{"path": "relative.safetensors"}', "is relative"),
                         (b'{"path": "/a", "fd": 3}', "must be"),
                         (b'{"fd": %d}' % unsealed, "is not sealed against writes and shrinking"),
                         (b'{"fd": %d}' % reader, "a FIFO"),
                         (b'{"fd": 999999}', "/fd/999999")]:
            status, answer = request_typed(sock, bad, "application/json" if bad.startswith(b"{") else "application/octet-stream")
            assert status == 400 and why in json.loads(answer)["error"], answer
    finally:
        for fd in (unsealed, reader, writer):
            os.close(fd)
    with vramd.connect(sock) as client:
        assert client.status("m")["version"] == version + 2  # the NaN and its undoing
        assert equal(client.forward("m", served["inputs"]), served["before"])


def request_typed(sock, body, content_type):
    connection = UnixConnection(str(sock))
    try:
        connection.request("POST", "/v1/models/m/weights", body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_an_update_takes_room_beside_the_old_values_only_where_it_cannot_write_in_place(served, tmp_path):
    # The model is 857,344 bytes, in a budget of 1,536,000: a whole copy beside it cannot fit.
    d = Daemon(tmp_path, budgets='cpu = "1500KiB"')
    (d.models / "m.toml").write_text(f'checkpoint = "{served["original"]}"\n')
    with d.start():
        with vramd.connect(d.sock) as client:
            client.load("m")
            # Loaded, its weights are views of the checkpoint's mapping, which an update never writes.
            message = refused(client, "m", served["changed"], 507, via="body")
            assert "needs 837.25 KiB on cpu" in message, message
            # One tensor at a time fits beside; each then lies in memory of the daemon's own.
            for name, value in served["changed"].items():
                client.update("m", {name: value}, via="body")
            assert client.status("m")["devices"]["cpu"] == 857344
            # Now a whole update is written where the old values are, and needs no room.
            assert client.update("m", served["state"], via="body")["version"] == 2 + len(served["changed"])
            assert equal(client.forward("m", served["inputs"]), served["before"])
            # A lease holds the old values: the next update goes beside them again, and is refused.
            with client.lease("m"):
                assert "needs 837.25 KiB on cpu" in refused(client, "m", served["changed"], 507, via="body")
                # A sealed memfd of the model's dtypes needs no room at all: the weights keep its pages.
                client.update("m", served["changed"])
                assert client.status("m")["devices"]["cpu"] == 857344
                assert equal(client.forward("m", served["inputs"]), served["after"])
        assert d.stop() == 0


def memfds(pid, name="vramd-update"):
    """The inodes of the memfds named `name` that process `pid` maps."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {int(line.split()[4]) for line in lines if f"/memfd:{name} " in line + " "}


UPDATE_IN_A_CHILD = """
import sys, vramd
from safetensors.torch import load_file
with vramd.connect(sys.argv[1]) as client:
    print(client.update("m", load_file(sys.argv[2]))["version"])
"""


def test_a_sealed_memfd_of_the_models_dtypes_becomes_its_weights_without_a_copy(served, tmp_path):
    # The model is 857,344 bytes, in a budget of 2 MiB: room for two copies, not three. After an
    # update, the values it replaced are freed on a thread of the daemon's, and counted until then.
    d = Daemon(tmp_path, budgets='cpu = "2MiB"')
    for name in ("m", "n"):
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{served["original"]}"\n')
    with d.start(), vramd.connect(d.sock) as client:
        client.load("m")
        daemon = d.process.pid
        before = memfds(daemon)
        # From a process that exits at once: the daemon keeps the memfd's pages, not a copy of them.
        changed = tmp_path / "changed.safetensors"
        save_file(served["changed"], changed)
        child = subprocess.run([sys.executable, "-c", UPDATE_IN_A_CHILD, str(d.sock), str(changed)],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
                               timeout=120)
        assert child.returncode == 0, child.stderr
        adopted = memfds(daemon) - before
        assert len(adopted) == 1, adopted
        assert equal(client.forward("m", served["inputs"]), served["after"])
        # A lease hands on the same memfd.
        with client.lease("m") as lease:
            assert memfds(os.getpid()) & adopted == adopted
            assert all(torch.equal(lease[name], served["changed"][name]) for name in served["changed"])
        # Values that must be cast are copied, and the memfd before is let go whole. Until it is,
        # a load that needs its room waits for it (rather than unload m): so once n is loaded,
        # the daemon maps the memfd no more, whether or not the load had to wait.
        client.update("m", {name: value.to(torch.float64) for name, value in served["state"].items()})
        client.load("n")
        assert memfds(daemon) & adopted == set()
        assert client.status("m")["state"] == "ready"
        assert equal(client.forward("m", served["inputs"]), served["before"])
        client.unload("n")
        # One of those values out of place (a bfloat16 among float32) copies them all: here in
        # place, m's values being memory of the daemon's own now.
        mixed = {**served["changed"], "lm_head.weight": served["changed"]["lm_head.weight"].to(torch.bfloat16)}
        client.update("m", mixed)
        assert memfds(daemon) - before == set()
        client.update("m", served["state"])
        assert len(memfds(daemon) - before) == 1
        assert equal(client.forward("m", served["inputs"]), served["before"])
        assert d.stop() == 0


def test_a_load_waits_for_the_values_an_update_replaced_to_be_freed(served, tmp_path):
    # The model is 857,344 bytes, in a budget of 2 MiB: room for two copies, not three.
    d = Daemon(tmp_path, budgets='cpu = "2MiB"')
    for name in ("m", "n"):
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{served["original"]}"\n')
    cpu = lambda: get_json(d.sock, "/v1/status")["devices"]["cpu"]  # noqa: E731
    model = lambda name: get_json(d.sock, f"/v1/models/{name}")  # noqa: E731
    loaded = []
    with d.start(), vramd.connect(d.sock) as client:
        client.load("m")
        # The thread that frees what updates replaced is held still while the update runs.
        with thread_held(d.process.pid, "vramd-release"):
            # Its new values go beside the old, views of the checkpoint's mapping, which the
            # budget counts until that thread has freed them after the answer.
            client.update("m", served["changed"], via="body")
            assert cpu()["used"] == 2 * 857344 and cpu()["releasing"] == 857344, cpu()
            # n would fit beside m alone, not beside the values still held: its load waits for
            # them, rather than pass the budget or unload m.
            loading = threading.Thread(target=lambda: loaded.append(vramd.connect(d.sock).load("n")))
            loading.start()
            wait_for(lambda: model("n").get("waiting_for_room") or model("n")["state"] == "ready",
                     what="n's load to wait for room, or to load")
            assert model("n")["state"] != "ready" and model("m")["state"] == "ready", model("n")
            printed = vramctl(d.sock, "status").stdout
            assert "837.25 KiB of replaced values being freed" in printed and "(waiting for room)" in printed, printed
        loading.join(timeout=60)
        assert loaded and loaded[0]["state"] == "ready", loaded
        assert cpu()["releasing"] == 0 and cpu()["used"] == 2 * 857344, cpu()
        assert "waiting_for_room" not in model("n")
        assert equal(client.forward("m", served["inputs"]), served["after"])
        assert d.stop() == 0


def test_a_kept_memfd_takes_each_update_and_is_mapped_once_for_its_connection(served):
    sock, daemon = served["daemon"].sock, served["daemon"].process.pid
    head = "lm_head.weight"
    with vramd.connect(sock) as client:
        version = client.status("m")["version"]
        first = client.update("m", served["changed"], keep=True)
        assert first["version"] == version + 1
        assert first["updated"]["kept"] == {"memfd": "mapped", "page_locked": []}  # no GPU here
        assert equal(client.forward("m", served["inputs"]), served["after"])
        kept = memfds(daemon, "vramd-update-kept")
        assert len(kept) == 1, kept
        # Shown with its client's pid in /v1/status, /metrics and vramctl status.
        size, pid = len(vramd._safetensors.dumps(served["changed"])), os.getpid()
        assert get_json(sock, "/v1/status")["kept_memfds"] == [{"model": "m", "pid": pid, "bytes": size,
                                                                "page_locked": []}]
        assert f'vramd_kept_memfd_bytes{{model="m",pid="{pid}"}} {size}\n' in request(sock, "GET", "/metrics")[1].decode()
        assert f"updates from pid {pid} through a kept memfd of " in vramctl(sock, "status").stdout
        assert get_json(sock, "/v1/models/m")["charge"]["cpu"]["parts"]["kept_memfds"] == size
        # The same tensors again: written into the same memfd, which the daemon maps already.
        second = client.update("m", served["state"], keep=True)
        assert second["updated"]["kept"]["memfd"] == "reused" and second["version"] == version + 2
        assert equal(client.forward("m", served["inputs"]), served["before"])
        assert memfds(daemon, "vramd-update-kept") == kept
        # Other tensors: a memfd of their own, in place of the one before.
        third = client.update("m", {head: served["changed"][head]}, keep=True)
        assert third["updated"]["kept"]["memfd"] == "mapped"
        assert equal(client.forward("m", served["inputs"]), served["after_partial"])
        assert len(memfds(daemon, "vramd-update-kept") - kept) == 1 and not memfds(daemon, "vramd-update-kept") & kept
        # An update without keep lets it go (unmapped on a thread of the daemon's).
        assert "kept" not in client.update("m", served["state"])["updated"]
        assert get_json(sock, "/v1/status")["kept_memfds"] == []
        wait_for(lambda: not memfds(daemon, "vramd-update-kept"), what="the kept memfd to be unmapped")
        assert equal(client.forward("m", served["inputs"]), served["before"])
        with pytest.raises(ValueError, match="keep=True keeps a memfd of tensors"):
            client.update("m", served["updated"], keep=True)
        client.update("m", {head: served["state"][head]}, keep=True)
        assert len(memfds(daemon, "vramd-update-kept")) == 1
    # The connection's end lets it go too.
    wait_for(lambda: not memfds(daemon, "vramd-update-kept"), what="the kept memfd to be unmapped")


def test_a_kept_memfd_counts_in_the_budget_and_one_that_cannot_fit_is_refused(served, tmp_path):
    # The model is 857,344 bytes; the budget leaves 600,000 beside it: room for a memfd of its
    # lm_head (256,000 bytes) with that weight's new values, not for one of every weight.
    head = "lm_head.weight"
    d = Daemon(tmp_path, budgets=f"cpu = {857344 + 600000}")
    (d.models / "m.toml").write_text(f'checkpoint = "{served["original"]}"\n')
    cpu = lambda: get_json(d.sock, "/v1/status")["devices"]["cpu"]  # noqa: E731
    with d.start(), vramd.connect(d.sock) as client:
        client.load("m")
        with pytest.raises(vramd.DaemonError, match=r"model 'm' needs .* on cpu but only .* can be freed") as refused:
            client.update("m", served["changed"], keep=True)
        assert refused.value.status == 507
        assert cpu()["used"] == 857344 and equal(client.forward("m", served["inputs"]), served["before"])
        size = len(vramd._safetensors.dumps({head: served["changed"][head]}))
        assert client.update("m", {head: served["changed"][head]}, keep=True)["updated"]["kept"]["memfd"] == "mapped"
        wait_for(lambda: cpu()["releasing"] == 0, what="the replaced values to be freed")
        assert get_json(d.sock, "/v1/models/m")["charge"]["cpu"]["parts"] == {"weights": 857344, "kept_memfds": size}
        assert cpu()["used"] == 857344 + size <= cpu()["budget"]
        assert equal(client.forward("m", served["inputs"]), served["after_partial"])
        assert "kept" not in client.update("m", {head: served["state"][head]})["updated"]  # lets it go
        assert cpu()["models"] == {"m": 857344}
        assert d.stop() == 0


KEEP_THEN_WAIT = """
import sys, vramd
from safetensors.torch import load_file
client = vramd.connect(sys.argv[1])
print(client.update("m", load_file(sys.argv[2]), keep=True)["updated"]["kept"]["memfd"], flush=True)
sys.stdin.read()  # until killed
"""


def test_a_trainer_killed_while_the_daemon_keeps_its_memfd_leaves_nothing_behind(served, tmp_path):
    sock, daemon = served["daemon"].sock, served["daemon"].process.pid
    changed = tmp_path / "changed.safetensors"
    save_file(served["changed"], changed)
    child = subprocess.Popen([sys.executable, "-c", KEEP_THEN_WAIT, str(sock), str(changed)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    try:
        assert child.stdout.readline().strip() == "mapped"
        assert len(memfds(daemon, "vramd-update-kept")) == 1
    finally:
        child.kill()  # SIGKILL: no close(), only the connection's end
        child.wait(timeout=60)
    wait_for(lambda: not memfds(daemon, "vramd-update-kept"), what="the dead client's kept memfd to be unmapped")
    with vramd.connect(sock) as client:
        assert equal(client.forward("m", served["inputs"]), served["after"])
        client.update("m", served["state"])
        assert equal(client.forward("m", served["inputs"]), served["before"])


def test_a_kept_memfd_is_copied_from_never_kept_as_the_weights(served):
    """Through the socket itself: the client writes new values into its memfd whenever it likes;
    the model takes them only when an update asks, and is refused a memfd it could cut short."""
    sock = str(served["daemon"].sock)
    head = served["state"]["lm_head.weight"]
    body = bytes(vramd._safetensors.dumps({"lm_head.weight": head}))
    memfd = os.memfd_create("vramd-test-kept", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    connection = UnixConnection(sock)
    try:
        os.write(memfd, body)
        os.write(unsealed, body)
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)

        def post(payload):
            connection.request("POST", "/v1/models/m/weights", body=json.dumps(payload),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        status, answer = post({"fd": memfd, "keep": True})
        assert status == 200 and answer["updated"]["kept"]["memfd"] == "mapped", answer
        # New values written into it after the answer reach no forward...
        changed = bytes(vramd._safetensors.dumps({"lm_head.weight": served["changed"]["lm_head.weight"]}))
        os.pwrite(memfd, changed, 0)
        with vramd.connect(sock) as client:
            assert equal(client.forward("m", served["inputs"]), served["before"])
            # ... until an update takes them.
            status, answer = post({"fd": memfd, "keep": True})
            assert status == 200 and answer["updated"]["kept"]["memfd"] == "reused", answer
            assert equal(client.forward("m", served["inputs"]), served["after_partial"])
            for bad, why in [({"fd": unsealed, "keep": True}, "is not sealed against shrinking (fcntl F_ADD_SEALS"),
                             ({"fd": memfd, "keep": 1}, "keep must be true or false, beside {\"fd\": N}"),
                             ({"path": str(served["updated"]), "keep": True}, "keep must be true or false"),
                             ({"fd": memfd}, "is not sealed against writes and shrinking")]:
                status, answer = post(bad)
                assert status == 400 and why in answer["error"], answer
            version = client.status("m")["version"]
            client.update("m", {"lm_head.weight": head})
            assert client.status("m")["version"] == version + 1
            assert equal(client.forward("m", served["inputs"]), served["before"])
    finally:
        connection.close()
        os.close(memfd)
        os.close(unsealed)
