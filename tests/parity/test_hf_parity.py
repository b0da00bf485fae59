"""vramctl run against Hugging Face transformers on the same checkpoints: small randomly
initialised models of each architecture, saved with save_pretrained, in float32 and bfloat16."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
import hf_models  # noqa: E402
from daemon_support import Daemon, request  # noqa: E402
from safetensors.torch import load  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
close, relative_error = hf_models.close, hf_models.relative_error


def vramctl(*args):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def witnesses(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    made = {}
    for case in hf_models.CASES:
        for dtype in hf_models.DTYPES_THIS_RUN:
            made[case, dtype] = hf_models.make(case, dtype, out)
    return made


def run(folder, tmp_path, extra=""):
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n{extra}')
    output = tmp_path / "out.safetensors"
    result = vramctl("run", config, "--input", folder / "inputs.safetensors", "--output", output)
    assert result.returncode == 0, result.stderr
    return load_file(output)


@pytest.mark.parametrize("dtype", hf_models.DTYPES)
@pytest.mark.parametrize("case", hf_models.CASES)
def test_outputs_match_transformers(witnesses, case, dtype, tmp_path):
    if (case, dtype) not in witnesses:
        pytest.skip(hf_models.SKIP_UNDER_SANITIZERS)
    folder = witnesses[case, dtype]
    got = run(folder, tmp_path)
    for name, expected in load_file(folder / "expected.safetensors").items():
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        assert close(got[name], expected, dtype), name


def test_fresh_processes_compute_the_same_bits(witnesses, tmp_path):
    # A process's first forward gave other bits in one sequence's rows in about 1 process in 50
    # (1 in 13 with spinning OpenMP threads): GPT-2's tanh, split between two threads whose first
    # calls of MKL's vector tanh raced (docs/benchmarks.md). Fresh processes, two at a time, two
    # spinning threads each: against the binary before the fix this failed 4 runs of 4.
    folder = witnesses["gpt2", "float32"]
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n')
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}
    outputs = []
    for pair in range(50):
        started = []
        for i in range(2):
            output = tmp_path / f"out{pair}-{i}.safetensors"
            started.append(subprocess.Popen([VRAMCTL, "run", config, "--input", folder / "inputs.safetensors",
                                             "--output", output], env=env, stderr=subprocess.PIPE, text=True))
            outputs.append(output)
        for process in started:
            _, stderr = process.communicate(timeout=300)  # read as it comes: a full pipe would stall the run
            assert process.returncode == 0, stderr
    first = load_file(outputs[0])
    differing = [output.name for output in outputs[1:]
                 if not all(torch.equal(tensor, first[name]) for name, tensor in load_file(output).items())]
    assert not differing, f"{len(differing)} of {len(outputs)} processes computed other bits: {differing}"


def test_every_family_serves_from_the_daemon_what_transformers_computes(witnesses, tmp_path):
    # One daemon, every case in both dtypes, each model loaded on its first forward.
    daemon = Daemon(tmp_path)
    for (case, dtype), folder in witnesses.items():
        (daemon.models / f"{case}-{dtype}.toml").write_text(f'checkpoint = "{folder / "model"}"\n')
    daemon.start()
    try:
        for (case, dtype), folder in witnesses.items():
            inputs = (folder / "inputs.safetensors").read_bytes()
            status, body = request(daemon.sock, "POST", f"/v1/models/{case}-{dtype}/forward", inputs)
            assert status == 200, (case, dtype, body)
            got = load(body)
            for name, expected in load_file(folder / "expected.safetensors").items():
                assert close(got[name], expected, dtype), (case, dtype, name)
    finally:
        assert daemon.stop() == 0


def test_the_sliding_window_and_rope_scaling_matter(witnesses, tmp_path):
    # Negative controls: with the window or the scaling switched off the outputs must differ,
    # or the matches above would prove nothing about them.
    for case, override in [("mistral", "sliding_window = 1000"),
                           ("llama3", 'rope_parameters = { rope_type = "default", rope_theta = 500000.0 }'),
                           ("qwen2_sliding", "use_sliding_window = false"),
                           ("qwen3", 'rope_parameters = { rope_type = "default", rope_theta = 10000.0 }'),
                           ("gemma2", "attn_logit_softcapping = 1000.0"),
                           ("gemma2", "final_logit_softcapping = 1000.0"),
                           ("gemma3", 'layer_types = ["full_attention", "full_attention", "full_attention"]'),
                           ("phi3", "original_max_position_embeddings = 32"),
                           ("roberta", "pad_token_id = 0"),
                           ("t5_encoder", "relative_attention_max_distance = 128"),
                           ("mixtral", "sliding_window = 1000"),
                           ("mixtral", "num_experts_per_tok = 1"),
                           ("qwen2_moe", "norm_topk_prob = true"),
                           ("qwen3_moe", "norm_topk_prob = false"),
                           ("olmoe", "clip_qkv = 1000.0")]:
        folder = witnesses[case, "float32"]
        got = run(folder, tmp_path, f"[arch]\n{override}\n")
        output = "logits" if "logits" in got else "last_hidden_state"
        expected = load_file(folder / "expected.safetensors")[output]
        assert relative_error(got[output], expected) > 1e-3, (case, override)


@pytest.mark.parametrize("case", ["llama", "gpt2", "bert", "roberta", "clip_text_plain"])
def test_given_position_ids_are_used_as_transformers_uses_them(witnesses, case, tmp_path):
    # Rotary and learned positions, and RoBERTa's, which counts its own only when none are given.
    import transformers
    folder = witnesses[case, "float32"]
    inputs = load_file(folder / "inputs.safetensors")
    inputs["position_ids"] = (torch.arange(12) * 2 % 13 + 2).expand(2, 12).contiguous()
    model_class = getattr(transformers, transformers.AutoConfig.from_pretrained(folder / "model").architectures[0])
    expected = hf_models.outputs(model_class.from_pretrained(folder / "model").eval(), inputs)
    save_file(inputs, tmp_path / "in.safetensors")
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n')
    result = vramctl("run", config, "--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    got = load_file(tmp_path / "out.safetensors")
    for name, want in expected.items():
        assert close(got[name], want), name
    assert relative_error(got[name], load_file(folder / "expected.safetensors")[name]) > 1e-3  # they mattered


def test_a_forced_dtype_converts_the_weights(witnesses, tmp_path):
    folder = witnesses["gpt2", "float32"]
    got = run(folder, tmp_path, "dtype = \"bfloat16\"\n")
    expected = load_file(folder / "expected.safetensors")["logits"]
    assert got["logits"].dtype == torch.bfloat16
    assert relative_error(got["logits"], expected) < 5e-2


def test_a_base_model_checkpoint_loads_into_the_model_with_a_head(witnesses, tmp_path):
    # GPT2Model's names lack "transformer."; the LM head is tied to wte, so nothing is missing.
    folder = witnesses["gpt2", "float32"]
    tensors = load_file(folder / "model" / "model.safetensors")
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, bare / "model.safetensors")
    (bare / "config.json").write_text((folder / "model" / "config.json").read_text())
    config = tmp_path / "bare.toml"
    config.write_text(f'checkpoint = "{bare}"\n')
    output = tmp_path / "out.safetensors"
    result = vramctl("run", config, "--input", folder / "inputs.safetensors", "--output", output)
    assert result.returncode == 0, result.stderr
    # Within the parity every case keeps (hf_models.TOLERANCE).
    got, expected = load_file(output)["logits"], load_file(folder / "expected.safetensors")["logits"]
    assert close(got, expected)


def broken_copy(folder, tmp_path, edit):
    tensors = load_file(folder / "model" / "model.safetensors")
    edit(tensors)
    broken = tmp_path / "broken"
    broken.mkdir(exist_ok=True)
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((folder / "model" / "config.json").read_text())
    return broken


def run_broken(broken, tmp_path, folder, extra=""):
    config = tmp_path / "broken.toml"
    config.write_text(f'checkpoint = "{broken}"\n{extra}')
    return vramctl("run", config, "--input", folder / "inputs.safetensors"), config


def test_missing_unexpected_and_mismatched_keys_are_named(witnesses, tmp_path):
    folder = witnesses["llama", "float32"]

    def edit(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
        tensors["model.norm.weight"] = torch.zeros(63)

    result, config = run_broken(broken_copy(folder, tmp_path, edit), tmp_path, folder)
    assert result.returncode == 1
    message = result.stderr
    assert str(config) in message
    assert "'model.norm.weight' is [63], the architecture expects [64]" in message
    assert "1 missing: 'model.layers.1.mlp.up_proj.weight'" in message
    assert "1 unexpected: 'model.layers.1.mlp.extra.weight'" in message
    assert message.count("\n") == 1


def test_the_advice_fits_the_mismatch_loading_anyway_only_where_some_names_match(witnesses, tmp_path):
    folder = witnesses["llama", "float32"]

    def edit(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]

    result, _ = run_broken(broken_copy(folder, tmp_path, edit), tmp_path, folder)
    assert result.returncode == 1 and result.stderr.rstrip().endswith("(strict = false loads anyway)"), result.stderr
    # A converter that renames every tensor away: no name matches, and loading anyway would load nothing.
    (tmp_path / "away.lua").write_text('return src:renamed({ { "^", "other." } })\n')
    result, _ = run_broken(folder / "model", tmp_path, folder, f'converter = "{tmp_path / "away.lua"}"\n')
    assert result.returncode == 1, result.stderr
    assert result.stderr.rstrip().endswith(
        "(no tensor matches a parameter: check the prefix and the converter; vramctl convert shows the names it makes)"), \
        result.stderr


def test_strict_false_lists_missing_and_unexpected_keys_and_goes_on(witnesses, tmp_path):
    folder = witnesses["gpt2", "float32"]

    def edit(tensors):
        tensors["transformer.h.0.attn.rotary.weight"] = torch.zeros(3)

    result, _ = run_broken(broken_copy(folder, tmp_path, edit), tmp_path, folder, "strict = false\n")
    assert result.returncode == 0, result.stderr
    assert "unexpected checkpoint tensor (not used): transformer.h.0.attn.rotary.weight" in result.stderr

    def drop(tensors):
        del tensors["transformer.ln_f.bias"]

    result, _ = run_broken(broken_copy(folder, tmp_path, drop), tmp_path, folder, "strict = false\n")
    # Listed at load; the forward then refuses to run with the hole rather than invent weights.
    assert "missing from the checkpoint (strict = false; the parameter stays empty): transformer.ln_f.bias" in result.stderr
    assert result.returncode == 1 and "'transformer.ln_f.bias' was never loaded" in result.stderr


def test_integer_weights_are_refused(witnesses, tmp_path):
    folder = witnesses["bert", "float32"]

    def edit(tensors):
        tensors["pooler.dense.bias"] = torch.zeros(64, dtype=torch.int32)

    result, _ = run_broken(broken_copy(folder, tmp_path, edit), tmp_path, folder)
    assert result.returncode == 1
    assert "'pooler.dense.bias' is I32, the architecture expects floating-point weights" in result.stderr


@pytest.mark.parametrize("inputs, message", [
    ({"attention_mask": torch.ones(1, 4, dtype=torch.long)}, "missing input 'input_ids' (given: 'attention_mask')"),
    ({"input_ids": torch.tensor([[1, 2, 5000]])}, "input 'input_ids' holds id 5000, outside [0, 1000)"),
    ({"input_ids": torch.tensor([[1.0, 2.0]])}, "input 'input_ids': expected integer token ids [batch, sequence], found float32 [1, 2]"),
    ({"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 3)}, "input 'attention_mask' is [1, 3] but input_ids is [1, 2]"),
    ({"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 7]])}, "input 'attention_mask' must hold only 0 and 1"),
    ({"input_ids": torch.ones(1, 65, dtype=torch.long)}, "input 'input_ids' has 65 tokens; this model takes at most 64"),
    # A name the model does not read is refused, never dropped: a misspelled mask would change the answer.
    ({"input_ids": torch.tensor([[1, 2]]), "attention_masks": torch.ones(1, 2)},
     "input 'attention_masks' is not one this model takes; did you mean 'attention_mask'? "
     "(it takes input_ids, attention_mask, position_ids)"),
    ({"input_ids": torch.tensor([[1, 2]]), "token_type_ids": torch.zeros(1, 2, dtype=torch.long)},
     "input 'token_type_ids' is not one this model takes (it takes input_ids, attention_mask, position_ids)"),
])
def test_bad_inputs_are_named(witnesses, tmp_path, inputs, message):
    folder = witnesses["gpt2", "float32"]
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n')
    save_file(inputs, tmp_path / "in.safetensors")
    result = vramctl("run", config, "--input", tmp_path / "in.safetensors")
    assert result.returncode == 1
    assert str(tmp_path / "in.safetensors") in result.stderr and message in result.stderr


@pytest.mark.parametrize("extra, message", [
    ('architecture = "gpt3"\n', "unknown architecture 'gpt3' (known: bert, "),
    ('[arch]\nn_head = 5\n', "n_embd (64) must be a multiple of n_head (5)"),
    ('[arch]\nn_layer = "two"\n', "hyperparameter 'n_layer': expected an integer, found \"two\""),
    ('[arch]\nactivation_function = "swiglu"\n',
     "hyperparameter 'activation_function': expected one of 'gelu', 'gelu_new', 'gelu_pytorch_tanh', 'quick_gelu', "
     "'silu', 'swish', 'relu', found \"swiglu\""),
])
def test_bad_hyperparameters_are_named(witnesses, tmp_path, extra, message):
    folder = witnesses["gpt2", "float32"]
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n{extra}')
    result = vramctl("run", config)
    assert result.returncode == 1
    assert str(config) in result.stderr and message in result.stderr


def test_a_checkpoint_without_config_json_needs_its_hyperparameters(witnesses, tmp_path):
    folder = witnesses["gpt2", "float32"]
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model" / "model.safetensors"}"\narchitecture = "gpt2"\n')
    assert vramctl("run", config).returncode == 0  # config.json beside the file is found
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "model.safetensors").write_bytes((folder / "model" / "model.safetensors").read_bytes())
    config.write_text(f'checkpoint = "{lone}"\narchitecture = "gpt2"\n')
    result = vramctl("run", config)
    # Every missing key at once, not one per try.
    assert result.returncode == 1
    assert ("5 missing hyperparameters: 'n_embd' (an integer), 'n_layer' (an integer), 'n_head' (an integer), "
            "'vocab_size' (an integer), 'n_positions' (an integer); set them in config.json or [arch]") in result.stderr
    config.write_text(f'checkpoint = "{lone}"\narchitecture = "gpt2"\n[arch]\nn_embd = 64\nn_head = 4\n'
                      'vocab_size = 1000\nn_positions = 64\n')
    result = vramctl("run", config)
    assert result.returncode == 1
    assert "missing hyperparameter 'n_layer' (an integer; set it in config.json or [arch])" in result.stderr
    config.write_text(f'checkpoint = "{lone}"\narchitecture = "gpt2"\n[arch]\nn_embd = 64\nn_head = 4\n'
                      'vocab_size = 1000\nn_positions = 64\nn_layer = 2\n')
    result = vramctl("run", config, "--input", folder / "inputs.safetensors", "--output", tmp_path / "o.safetensors")
    assert result.returncode == 0, result.stderr


def test_a_nanogpt_checkpoint_loads_through_the_shipped_converter(witnesses, tmp_path):
    # The GPT-2 witness re-saved the way nanoGPT saves a compiled model: torch.save of a
    # state dict, nn.Linear projections, an explicit lm_head, keys under "_orig_mod.".
    folder = witnesses["gpt2", "float32"]
    tensors = load_file(folder / "model" / "model.safetensors")
    linear = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    nano = {k: (v.t().contiguous() if k.endswith(linear) else v) for k, v in tensors.items()}
    nano["lm_head.weight"] = nano["transformer.wte.weight"]
    torch.save({"_orig_mod." + k: v for k, v in nano.items()}, tmp_path / "ckpt.pt")
    converters = Path(__file__).resolve().parents[2] / "scripts" / "converters"
    config = tmp_path / "nano.toml"
    config.write_text(f'checkpoint = "ckpt.pt"\nprefix = "_orig_mod."\narchitecture = "gpt2"\n'
                      f'converter = "{converters / "nanogpt.lua"}"\n'
                      "[arch]\nn_embd = 64\nn_head = 4\nn_layer = 2\nvocab_size = 1000\nn_positions = 64\n")
    output = tmp_path / "out.safetensors"
    result = vramctl("run", config, "--input", folder / "inputs.safetensors", "--output", output)
    assert result.returncode == 0, result.stderr
    expected = load_file(folder / "expected.safetensors")
    assert close(load_file(output)["logits"], expected["logits"])
    # Without the converter the layouts clash, and the error says where.
    config.write_text(config.read_text().replace(f'converter = "{converters / "nanogpt.lua"}"\n', ""))
    result = vramctl("run", config)
    assert result.returncode == 1
    assert "'transformer.h.0.mlp.c_fc.weight' is [256, 64], the architecture expects [64, 256]" in result.stderr


def test_a_nanogpt_training_checkpoint_without_biases_loads_as_train_py_saves_it(witnesses, tmp_path):
    # train.py's default: bias=False, exact GELU, a compiled model, and a ckpt.pt holding the
    # optimizer state and model_args beside the weights. The witness is transformers' GPT-2 with
    # the same weights, zero biases and activation "gelu".
    import transformers
    folder = witnesses["gpt2", "float32"]
    inputs = load_file(folder / "inputs.safetensors")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_head=4, n_layer=2, vocab_size=1000, n_positions=64, activation_function="gelu")).eval()
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if name.endswith(".bias"):
                parameter.zero_()
        expected = hf(**{k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}).logits
    linear = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    weights = {k: (v.t().contiguous() if k.endswith(linear) else v.clone())
               for k, v in hf.state_dict().items() if not k.endswith(".bias") and ".attn.bias" not in k}
    optimizer = torch.optim.AdamW(hf.parameters())
    hf(input_ids=inputs["input_ids"]).logits.sum().backward()
    optimizer.step()
    torch.save({"model": {"_orig_mod." + k: v for k, v in weights.items()}, "optimizer": optimizer.state_dict(),
                "model_args": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "bias": False,
                               "vocab_size": 1000, "dropout": 0.0},
                "iter_num": 100, "best_val_loss": torch.tensor(2.5), "config": {"learning_rate": 6e-4}},
               tmp_path / "ckpt.pt")
    converters = Path(__file__).resolve().parents[2] / "scripts" / "converters"
    arch = ('[arch]\nn_embd = 64\nn_head = 4\nn_layer = 2\nvocab_size = 1000\nn_positions = 64\n'
            'activation_function = "gelu"\n')
    config = tmp_path / "nano.toml"
    output = tmp_path / "out.safetensors"
    # The converter tells a model without biases by their absence; bias = false says it outright.
    for bias in ["", "bias = false\n"]:
        config.write_text(f'checkpoint = "ckpt.pt"\nprefix = "model._orig_mod."\narchitecture = "gpt2"\n'
                          f'converter = "{converters / "nanogpt.lua"}"\n{arch}{bias}')
        result = vramctl("run", config, "--input", folder / "inputs.safetensors", "--output", output)
        assert result.returncode == 0, result.stderr
        assert close(load_file(output)["logits"], expected)
    # bias = true, which the checkpoint contradicts, is refused saying what to set.
    config.write_text(config.read_text().replace("bias = false\n", "bias = true\n"))
    result = vramctl("run", config)
    assert result.returncode == 1, result.stderr
    assert ("bias = true in [arch], but the checkpoint has no bias tensors (a model trained with bias=False); "
            "set bias = false, or leave bias out") in result.stderr, result.stderr


def test_a_family_is_not_forced_on_a_checkpoint_of_another(tmp_path):
    # Gemma's weights have LLaMA's names and shapes: forced to load as "llama", they used to load
    # without a word and give all-zero logits. The checkpoint's model_type now has the last word,
    # unless [arch] overrides it on purpose.
    import transformers
    config = transformers.GemmaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    transformers.GemmaForCausalLM(config).save_pretrained(tmp_path / "gemma")
    toml = tmp_path / "gemma.toml"
    toml.write_text(f'checkpoint = "{tmp_path / "gemma"}"\narchitecture = "llama"\n')
    result = vramctl("run", toml)
    assert result.returncode == 1
    assert str(toml) in result.stderr and ("the checkpoint's model_type is 'gemma', which architecture 'llama' does "
                                           "not declare") in result.stderr, result.stderr
    toml.write_text(f'checkpoint = "{tmp_path / "gemma"}"\narchitecture = "llama"\n[arch]\nmodel_type = "llama"\n')
    assert vramctl("run", toml).returncode == 0


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_router_logits_are_transformers_when_asked_for(witnesses, case, tmp_path):
    # transformers' output_router_logits: each sparse layer's [tokens, experts], stacked; the
    # dense layer of qwen2_moe has none.
    import transformers
    folder = witnesses[case, "float32"]
    model_class = getattr(transformers, transformers.AutoConfig.from_pretrained(folder / "model").architectures[0])
    model = model_class.from_pretrained(folder / "model").eval()
    inputs = load_file(folder / "inputs.safetensors")
    with torch.no_grad():
        expected = torch.stack(model(**inputs, output_router_logits=True).router_logits)
    assert expected.shape[0] == 2  # qwen2_moe's layer 1 is dense and has no router
    for flag, wanted in [(torch.tensor(True), True), (torch.tensor([0]), False)]:
        save_file({**inputs, "output_router_logits": flag}, tmp_path / "in.safetensors")
        config = tmp_path / "model.toml"
        config.write_text(f'checkpoint = "{folder / "model"}"\n')
        result = vramctl("run", config, "--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors")
        assert result.returncode == 0, result.stderr
        got = load_file(tmp_path / "out.safetensors")
        assert ("router_logits" in got) == wanted
        if wanted:
            assert got["router_logits"].shape == expected.shape
            assert close(got["router_logits"], expected)
    save_file({**inputs, "output_router_logits": torch.tensor(2)}, tmp_path / "in.safetensors")
    result = vramctl("run", config, "--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors")
    assert result.returncode != 0 and "input 'output_router_logits' must be one element, 0 or 1" in result.stderr
