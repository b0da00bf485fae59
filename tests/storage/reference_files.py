"""The reference safetensors package as a witness for vramd's reader and writer.

  reference_files.py write PATH   writes arange-valued tensors of many dtypes and layouts
  reference_files.py check PATH   checks a file vramd wrote: arange values, metadata kept
  reference_files.py write-pickle PATH   torch.save of a module's state dict, arange values
"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint16, torch.uint32, torch.uint64]

# The names vramd's test gives (LibTorch's spelling of each dtype).
WRITTEN_BY_VRAMD = {"Float": torch.float32, "BFloat16": torch.bfloat16, "Half": torch.float16,
                    "Long": torch.int64, "Float8_e4m3fn": torch.float8_e4m3fn}


def write(path):
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        shape = [(2, 3, 4), (5,), (7, 3), ()][i % 4]
        count = 1
        for d in shape:
            count *= d
        tensors[str(dtype).removeprefix("torch.")] = torch.arange(count, dtype=torch.float32).reshape(shape).to(dtype)
    tensors["empty"] = torch.zeros((0, 4))
    save_file(tensors, path, metadata={"made_by": "safetensors"})


def check(path):
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(WRITTEN_BY_VRAMD), list(f.keys())
        assert f.metadata() == {"made_by": "vramd"}, f.metadata()
        for key in f.keys():
            tensor = f.get_tensor(key)
            expected = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(tensor.dtype)
            assert tensor.dtype == WRITTEN_BY_VRAMD[key], (key, tensor.dtype)
            assert torch.equal(tensor.float(), expected.float()), key


def write_pickle(path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(5, 2))
    model[2].to(torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.arange(parameter.numel(), dtype=torch.float32).reshape(parameter.shape))
    state = model.state_dict()
    state["tied"] = state["0.weight"]  # two names, one storage
    state["row"] = model[0].weight[1]  # a view that starts inside its storage
    torch.save(state, path)


if __name__ == "__main__":
    {"write": write, "check": check, "write-pickle": write_pickle}[sys.argv[1]](sys.argv[2])
