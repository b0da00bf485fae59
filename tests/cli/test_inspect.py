"""vramctl inspect, driven as a user would, with the reference safetensors package as witness."""
import json
import os
import struct
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

VRAMCTL = os.environ["VRAMCTL"]


def vramctl(*args):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=120)


def raw_file(header, data=b"", declared=None):
    header = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(header) if declared is None else declared) + header + data


def tensor(name, dtype, shape, begin, end):
    return f'"{name}":{{"dtype":"{dtype}","shape":{json.dumps(shape)},"data_offsets":[{begin},{end}]}}'


def test_inspect_json_matches_what_safetensors_reports(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {
        "embed.weight": torch.randn(10, 4).to(torch.bfloat16),
        "layers.0.q.weight": torch.randn(4, 4),
        "layers.0.q.scale": torch.ones(4).to(torch.float8_e4m3fn),
        "step": torch.tensor(3, dtype=torch.int64),
        "mask": torch.ones(2, 2, dtype=torch.bool),
    }
    save_file(tensors, path, metadata={"format": "pt", "note": "hello"})
    result = vramctl("inspect", path, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    with safe_open(path, framework="pt") as f:
        assert sorted(doc["tensors"]) == sorted(f.keys())
        for key in f.keys():
            piece = f.get_slice(key)
            assert doc["tensors"][key]["dtype"] == piece.get_dtype()
            assert doc["tensors"][key]["shape"] == list(piece.get_shape())
        assert doc["files"][0]["metadata"] == f.metadata()
    assert doc["total_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert doc["totals"]["BF16"] == {"tensors": 1, "bytes": 80}


def test_inspect_text_lists_names_dtypes_shapes_sizes_and_totals(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(3, 5), "b.bias": torch.zeros(7, dtype=torch.float16)}, path)
    result = vramctl("inspect", path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:4] == ["a.weight", "F32", "[3,", "5]"] for line in lines), result.stdout
    assert any(line.split()[:3] == ["b.bias", "F16", "[7]"] for line in lines), result.stdout
    assert "all      2 tensors  74 B" in result.stdout



def test_inspect_text_escapes_control_bytes_from_the_checkpoint(tmp_path):
    # A newline or a terminal's escape sequence in a name or metadata value is printed escaped.
    path = tmp_path / "hostile.safetensors"
    header = {"__metadata__": {"note\x07": "two\nlines\x1b[2J"},
              "evil\x1b[31m.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    path.write_bytes(raw_file(json.dumps(header), b"abcd"))
    result = vramctl("inspect", path)
    assert result.returncode == 0, result.stderr
    assert {c for c in result.stdout if ord(c) < 0x20} == {"\n"}, repr(result.stdout)
    assert "    note\\x07 = two\\x0alines\\x1b[2J\n" in result.stdout
    assert any(line.split()[:2] == ["evil\\x1b[31m.w", "F32"] for line in result.stdout.splitlines()), result.stdout


def test_inspect_takes_one_model_out_of_a_multi_model_file(tmp_path):
    path = tmp_path / "pipeline.safetensors"
    save_file({"vae.w": torch.zeros(2), "unet.w": torch.zeros(3), "unet.b": torch.zeros(1)}, path)
    doc = json.loads(vramctl("inspect", path, "--prefix", "unet.", "--json").stdout)
    assert sorted(doc["tensors"]) == ["b", "w"]
    kept = json.loads(vramctl("inspect", path, "--prefix", "unet.", "--keep-prefix", "--json").stdout)
    assert sorted(kept["tensors"]) == ["unet.b", "unet.w"]


def test_inspect_reads_a_sharded_checkpoint_through_its_index(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    doc = json.loads(vramctl("inspect", tmp_path, "--json").stdout)
    assert doc["tensors"]["b"]["file"].endswith("model-00002-of-00002.safetensors")
    assert len(doc["files"]) == 2


def test_a_folder_is_read_as_hugging_face_reads_it(tmp_path):
    weights = {"w": torch.ones(4)}
    save_file({"input_ids": torch.tensor([[1, 2]])}, tmp_path / "inputs.safetensors")
    save_file(weights, tmp_path / "optimizer.safetensors")
    refused = vramctl("inspect", tmp_path)
    assert refused.returncode == 1
    assert "holds 2 checkpoint files (inputs.safetensors, optimizer.safetensors)" in refused.stderr
    assert f'checkpoint = "{tmp_path}/*.safetensors"' in refused.stderr
    save_file(weights, tmp_path / "model.safetensors")
    result = vramctl("inspect", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report["tensors"]) == ["w"]
    assert report["warnings"] == [f"{tmp_path}: loading model.safetensors as Hugging Face would; inputs.safetensors, "
                                  f'optimizer.safetensors beside it left out (checkpoint = "{tmp_path}/*.safetensors" '
                                  "loads them all)"]


def test_inspect_reads_a_pytorch_state_dict_lazily(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(5, 2).to(torch.bfloat16))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # an OrderedDict with _metadata
    result = vramctl("inspect", tmp_path / "pytorch_model.bin", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["files"][0]["format"] == "pytorch-pickle"
    expected = {k: ([v.shape[i] for i in range(v.dim())], str(v.dtype)) for k, v in model.state_dict().items()}
    dtypes = {"torch.float32": "F32", "torch.bfloat16": "BF16"}
    assert {k: (v["shape"], v["dtype"]) for k, v in doc["tensors"].items()} == {
        k: (shape, dtypes[dtype]) for k, (shape, dtype) in expected.items()}
    assert result.stderr == ""


def test_a_training_checkpoint_is_flattened_and_its_non_tensors_left_out(tmp_path):
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3, "lr": 0.1}, tmp_path / "train.pt")
    result = vramctl("inspect", tmp_path / "train.pt", "--prefix", "model.", "--json")
    assert result.returncode == 0, result.stderr
    assert list(json.loads(result.stdout)["tensors"]) == ["w"]
    assert "2 entries that are not tensors were left out" in result.stderr


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


PICKLES_REFUSED = [
    ("runs-code", lambda: {"w": torch.zeros(1), "evil": RunsCode()}, {}, "GLOBAL 'posix.system' is not a global torch.load(weights_only=True) allows"),
    ("not-a-dict", lambda: [torch.zeros(2)], {}, "data.pkl holds a list, not a state dict"),
    ("no-tensors", lambda: {"epoch": 1}, {}, "holds no tensors"),
    ("transposed", lambda: {"t": torch.zeros(3, 4).t()}, {}, "tensor 't' is not contiguous in its storage"),
    ("legacy", lambda: {"w": torch.zeros(2)}, {"_use_new_zipfile_serialization": False}, "not a torch.save zip checkpoint"),
]


@pytest.mark.parametrize("case,make,options,message", PICKLES_REFUSED, ids=[c[0] for c in PICKLES_REFUSED])
def test_pickles_that_are_not_plain_state_dicts_are_refused_without_running_them(tmp_path, case, make, options, message):
    path = tmp_path / f"{case}.pt"
    torch.save(make(), path, **options)
    result = vramctl("inspect", path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"vramctl inspect: {path}: "), lines[0]
    assert message in lines[0]
    assert not (tmp_path / "should-not-exist").exists()


OK = tensor("w", "F32", [1], 0, 4)

# (case, file bytes, the one line vramctl prints after the path)
MALFORMED = [
    ("too-short", b"abc", "file is 3 bytes, too small to hold a safetensors header length"),
    ("huge-header", raw_file("{}", declared=100_000_001), "header length 100000001 exceeds the limit"),
    ("header-past-end", raw_file("{}", declared=99), "header length 99 runs past the end of the file"),
    ("no-brace", raw_file(" {}"), "header does not start with '{'"),
    ("bad-utf8", raw_file(b'{"w\xff": 1}'), "header is not valid UTF-8"),
    ("bad-json", raw_file('{"w": {'), "header is not valid JSON"),
    ("tensor-not-object", raw_file('{"w": [1]}'), "tensor 'w' is an array, not an object"),
    ("missing-dtype", raw_file('{"w":{"shape":[],"data_offsets":[0,0]}}'), "tensor 'w' has no dtype"),
    ("unknown-dtype", raw_file("{" + tensor("w", "F31", [1], 0, 4) + "}", b"abcd"), "unknown dtype 'F31'"),
    ("negative-dim", raw_file("{" + tensor("w", "F32", [-1], 0, 4) + "}", b"abcd"), "below zero"),
    ("end-before-start", raw_file("{" + tensor("h.0.w", "F32", [2], 16, 8) + "}", b"x" * 16),
     "tensor 'h.0.w' has data_offsets [16, 8]: end before start"),
    ("truncated", raw_file("{" + tensor("w", "F32", [4], 0, 16) + "}", b"x" * 8), "is the file truncated?"),
    ("size-mismatch", raw_file("{" + tensor("w", "F32", [2, 3], 0, 20) + "}", b"x" * 20),
     "shape [2, 3] of F32 (24 bytes) but data_offsets [0, 20] span 20 bytes"),
    ("overflow", raw_file("{" + tensor("w", "F32", [2**32, 2**32], 0, 0) + "}"), "element count overflows"),
    ("overlap", raw_file("{" + tensor("a", "F32", [2], 0, 8) + "," + tensor("b", "F32", [1], 4, 8) + "}", b"x" * 8),
     "tensor 'b' has data_offsets [4, 8] overlapping tensor 'a'"),
    ("hole", raw_file("{" + tensor("a", "F32", [1], 0, 4) + "," + tensor("b", "F32", [1], 8, 12) + "}", b"x" * 12),
     "leaving a hole of 4 bytes at offset 4"),
    ("trailing", raw_file("{" + OK + "}", b"abcdefg"), "3 trailing bytes after the last tensor"),
    ("duplicate", raw_file("{" + OK + "," + OK + "}", b"abcd"), "header has the tensor 'w' twice"),
    ("metadata-not-string", raw_file('{"__metadata__":{"n":1}}'), "metadata values must be strings"),
]


@pytest.mark.parametrize("case,data,message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_files_are_refused_with_one_clear_line(tmp_path, case, data, message):
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    result = vramctl("inspect", path)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"vramctl inspect: {path}: "), lines[0]
    assert message in lines[0], lines[0]


# Where vramd is stricter than the reference, on purpose: it accepts these two.
STRICTER_THAN_REFERENCE = {"duplicate", "no-brace"}


def reference_refuses(path):
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("case,data,message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_the_reference_refuses_each_malformed_file_but_the_two_we_are_stricter_on(tmp_path, case, data, message):
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    assert reference_refuses(path) == (case not in STRICTER_THAN_REFERENCE)


def test_a_model_config_given_to_inspect_is_pointed_to_convert(tmp_path):
    """A model config is no checkpoint: inspect says which command shows its converted names,
    instead of reading its text as a safetensors header."""
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{tmp_path / "model.safetensors"}"\n')
    result = vramctl("inspect", config)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"vramctl inspect: {config}: is a model config, not a checkpoint: `vramctl convert {config}` "
                             "shows the tensors its converter makes, `vramctl check` checks it whole\n"), result.stderr
    assert "w" in vramctl("convert", config).stdout
