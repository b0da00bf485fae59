"""Updates of weights on a GPU through the real daemon and the Python package: a resident model on
cuda:0 and one streamed through cuda:0 under a limit from host copies each equal a fresh load of
the updated checkpoint after an update from a memfd and from a path; a lease of GPU memory taken
before an update keeps its values, and a following one gets the new version; one that follows in
place keeps its addresses and sees each update's values there; a kept memfd is page-locked once
and takes a trainer's updates, or, where CUDA will not page-lock it, takes them all the same.
Skips without a GPU; scripts/gpu-check runs it where there is one."""
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_support import ROOT, Daemon  # noqa: E402
from test_update import equal  # noqa: E402

sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "parity"))
import hf_models  # noqa: E402
import vramd  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: updates of GPU weights not run")]
ON_CUDA = '[vram]\ncomputation = { device = "cuda:0" }\n'
STREAMED = '[vram]\ncomputation = { device = "cuda:0" }\nonload = { device = "cpu" }\nlimit = "300KiB"\n'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("update_cuda")
    witness = hf_models.make("llama", "float32", out)
    original = witness / "model" / "model.safetensors"
    state = load_file(original)
    changed = hf_models.perturbed(state)
    updated = hf_models.save_beside(witness, changed, out / "updated")
    d = Daemon(out, budgets='cpu = "4GiB"\n"cuda:0" = "4GiB"')
    for name, path, table in [("gpu", original, ON_CUDA), ("gpu-fresh", updated, ON_CUDA),
                              ("streamed", original, STREAMED), ("streamed-fresh", updated, STREAMED)]:
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{path}"\n{table}')
    inputs = load_file(witness / "inputs.safetensors")
    with d.start():
        yield {"daemon": d, "inputs": inputs, "state": state, "changed": changed, "updated": updated,
               "original": original}
        assert d.stop() == 0


@pytest.mark.parametrize("name", ["gpu", "streamed"])
def test_gpu_weights_take_an_update_from_a_memfd_and_from_a_path(served, name):
    with vramd.connect(served["daemon"].sock) as client:
        want = client.forward(f"{name}-fresh", served["inputs"])
        before = client.forward(name, served["inputs"])
        client.update(name, served["changed"])
        assert equal(client.forward(name, served["inputs"]), want)
        client.update(name, served["changed"])  # in place this time, where the weights are the daemon's own
        assert equal(client.forward(name, served["inputs"]), want)
        client.update(name, served["original"])
        assert equal(client.forward(name, served["inputs"]), before)
        client.unload(f"{name}-fresh")


def test_a_trainers_cuda_tensors_go_from_the_device_straight_into_the_update(served):
    """The RL case: new weights on the trainer's GPU are copied once, into the memfd, with no host
    copy beside it; the file is the one their host copies make, and the model takes them."""
    from vramd import _safetensors
    on_gpu = {name: value.to("cuda:0") for name, value in served["changed"].items()}
    assert bytes(_safetensors.dumps(on_gpu)) == bytes(_safetensors.dumps(served["changed"]))
    with vramd.connect(served["daemon"].sock) as client:
        want = client.forward("gpu-fresh", served["inputs"])
        before = client.forward("gpu", served["inputs"])
        client.update("gpu", on_gpu)
        assert equal(client.forward("gpu", served["inputs"]), want)
        client.update("gpu", {name: value.to("cuda:0") for name, value in served["state"].items()}, via="body")
        assert equal(client.forward("gpu", served["inputs"]), before)
        client.unload("gpu-fresh")


@pytest.mark.parametrize("name", ["gpu", "streamed"])
def test_a_kept_memfd_page_locked_once_takes_a_trainers_updates(served, name):
    """The RL loop: a trainer's CUDA tensors written each step into the memfd it keeps, which
    the daemon page-locks for cuda:0 on the first update and copies from directly after."""
    on_gpu = {key: value.to("cuda:0") for key, value in served["changed"].items()}
    back = {key: value.to("cuda:0") for key, value in served["state"].items()}
    with vramd.connect(served["daemon"].sock) as client:
        want = client.forward(f"{name}-fresh", served["inputs"])
        before = client.forward(name, served["inputs"])
        # Page-locked for the GPU that holds weights: a streamed model's resident layers' there.
        locked = ["cuda:0"] if client.status(name)["devices"].get("cuda:0") else []
        assert name == "streamed" or locked
        for step in range(3):
            answer = client.update(name, on_gpu if step % 2 == 0 else back, keep=True)
            assert answer["updated"]["kept"] == {"memfd": "reused" if step else "mapped", "page_locked": locked}
            assert client._kept[name].registered is not None  # the trainer's side page-locked too
            assert equal(client.forward(name, served["inputs"]), want if step % 2 == 0 else before)
        # Twice the weights' bytes (float64 values, cast on the host): mapped, never page-locked.
        answer = client.update(name, {key: value.double() for key, value in on_gpu.items()}, keep=True)
        assert answer["updated"]["kept"] == {"memfd": "mapped", "page_locked": []}
        assert equal(client.forward(name, served["inputs"]), want)
        client.update(name, served["original"])
        assert equal(client.forward(name, served["inputs"]), before)
        client.unload(f"{name}-fresh")


def test_a_kept_memfd_cuda_will_not_page_lock_still_takes_the_update(served, monkeypatch):
    """CUDA keeps a refused call's error as the thread's last one, which torch's next kernel launch
    check would raise as that kernel's: a kept memfd CUDA refuses to page-lock on the trainer's
    side is written as pageable memory, and the trainer's kernels after it run."""
    cudart = torch.cuda.cudart()
    real = cudart.cudaHostRegister
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda address, size, flags: real(0, 0, flags))  # refused
    on_gpu = {key: value.to("cuda:0") for key, value in served["changed"].items()}
    with vramd.connect(served["daemon"].sock) as client:
        want = client.forward("gpu-fresh", served["inputs"])
        before = client.forward("gpu", served["inputs"])
        client.update("gpu", on_gpu, keep=True)
        assert client._kept["gpu"].registered is None
        assert torch.equal(torch.ones(4, device="cuda:0") + 1, torch.full((4,), 2.0, device="cuda:0"))  # a kernel
        assert equal(client.forward("gpu", served["inputs"]), want)
        client.update("gpu", served["original"])
        assert equal(client.forward("gpu", served["inputs"]), before)
        client.unload("gpu-fresh")


def test_a_gpu_lease_keeps_its_values_and_a_following_one_gets_the_update(served):
    with vramd.connect(served["daemon"].sock) as client:
        client.update("gpu", served["state"])
        kept, following = client.lease("gpu", device="cuda:0"), client.lease("gpu", device="cuda:0", follow=True)
        with kept, following:
            before = {name: t.clone() for name, t in kept.state_dict.items()}
            client.update("gpu", served["changed"])
            new = following.wait_update(timeout=60)
            assert all(torch.equal(new[name].cpu(), served["changed"][name]) for name in served["changed"])
            assert all(torch.equal(kept.state_dict[name], before[name]) for name in before)
        client.update("gpu", served["state"])


def test_an_in_place_gpu_lease_keeps_its_addresses_and_sees_each_update(served):
    with vramd.connect(served["daemon"].sock) as client:
        client.update("gpu", served["state"])
        want = client.forward("gpu-fresh", served["inputs"])
        lease = client.lease("gpu", device="cuda:0", in_place=True)
        with lease:
            tensors, version = lease.state_dict, lease.version
            addresses = {name: t.data_ptr() for name, t in tensors.items()}
            assert all(torch.equal(tensors[name].cpu(), served["state"][name]) for name in served["changed"])
            # A lease that keeps its values cannot share memory that updates write into.
            with pytest.raises(vramd.DaemonError, match="is leased in place by lease") as refused:
                client.lease("gpu", device="cuda:0")
            assert refused.value.status == 409
            used = client.status()["devices"]["cuda:0"]["used"]
            client.update("gpu", served["changed"])  # from a memfd
            assert client.status()["devices"]["cuda:0"]["used"] == used  # written where the lease reads: no room beside
            assert lease.wait_update(timeout=60) is tensors
            assert lease.version == version + 1
            assert {name: t.data_ptr() for name, t in tensors.items()} == addresses
            assert all(torch.equal(tensors[name].cpu(), served["changed"][name]) for name in served["changed"])
            assert equal(client.forward("gpu", served["inputs"]), want)
            client.update("gpu", served["original"])  # a path: read into host memory and checked, then written
            lease.wait_update(timeout=60)
            assert lease.version == version + 2
            assert all(torch.equal(tensors[name].cpu(), served["state"][name]) for name in served["state"])
        with client.lease("gpu", device="cuda:0"), pytest.raises(vramd.DaemonError, match="keeps its values") as refused:
            client.lease("gpu", device="cuda:0", in_place=True)
        assert refused.value.status == 409
        client.unload("gpu-fresh")
