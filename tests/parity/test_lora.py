"""LoRA adapters ([[lora]] in a model config) against peft, their own tool, on the same base: a
LLaMA with a PEFT adapter equals peft's merge_and_unload(); so do a stacked pair at different
scales (one on the embedding too) and an rsLoRA adapter with rank_pattern and alpha_pattern, also
streamed under a limit. Bad adapters are refused naming the file and key, by `vramctl check` and
by the daemon, which keeps serving its other models; removing the adapters gives the base's
outputs bit for bit."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "daemon"))
import hf_models  # noqa: E402
from daemon_support import Daemon, get_json, model, request  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
# name -> (peft.LoraConfig's arguments, seed)
ADAPTERS = {
    "attention": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 1),
    "mlp": (dict(r=2, lora_alpha=3, target_modules=["gate_proj", "down_proj", "embed_tokens"]), 2),
    "rslora": (dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"],
                    rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"k_proj": 16}), 3),
}


def merged_model(base_folder, adapters):
    """peft's own merge: each (adapter folder, scale) loaded onto the base in turn, its scale set
    on every LoRA layer (peft's set_scale), then merge_and_unload()."""
    import peft
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    for folder, scale in adapters:
        model = peft.PeftModel.from_pretrained(model, folder)
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.set_scale("default", scale)
        model = model.merge_and_unload().eval()
    return model


def merged_outputs(base_folder, inputs, adapters):
    return hf_models.outputs(merged_model(base_folder, adapters), inputs)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    import peft
    import transformers
    out = tmp_path_factory.mktemp("lora")
    witness = hf_models.make("llama", "float32", out)
    folders = {}
    for name, (options, seed) in ADAPTERS.items():
        model = transformers.LlamaForCausalLM.from_pretrained(witness / "model", dtype=torch.float32)
        torch.manual_seed(seed)
        peft_model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **options))
        with torch.no_grad():  # peft's random B is small; larger factors make a wrong merge visible
            for parameter_name, parameter in peft_model.named_parameters():
                if "lora_" in parameter_name:
                    parameter.normal_(0, 0.3)
        folders[name] = out / name
        peft_model.save_pretrained(folders[name], save_embedding_layers=False)  # the factors alone
    inputs = load_file(witness / "inputs.safetensors")
    (out / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    return {"out": out, "witness": witness, "folders": folders, "inputs": inputs}


def config(lora, name, loras, extra=""):
    path = lora["out"] / f"{name}.toml"
    tables = "".join(f'[[lora]]\npath = "{p}"\nscale = {s}\n' for p, s in loras)
    path.write_text(f'name = "m"\ncheckpoint = "{lora["witness"] / "model"}"\n{extra}\n{tables}')
    return path


def vramctl(*args, timeout=300):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def run(lora, path):
    output = path.with_suffix(".out.safetensors")
    result = vramctl("run", path, "--daemon-config", lora["out"] / "vramd.toml", "--input",
                     lora["witness"] / "inputs.safetensors", "--output", output, "--threads", "1")
    assert result.returncode == 0, result.stderr
    return load_file(output)


def served_forward(d, name, inputs):
    """The outputs of a forward of model `name` on the running daemon `d`; `inputs`: a
    safetensors body."""
    status, out = request(d.sock, "POST", f"/v1/models/{name}/forward", inputs)
    assert status == 200, out
    return load(out)


def assert_close(got, expected):
    for name, value in expected.items():
        assert hf_models.close(got[name], value), (name, hf_models.relative_error(got[name], value))


STREAMED = '[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\nlimit = "700KiB"\n'
SETS = {
    "one": [("attention", 1.0)],
    "stacked": [("attention", 0.5), ("mlp", -1.5)],
    "rslora": [("rslora", 1.0)],
}


@pytest.mark.parametrize("vram", ["", STREAMED], ids=["resident", "streamed"])
@pytest.mark.parametrize("which", SETS)
def test_adapters_equal_peft_merge_and_unload(lora, which, vram):
    chosen = [(lora["folders"][name], scale) for name, scale in SETS[which]]
    expected = merged_outputs(lora["witness"] / "model", lora["inputs"], chosen)
    got = run(lora, config(lora, f"{which}-{bool(vram)}", chosen, vram))
    assert_close(got, expected)
    base = load_file(lora["witness"] / "expected.safetensors")
    assert not torch.allclose(got["logits"], base["logits"], rtol=1e-3), "the adapters changed nothing"


def test_a_safetensors_file_with_peft_keys_and_alphas_applies_as_its_folder(lora, tmp_path):
    # The folder's adapter as one file, alpha per module as diffusers' files carry it.
    folder = lora["folders"]["attention"]
    tensors = load_file(folder / "adapter_model.safetensors")
    options = ADAPTERS["attention"][0]
    alphas = {name.replace(".lora_A.weight", ".alpha"): torch.tensor(float(options["lora_alpha"]))
              for name in tensors if name.endswith(".lora_A.weight")}
    save_file({**tensors, **alphas}, tmp_path / "adapter.safetensors")
    expected = merged_outputs(lora["witness"] / "model", lora["inputs"], [(folder, 0.7)])
    assert_close(run(lora, config(lora, "file", [(tmp_path / "adapter.safetensors", 0.7)])), expected)


def broken_adapters(lora, root):
    """name -> (adapter path, what the refusal names)."""
    good = lora["folders"]["attention"]
    tensors = load_file(good / "adapter_model.safetensors")
    q_a = next(name for name in tensors if name.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
    q_b = q_a.replace("lora_A", "lora_B")
    out = {}

    def folder(name, tensors=None, config=None, raw=None):
        path = root / name
        shutil.copytree(good, path)
        if tensors is not None:
            save_file(tensors, path / "adapter_model.safetensors")
        if config is not None:
            settings = json.loads((good / "adapter_config.json").read_text())
            settings.update(config)
            (path / "adapter_config.json").write_text(json.dumps(settings))
        if raw is not None:
            (path / "adapter_model.safetensors").write_bytes(raw)
        return path

    unknown = {(k.replace("q_proj", "qq_proj") if "layers.0.self_attn.q_proj" in k else k): v for k, v in tensors.items()}
    out["unknown module"] = (folder("unknown", unknown), "qq_proj")
    out["rank mismatch"] = (folder("rank", config={"r": 8}), "rank mismatch")
    wrong = dict(tensors)
    wrong[q_b] = torch.zeros(tensors[q_b].shape[0], 3)
    out["factors of two ranks"] = (folder("ranks", wrong), "rank mismatch")
    out["missing file"] = (root / "nowhere", "no such file")
    raw = (good / "adapter_model.safetensors").read_bytes()
    out["truncated file"] = (folder("truncated", raw=raw[: len(raw) - 100]), "adapter_model.safetensors")
    dora = dict(tensors)
    dora[q_a.replace("lora_A.weight", "lora_magnitude_vector")] = torch.ones(64)
    out["DoRA"] = (folder("dora", dora), "DoRA")
    loha = {q_a.replace("lora_A.weight", "hada_w1_a"): torch.ones(4, 4)}
    out["LoHa"] = (folder("loha", loha), "LoHa")
    out["not LoRA"] = (folder("prefix", config={"peft_type": "PREFIX_TUNING"}), "PREFIX_TUNING")
    out["target_modules no regex"] = (folder("targets", config={"target_modules": "q_proj("}),
                                      "target_modules 'q_proj(' is no regular expression")
    return out


def test_bad_adapters_are_refused_naming_them_and_the_daemon_serves_on(lora, tmp_path):
    broken = broken_adapters(lora, tmp_path)
    for what, (path, named) in broken.items():
        result = vramctl("check", config(lora, "bad", [(path, 1.0)]), "--daemon-config", lora["out"] / "vramd.toml")
        assert result.returncode != 0, what
        assert named in result.stderr + result.stdout, (what, result.stderr + result.stdout)
        assert "[[lora]] 1" in result.stderr + result.stdout, (what, result.stderr)
    # A NaN in an adapter is data, not a fault.
    nan = tmp_path / "nan"
    shutil.copytree(lora["folders"]["attention"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    result = vramctl("check", config(lora, "nan", [(nan, 1.0)]), "--daemon-config", lora["out"] / "vramd.toml")
    assert result.returncode == 0, result.stderr

    d = Daemon(tmp_path / "daemon")
    (d.models / "base.toml").write_text(f'checkpoint = "{lora["witness"] / "model"}"\n')
    bad_path, _ = broken["unknown module"]
    (d.models / "bad.toml").write_text(f'checkpoint = "{lora["witness"] / "model"}"\n[[lora]]\npath = "{bad_path}"\n')
    inputs = save(lora["inputs"])
    with d.start():
        status, body = request(d.sock, "POST", "/v1/models/bad/load")
        assert status >= 400, body
        assert "qq_proj" in model(d.sock, "bad").get("reason", ""), model(d.sock, "bad")
        status, body = request(d.sock, "POST", "/v1/models/base/forward", inputs)
        assert status == 200, body
        assert torch.equal(load(body)["logits"], run(lora, config(lora, "plain", []))["logits"])


def test_the_daemon_serves_adapters_and_an_edit_without_them_gives_the_base_bit_for_bit(lora, tmp_path):
    d = Daemon(tmp_path)
    path = lora["folders"]["attention"]
    text = f'checkpoint = "{lora["witness"] / "model"}"\n'
    (d.models / "m.toml").write_text(text + f'[[lora]]\npath = "{path}"\nscale = 0.5\n')
    inputs = save(lora["inputs"])
    expected = merged_outputs(lora["witness"] / "model", lora["inputs"], [(path, 0.5)])
    base = run(lora, config(lora, "plain", []))
    with d.start():
        status, body = request(d.sock, "POST", "/v1/models/m/forward", inputs)
        assert status == 200, body
        assert_close(load(body), expected)
        served = model(d.sock, "m")
        assert [(a["path"], a["scale"], a["format"]) for a in served["loras"]] == [(str(path), 0.5, "peft")], served
        assert served["loras"][0]["modules"] == 4  # q and v of two layers
        assert served["charge"]["cpu"]["parts"]["adapters"] == served["loras"][0]["bytes"] > 0, served["charge"]
        # An update of a weight the adapters change would drop its update: refused, naming it.
        q = next(n for n in load_file(lora["witness"] / "model" / "model.safetensors") if "layers.0.self_attn.q_proj" in n)
        status, body = request(d.sock, "POST", "/v1/models/m/weights", save({q: torch.zeros(64, 64)}))
        assert status == 400 and b"[[lora]] adapters change" in body and q.encode() in body, body
        (d.models / "m.toml").write_text(text)
        # POST /v1/reload reads the folder before it answers: the edit's replacement is queued
        # then, and the forward after it runs on the config without adapters.
        assert request(d.sock, "POST", "/v1/reload")[0] == 200
        status, body = request(d.sock, "POST", "/v1/models/m/forward", inputs)
        assert status == 200, body
        assert torch.equal(load(body)["logits"], base["logits"])
        assert model(d.sock, "m")["loras"] == []


def test_kohya_conv_and_linear_adapters_reach_a_lease_and_another_components_keys_are_skipped(tmp_path):
    import vramd
    g = torch.Generator().manual_seed(5)
    base = {"down_blocks.0.conv.weight": torch.randn(8, 4, 3, 3, generator=g),
            "down_blocks.0.proj.weight": torch.randn(8, 4, generator=g), "norm.weight": torch.randn(8, generator=g)}
    save_file(base, tmp_path / "unet.safetensors")
    conv, proj = "lora_unet_down_blocks_0_conv", "lora_unet_down_blocks_0_proj"
    adapter = {f"{conv}.lora_down.weight": torch.randn(2, 4, 3, 3, generator=g),
               f"{conv}.lora_up.weight": torch.randn(8, 2, 1, 1, generator=g), f"{conv}.alpha": torch.tensor(1.0),
               f"{proj}.lora_down.weight": torch.randn(3, 4, generator=g),  # no alpha: alpha is the rank
               f"{proj}.lora_up.weight": torch.randn(8, 3, generator=g),
               # the text encoder's part of the file: not this model's
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.randn(2, 4, generator=g),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.randn(4, 2, generator=g)}
    save_file(adapter, tmp_path / "kohya.safetensors")

    def update(name, factor):
        up, down = adapter[f"{name}.lora_up.weight"], adapter[f"{name}.lora_down.weight"]
        return (up.flatten(1) @ down.flatten(1)) * factor

    expected = {"down_blocks.0.conv.weight": base["down_blocks.0.conv.weight"] + update(conv, 0.5 * 1.0 / 2).reshape(8, 4, 3, 3),
                "down_blocks.0.proj.weight": base["down_blocks.0.proj.weight"] + update(proj, 0.5 * 3 / 3),
                "norm.weight": base["norm.weight"]}
    d = Daemon(tmp_path / "daemon")
    (d.models / "unet.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "unet.safetensors"}"\n'
                                        f'[[lora]]\npath = "{tmp_path / "kohya.safetensors"}"\nscale = 0.5\n')
    with d.start(), vramd.connect(d.sock) as c, c.lease("unet") as state_dict:
        for name, value in expected.items():
            torch.testing.assert_close(state_dict[name], value, rtol=1e-6, atol=1e-6)
        assert torch.equal(state_dict["norm.weight"], base["norm.weight"])
        served = model(d.sock, "unet")
        assert served["loras"][0]["format"] == "kohya" and served["loras"][0]["modules"] == 2, served
        assert any("1 module of components this model lacks skipped" in w for w in served["warnings"]), served

    flat = dict(adapter)
    flat[f"{conv}.lora_down.weight"] = torch.randn(2, 36, generator=g)
    save_file(flat, tmp_path / "flat.safetensors")
    (tmp_path / "flat.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "unet.safetensors"}"\n'
                                        f'[[lora]]\npath = "{tmp_path / "flat.safetensors"}"\n')
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "1GiB"\n')
    result = vramctl("check", tmp_path / "flat.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode != 0 and "2-D adapter on a convolution" in result.stdout + result.stderr, result
    result = vramctl("check", d.models / "unet.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 0 and (f"lora: {tmp_path / 'kohya.safetensors'} at scale 0.5 (kohya, 2 weights): added to "
                                       "the weights as they are read") in result.stdout, result
    # Unfused, a "weights" model's adapters are its clients' to apply: checked all the same.
    (tmp_path / "unfused.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "unet.safetensors"}"\n'
                                           f'fuse_lora = false\n[[lora]]\npath = "{tmp_path / "kohya.safetensors"}"\n')
    result = vramctl("check", tmp_path / "unfused.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 0 and (f"lora: {tmp_path / 'kohya.safetensors'} at scale 1 (kohya, 2 weights): applied by "
                                       "the clients that manage it") in result.stdout, result
    (tmp_path / "unfused.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "unet.safetensors"}"\n'
                                           f'fuse_lora = false\n[[lora]]\npath = "{tmp_path / "flat.safetensors"}"\n')
    result = vramctl("check", tmp_path / "unfused.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode != 0 and "2-D adapter on a convolution" in result.stdout + result.stderr, result


def test_a_loaded_model_switches_adapters_without_a_reload_from_each_client(lora, tmp_path):
    import vramd
    d = Daemon(tmp_path)
    (d.models / "m.toml").write_text(f'checkpoint = "{lora["witness"] / "model"}"\n')
    inputs = save(lora["inputs"])
    attention, mlp = lora["folders"]["attention"], lora["folders"]["mlp"]
    base = run(lora, config(lora, "plain", []))
    expected = merged_outputs(lora["witness"] / "model", lora["inputs"], [(attention, 0.5), (mlp, -1.5)])
    expected_rs = merged_outputs(lora["witness"] / "model", lora["inputs"], [(lora["folders"]["rslora"], 1.0)])

    def forward():
        return served_forward(d, "m", inputs)

    with d.start(), vramd.connect(d.sock) as c:
        assert torch.equal(forward()["logits"], base["logits"])
        loads = model(d.sock, "m")["stats"]["loads"]
        # The socket: a stacked pair.
        body = json.dumps({"loras": [{"path": str(attention), "scale": 0.5}, {"path": str(mlp), "scale": -1.5}]})
        status, answer = request(d.sock, "POST", "/v1/models/m/loras", body.encode())
        assert status == 200, answer
        answer = json.loads(answer)
        assert [(a["path"], a["scale"]) for a in answer["loras"]] == [(str(attention), 0.5), (str(mlp), -1.5)], answer
        assert answer["version"] == 2 and answer["updated"]["tensors"] > 0, answer
        assert_close(forward(), expected)
        # The Python package: another set; a bad one changes nothing.
        with pytest.raises(vramd.DaemonError) as refused:
            c.set_loras("m", [lora["folders"]["rslora"], tmp_path / "nowhere"])
        assert refused.value.status == 400 and "loras[1]" in str(refused.value) and "no such file" in str(refused.value)
        assert_close(forward(), expected)
        assert c.set_loras("m", [(lora["folders"]["rslora"], 1.0)])["version"] == 3
        assert_close(forward(), expected_rs)
        # vramctl: cleared, the checkpoint's own weights bit for bit.
        result = subprocess.run([VRAMCTL, "lora", "m", "--clear", "--socket", d.sock], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "m: version 4, no adapters" in result.stdout, result
        assert torch.equal(forward()["logits"], base["logits"])
        result = subprocess.run([VRAMCTL, "lora", "m", f"{attention}:0.5", "--socket", d.sock],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and f"{attention} at scale 0.5 (peft, 4 weights" in result.stdout, result
        served = model(d.sock, "m")
        assert served["stats"]["loads"] == loads, "a switch is no reload"
        assert served["charge"]["cpu"]["parts"]["adapters"] == served["loras"][0]["bytes"], served
        # Kept across an unload and the next load.
        assert request(d.sock, "POST", "/v1/models/m/unload")[0] == 200
        expected_one = merged_outputs(lora["witness"] / "model", lora["inputs"], [(attention, 0.5)])
        assert_close(forward(), expected_one)
        for body, named in [(b'{"loras": "x"}', "expected"), (b'{"loras": [{"path": "rel/x"}]}', "not absolute"),
                            (b'{"loras": [{"path": "/x", "scale": "big"}]}', "scale")]:
            status, answer = request(d.sock, "POST", "/v1/models/m/loras", body)
            assert status == 400 and named.encode() in answer, answer


def test_streamed_models_switch_layers_held_in_memory_and_layers_streamed_from_disk(lora, tmp_path):
    """A switch writes the layers a streamed model holds in memory (resident under its limit, or
    resting in host memory) and nothing of those it re-reads from disk at each use: their next
    read applies the new set, including a layer read ahead for the next forward before the
    switch. Outputs equal peft's merge; cleared, the base's bit for bit."""
    d = Daemon(tmp_path)
    checkpoint = f'checkpoint = "{lora["witness"] / "model"}"\n'
    (d.models / "disk.toml").write_text(checkpoint + STREAMED.replace("700KiB", "520KiB"))  # layers 0 and 1 stream
    (d.models / "host.toml").write_text(checkpoint + '[vram]\noffload = { device = "cpu" }\nonload = { device = "cpu" }\n'
                                        'limit = "700KiB"\nonload_limit = "1MiB"\n')
    attention, mlp = lora["folders"]["attention"], lora["folders"]["mlp"]
    inputs = save(lora["inputs"])
    base = run(lora, config(lora, "plain", []))
    with d.start():
        for name in ("disk", "host"):
            assert torch.equal(served_forward(d, name, inputs)["logits"], base["logits"])
        # The mlp adapter changes the embedding and the mlps, which stream from disk on "disk":
        # read at their next use (the embedding read ahead already for this forward), nothing of
        # them written. "host" holds the same weights in memory and writes them all.
        written = {}
        for name in ("disk", "host"):
            for adapters in ([(mlp, -1.5)], [(attention, 0.5), (mlp, -1.5)]):
                body = json.dumps({"loras": [{"path": str(p), "scale": s} for p, s in adapters]}).encode()
                status, answer = request(d.sock, "POST", f"/v1/models/{name}/loras", body)
                assert status == 200, answer
                written[name, len(adapters)] = json.loads(answer)["updated"]
                assert_close(served_forward(d, name, inputs), merged_outputs(lora["witness"] / "model", lora["inputs"],
                                                                             adapters))
            status, answer = request(d.sock, "POST", f"/v1/models/{name}/loras", b'{"loras": []}')
            assert status == 200, answer
            assert torch.equal(served_forward(d, name, inputs)["logits"], base["logits"])
        assert model(d.sock, "disk")["weights"]["disk_layers"] > 0
        for count in (1, 2):
            disk, host = written["disk", count], written["host", count]
            assert disk["tensors"] == host["tensors"] > 0 and disk["bytes"] < host["bytes"], written


def test_unfused_adapters_compute_beside_the_weights_and_switch_on_layers_streamed_from_disk(lora, tmp_path):
    attention, mlp = lora["folders"]["attention"], lora["folders"]["mlp"]
    stacked = [(attention, 0.5), (mlp, -1.5)]
    expected = merged_outputs(lora["witness"] / "model", lora["inputs"], stacked)
    assert_close(run(lora, config(lora, "unfused", stacked, "fuse_lora = false\n")), expected)
    d = Daemon(tmp_path)
    checkpoint = f'checkpoint = "{lora["witness"] / "model"}"\nfuse_lora = false\n'
    (d.models / "disk.toml").write_text(checkpoint + STREAMED.replace("700KiB", "520KiB"))
    inputs = save(lora["inputs"])
    base = run(lora, config(lora, "plain", []))
    with d.start():
        assert request(d.sock, "POST", "/v1/models/disk/forward", inputs)[0] == 200
        # The embedding streams from disk: unfused, its adapter is taken all the same.
        body = json.dumps({"loras": [{"path": str(p), "scale": s} for p, s in stacked]}).encode()
        status, answer = request(d.sock, "POST", "/v1/models/disk/loras", body)
        assert status == 200, answer
        assert json.loads(answer)["updated"]["bytes"] == 0, answer  # no weight written
        served = model(d.sock, "disk")
        assert served["charge"]["cpu"]["parts"]["adapters"] == sum(a["bytes"] for a in served["loras"]), served
        status, out = request(d.sock, "POST", "/v1/models/disk/forward", inputs)
        assert status == 200, out
        assert_close(load(out), expected)
        status, answer = request(d.sock, "POST", "/v1/models/disk/lease")
        assert status == 409 and b"fuse_lora = false" in answer, answer
        status, answer = request(d.sock, "POST", "/v1/models/disk/loras", b'{"loras": []}')
        assert status == 200, answer
        status, out = request(d.sock, "POST", "/v1/models/disk/forward", inputs)
        assert torch.equal(load(out)["logits"], base["logits"])


def stored_bytes(checkpoint, names=None):
    """The bytes of a safetensors file's tensors (those whose name contains one of `names`), from its header."""
    with open(checkpoint, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
               if k != "__metadata__" and (names is None or any(n in k for n in names)))


def test_configs_of_one_checkpoint_count_its_pages_once(lora, tmp_path):
    """Two configs of one checkpoint, each with an unfused adapter of its own, hold the base once:
    their weights are views of the checkpoint's pages, which the cpu budget counts once (one that
    holds a base and a third loads both, evicting neither), and status and `vramctl status` say
    who shares what. A fused config shares every weight its adapter leaves alone."""
    attention, mlp = lora["folders"]["attention"], lora["folders"]["mlp"]
    checkpoint = lora["witness"] / "model"
    base = stored_bytes(checkpoint / "model.safetensors")
    d = Daemon(tmp_path, budgets=f'cpu = "{base * 13 // 10240}KiB"')
    for name, folder, fuse in [("a", attention, "false"), ("b", mlp, "false"), ("c", attention, "true")]:
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{checkpoint}"\nfuse_lora = {fuse}\n'
                                               f'[[lora]]\npath = "{folder}"\n')
    inputs = save(lora["inputs"])

    def forward(name):
        return served_forward(d, name, inputs)

    def cpu():
        return get_json(d.sock, "/v1/status")["devices"]["cpu"]

    with d.start():
        assert_close(forward("a"), merged_outputs(checkpoint, lora["inputs"], [(attention, 1.0)]))
        assert_close(forward("b"), merged_outputs(checkpoint, lora["inputs"], [(mlp, 1.0)]))
        a, b = model(d.sock, "a"), model(d.sock, "b")
        assert a["state"] == "ready" and a["stats"]["loads"] == 1, a  # b's load evicted nothing
        assert a["views"] == {"bytes": base, "copies": 0, "shared": base, "with": ["b"]}, a
        assert b["views"] == {"bytes": base, "copies": 0, "shared": base, "with": ["a"]}, b
        adapters = sum(x["bytes"] for m in (a, b) for x in m["loras"])
        held = cpu()
        assert held["shared"] == base and held["used"] == sum(held["models"].values()) - base, held
        assert held["used"] <= 1.15 * (base + adapters), held
        shown = subprocess.run([VRAMCTL, "status", "--socket", d.sock], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert f"shared with b" in shown.stdout and "less for checkpoint pages models share" in shown.stdout, shown.stdout
        # Fused, q_proj and v_proj are its own; the rest it views with the others.
        assert_close(forward("c"), merged_outputs(checkpoint, lora["inputs"], [(attention, 1.0)]))
        c = model(d.sock, "c")
        own = stored_bytes(checkpoint / "model.safetensors", ["q_proj", "v_proj"])
        assert c["views"] == {"bytes": base - own, "copies": 0, "shared": base - own, "with": ["a", "b"]}, c
        assert cpu()["shared"] == 2 * base - own and all(model(d.sock, n)["state"] == "ready" for n in "ab")
        # Unloaded, a and b share nothing more: c is charged its whole weights.
        for name in "ab":
            assert request(d.sock, "POST", f"/v1/models/{name}/unload")[0] == 200
        c, held = model(d.sock, "c"), cpu()
        assert c["views"]["with"] == [] and c["views"]["shared"] == 0 and held["shared"] == 0, (c, held)
        assert held["used"] == c["charge"]["cpu"]["bytes"], (c, held)


def test_configs_that_cast_share_one_copy_of_the_base(lora, tmp_path):
    """Configs of a float32 checkpoint that compute in bfloat16, each with an unfused adapter of
    its own, hold one bfloat16 copy of the base between them: counted once by the cpu budget
    (which has room for one copy and a bit), and computing what each computes from a copy of its
    own. An update of one of them leaves the others' weights as the checkpoint has them, whether
    it is written beside the copy they share or into one it holds alone."""
    attention, mlp = lora["folders"]["attention"], lora["folders"]["mlp"]
    checkpoint = lora["witness"] / "model"
    copy = stored_bytes(checkpoint / "model.safetensors") // 2  # every tensor float32, held as bfloat16
    d = Daemon(tmp_path, budgets=f'cpu = "{copy * 13 // 10240}KiB"')
    for name, folder in [("a", attention), ("b", mlp), ("c", mlp)]:
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{checkpoint}"\ndtype = "bfloat16"\nfuse_lora = false\n'
                                               f'[[lora]]\npath = "{folder}"\n')
    inputs = save(lora["inputs"])
    norm = next(n for n in load_file(checkpoint / "model.safetensors") if n.endswith("norm.weight"))

    def forward(name):
        return served_forward(d, name, inputs)["logits"]

    def update(name):
        status, body = request(d.sock, "POST", f"/v1/models/{name}/weights", save({norm: torch.full((64,), 3.0)}))
        assert status == 200, body

    with d.start():
        alone = forward("a")  # read into copies of its own
        assert alone.dtype == torch.bfloat16
        assert model(d.sock, "a")["views"] == {"bytes": copy, "copies": copy, "shared": 0, "with": []}
        assert request(d.sock, "POST", "/v1/models/a/unload")[0] == 200
        b = forward("b")
        assert torch.equal(forward("a"), alone)  # a's weights now b's copies
        a_model, b_model = model(d.sock, "a"), model(d.sock, "b")
        assert b_model["state"] == "ready" and b_model["stats"]["loads"] == 1, b_model  # a's load evicted nothing
        assert a_model["views"] == {"bytes": copy, "copies": copy, "shared": copy, "with": ["b"]}, a_model
        held = get_json(d.sock, "/v1/status")["devices"]["cpu"]
        adapters = sum(x["bytes"] for m in (a_model, b_model) for x in m["loras"])
        assert held["shared"] == copy and held["used"] <= 1.15 * (copy + adapters), held
        shown = vramctl("status", "--socket", d.sock)
        assert shown.returncode == 0 and "are copies its configs can share, " in shown.stdout, shown
        # Updated while b holds the copy too: written beside it, b's weights stay the checkpoint's.
        update("a")
        assert not torch.equal(forward("a"), alone) and torch.equal(forward("b"), b)
        assert model(d.sock, "a")["views"]["copies"] == copy - 64 * 2  # the norm's copy its own now
        # Updated while it holds the copy alone: written into it, and c, loaded next, reads its own.
        assert request(d.sock, "POST", "/v1/models/a/unload")[0] == 200
        update("b")
        assert not torch.equal(forward("b"), b)
        assert torch.equal(forward("c"), b)


@pytest.mark.parametrize("fuse", ["true", "false"])
def test_gpt2s_conv1d_weights_take_the_update_transposed(lora, fuse):
    """GPT-2 holds its projections as [in, out] (transformers' Conv1D); peft trains them with
    fan_in_fan_out, and c_proj is square, where an update not transposed would fit and be wrong."""
    import peft
    import transformers
    out = lora["out"]
    witness = out / "gpt2-float32"
    if not witness.exists():
        hf_models.make("gpt2", "float32", out)
    folder = out / "gpt2-adapter"
    if not folder.exists():
        model = transformers.GPT2LMHeadModel.from_pretrained(witness / "model", dtype=torch.float32)
        torch.manual_seed(4)
        adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                             fan_in_fan_out=True, init_lora_weights=False))
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0, 0.3)
        adapted.save_pretrained(folder)
    inputs = load_file(witness / "inputs.safetensors")
    model = transformers.GPT2LMHeadModel.from_pretrained(witness / "model", dtype=torch.float32).eval()
    expected = hf_models.outputs(peft.PeftModel.from_pretrained(model, folder).merge_and_unload().eval(), inputs)
    path = out / f"gpt2-{fuse}.toml"
    path.write_text(f'checkpoint = "{witness / "model"}"\nfuse_lora = {fuse}\n[[lora]]\npath = "{folder}"\n')
    output = path.with_suffix(".out.safetensors")
    result = vramctl("run", path, "--daemon-config", out / "vramd.toml", "--input", witness / "inputs.safetensors",
                     "--output", output, "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert_close(load_file(output), expected)


def make_unet():
    import diffusers
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    """A tiny UNet's checkpoint, two kohya LoRA files on attention and a convolution (rank 2,
    alpha 1; the second on other weights too), an input, and diffusers' own outputs: the base's,
    and each file's fused at scale 0.5 (lora_state_dict, load_lora_adapter, fuse_lora)."""
    pytest.importorskip("diffusers")
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin
    out = tmp_path_factory.mktemp("unet")
    torch.manual_seed(0)
    base = make_unet()
    state = base.state_dict()
    save_file(dict(state), out / "unet.safetensors")
    g = torch.Generator().manual_seed(1)
    files = []
    for suffixes in [("attn1.to_q.weight", "attn2.to_k.weight", "resnets.0.conv1.weight"),
                     ("attn1.to_v.weight", "attn2.to_k.weight", "resnets.0.conv2.weight")]:
        names = [n for n in state if n.endswith(suffixes)]
        assert any(state[n].dim() == 4 for n in names) and any(state[n].dim() == 2 for n in names)
        kohya = {}
        for name in names:
            weight, key = state[name], "lora_unet_" + name[: -len(".weight")].replace(".", "_")
            down_shape = (2, *weight.shape[1:]) if weight.dim() == 4 else (2, weight.shape[1])
            up_shape = (weight.shape[0], 2, 1, 1) if weight.dim() == 4 else (weight.shape[0], 2)
            kohya[f"{key}.lora_down.weight"] = torch.randn(down_shape, generator=g) * 0.3
            kohya[f"{key}.lora_up.weight"] = torch.randn(up_shape, generator=g) * 0.3
            kohya[f"{key}.alpha"] = torch.tensor(1.0)
        files.append(out / f"kohya{len(files)}.safetensors")
        save_file(kohya, files[-1])
    sample, states = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 5, 32, generator=g)
    expected = []
    with torch.no_grad():
        for path in files:
            witness = make_unet()
            witness.load_state_dict(state)
            lora_state, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(str(path))
            witness.load_lora_adapter(lora_state, network_alphas=alphas, prefix="unet", adapter_name="kohya")
            witness.fuse_lora(lora_scale=0.5)
            expected.append(witness(sample, 10, states).sample)
        want_base = base(sample, 10, states).sample
    for want in expected:
        assert not torch.allclose(want, want_base, rtol=1e-3), "an adapter changed nothing"
    limit = sum(v.numel() * 4 for v in state.values()) // 3
    served = (f'checkpoint = "{out / "unet.safetensors"}"\narchitecture = "weights"\ndtype = "float32"\n'
              f'[vram]\nonload = {{ device = "cpu", dtype = "float32" }}\nlimit = {limit}\n')
    return {"files": files, "input": (sample, 10, states), "expected": expected, "base": want_base,
            "served": served, "limit": limit}


def managed_unet():
    from accelerate import init_empty_weights
    with init_empty_weights():
        return make_unet()


def test_a_managed_unet_with_a_kohya_lora_equals_diffusers_fuse_lora(unet, tmp_path):
    """The UNet served as architecture "weights" with the first file in its config ([[lora]],
    scale 0.5), managed in a client under a third of its size: the client gets the adapted
    values the daemon holds at rest."""
    import vramd
    d = Daemon(tmp_path / "daemon")
    (d.models / "unet.toml").write_text(unet["served"] + f'[[lora]]\npath = "{unet["files"][0]}"\nscale = 0.5\n')
    module = managed_unet()
    with d.start(), vramd.connect(d.sock) as client, vramd.manage(module, "unet", client=client) as managed, \
            torch.no_grad():
        got = module(*unet["input"]).sample
        assert managed.stats()["peak"] <= unet["limit"]
    assert hf_models.relative_error(got, unet["expected"][0]) <= 1e-5, hf_models.relative_error(got, unet["expected"][0])


def test_managed_modules_apply_adapters_of_their_own_over_one_lease_and_switch_between_forwards(unet, tmp_path):
    """Two modules managed from one model with no adapters, each with its own (manage(loras=)),
    equal diffusers' fused outputs; set_loras() switches one between forwards, [] gives what a
    module managed without adapters gives, bit for bit, and a bad set is refused naming it with
    the set in force kept."""
    import vramd
    d = Daemon(tmp_path / "daemon")
    (d.models / "unet.toml").write_text(unet["served"])
    first, second = managed_unet(), managed_unet()
    files, expected = unet["files"], unet["expected"]

    def close(got, want):
        return hf_models.relative_error(got, want) <= 1e-5

    with d.start(), vramd.connect(d.sock) as client, torch.no_grad(), \
            vramd.manage(first, "unet", client=client, loras=[(files[0], 0.5)]) as a, \
            vramd.manage(second, "unet", client=client, loras=[(files[1], 0.5)]) as b:
        assert close(first(*unet["input"]).sample, expected[0])
        assert close(second(*unet["input"]).sample, expected[1])
        a.set_loras([(files[1], 0.5)])
        assert a.loras == [(str(files[1]), 0.5)]
        assert close(first(*unet["input"]).sample, expected[1])
        with pytest.raises(vramd.ManageError, match=r"loras\[1\], .*nowhere: no such file"):
            a.set_loras([files[0], tmp_path / "nowhere"])
        assert close(first(*unet["input"]).sample, expected[1])  # the set in force kept
        b.set_loras([])
        cleared = second(*unet["input"]).sample
        assert b.stats()["peak"] <= unet["limit"]
        plain = managed_unet()
        with vramd.manage(plain, "unet", client=client):
            assert torch.equal(cleared, plain(*unet["input"]).sample)  # the leased weights as they are, bit for bit
        assert close(cleared, unet["base"])
    # The daemon's model holds no adapter: they were this process's.
    with d.start():
        assert model(d.sock, "unet")["loras"] == []


def test_a_weights_model_served_unfused_leaves_its_adapters_to_the_clients_that_manage_it(unet, tmp_path):
    """architecture "weights" with fuse_lora = false: the daemon checks the adapters and holds the
    checkpoint's weights as they are, charging no adapter; a lease must say it applies them (409
    otherwise) and gets them listed; vramd.manage adds them as each unit comes in, equal to
    diffusers' fuse_lora. A switch (Client.set_loras) reaches a module that follows at its next
    wait_update(), [] giving the base's outputs bit for bit; two such configs with different
    files hold the base once."""
    import vramd
    d = Daemon(tmp_path / "daemon")
    files, expected = unet["files"], unet["expected"]
    for name, file in (("first", files[0]), ("second", files[1])):
        (d.models / f"{name}.toml").write_text('fuse_lora = false\n' + unet["served"] +
                                               f'[[lora]]\npath = "{file}"\nscale = 0.5\n')
    (d.models / "plain.toml").write_text(unet["served"])
    checkpoint = load_file(str(unet["files"][0]).replace("kohya0.safetensors", "unet.safetensors"))

    def close(got, want):
        return hf_models.relative_error(got, want) <= 1e-5

    with d.start(), vramd.connect(d.sock) as client, torch.no_grad():
        with pytest.raises(vramd.DaemonError, match=r"has its LoRA adapters applied by the clients that manage it "
                                                    r".*vramd\.manage does") as refused:
            client.lease("first")
        assert refused.value.status == 409
        assert request(d.sock, "GET", "/v1/models/first/lease")[0] == 409
        status, answer = request(d.sock, "GET", "/v1/models/first/lease?adapters=true")
        assert status == 200 and json.loads(answer)["loras"] == [{"path": str(files[0]), "scale": 0.5}], answer
        with client.lease("first", adapters=True) as state_dict:  # the checkpoint's weights, unadapted
            assert state_dict.keys() == checkpoint.keys()
            assert all(torch.equal(state_dict[k], v) for k, v in checkpoint.items())
        served = model(d.sock, "first")
        assert [a["path"] for a in served["loras"]] == [str(files[0])], served
        assert "adapters" not in served["charge"]["cpu"]["parts"], served  # its clients hold them

        plain = managed_unet()
        with vramd.manage(plain, "plain", client=client):
            base = plain(*unet["input"]).sample
        module = managed_unet()
        with vramd.manage(module, "first", client=client, follow=True) as managed:
            assert managed.served_loras == [(str(files[0]), 0.5)] and managed.loras == []
            assert close(module(*unet["input"]).sample, expected[0])
            assert managed.stats()["peak"] <= unet["limit"]
            answer = client.set_loras("first", [(files[1], 0.5)])
            assert answer["version"] == 2 and answer["updated"]["bytes"] == 0, answer
            leased = managed.lease.state_dict
            assert managed.wait_update(timeout=60) == 2 and managed.served_loras == [(str(files[1]), 0.5)]
            assert managed.lease.state_dict is leased  # the same weights: nothing mapped again
            assert close(module(*unet["input"]).sample, expected[1])
            # Checked from the files' headers, their factors never read here: each bad file is
            # refused naming it, and the set in force stays.
            kohya = load_file(files[0])
            conv = next(k for k in kohya if k.endswith("conv1.lora_down.weight"))
            up = next(k for k in kohya if k.endswith("to_q.lora_up.weight"))
            bad = {conv: {**kohya, conv: kohya[conv].flatten(1).contiguous()},
                   up.removesuffix(".lora_up.weight"): {**kohya, up: torch.zeros(kohya[up].shape[0], kohya[up].shape[1] + 1)}}
            truncated = tmp_path / "truncated.safetensors"
            truncated.write_bytes(files[0].read_bytes()[:-64])
            for i, (named, tensors) in enumerate(bad.items()):
                path = tmp_path / f"bad{i}.safetensors"
                save_file(tensors, path)
                bad[named] = path
            bad["is the file truncated?"] = truncated
            for named, path in bad.items():
                with pytest.raises(vramd.DaemonError) as refused:
                    client.set_loras("first", [(path, 0.5)])
                assert refused.value.status == 400 and named in str(refused.value), (named, str(refused.value))
            served = model(d.sock, "first")
            assert served["version"] == 2 and [a["path"] for a in served["loras"]] == [str(files[1])], served
            # A module holding copies of every weight (float64, no limit) brings again only the
            # units whose weights the old set or the new one changes.
            whole = managed_unet()
            double = tuple(t.double() if isinstance(t, torch.Tensor) else t for t in unet["input"])
            with vramd.manage(whole, "first", client=client, follow=True, dtype=torch.float64, limit="1GiB") as copies:
                whole(*double)
                everything = copies.stats()["bytes_moved"]
                client.set_loras("first", [(files[0], 0.5)])
                assert managed.wait_update(timeout=60) == copies.wait_update(timeout=60) == 3
                whole(*double)
                moved = copies.stats()["bytes_moved"] - everything
                assert 0 < moved < everything // 2, (moved, everything)
            client.set_loras("first", [])
            managed.wait_update(timeout=60)
            assert torch.equal(module(*unet["input"]).sample, base)
            # Its own adapters go after the served ones. The served file here also holds a text
            # encoder's keys (kohya's lora_te_), which the client skips as the daemon does.
            both = tmp_path / "both.safetensors"
            save_file({**load_file(files[0]), "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.ones(2, 4),
                       "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.ones(4, 2)}, both)
            client.set_loras("first", [(both, 0.5)])
            managed.wait_update(timeout=60)
            managed.set_loras([(files[1], 0.0)])
            assert managed.loras == [(str(files[1]), 0.0)]
            assert close(module(*unet["input"]).sample, expected[0])
        # The two configs view one checkpoint's pages: counted once.
        client.load("second")
        cpu = get_json(d.sock, "/v1/status")["devices"]["cpu"]
        assert cpu["shared"] > 0 and cpu["models"]["first"] > 0 and cpu["models"]["second"] > 0, cpu
        assert cpu["used"] < cpu["models"]["first"] + cpu["models"]["second"], cpu


def memfd_inodes(pid, name):
    """The inodes of the memfds named `name` that process `pid` maps."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {int(line.split()[4]) for line in lines if f"/memfd:{name} " in line + " "}


def test_a_leased_models_switch_writes_its_adapted_weights_into_a_region_the_next_lease_hands_on(unet, tmp_path):
    """A "weights" model fused in the daemon, followed by a managed module: the switch writes the
    weights it adapts into one new sealed region, and the new version's lease hands that region
    on as it is, where it would pack them into a region of its own (a copy of each)."""
    import vramd
    d = Daemon(tmp_path / "daemon")
    files, expected = unet["files"], unet["expected"]
    (d.models / "fused.toml").write_text(unet["served"] + f'[[lora]]\npath = "{files[0]}"\nscale = 0.5\n')
    module = managed_unet()
    with d.start(), vramd.connect(d.sock) as client, torch.no_grad(), \
            vramd.manage(module, "fused", client=client, follow=True) as managed:
        assert hf_models.relative_error(module(*unet["input"]).sample, expected[0]) <= 1e-5
        daemon, name = d.process.pid, "vramd:fused"
        leased = memfd_inodes(daemon, name)
        assert len(leased) == 1, leased
        answer = client.set_loras("fused", [(files[1], 0.5)])
        written = memfd_inodes(daemon, name) - leased
        assert len(written) == 1 and answer["updated"]["tensors"] > 0, (written, answer)
        assert managed.wait_update(timeout=60) == 2
        # Handed on as it is, not packed again (the region leased first goes once the module lets it go:
        # every weight in it was one of the first set's, which the switch replaced).
        assert memfd_inodes(daemon, name) - leased == written
        assert written <= memfd_inodes(os.getpid(), name)
        assert hf_models.relative_error(module(*unet["input"]).sample, expected[1]) <= 1e-5


def test_weights_prepared_in_float8_take_the_adapter_before_their_rounding(lora):
    """[vram] preparing in float8, computed in float32: each weight, adapted in float32, is held in
    float8 and cast for its op. Equal, within float32's bound, to peft's merge with every weight
    rounded through float8 and computed in float32."""
    attention = lora["folders"]["attention"]

    def through_float8(adapters):
        model = merged_model(lora["witness"] / "model", adapters)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.float8_e4m3fn).to(torch.float32))
        return hf_models.outputs(model, lora["inputs"])

    expected, base = through_float8([(attention, 0.5)]), through_float8([])
    got = run(lora, config(lora, "float8", [(attention, 0.5)],
                           'dtype = "float32"\n[vram]\npreparing = { dtype = "float8_e4m3fn" }\n'))
    assert_close(got, expected)
    assert not hf_models.close(got["logits"], base["logits"]), "the adapter changed nothing"


def test_a_partitioned_model_adapts_each_ranks_slices(lora):
    """[partition] on 2 ranks: each rank reads the adapted weights whole and keeps its slice of
    them; the outputs equal the single process's bit for bit, and peft's merge."""
    stacked = [(lora["folders"]["attention"], 0.5), (lora["folders"]["mlp"], -1.5)]
    single = run(lora, config(lora, "single", stacked))
    path = config(lora, "partitioned", stacked, '[partition]\nworld_size = 2\ntimeout = "20s"\n')
    output = path.with_suffix(".out.safetensors")
    result = vramctl("run", path, "--daemon-config", lora["out"] / "vramd.toml", "--input",
                     lora["witness"] / "inputs.safetensors", "--output", output, "--threads", "1", "--ranks", "2")
    assert result.returncode == 0, result.stderr
    got = load_file(output)
    for name in single:
        assert torch.equal(got[name], single[name]), name
    assert_close(got, merged_outputs(lora["witness"] / "model", lora["inputs"], stacked))


def test_a_client_refuses_a_pattern_that_is_no_regular_expression(tmp_path):
    """vramd.manage's own reader (manage/lora.py) names a rank_pattern it cannot compile, as the
    daemon's does, rather than raising re.error."""
    from vramd.manage.lora import read_loras
    import vramd
    module = torch.nn.Sequential(torch.nn.Linear(4, 3))
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({"base_model.model.0.lora_A.weight": torch.ones(2, 4), "base_model.model.0.lora_B.weight": torch.ones(3, 2)},
              folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                            "rank_pattern": {"0(": 2}}))
    with pytest.raises(vramd.ManageError, match=r"loras\[0\], .*adapter: pattern '0\(' is no regular expression"):
        read_loras([folder], module)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    terms = read_loras([(folder, 0.5)], module)["0.weight"]
    assert [(d.shape, u.shape, f, t) for d, u, f, t in terms] == [((2, 4), (3, 2), 0.5, False)]



# --- An adapter on a mixture of experts' experts ----------------------------------------------------

def module_tree(state):
    """A module holding a Linear for every 2-D weight of `state`, under the checkpoint's names,
    for peft to adapt and merge: Mixtral adapters name the Hub layout's experts.N.w1/w2/w3, which
    transformers 5's MixtralForCausalLM fuses into experts.gate_up_proj and down_proj."""
    root = torch.nn.Module()
    for name, value in state.items():
        if not name.endswith(".weight") or value.dim() != 2:
            continue
        *path, leaf = name[: -len(".weight")].split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        linear = torch.nn.Linear(value.shape[1], value.shape[0], bias=False)
        linear.weight.data.copy_(value)
        module.add_module(leaf, linear)
    return root


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A Mixtral saved as on the Hub (per-expert tensors), a peft adapter on every expert's w1, w2
    and w3 and on q_proj, and the witness: transformers' from_pretrained of the checkpoint with
    peft's merge_and_unload() of the adapter written into it."""
    import peft
    import transformers
    out = tmp_path_factory.mktemp("moe")
    witness = hf_models.make("mixtral", "float32", out)
    state = load_file(witness / "model" / "model.safetensors")
    torch.manual_seed(5)
    adapted = peft.get_peft_model(module_tree(state), peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["w1", "w2", "w3", "q_proj"], init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.3)
    adapted.save_pretrained(out / "adapter")
    merged = hf_models.save_beside(witness, {**state, **adapted.merge_and_unload().state_dict()}, out / "merged")
    inputs = load_file(witness / "inputs.safetensors")
    expected = hf_models.outputs(transformers.MixtralForCausalLM.from_pretrained(
        merged.parent, dtype=torch.float32).eval(), inputs)
    base = load_file(witness / "expected.safetensors")
    assert not hf_models.close(expected["logits"], base["logits"]), "the adapter changed nothing"
    (out / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    return {"out": out, "witness": witness, "adapter": out / "adapter", "inputs": inputs, "expected": expected,
            "base": base}


MOE_STREAMED = '[vram]\noffload = { device = "disk" }\nonload = { device = "disk" }\nlimit = "300KiB"\n'


@pytest.mark.parametrize("vram", ["", MOE_STREAMED], ids=["resident", "streamed"])
@pytest.mark.parametrize("fuse", ["true", "false"])
def test_an_adapter_on_a_mixtures_experts_equals_peft_merge(moe, vram, fuse):
    """vramd's Mixtral family holds each expert's w1, w2 and w3 as the checkpoint names them: the
    adapter's terms go to each expert, fused or unfused, resident or streamed under a limit below
    one layer's experts."""
    path = moe["out"] / f"mixtral-{fuse}-{bool(vram)}.toml"
    path.write_text(f'name = "m"\ncheckpoint = "{moe["witness"] / "model"}"\nfuse_lora = {fuse}\n{vram}\n'
                    f'[[lora]]\npath = "{moe["adapter"]}"\n')
    assert_close(run({"out": moe["out"], "witness": moe["witness"]}, path), moe["expected"])


def test_an_adapter_on_the_hub_layouts_experts_reaches_transformers_fused_experts(moe, tmp_path):
    """Served with converter = "transformers" (experts.N.w1/w3 stacked and joined into
    gate_up_proj), the adapter naming the checkpoint's experts is fused into those tensors before
    the conversion: a transformers 5 Mixtral managed under a limit below its size equals
    transformers' own from_pretrained of peft's merge. A switch to [] gives the base's values bit
    for bit and back; unfused, such an adapter is refused naming the checkpoint's tensor and
    what the converter makes of it, and so is it as the client's own (manage(loras=)), saying
    that the daemon applies it."""
    from accelerate import init_empty_weights
    import transformers
    import vramd
    d = Daemon(tmp_path / "daemon", extra=f'python = "{sys.executable}"')
    served = f'checkpoint = "{moe["witness"] / "model"}"\narchitecture = "weights"\nconverter = "transformers"\n'
    lora = f'[[lora]]\npath = "{moe["adapter"]}"\n'
    (d.models / "experts.toml").write_text(served + lora)
    (d.models / "plain.toml").write_text(served)
    (d.models / "unfused.toml").write_text(served + "fuse_lora = false\n" + lora)
    config = transformers.AutoConfig.from_pretrained(moe["witness"] / "model")
    with init_empty_weights():
        module = transformers.MixtralForCausalLM(config).eval()
    sizes = [sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in module.modules()]
    limit = max(sum(sizes) // 3, 2 * max(sizes))
    assert limit < sum(sizes)
    inputs = {k: moe["inputs"][k] for k in ("input_ids", "attention_mask")}

    def forward(m):
        return hf_models.outputs(m, inputs)

    with d.start(), vramd.connect(d.sock) as client, torch.no_grad():
        with vramd.manage(module, "experts", client=client, limit=limit, follow=True) as managed:
            assert_close(forward(module), moe["expected"])
            assert managed.stats()["peak"] <= limit
            assert [a["path"] for a in client.set_loras("experts", [])["loras"]] == []
            managed.wait_update(timeout=60)
            cleared = forward(module)
            client.set_loras("experts", [(moe["adapter"], 1.0)])
            managed.wait_update(timeout=60)
            assert_close(forward(module), moe["expected"])
        with init_empty_weights():
            plain = transformers.MixtralForCausalLM(config).eval()
        with vramd.manage(plain, "plain", client=client, limit=limit):
            base = forward(plain)
        # The client's own adapters name the module's weights: this one is the daemon's to apply.
        with pytest.raises(vramd.ManageError, match=r"experts\.0\.w1' is not the module's .*give the served model its \[\[lora\]\]"):
            vramd.manage(plain, "plain", client=client, limit=limit, loras=[(moe["adapter"], 1.0)])
        for name in base:
            assert torch.equal(cleared[name], base[name]), name
        assert_close(base, moe["base"])
        status, answer = request(d.sock, "POST", "/v1/models/unfused/load")
        assert status >= 400, answer
        reason = model(d.sock, "unfused").get("reason", "")
        assert ("'model.layers.0.block_sparse_moe.experts.0.w1.weight', which the converter makes into "
                "'model.layers.0.mlp.experts.gate_up_proj'") in reason and "fuse_lora = true" in reason, reason
        assert model(d.sock, "experts")["state"] == "ready"  # the others serve on
