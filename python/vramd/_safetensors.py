"""The safetensors format, as far as forwards need it: named tensors to bytes and back.

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and data_offsets (relative to the end of the header), then the tensors' bytes."""
from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Mapping

import torch

HEADER_LIMIT = 100_000_000  # the reference's, and the daemon's

# Every dtype the daemon reads into LibTorch (lib/storage/tensor_io.cpp): safetensors name, torch dtype.
_PAIRS = [
    ("BOOL", torch.bool), ("U8", torch.uint8), ("I8", torch.int8), ("U16", torch.uint16),
    ("I16", torch.int16), ("U32", torch.uint32), ("I32", torch.int32), ("U64", torch.uint64),
    ("I64", torch.int64), ("F16", torch.float16), ("BF16", torch.bfloat16), ("F32", torch.float32),
    ("F64", torch.float64), ("C64", torch.complex64), ("F8_E4M3", torch.float8_e4m3fn),
    ("F8_E5M2", torch.float8_e5m2), ("F8_E8M0", getattr(torch, "float8_e8m0fnu", None)),
]
DTYPES = {name: dtype for name, dtype in _PAIRS if dtype is not None}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The same dtypes by torch's own names ("bfloat16"), as lease manifests spell them.
TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in NAMES}


def dumps(tensors: Mapping[str, torch.Tensor], allocate=bytearray):
    """A safetensors file of `tensors` (any device, layout or strides), in the writable buffer
    `allocate(size)` gives (a bytearray, or an mmap). Each tensor is copied once, from its device
    straight into the buffer: a trainer's GPU weights need no host copy of their own beside it.
    Larger elements come first so that every tensor is aligned for its dtype, as the daemon
    writes them. Raises TypeError or ValueError naming the tensor that cannot be written."""
    entries = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r}: expected a string other than '__metadata__'")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, found {type(tensor).__name__}")
        if tensor.dtype not in NAMES:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name vramd reads; "
                             f"convert it to one of {', '.join(map(str, TORCH_DTYPES))}")
        if tensor.is_meta:
            raise ValueError(f"tensor {name!r} is on the meta device: it has no values to write")
        data = tensor.detach()
        if data.layout != torch.strided:
            data = data.to_dense()
        entries.append((name, data))
    entries.sort(key=lambda entry: -entry[1].element_size())

    header, end = {}, 0
    for name, data in entries:
        size = data.numel() * data.element_size()
        header[name] = {"dtype": NAMES[data.dtype], "shape": list(data.shape), "data_offsets": [end, end + size]}
        end += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out = allocate(8 + len(text) + end)
    out[:8] = struct.pack("<Q", len(text))
    out[8:8 + len(text)] = text
    for name, data in entries:
        begin, finish = header[name]["data_offsets"]
        if finish > begin:
            place = torch.frombuffer(out, dtype=torch.uint8, count=finish - begin, offset=8 + len(text) + begin)
            place.copy_(data.contiguous().reshape(-1).view(torch.uint8))
    return out


def loads(data: bytes | bytearray | memoryview, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file in the order of their data (as the reference's
    load_file gives them), each a writable copy; with copy=False, views of `data` (a bytearray)
    where their bytes are aligned for their dtype, which keep it alive. Raises ValueError saying
    what is malformed."""
    size = len(data)
    if size < 8:
        raise ValueError(f"{size} bytes, fewer than the 8 of the header length")
    (header_size,) = struct.unpack_from("<Q", data)
    if header_size > HEADER_LIMIT or 8 + header_size > size:
        raise ValueError(f"header length {header_size} does not fit in {size} bytes")
    try:
        header = json.loads(bytes(data[8:8 + header_size]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    base = 8 + header_size
    entries = sorted(((name, *_entry(name, entry)) for name, entry in header.items() if name != "__metadata__"),
                     key=lambda e: (e[3], e[0]))  # (begin, end), name
    tensors = {}
    for name, dtype, shape, (begin, end) in entries:
        if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
            raise ValueError(f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold {dtype} "
                             f"{shape} within the {size - base} bytes of data")
        if not copy and end > begin and (base + begin) % dtype.itemsize == 0:
            tensors[name] = torch.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                             offset=base + begin).view(shape)
            continue
        tensor = torch.empty(shape, dtype=dtype)
        if end > begin:
            with warnings.catch_warnings():  # `data` may be read-only bytes; it is only read
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                source = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=base + begin)
            tensor.reshape(-1).view(torch.uint8).copy_(source)
        tensors[name] = tensor
    return tensors


def metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The `__metadata__` of a safetensors file that loads() has read ({} when it has none)."""
    (header_size,) = struct.unpack_from("<Q", data)
    found = json.loads(bytes(data[8:8 + header_size]).decode("utf-8")).get("__metadata__") or {}
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise ValueError("__metadata__ is not an object of strings")
    return found


def _entry(name, entry):
    """(dtype, shape, data_offsets) of one header entry, checked."""
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r}: expected an object, found {entry!r:.80}")
    dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r}: dtype {entry.get('dtype')!r:.40} is not one of {', '.join(DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _naturals(shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r:.80} is not a list of non-negative integers")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[1] < offsets[0]:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r:.80} are not [begin, end]")
    return dtype, shape, offsets


def _naturals(value) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
