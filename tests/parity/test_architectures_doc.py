"""docs/architectures.md's walkthrough, done as it says: the StarCoder2 family file taken from
the page, saved where the page saves it, and a random Starcoder2ForCausalLM saved by
transformers run through vramctl and the daemon, against transformers' own logits."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "daemon"))
sys.path.insert(0, str(ROOT / "tests" / "parity"))
from daemon_support import Daemon, request  # noqa: E402
from hf_models import close  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]


def walkthrough():
    """(the path the page saves the file at, the file's text)."""
    page = (ROOT / "docs" / "architectures.md").read_text()
    found = re.search(r"<!-- walkthrough: (\S+) -->\n```toml\n(.*?)```", page, re.S)
    assert found, "docs/architectures.md lost its walkthrough block"
    return found.group(1), found.group(2)


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("starcoder2")
    torch.manual_seed(0)
    config = transformers.Starcoder2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                                           max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    model = transformers.Starcoder2ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.save_pretrained(folder / "model")
    model = transformers.Starcoder2ForCausalLM.from_pretrained(folder / "model").eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, folder / "in.safetensors")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    return folder, expected


def test_the_walkthrough_family_runs_starcoder2_as_transformers_does(starcoder2, tmp_path):
    folder, expected = starcoder2
    where, text = walkthrough()
    (tmp_path / where).parent.mkdir(parents=True)
    (tmp_path / where).write_text(text)
    (tmp_path / "vramd.toml").write_text(f'architectures = ["{Path(where).parent}"]\n')
    (tmp_path / "starcoder2.toml").write_text(f'checkpoint = "{folder / "model"}"\n')
    common = ["--daemon-config", tmp_path / "vramd.toml"]
    result = subprocess.run([VRAMCTL, "check", tmp_path / "starcoder2.toml", *common], capture_output=True, text=True)
    assert result.returncode == 0 and "(starcoder2, float32)" in result.stdout, result.stdout + result.stderr
    result = subprocess.run([VRAMCTL, "run", tmp_path / "starcoder2.toml", *common, "--input", folder / "in.safetensors",
                             "--output", tmp_path / "out.safetensors"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert close(load_file(tmp_path / "out.safetensors")["logits"], expected)

    # Without the folder the family is unknown; named by path, it needs none.
    result = subprocess.run([VRAMCTL, "run", tmp_path / "starcoder2.toml"], capture_output=True, text=True)
    assert result.returncode == 1 and "no family computes model_type 'starcoder2'" in result.stderr, result.stderr
    (tmp_path / "by_path.toml").write_text(f'checkpoint = "{folder / "model"}"\narchitecture = "{where}"\n')
    result = subprocess.run([VRAMCTL, "run", tmp_path / "by_path.toml", "--input", folder / "in.safetensors",
                             "--output", tmp_path / "out2.safetensors"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert close(load_file(tmp_path / "out2.safetensors")["logits"], expected)


def test_the_daemon_runs_a_family_from_its_architectures_folder(starcoder2, tmp_path):
    folder, expected = starcoder2
    where, text = walkthrough()
    daemon = Daemon(tmp_path, extra=f'architectures = ["{Path(where).parent}"]')
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(text)
    (daemon.models / "starcoder2.toml").write_text(f'checkpoint = "{folder / "model"}"\n')
    daemon.start()
    try:
        status, body = request(daemon.sock, "POST", "/v1/models/starcoder2/forward", (folder / "in.safetensors").read_bytes())
        assert status == 200, body
        assert close(load(body)["logits"], expected)
    finally:
        assert daemon.stop() == 0


def test_a_broken_family_file_is_named_and_harms_no_other_model(starcoder2, tmp_path):
    folder, _ = starcoder2
    families = tmp_path / "families"
    families.mkdir()
    (families / "starcoder2.toml").write_text('extends = "llama"\nmodel_types = ["starcoder2"]\n[switches]\nnorm = "rmsnorm"\n')
    (tmp_path / "vramd.toml").write_text('architectures = ["families"]\n')
    (tmp_path / "starcoder2.toml").write_text(f'checkpoint = "{folder / "model"}"\n')
    result = subprocess.run([VRAMCTL, "check", tmp_path / "starcoder2.toml", "--daemon-config", tmp_path / "vramd.toml"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{families / 'starcoder2.toml'}:4:8: switches.norm = 'rmsnorm': the value: expected one of 'rms', 'layer'" \
        in result.stdout + result.stderr
    # A LLaMA checkpoint beside it still finds the shipped family.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    (tmp_path / "llama.toml").write_text(f'checkpoint = "{tmp_path / "llama"}"\n')
    result = subprocess.run([VRAMCTL, "check", tmp_path / "llama.toml", "--daemon-config", tmp_path / "vramd.toml"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "(llama, float32)" in result.stdout, result.stdout + result.stderr
