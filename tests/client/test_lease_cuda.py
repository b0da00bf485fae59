"""Leases of GPU memory through the real daemon, the Python package and vramctl: allocations of
CUDA's virtual memory API handed over as file descriptors and mapped by each client. Every leased
tensor against safetensors (and the converter's bfloat16), the daemon's forward unchanged by the
repacking and by a client's write, a killed client, several clients sharing one copy, and bad
requests. Skips without a GPU; scripts/gpu-check runs it where there is one."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_support import ROOT, Daemon, model, request, vramctl, wait_for  # noqa: E402
import test_lease  # noqa: E402
from test_lease import nanogpt_checkpoint, nanogpt_config  # noqa: E402

sys.path.insert(0, str(ROOT / "python"))
import vramd  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU here: leases of GPU memory (cuMemCreate, descriptors) not run")]
ON_CUDA = '[vram]\ncomputation = { device = "cuda:0" }\n'
BERT_INPUT = {"input_ids": torch.tensor([[101, 7570, 2024, 2017, 102]])}


def tiny_bert(folder):
    """A small random BERT as save_pretrained writes it: no demo package needed on a GPU machine."""
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=8000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)
    transformers.BertModel(config).eval().save_pretrained(folder)
    return folder / "model.safetensors"


def odd_tensors():
    """A one-byte float8 first, so that every tensor after it lies off every alignment, then float32
    tensors of many sizes: 150 MiB in all, more chunks than the staging buffers (16 of 8 MiB).
    The model rests in float32, the checkpoint's dtype by size, so all but the first are read
    onto the GPU as they lie (architecture "weights" takes floating-point tensors only)."""
    torch.manual_seed(1)
    return {"a.byte": torch.tensor([0.5], dtype=torch.float8_e4m3fn), "b.small": torch.randn(3, 5),
            "c.large": torch.randn(25 << 20), "d.range": torch.arange(99999, dtype=torch.float32),
            "e.odd": torch.randn(12289), "f.larger": torch.randn((12 << 20) + 3)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lease_cuda")
    bert = tiny_bert(folder / "bert")
    nano_state = nanogpt_checkpoint(folder)
    d = Daemon(folder, budgets='cpu = "4GiB"\n"cuda:0" = "4GiB"')
    (d.models / "bert.toml").write_text(f'checkpoint = "{bert}"\n{ON_CUDA}')
    (d.models / "nano.toml").write_text(nanogpt_config(folder, 'device = "cuda:0", dtype = "bfloat16"'))
    save_file({"w": torch.randn(256 << 20, dtype=torch.float16)}, folder / "big.safetensors")  # 512 MiB
    (d.models / "big.toml").write_text(f'checkpoint = "{folder / "big.safetensors"}"\narchitecture = "weights"\n{ON_CUDA}')
    (d.models / "on_cpu.toml").write_text(f'checkpoint = "{bert}"\n')
    save_file(odd_tensors(), folder / "odd.safetensors")
    for direct in ("true", "false"):
        (d.models / f"odd_direct_{direct}.toml").write_text(
            f'checkpoint = "{folder / "odd.safetensors"}"\narchitecture = "weights"\n{ON_CUDA}direct_io = {direct}\n')
    with d.start():
        yield {"daemon": d, "sock": str(d.sock), "bert": bert, "nano": nano_state}


def run_client(served, name, body, **kwargs):
    """test_lease's client process, leasing `name` on cuda:0 with `free_before` measured first."""
    return test_lease.run_client(served, name, body, device="cuda:0", prelude="""\
        torch.cuda.init(); torch.zeros(1, device="cuda:0")  # the context exists before measuring
        free_before = torch.cuda.mem_get_info(0)[0]
        """, **kwargs)


def test_leased_gpu_tensors_are_the_checkpoint_bit_for_bit(served):
    sock = served["sock"]
    with vramd.connect(sock) as c:
        before = c.forward("bert", BERT_INPUT)
        expected = load_file(served["bert"])
        with c.lease("bert", device="cuda:0") as state_dict:
            assert set(state_dict) <= set(expected) and len(state_dict) >= len(expected) - 2, set(expected) - set(state_dict)
            for name, tensor in state_dict.items():
                assert tensor.device == torch.device("cuda:0"), name
                assert torch.equal(tensor.cpu(), expected[name]), name
            leases = model(sock, "bert")["leases"]
            assert [(x["pid"], x["device"]) for x in leases] == [(os.getpid(), "cuda:0")]
        # The daemon computes from the exported allocation now, with the same result.
        after = c.forward("bert", BERT_INPUT)
    assert all(torch.equal(before[k], after[k]) for k in before)
    wait_for(lambda: model(sock, "bert")["leases"] == [], timeout=2, what="the lease to end")


def test_converted_gpu_lease_is_what_transformers_holds_in_bfloat16(served):
    with vramd.connect(served["sock"]) as c:
        lease = c.lease("nano", device="cuda:0")
        with lease as state_dict:
            assert [r["kind"] for r in lease.manifest["regions"]] == ["cuda"] and lease.manifest["device"] == "cuda:0"
            for name, tensor in served["nano"].items():
                assert state_dict[name].dtype == torch.bfloat16 and state_dict[name].is_cuda, name
                assert torch.equal(state_dict[name].cpu(), tensor.to(torch.bfloat16)), name
            assert state_dict["lm_head.weight"].data_ptr() == state_dict["transformer.wte.weight"].data_ptr()
            assert lease.read_only, "the driver mapped the leased GPU memory writable"


@pytest.mark.parametrize("direct", ["true", "false"])
def test_weights_read_onto_the_gpu_through_staging_are_the_checkpoint(served, direct):
    expected = odd_tensors()
    with vramd.connect(served["sock"]) as c:
        c.load(f"odd_direct_{direct}")
        with c.lease(f"odd_direct_{direct}", device="cuda:0") as state_dict:
            assert set(state_dict) == set(expected)
            for name, tensor in state_dict.items():
                assert tensor.device == torch.device("cuda:0") and tensor.dtype == torch.float32, name
                assert torch.equal(tensor.cpu(), expected[name].float()), name
        c.unload(f"odd_direct_{direct}")


def test_a_client_cannot_write_gpu_weights_and_the_forward_is_unchanged(served):
    with vramd.connect(served["sock"]) as c:
        before = c.forward("bert", BERT_INPUT)
    client = run_client(served, "bert", """
        print("leased", lease.read_only, flush=True)
        sd["embeddings.word_embeddings.weight"].add_(1)
        torch.cuda.synchronize()
        print("wrote", flush=True)
        """)
    out, err = client.communicate(timeout=120)
    assert "leased True" in out and "wrote" not in out and client.returncode != 0, (out, err)
    with vramd.connect(served["sock"]) as c:
        after = c.forward("bert", BERT_INPUT)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert served["daemon"].healthy()


def test_a_killed_gpu_client_ends_its_lease_and_unload_then_goes_on(served):
    sock = served["sock"]
    client = run_client(served, "nano", """
        print("leased", flush=True)
        time.sleep(120)
        """)
    assert client.stdout.readline().strip() == "leased", client.stderr.read()
    status, body = request(sock, "POST", "/v1/models/nano/unload?wait=false")
    assert status == 409 and f"leased by pid {client.pid}" in json.loads(body)["error"]
    client.kill()
    killed = time.monotonic()
    client.wait()
    wait_for(lambda: model(sock, "nano")["leases"] == [], timeout=5, what="the killed client's lease to end")
    assert time.monotonic() - killed < 5  # at once: the death closes its connection (a wide margin on a busy machine)
    status, body = request(sock, "POST", "/v1/models/nano/unload?wait=false")
    assert status == 200, body
    assert model(sock, "nano")["state"] == "unloaded"


def test_three_gpu_clients_share_one_copy(served):
    """Each client's import costs it no GPU memory of its own: the allocation is the daemon's."""
    with vramd.connect(served["sock"]) as c, c.lease("big", device="cuda:0"):
        pass  # loaded and moved into an exported allocation before any client measures the device
    clients = []
    try:
        for _ in range(3):  # one at a time, so that no other context starts while one measures
            client = run_client(served, "big", """
                total = sum(float(t.sum()) for t in sd.values())  # every byte read
                torch.cuda.empty_cache()
                print("grew", free_before - torch.cuda.mem_get_info(0)[0], flush=True)
                sys.stdin.readline()
                """, stdin=subprocess.PIPE)
            line = client.stdout.readline().split()
            assert line and line[0] == "grew", client.stderr.read()
            clients.append((client, int(line[1])))
        assert len(model(served["sock"], "big")["leases"]) == 3
        size = model(served["sock"], "big")["devices"]["cuda:0"]
        assert size >= 512 << 20
        for _, grew in clients:  # a few MiB of the sums above, not the model
            assert grew <= 0.1 * size + (64 << 20), (grew, size)
    finally:
        for client, _ in clients:
            client.stdin.close()
            client.wait(60)


def test_bad_gpu_leases_get_clear_errors_and_harm_nothing(served):
    sock = served["sock"]
    with vramd.connect(sock) as c:
        def refused(name, device):
            with pytest.raises(vramd.DaemonError) as raised:
                with c.lease(name, device=device):
                    pass
            return raised.value

        on_cpu = refused("on_cpu", "cuda:0")
        assert on_cpu.status == 409 and "computation.device" in str(on_cpu)
        elsewhere = refused("bert", "cuda:7")
        assert elsewhere.status == 409 and "lease it on cuda:0" in str(elsewhere)
        assert refused("bert", "cpu").status == 409
        assert refused("bert", "cuda:x").status == 400
    with vramd.connect(sock) as c, c.lease("bert", device="cuda:0") as state_dict:
        assert state_dict
    assert served["daemon"].healthy()


def test_examples_and_vramctl_lease_gpu_memory(served):
    sock = served["sock"]
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "lease_transformers.py"), "bert",
                             str(served["bert"].parent), "--device", "cuda:0"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VRAMD_SOCKET": sock, "PYTHONPATH": str(ROOT / "python")})
    assert result.returncode == 0 and "equals from_pretrained's" in result.stdout, result.stdout + result.stderr
    held = vramctl(sock, "lease", "bert", "--device", "cuda:0")
    assert "on cuda:0" in held.stdout and "mapped 1 regions on cuda:0 read-only" in held.stderr, held
    holder = subprocess.Popen([os.environ["VRAMCTL"], "lease", "nano", "--device", "cuda:0", "--hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "VRAMD_SOCKET": sock})
    assert "lease" in holder.stdout.readline()
    wait_for(lambda: [x["pid"] for x in model(sock, "nano")["leases"]] == [holder.pid], what="vramctl's lease")
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    wait_for(lambda: model(sock, "nano")["leases"] == [], timeout=5, what="vramctl's lease to end")
