"""A model partitioned across the daemon's group of processes ([group] world_size = 2 in the
daemon config; [partition] in the model's): served through the real socket with the
single-process model's outputs; when a rank dies, the request to that model fails with an error
naming it while the daemon and its other models carry on, and once the daemon has started the
rank again the model loads and serves again. An update reaches every rank's slices."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save

from daemon_support import ROOT, VRAMCTL, Daemon, model, request, vramctl, wait_for
import hf_models

sys.path.insert(0, str(ROOT / "python"))
import vramd  # noqa: E402


def children(pid):
    """Of every thread: the daemon starts a rank again from a thread of its own."""
    return sorted(int(p) for task in Path(f"/proc/{pid}/task").iterdir() if (task / "children").exists()
                  for p in (task / "children").read_text().split())


def test_a_partitioned_model_serves_and_survives_a_rank_dying(tmp_path):
    case = hf_models.make("llama3", "float32", tmp_path / "hf")
    d = Daemon(tmp_path / "d", extra="[group]\nworld_size = 2")
    checkpoint = case / "model"
    (d.models / "split.toml").write_text(f'checkpoint = "{checkpoint}"\n[partition]\nworld_size = 2\ntimeout = "5s"\n')
    (d.models / "whole.toml").write_text(f'checkpoint = "{checkpoint}"\n')
    inputs = load_file(case / "inputs.safetensors")

    # The single-process model's outputs, from vramctl run.
    reference = tmp_path / "reference.safetensors"
    subprocess.run([VRAMCTL, "run", d.models / "whole.toml", "--daemon-config", d.config, "--input",
                    case / "inputs.safetensors", "--output", reference], check=True)
    expected = load_file(reference)

    with d.start():
        [worker] = children(d.process.pid)  # rank 1, started by the daemon
        status, body = request(d.sock, "POST", "/v1/models/split/forward", save(inputs))
        assert status == 200, body
        got = load(body)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        weights = model(d.sock, "split")["weights"]
        assert weights["plan"].startswith("rank 0 of 2: holds 1/2 of"), weights
        assert model(d.sock, "split")["devices"]["cpu"] >= weights["resident"] > 0  # this rank's half

        # Sleep and wake go to every rank; the outputs stay the same.
        vramctl(d.sock, "offload", "split")
        status, body = request(d.sock, "POST", "/v1/models/split/forward", save(inputs))
        assert status == 200 and all(torch.equal(load(body)[k], expected[k]) for k in expected)

        # Rank 1 dies: the partitioned model's requests fail, saying so; the rest serves on.
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text(),
                 what="rank 1 to die")
        status, body = request(d.sock, "POST", "/v1/models/split/forward", save(inputs))
        assert status == 500, body
        assert f"rank 1 (pid {worker}) has exited" in body.decode(), body
        status, body = request(d.sock, "POST", "/v1/models/whole/forward", save(inputs))
        assert status == 200 and all(torch.equal(load(body)[k], expected[k]) for k in expected)

        # The failed model was unloaded; the daemon starts rank 1 again, and the next request
        # loads the model across both ranks and answers as before.
        assert model(d.sock, "split")["state"] == "unloaded"
        wait_for(lambda: children(d.process.pid) not in ([], [worker]), what="rank 1 to be started again")
        [restarted] = children(d.process.pid)
        status, body = request(d.sock, "POST", "/v1/models/split/forward", save(inputs))
        assert status == 200, body
        assert all(torch.equal(load(body)[k], expected[k]) for k in expected)
        assert children(d.process.pid) == [restarted]
        assert d.healthy()

        # A config whose file name is not UTF-8 cannot be named to the other ranks in JSON: its
        # load fails naming the file, before the ranks are told anything, and the group serves on.
        odd = os.path.join(os.fsencode(d.models), b"odd\xff.toml")
        with open(odd, "w") as f:
            f.write(f'name = "odd"\ncheckpoint = "{checkpoint}"\n[partition]\nworld_size = 2\n')
        wait_for(lambda: request(d.sock, "GET", "/v1/models/odd")[0] == 200, what="the daemon to see odd\\xff.toml")
        status, body = request(d.sock, "POST", "/v1/models/odd/forward", save(inputs))
        assert status == 500, body
        assert "odd\\xff.toml': a partitioned model's config is named to the other ranks in JSON" in json.loads(body)["error"]
        status, body = request(d.sock, "POST", "/v1/models/split/forward", save(inputs), timeout=30)
        assert status == 200 and all(torch.equal(load(body)[k], expected[k]) for k in expected)


def test_a_partitioned_model_takes_an_update_on_every_rank(tmp_path):
    case = hf_models.make("llama3", "float32", tmp_path / "hf")
    state = load_file(case / "model" / "model.safetensors")
    changed = hf_models.perturbed(state)
    hf_models.save_beside(case, changed, tmp_path / "changed")
    d = Daemon(tmp_path / "d", extra="[group]\nworld_size = 2")
    partition = '[partition]\nworld_size = 2\ntimeout = "30s"\n'
    (d.models / "split.toml").write_text(f'checkpoint = "{case / "model"}"\n{partition}')
    (d.models / "fresh.toml").write_text(f'checkpoint = "{tmp_path / "changed"}"\n')
    inputs = load_file(case / "inputs.safetensors")
    with d.start():
        with vramd.connect(d.sock) as client:
            before = client.forward("split", inputs)
            after = client.forward("fresh", inputs)
            # Rank 0 checks the tensors, then hands the same bytes to rank 1; each writes its slices.
            assert client.update("split", changed, via="body")["version"] == 2
            got, version = client.forward("split", inputs, with_version=True)
            assert version == 2 and all(torch.equal(got[k], after[k]) for k in after)
            assert client.update("split", state)["version"] == 3  # a memfd, read by rank 0
            assert all(torch.equal(client.forward("split", inputs)[k], before[k]) for k in before)
            # A path is read on rank 0 and handed to rank 1 as bytes: it need not exist on its host.
            assert client.update("split", tmp_path / "changed")["version"] == 4
            assert all(torch.equal(client.forward("split", inputs)[k], after[k]) for k in after)
            assert client.update("split", state)["version"] == 5
            with pytest.raises(vramd.DaemonError) as caught:
                client.update("split", {"model.layers.0.nope": state["model.norm.weight"]})
            assert caught.value.status == 400
            assert all(torch.equal(client.forward("split", inputs)[k], before[k]) for k in before)
            assert client.status("split")["version"] == 5
        assert d.stop() == 0
