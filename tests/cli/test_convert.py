"""vramctl convert, driven as a user would: real files, a real converter script."""
import json
import os
import subprocess

import torch
from safetensors.torch import load_file, save_file

VRAMCTL = os.environ["VRAMCTL"]


def vramctl(*args):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=120)


def setup(tmp_path, script):
    save_file({"a.weight": torch.arange(6.0).reshape(2, 3), "b.weight": torch.ones(3)}, tmp_path / "ck.safetensors")
    (tmp_path / "convert.lua").write_text(script)
    config = tmp_path / "m.toml"
    config.write_text('checkpoint = "ck.safetensors"\nconverter = "convert.lua"\n')
    return config


def test_convert_prints_targets_with_dtype_shape_and_expression(tmp_path):
    config = setup(tmp_path, 'print("converting")\nreturn { ["x.weight"] = src["a.weight"]:t() }\n')
    result = vramctl("convert", config)
    assert result.returncode == 0, result.stderr
    assert "  x.weight  F32      [3, 2]  = transpose(src['a.weight'], 0, 1)\n" in result.stdout
    assert "1 source tensors are not used: b.weight" in result.stdout
    assert "print: converting" in result.stderr


def test_convert_output_writes_the_evaluated_checkpoint(tmp_path):
    config = setup(tmp_path, 'return { x = src["a.weight"]:t():cast("bfloat16") }\n')
    result = vramctl("convert", config, "--output", tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"wrote 1 tensor, 12 B, to {tmp_path / 'out.safetensors'}\n"  # said, beside the plan
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["x"], torch.arange(6.0).reshape(2, 3).t().to(torch.bfloat16))


def test_without_a_converter_every_key_maps_to_itself(tmp_path):
    config = setup(tmp_path, "")
    config.write_text('checkpoint = "ck.safetensors"\n')
    doc = json.loads(vramctl("convert", config, "--json").stdout)
    assert doc["tensors"]["a.weight"] == {"dtype": "F32", "shape": [2, 3], "expression": "src['a.weight']"}


def test_a_broken_converter_is_one_line_naming_the_script_and_line(tmp_path):
    config = setup(tmp_path, 'local out = {}\nout.x = src["a.weight"]:reshape({4, 2})\nreturn out\n')
    result = vramctl("convert", config)
    assert result.returncode == 1
    assert result.stderr == (f"vramctl convert: {tmp_path / 'convert.lua'}:2: reshape of src['a.weight'] (shape [2, 3]): "
                             "[4, 2] holds 8 elements, the tensor 6\n")


def test_a_converter_that_escapes_is_stopped_and_named(tmp_path):
    config = setup(tmp_path, 'os.execute("touch escaped")\n')
    result = vramctl("convert", config)
    assert result.returncode == 1
    assert result.stderr == f"vramctl convert: {tmp_path / 'convert.lua'}:1: unknown global 'os'\n"
    assert not (tmp_path / "escaped").exists()



def test_what_a_converter_prints_or_names_reaches_the_terminal_escaped(tmp_path):
    # A downloaded converter is sandboxed, and so is its output: no newline or escape sequence of
    # its own reaches the terminal, and a name that is not UTF-8 is refused by name.
    config = setup(tmp_path, 'print("hi\\27[2J", "two\\nlines")\nreturn { ["x\\n\\27[31m"] = src["a.weight"] }\n')
    result = vramctl("convert", config)
    assert result.returncode == 0, result.stderr
    assert "print: hi\\x1b[2J\ttwo\\x0alines\n" in result.stderr
    assert "  x\\x0a\\x1b[31m  F32" in result.stdout
    assert {c for c in result.stdout + result.stderr if ord(c) < 0x20} == {"\n", "\t"}
    config = setup(tmp_path, 'return { ["x\\255"] = src["a.weight"] }\n')
    for args in [(), ("--json",), ("--output", tmp_path / "out.safetensors")]:
        result = vramctl("convert", config, *args)
        assert result.returncode == 1
        assert result.stderr == (f"vramctl convert: {tmp_path / 'convert.lua'}: target 'x\\xff' is not valid UTF-8, "
                                 "as safetensors and vramd's replies need\n")
    assert not (tmp_path / "out.safetensors").exists()


def test_arch_is_the_merged_hyperparameters_in_convert_and_check(tmp_path):
    # arch: config.json beside the checkpoint, with the model config's [arch] merged over it,
    # the same table the architecture reads; vramctl convert and check see what a load sees.
    config = setup(tmp_path, 'assert(arch.vocab_size == 7, "config.json not seen")\n'
                             'assert(arch.hidden_size == 3, "[arch] not merged over config.json")\n'
                             'return { x = src["a.weight"]:reshape({arch.n_heads, arch.hidden_size}) }\n')
    (tmp_path / "config.json").write_text('{"vocab_size": 7, "hidden_size": 99, "n_heads": 5}')
    config.write_text('checkpoint = "ck.safetensors"\nconverter = "convert.lua"\n[arch]\nhidden_size = 3\nn_heads = 2\n')
    result = vramctl("convert", config, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tensors"]["x"]["shape"] == [2, 3]
    result = vramctl("check", config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ok    {config}: model 'm', 1 tensor, 24 B\n" in result.stdout, result.stdout
