"""vramctl plan against accelerate's infer_auto_device_map: the same transformers model built
under accelerate.init_empty_weights from the checkpoint's config.json, with the architecture's
block class as no_split_module_classes, must put every weight-holding layer on the same device
as vramd's plan, for budgets that keep it on one device and budgets that spread it over
cuda:0, cuda:1, cpu and disk (no GPU is needed: both only plan).

Differences between the two models that are not the planner's, handled here explicitly:
- transformers 5 does not tie weights under init_empty_weights: the witness calls tie_weights()
  (accelerate would otherwise warn and plan lm_head as an independent layer);
- the witness holds buffers vramd does not (LLaMA's rotary inv_freq, BERT's position_ids and
  token_type_ids), which accelerate counts in module sizes; they are removed so that both plan
  the same bytes and agreement can be asserted to the byte at every budget;
- accelerate names GPUs by integers: cuda:N is passed as N and N read back as cuda:N;
- a checkpoint of the bare base model is planned by vramd as the model with its head (names
  under "model.", lm_head tied): the witness is the bare model, its names get the prefix, and
  the extra lm_head is checked on its own.
"""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import accelerate
import pytest
import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
CASES = ["llama", "llama3", "gpt2", "bert", "roberta"]  # llama3 and gpt2 tie lm_head to the embeddings


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    made = {case: hf_models.make(case, "float32", out) / "model" for case in CASES}
    # The bare base model of llama3 (no "model." prefix, no lm_head; tied embeddings).
    config, _ = hf_models.CASES["llama3"]()
    T.LlamaModel(config).save_pretrained(out / "llama3-base", safe_serialization=True)
    made["llama3-base"] = out / "llama3-base"
    return made


def witness(folder):
    """The transformers model of the checkpoint on the meta device, as accelerate plans it."""
    config = T.AutoConfig.from_pretrained(folder)
    model_class = getattr(T, config.architectures[0])
    with accelerate.init_empty_weights():
        model = model_class(config)
    model.tie_weights()
    for module in model.modules():
        module._buffers.clear()
        module._non_persistent_buffers_set.clear()
    return model


def block_class(model):
    """The class of the modules vramd never divides: the first one under a numeric name."""
    for name, module in model.named_modules():
        if any(part.isdigit() for part in name.split(".")):
            return type(module).__name__
    raise AssertionError("no blocks")


def leaves(model):
    return [name for name, module in model.named_modules() if next(module.parameters(recurse=False), None) is not None]


def covering(name, keys):
    """The device of the longest key that is `name` or holds it ("" holds everything)."""
    best = None
    for key in keys:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    assert best is not None, f"{name} is in no entry"
    return best


def accelerate_plan(model, budgets, dtype):
    max_memory = {int(k[5:]) if k.startswith("cuda:") else k: v for k, v in budgets.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Device 0 is not available": planning needs none
        device_map = accelerate.infer_auto_device_map(model, max_memory=max_memory, dtype=dtype,
                                                      no_split_module_classes=[block_class(model)])
    return {k: f"cuda:{v}" if isinstance(v, int) else v for k, v in device_map.items()}


def accelerate_balanced(model, budgets, dtype, low_zero):
    """accelerate's get_balanced_memory for these budgets (cuda:N as N), as transformers'
    device_map="balanced" and "balanced_low_0" call it, then its map on what it gives."""
    max_memory = {int(k[5:]) if k.startswith("cuda:") else k: v for k, v in budgets.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        balanced = accelerate.utils.get_balanced_memory(model, max_memory=max_memory, dtype=dtype, low_zero=low_zero,
                                                        no_split_module_classes=[block_class(model)])
    return {f"cuda:{k}" if isinstance(k, int) else k: int(v) for k, v in balanced.items()}


def vramctl_plan(config, budgets, dtype=None, daemon_config=None, strategy=None):
    args = [VRAMCTL, "plan", config, "--json", "--max-memory", ",".join(f"{k}={v}" for k, v in budgets.items())]
    if dtype:
        args += ["--dtype", dtype]
    if strategy:
        args += ["--strategy", strategy]
    if daemon_config:
        args += ["--daemon-config", daemon_config]
    result = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture()
def config_for(checkpoints, tmp_path):
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')

    def write(case):
        config = tmp_path / f"{case}.toml"
        config.write_text(f'checkpoint = "{checkpoints[case]}"\n')
        return config, tmp_path / "vramd.toml"
    return write


def settings(units):
    """Budgets in bytes that keep the model whole, spill it, and sit on the edges of units."""
    sizes = [unit["bytes"] for unit in units]
    total, largest = sum(sizes), max(sizes)
    first_two = sum(sizes[:2])
    return [
        {"cuda:0": "1GiB"},
        {"cpu": "1GiB"},
        {"cuda:0": total + largest},                  # fits beside the reserve
        {"cuda:0": total},                            # fits only once the largest unit is placed
        {"cuda:0": total // 2, "cpu": total // 4},    # spills to cpu, then disk
        {"cuda:0": total // 3, "cuda:1": total // 3, "cpu": total // 2},
        {"cuda:0": total // 4, "cuda:1": total // 4, "disk": total},
        {"cuda:1": total // 2, "cpu": total},         # the first GPU need not be cuda:0
        {"cuda:0": first_two + largest, "cpu": largest * 2},      # edges: exactly two units beside the reserve
        {"cuda:0": first_two + largest - 1, "cpu": largest * 2 + 1},
        {"cuda:0": largest - 1, "cuda:1": first_two + largest, "cpu": total // 3},  # nothing fits cuda:0
    ]


def compare(model, plan, budgets, dtype, prefix=""):
    expected = accelerate_plan(model, budgets, dtype)
    ours = {unit["name"]: unit["device"] for unit in plan["units"]}
    got = {}
    for leaf in leaves(model):
        name = prefix + leaf
        got[name] = ours[covering(name, ours)]
    want = {prefix + leaf: expected[covering(leaf, expected)] for leaf in leaves(model)}
    assert got == want, f"{budgets}: vramd {plan['units']} accelerate {expected}"
    return expected


@pytest.mark.parametrize("case", CASES)
def test_every_layer_goes_where_accelerate_puts_it(case, config_for, checkpoints):
    config, daemon = config_for(case)
    model = witness(checkpoints[case])
    units = vramctl_plan(config, {"cuda:0": "1TiB"}, daemon_config=daemon)["units"]
    # Both models have the same layers with the same bytes.
    ours = {unit["name"] for unit in units}
    assert {covering(leaf, ours) for leaf in leaves(model)} == ours
    for budgets in settings(units):
        compare(model, vramctl_plan(config, budgets, daemon_config=daemon), budgets, torch.float32)


def in_bytes(budgets):
    return {k: v if isinstance(v, int) else accelerate.utils.convert_file_size_to_int(v) for k, v in budgets.items()}


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_0"])
@pytest.mark.parametrize("case", CASES)
def test_balanced_strategies_lower_the_budgets_and_place_as_accelerate_does(case, strategy, config_for, checkpoints):
    # transformers' device_map="balanced" and "balanced_low_0": get_balanced_memory, then
    # infer_auto_device_map on what it gives. Both the budgets and every layer's device agree.
    config, daemon = config_for(case)
    model = witness(checkpoints[case])
    units = vramctl_plan(config, {"cuda:0": "1TiB"}, daemon_config=daemon)["units"]
    total = sum(unit["bytes"] for unit in units)
    lowered = 0
    # accelerate 1.15's get_balanced_memory cannot read "disk" in max_memory (torch.device("disk")
    # raises), so the settings with disk are vramd's alone.
    for budgets in [b for b in settings(units) if "disk" not in b] + [{"cuda:0": total, "cuda:1": total, "cpu": total},
                                      {"cuda:0": total, "cuda:1": total, "cuda:2": total},
                                      {"cuda:0": total // 3, "cuda:1": total, "cuda:2": total // 2, "cpu": total}]:
        plan = vramctl_plan(config, budgets, daemon_config=daemon, strategy=strategy)
        assert plan["strategy"] == strategy and plan["max_memory"] == in_bytes(budgets), plan["max_memory"]
        balanced = accelerate_balanced(model, budgets, torch.float32, strategy == "balanced_low_0")
        assert {k: v for k, v in plan["budgets"].items() if k in balanced} == balanced, (budgets, plan["budgets"])
        lowered += balanced != in_bytes(budgets)
        compare(model, plan, balanced, torch.float32)
    assert lowered >= 3  # the balancing did something in most settings of several GPUs


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A Mixtral checkpoint's config, the daemon config beside it, and its witness."""
    folder = tmp_path_factory.mktemp("mixtral")
    checkpoint = hf_models.make("mixtral", "float32", folder) / "model"
    (folder / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    (folder / "mixtral.toml").write_text(f'checkpoint = "{checkpoint}"\n')
    return folder / "mixtral.toml", folder / "vramd.toml", witness(checkpoint)


def test_balanced_budgets_count_a_mixtures_experts_as_transformers_holds_them(mixtral):
    # accelerate keeps a Mixtral block whole and transformers 5 holds each block's experts as one
    # module: the budgets get_balanced_memory gives follow from those sizes. vramd places each
    # expert on its own after its block (test_a_mixtures_experts_are_units_of_their_own_after_their_block),
    # from the same budgets.
    config, daemon, model = mixtral
    total = sum(p.numel() * 4 for p in model.parameters())
    lowered = 0
    for strategy in ("balanced", "balanced_low_0"):
        for budgets in [{"cuda:0": total, "cuda:1": total}, {"cuda:0": total // 2, "cuda:1": total // 2, "cpu": total},
                        {"cuda:0": total, "cuda:1": total, "cuda:2": total, "cpu": total}]:
            plan = vramctl_plan(config, budgets, daemon_config=daemon, strategy=strategy)
            balanced = accelerate_balanced(model, budgets, torch.float32, strategy == "balanced_low_0")
            assert {k: v for k, v in plan["budgets"].items() if k in balanced} == balanced, (strategy, budgets)
            lowered += balanced != in_bytes(budgets)
    assert lowered >= 4, lowered


def test_the_printed_balanced_map_says_which_budgets_it_lowered(config_for):
    config, daemon = config_for("llama")
    result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon), "--strategy", "balanced",
                             "--max-memory", "cuda:0=1MiB,cuda:1=1MiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("balanced, as accelerate's get_balanced_memory: cuda:0 ") and \
        lines[1].endswith(" of 1.00 MiB"), lines
    assert any(" -> cuda:1 " in line for line in lines), lines  # spread, not all on cuda:0
    result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon), "--strategy", "even",
                             "--max-memory", "cuda:0=1MiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--strategy" in result.stderr and "even" in result.stderr, result.stderr


def unit_of(path):
    """vramd's unit of a layer (model/device_map.hpp): the path up to its first all-digit part."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return path


def test_every_family_lists_its_units_in_transformers_module_order(tmp_path):
    # accelerate places units in the order of the model's modules, so a plan in another order
    # differs from accelerate's wherever a budget ends between two units that were swapped.
    # transformers may hold a module whose weights are all another's (T5's encoder.embed_tokens
    # is `shared`); vramd holds no layer for it, which changes no placement.
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    differ = {}
    for case in hf_models.CASES:
        config, model_class, *options = hf_models.CASES[case]()
        model = model_class(config, **(options[0] if options else {}))
        folder = tmp_path / case
        model.save_pretrained(folder, safe_serialization=True)
        (tmp_path / f"{case}.toml").write_text(f'checkpoint = "{folder}"\n')
        units = vramctl_plan(tmp_path / f"{case}.toml", {"cpu": "1TiB"}, daemon_config=tmp_path / "vramd.toml")["units"]
        got = [unit["name"] for unit in units]
        seen, expected, borrowed = set(), [], set()
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            if all(id(p) in seen for p in own):
                borrowed.add(unit_of(name))
            seen.update(id(p) for p in own)
            expected.append(unit_of(name))
        expected = list(dict.fromkeys(expected))
        # A checkpoint without the wrapper's prefix (CLIPTextModel's) is planned under it.
        prefix = got[0][:-len(expected[0])] if got[0].endswith("." + expected[0]) else ""
        # An expert is a unit of vramd's own (transformers holds a mixture's experts as one
        # module): it follows its block, so each block's units come in the block's place.
        got = list(dict.fromkeys(unit_of(name.removeprefix(prefix)) for name in got))
        if [u for u in expected if u not in borrowed or u in got] != got:
            differ[case] = (got, expected)
    assert not differ, "\n".join(f"{case}: vramd {got}, transformers {want}" for case, (got, want) in differ.items())


@pytest.mark.parametrize("case", ["llama3", "bert"])
def test_the_planning_dtype_sizes_the_layers_as_accelerate_dtype_does(case, config_for, checkpoints):
    config, daemon = config_for(case)
    model = witness(checkpoints[case])
    plan = vramctl_plan(config, {"cpu": "1GiB"}, dtype="bfloat16", daemon_config=daemon)
    assert plan["dtype"] == "bfloat16"
    total = sum(unit["bytes"] for unit in plan["units"])
    for budgets in [{"cuda:0": total // 2, "cpu": total // 4}, {"cuda:0": total // 3, "cuda:1": total // 3}]:
        compare(model, vramctl_plan(config, budgets, dtype="bfloat16", daemon_config=daemon), budgets, torch.bfloat16)


def test_tied_embeddings_and_head_share_a_device_when_the_model_spreads(config_for, checkpoints):
    config, daemon = config_for("gpt2")
    units = vramctl_plan(config, {"cuda:0": "1GiB"}, daemon_config=daemon)["units"]
    assert units[-1] == {"name": "lm_head", "device": "cuda:0", "bytes": 0}  # its weight is transformer.wte's
    size = {unit["name"]: unit["bytes"] for unit in units}
    block = size["transformer.h.0"]
    # cuda:0 holds the embeddings beside room for a block, cpu one block beside room for the next.
    budgets = {"cuda:0": size["transformer.wte"] + size["transformer.wpe"] + block, "cpu": 2 * block}
    plan = vramctl_plan(config, budgets, daemon_config=daemon)
    devices = {unit["name"]: unit["device"] for unit in plan["units"]}
    assert devices == {"transformer.wte": "cuda:0", "transformer.wpe": "cuda:0", "transformer.h.0": "cpu",
                       "transformer.h.1": "disk", "transformer.ln_f": "disk", "lm_head": "cuda:0"}
    assert plan["reserved_by_device"] == {"cuda:0": block, "cpu": size["transformer.ln_f"], "disk": 0}
    compare(witness(checkpoints["gpt2"]), plan, budgets, torch.float32)


def test_a_bare_base_model_checkpoint_is_planned_as_the_model_with_its_head(config_for, checkpoints):
    config, daemon = config_for("llama3-base")
    model = witness(checkpoints["llama3-base"])
    assert type(model).__name__ == "LlamaModel"
    units = vramctl_plan(config, {"cuda:0": "1TiB"}, daemon_config=daemon)["units"]
    assert [unit["name"] for unit in units][:1] + [unit["name"] for unit in units][-2:] == \
        ["model.embed_tokens", "model.norm", "lm_head"]
    for budgets in settings(units):
        plan = vramctl_plan(config, budgets, daemon_config=daemon)
        compare(model, plan, budgets, torch.float32, prefix="model.")
        devices = {unit["name"]: unit["device"] for unit in plan["units"]}
        assert devices["lm_head"] == devices["model.embed_tokens"]


def test_the_printed_map_has_a_row_per_unit_or_run_of_blocks_then_the_devices(config_for):
    config, daemon = config_for("llama")
    result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon),
                             "--max-memory", "cpu=1MiB,cuda:0=700KiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "model 'llama' (llama), float32: 837.25 KiB in 5 units\n"
        "  model.embed_tokens -> cuda:0  250.00 KiB\n"
        "  model.layers.0     -> cuda:0  168.50 KiB\n"
        "  model.layers.1     -> cpu     168.50 KiB\n"
        "  model.norm         -> cpu     256 B\n"
        "  lm_head            -> cpu     250.00 KiB\n"
        "cuda:0:  418.50 KiB of 700.00 KiB, 250.00 KiB kept free to bring in offloaded units\n"
        "cpu:     418.75 KiB of 1.00 MiB\n"
        "reserved: 250.00 KiB: the room the first GPU and cpu keep free to bring in the largest unit placed after "
        "them, as accelerate does\n")
    result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon), "--max-memory", "cuda:0=1GiB"],
                            capture_output=True, text=True, timeout=120)
    assert "  model.layers.0-1   -> cuda:0  337.00 KiB\n" in result.stdout
    assert result.stdout.endswith("cuda:0:  837.25 KiB of 1.00 GiB\nreserved: 0 B (no unit went past the first GPU or cpu)\n")


def test_a_malformed_max_memory_is_one_line_naming_the_option_and_the_bad_part(config_for):
    config, daemon = config_for("llama")
    for value, message in [
        ("cuda:0=2XB", "--max-memory: cuda:0: '2XB' is not a size"),
        ("gpu0=1GiB", "--max-memory: unknown device 'gpu0'; expected cuda:N, cpu or disk"),
        ("cuda:0=1GiB,cuda:0=2GiB", "--max-memory: cuda:0 is given twice"),
        ("cuda:0", "--max-memory: 'cuda:0' is not DEVICE=SIZE"),
        ("cuda:0=1GiB,,cpu=1GiB", "--max-memory: an empty entry in 'cuda:0=1GiB,,cpu=1GiB'"),
        ("", "--max-memory: no device given"),
    ]:
        result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon), "--max-memory", value],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, value
        assert result.stdout == ""
        assert result.stderr.startswith("vramctl plan: " + message), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


def test_a_full_disk_is_refused_with_what_does_not_fit(config_for):
    config, daemon = config_for("llama")
    result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon),
                             "--max-memory", "cpu=300KiB,disk=300KiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("vramctl plan: --max-memory: the model does not fit: "), result.stderr


def test_a_mixtures_experts_are_units_of_their_own_after_their_block(mixtral):
    # accelerate keeps a Mixtral block whole (its no_split class); vramd's plan holds in the block
    # only what every token runs through, and places each expert on its own after it, so that a
    # GPU can hold the shared parts of more blocks and the experts that fit.
    config, daemon, model = mixtral
    experts = model.config.num_local_experts
    units = vramctl_plan(config, {"cuda:0": "1TiB"}, daemon_config=daemon)["units"]
    names = [unit["name"] for unit in units]
    blocks = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert names == ["model.embed_tokens"] + [
        name for block in blocks
        for name in [block] + [f"{block}.block_sparse_moe.experts.{e}" for e in range(experts)]] + ["model.norm", "lm_head"]
    size = {unit["name"]: unit["bytes"] for unit in units}
    assert sum(size.values()) == sum(p.numel() * 4 for p in model.parameters())
    expert = 3 * model.config.hidden_size * model.config.intermediate_size * 4  # w1, w2, w3 in float32
    assert all(size[f"{block}.block_sparse_moe.experts.{e}"] == expert for block in blocks for e in range(experts))
    # cuda:0 keeps room for the largest unit (the embeddings) and holds the embeddings, block 0's
    # shared part and two of its experts; the rest goes to cpu.
    budget = 2 * size["model.embed_tokens"] + size["model.layers.0"] + 2 * expert
    plan = vramctl_plan(config, {"cuda:0": budget, "cpu": "1GiB"}, daemon_config=daemon)
    devices = {unit["name"]: unit["device"] for unit in plan["units"]}
    on_gpu = [name for name in names if devices[name] == "cuda:0"]
    assert on_gpu == ["model.embed_tokens", "model.layers.0", "model.layers.0.block_sparse_moe.experts.0",
                      "model.layers.0.block_sparse_moe.experts.1"]
    result = subprocess.run([VRAMCTL, "plan", str(config), "--daemon-config", str(daemon),
                             "--max-memory", f"cuda:0={budget},cpu=1GiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "  model.layers.0.block_sparse_moe.experts.0-1 -> cuda:0" in result.stdout
    assert f"  model.layers.0.block_sparse_moe.experts.2-{experts - 1} -> cpu   " in result.stdout
