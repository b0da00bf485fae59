"""LoRA adapters computed on a GPU, against the adapters' own tools on the CPU: a LLaMA on cuda:0,
resident and streamed through it under a limit, fused and unfused, equals peft's
merge_and_unload() after each switch from the Python package, and [] gives the base's outputs
bit for bit. A UNet managed on cuda:0 that follows a model whose clients apply its adapters
equals diffusers' fuse_lora after each switch, and a module holding every weight on the GPU
brings again only the units the adapters change. Skips without a GPU; scripts/gpu-check runs it
where there is one."""
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "daemon"))
sys.path.insert(0, str(HERE.parent.parent / "python"))
import hf_models  # noqa: E402
from daemon_support import Daemon  # noqa: E402
from test_lora import lora, managed_unet, merged_outputs, unet  # noqa: E402,F401 (fixtures)
import vramd  # noqa: E402

DEVICE = "cuda:0"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: LoRA adapters on a GPU not run")]
ON_DEVICE = f'[vram]\ncomputation = {{ device = "{DEVICE}" }}\n'
STREAMED = f'[vram]\ncomputation = {{ device = "{DEVICE}" }}\nonload = {{ device = "cpu" }}\nlimit = "700KiB"\n'
BUDGETS = f'cpu = "8GiB"\n"{DEVICE}" = "8GiB"'


@pytest.fixture
def exact_convolutions():
    """cuDNN's convolutions in float32, not TF32 (torch's default), so that a UNet on the GPU
    can be held to diffusers' output on the CPU within float32's bound."""
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = allowed


@pytest.mark.parametrize("vram", [ON_DEVICE, STREAMED], ids=["resident", "streamed"])
def test_a_llama_on_the_gpu_switches_adapters_fused_and_unfused_equal_to_peft(lora, tmp_path, vram):
    folders, base_folder = lora["folders"], lora["witness"] / "model"
    stacked = [(folders["attention"], 0.5), (folders["mlp"], -1.5)]
    other = [(folders["rslora"], 1.0)]
    d = Daemon(tmp_path / "daemon", budgets=BUDGETS)
    tables = "".join(f'[[lora]]\npath = "{p}"\nscale = {s}\n' for p, s in stacked)
    checkpoint = f'checkpoint = "{base_folder}"\n'
    (d.models / "base.toml").write_text(checkpoint + vram)
    (d.models / "fused.toml").write_text(checkpoint + vram + tables)
    (d.models / "unfused.toml").write_text("fuse_lora = false\n" + checkpoint + vram + tables)
    want = {"stacked": merged_outputs(base_folder, lora["inputs"], stacked),
            "other": merged_outputs(base_folder, lora["inputs"], other)}
    with d.start(), vramd.connect(d.sock) as client:
        base = client.forward("base", lora["inputs"])
        client.unload("base")
        for name in ("fused", "unfused"):
            for which, adapters in (("stacked", None), ("other", other), ("stacked", stacked)):
                if adapters is not None:
                    answer = client.set_loras(name, adapters)
                    assert [a["path"] for a in answer["loras"]] == [str(p) for p, _ in adapters], answer
                got = client.forward(name, lora["inputs"])
                for output, value in want[which].items():
                    assert hf_models.close(got[output], value), (name, which, output,
                                                                 hf_models.relative_error(got[output], value))
            client.set_loras(name, [])
            cleared = client.forward(name, lora["inputs"])
            assert all(torch.equal(cleared[k], base[k]) for k in base), name  # the base's, bit for bit
            status = client.status(name)
            assert DEVICE in status["devices"], status
            client.unload(name)


def test_a_unet_managed_on_the_gpu_follows_the_switches_of_a_model_whose_clients_apply_its_adapters(
        unet, tmp_path, exact_convolutions):
    files, expected = unet["files"], unet["expected"]
    d = Daemon(tmp_path / "daemon", budgets=BUDGETS)
    (d.models / "first.toml").write_text('fuse_lora = false\n' + unet["served"] +
                                         f'[[lora]]\npath = "{files[0]}"\nscale = 0.5\n')
    (d.models / "plain.toml").write_text(unet["served"])
    x = tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in unet["input"])

    def close(got, want):
        return hf_models.relative_error(got.cpu(), want) <= 1e-5

    with d.start(), vramd.connect(d.sock) as client, torch.no_grad():
        plain = managed_unet()
        with vramd.manage(plain, "plain", client=client, device=DEVICE):
            base = plain(*x).sample
        assert close(base, unet["base"])
        # Under the model's limit, streamed through the GPU.
        module = managed_unet()
        with vramd.manage(module, "first", client=client, follow=True, device=DEVICE) as managed:
            assert close(module(*x).sample, expected[0])
            assert managed.stats()["peak"] <= unet["limit"]
            client.set_loras("first", [(files[1], 0.5)])
            assert managed.wait_update(timeout=60) == 2
            assert close(module(*x).sample, expected[1])
            # Every weight held on the GPU (no limit): a switch brings again only the units the
            # old set or the new one changes, their page-locked lease kept.
            whole = managed_unet()
            with vramd.manage(whole, "first", client=client, follow=True, device=DEVICE, limit="1GiB") as copies:
                assert close(whole(*x).sample, expected[1])
                everything = copies.stats()["bytes_moved"]
                client.set_loras("first", [(files[0], 0.5)])
                assert copies.wait_update(timeout=60) == managed.wait_update(timeout=60) == 3
                assert close(whole(*x).sample, expected[0])
                moved = copies.stats()["bytes_moved"] - everything
                assert 0 < moved < everything // 2, (moved, everything)
                # Its own adapters on top of the served ones, switched between forwards.
                copies.set_loras([(files[1], 0.0)])
                assert close(whole(*x).sample, expected[0])
            client.set_loras("first", [])
            assert managed.wait_update(timeout=60) == 4
            assert torch.equal(module(*x).sample, base)  # the leased weights as they are, bit for bit
