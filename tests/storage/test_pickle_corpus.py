"""PyTorch pickle checkpoints, valid and hostile, through vramctl inspect, check, convert and run
and through the daemon. The oracle is torch.load(weights_only=True) in this same run: a file it
accepts is read bit for bit or refused for a documented reason; a hostile file is refused in one
line naming it; nothing crashes, hangs, grows past a memory bound, or runs a payload.
"""
import collections
import io
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_support import Daemon, request  # noqa: E402
import hf_models  # noqa: E402  (daemon_support puts tests/parity on the path)

VRAMCTL = os.environ["VRAMCTL"]
MEMORY_BOUND = 300 << 20  # over a small valid file's peak


# --- Forged checkpoints: torch.save's layout with any pickle inside -----------------------------

class Storage:
    def __init__(self, key, type_name, numel):
        self.key, self.type_name, self.numel = key, type_name, numel


class Rebuild:
    """Pickles as torch._utils._rebuild_tensor_v2 (v3 with a dtype) of the given arguments."""

    def __init__(self, storage, offset, shape, stride, dtype=None, hooks=None):
        self.args = (storage, offset, tuple(shape), tuple(stride), False,
                     collections.OrderedDict() if hooks is None else hooks)
        self.dtype = dtype

    def __reduce__(self):
        if self.dtype is not None:
            return torch._utils._rebuild_tensor_v3, self.args + (self.dtype,)
        return torch._utils._rebuild_tensor_v2, self.args


class Forger(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            storage_type = torch.UntypedStorage if obj.type_name == "UntypedStorage" else getattr(torch, obj.type_name)
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def forged_pickle(obj):
    buffer = io.BytesIO()
    Forger(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_zip(path, members, compress=()):
    """members: (name, bytes) in order; names in `compress` are deflated."""
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members:
            z.writestr(zipfile.ZipInfo(name), data, zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED)


def forge(path, data_pkl, records, compress=(), extra=()):
    members = [("archive/data.pkl", data_pkl), ("archive/byteorder", b"little")]
    members += [(f"archive/data/{key}", data) for key, data in records.items()]
    write_zip(path, members + list(extra) + [("archive/version", b"3\n")], compress)


def f32(n):
    return torch.arange(n, dtype=torch.float32).numpy().tobytes()


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def global_op(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text_op(value):
    raw = value if isinstance(value, bytes) else value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def state_with(*items):
    """A protocol-2 pickle of {key: value} from raw opcode pieces."""
    return b"\x80\x02}(" + b"".join(items) + b"u."


def payload_pickles(marker):
    """Raw pickles that would run `touch marker` under pickle.load; torch.load refuses every one."""
    command = text_op(f"touch {marker}")
    tensor_w = forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 1), 0, [1], [1])})[2:-1]  # '}' ... 's'
    calls = {
        "reduce-os-system": global_op("os", "system") + command + b"\x85R",
        "reduce-posix-system": global_op("posix", "system") + command + b"\x85R",
        "reduce-subprocess": global_op("subprocess", "check_call") + b"(" + text_op("touch") + text_op(str(marker)) + b"l\x85R",
        "reduce-eval": global_op("builtins", "eval") + text_op(f"__import__('os').system('touch {marker}')") + b"\x85R",
        "reduce-exec": global_op("builtins", "exec") + text_op(f"import os; os.system('touch {marker}')") + b"\x85R",
        "reduce-py2-eval": global_op("__builtin__", "eval") + text_op(f"__import__('os').system('touch {marker}')") + b"\x85R",
        "reduce-getattr": global_op("builtins", "getattr") + global_op("os", "system") + b"\x85R",
        "reduce-torch-load": global_op("torch", "load") + text_op(str(marker)) + b"\x85R",
        "reduce-runpy": global_op("runpy", "_run_code") + text_op(f"import os; os.system('touch {marker}')") + b"}\x86R",
        "reduce-numpy": global_op("numpy.testing._private.utils", "runstring") + text_op("1") + b"}\x86R",
        "stack-global": b"\x8c\x02os\x8c\x06system\x93" + command + b"\x85R",
        "inst": b"(" + command + b"ios\nsystem\n",
        "obj": b"(" + global_op("os", "system") + command + b"o",
        "newobj": global_op("os", "system") + command + b"\x85\x81",
        "ext": b"\x82\x01" + command + b"\x85R",
        "persid-text": b"P" + b"touch\n",
        "build-setstate": global_op("collections", "OrderedDict") + b")R}(" + text_op("__setstate__") +
                          global_op("os", "system") + b"ub" + command + b"b",
    }
    pickles = {name: b"\x80\x02}(" + text_op("evil") + body + b"u." for name, body in calls.items()}
    # The state dict itself, followed by BUILD that sets __setstate__ to os.system.
    pickles["state-dict-build-setstate"] = (b"\x80\x02" + tensor_w + b"}(" + text_op("__setstate__") +
                                            global_op("os", "system") + b"ub" + command + b"b.")
    # The same payload inside _rebuild_tensor_v2's hooks argument.
    hooks = (global_op("collections", "OrderedDict") + b")R}(" + text_op("__setstate__") + global_op("os", "system") +
             b"ub" + command + b"b")
    pickles["hooks-build-setstate"] = (b"\x80\x02}(" + text_op("w") + global_op("torch._utils", "_rebuild_tensor_v2") +
                                       b"((" + text_op("storage") + global_op("torch", "FloatStorage") + text_op("0") +
                                       text_op("cpu") + b"K\x01tQK\x00K\x01\x85K\x01\x85\x89" + hooks + b"tRu.")
    return pickles


# --- The corpus ---------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]


def random_tensor(dtype, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    count = 1
    for d in shape:
        count *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype.is_floating_point and dtype.itemsize > 1:  # no NaN payloads to compare: bit patterns of finite values
        return torch.randn(shape, generator=generator).to(dtype)
    return raw.view(dtype).reshape(shape)


def valid_cases():
    """name -> (object torch.save writes, save options, config extra); every one torch accepts."""
    cases = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        cases[f"dtype-{name}"] = ({"w": random_tensor(dtype, (3, 5), i), "s": random_tensor(dtype, (), i + 100)}, {}, "")
        matrix = random_tensor(dtype, (4, 3, 2), i + 200)
        cases[f"views-{name}"] = ({"m": matrix, "row": matrix[2], "slab": matrix[1:3], "p": torch.nn.Parameter(
            matrix[3], requires_grad=False)}, {}, "")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(5, 2))
    cases["module-state-dict"] = (model.state_dict(), {}, "")  # an OrderedDict with _metadata
    matrix = torch.randn(6, 4)
    cases["shared-and-views"] = ({"m": matrix, "tied": matrix, "row": matrix[2], "rows": matrix[1:4], "tail": matrix.view(-1)[5:]}, {}, "")
    cases["zero-size"] = ({"a": torch.zeros(3, 0), "b": torch.zeros(0), "c": torch.zeros(0, 4), "d": torch.ones(2)}, {}, "")
    cases["parameter"] = ({"p": torch.nn.Parameter(torch.randn(3, 2)), "q": torch.nn.Parameter(torch.randn(2), requires_grad=False)}, {}, "")
    with_state = torch.nn.Parameter(torch.randn(2))
    with_state.note = "kept"
    attribute = torch.randn(3)
    attribute.note = 1
    cases["tensor-attributes"] = ({"p": with_state, "t": attribute}, {}, "")
    cases["requires-grad"] = ({"g": torch.randn(2, 2).requires_grad_()}, {}, "")
    cases["big"] = ({"w": torch.randn(512, 512)}, {}, "")
    cases["many-tensors"] = ({f"layer.{i}.w": torch.full((2,), float(i)) for i in range(2000)}, {}, "")
    cases["unicode-keys"] = ({"gewicht.ä": torch.ones(2), "权重": torch.zeros(3)}, {}, "")
    cases["deep-nesting"] = ({"a": {"b": {"c": {"d": {"e": torch.ones(1)}}}}}, {}, "")
    cases["protocol-3"] = ({"w": torch.randn(4)}, {"pickle_protocol": 3}, "")
    junk = {"w": torch.randn(3), "epoch": 3, "lr": 0.1, "name": "x", "none": None, "flag": True,
            "bytes": b"abc", "set": {1, 2}, "complex": 1 + 2j, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
            "list": [1, 2.5, "a", (1, 2)], "nested": {"deep": {"v": torch.arange(4)}}, 7: torch.zeros(1)}
    cases["junk-beside-tensors"] = (junk, {}, "")
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    cases["training-checkpoint"] = ({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3},
                                    {}, 'prefix = "model."\n')
    cases["training-checkpoint-no-prefix"] = ({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, {}, "")
    cases["transposed-outside-prefix"] = ({"model": {"w": torch.randn(2, 3)}, "ema": {"t": torch.randn(3, 2).t()}},
                                          {}, 'prefix = "model."\n')
    return cases


# name -> (what the refusal line must hold); torch accepts these, vramd refuses for a documented reason
DOCUMENTED_REFUSALS = {
    "transposed": "tensor 't' is not contiguous in its storage",
    "legacy-format": "not a torch.save zip checkpoint",
    "deflated-storage": "is compressed; vramd maps tensor data in place and reads stored records only",
    "conjugate": "tensor metadata",
    "sparse": "layout 'torch.sparse_coo' is not read",
    "surrogate-key": "is not valid UTF-8",
    "complex128": "GLOBAL 'torch.ComplexDoubleStorage' is not a global torch.load(weights_only=True) allows that vramd reads",
    "untyped-two-dtypes": "is read as F64, but the storage is F32",
    "hooks-not-empty": "backward hooks must be an empty OrderedDict",
}


def build_corpus(folder, marker):
    """name -> (path, expectation): 'read', 'documented' or 'hostile' with the refusal's text."""
    corpus = {}

    def save(name, obj, **options):
        path = folder / f"{name}.pt"
        torch.save(obj, path, **options)
        return path

    for name, (obj, options, extra) in valid_cases().items():
        corpus[name] = (save(name, obj, **options), "read", extra)

    # Valid files torch.save does not write but torch.load reads.
    state = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    path = save("deflated-data-pkl", state)
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    write_zip(path, members, compress={n for n, _ in members if n.endswith("data.pkl")})
    corpus["deflated-data-pkl"] = (path, "read", "")
    pairs = forged_pickle(collections.OrderedDict([("w", Rebuild(Storage("0", "FloatStorage", 4), 0, [4], [1]))]))
    forge(folder / "ordered-dict-pairs.pt", pairs, {"0": f32(4)})
    corpus["ordered-dict-pairs"] = (folder / "ordered-dict-pairs.pt", "read", "")
    untyped = forged_pickle({"a": Rebuild(Storage("0", "UntypedStorage", 8), 0, [4], [1], torch.uint16),
                             "b": Rebuild(Storage("0", "UntypedStorage", 8), 2, [2], [1], torch.uint16)})
    forge(folder / "untyped-shared.pt", untyped, {"0": bytes(range(8))})
    corpus["untyped-shared"] = (folder / "untyped-shared.pt", "read", "")

    first = forged_pickle(Rebuild(Storage("0", "FloatStorage", 1), 0, [1], [1]))[2:-1]
    last = forged_pickle(Rebuild(Storage("1", "FloatStorage", 2), 0, [2], [1]))[2:-1]
    forge(folder / "duplicate-key.pt", state_with(text_op("w") + first + text_op("w") + last), {"0": f32(1), "1": f32(2)})
    corpus["duplicate-key"] = (folder / "duplicate-key.pt", "read", "")

    # Valid files vramd refuses for a documented reason.
    documented = {
        "transposed": lambda p: torch.save({"t": torch.randn(3, 4).t()}, p),
        "legacy-format": lambda p: torch.save({"w": torch.zeros(2)}, p, _use_new_zipfile_serialization=False),
        "conjugate": lambda p: torch.save({"c": torch.randn(2, dtype=torch.complex64).conj()}, p),
        "sparse": lambda p: torch.save({"s": torch.eye(3).to_sparse()}, p),
        "complex128": lambda p: torch.save({"c": torch.randn(2, dtype=torch.complex128)}, p),
    }
    for name, write in documented.items():
        write(folder / f"{name}.pt")
        corpus[name] = (folder / f"{name}.pt", "documented", "")
    path = save("deflated-storage", {"w": torch.randn(64)})
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    write_zip(path, members, compress={n for n, _ in members if "/data/" in n})
    corpus["deflated-storage"] = (path, "documented", "")
    forge(folder / "surrogate-key.pt", state_with(text_op(b"w\xed\xa0\x80") + forged_pickle(
        Rebuild(Storage("0", "FloatStorage", 1), 0, [1], [1]))[2:-1]), {"0": f32(1)})
    corpus["surrogate-key"] = (folder / "surrogate-key.pt", "documented", "")

    # Hostile files: code, reads outside records, lies, bombs.
    hostile = {}
    for name, data in payload_pickles(marker).items():
        hostile[f"payload-{name}"] = (data, {"0": f32(1)}, "data.pkl at byte")
    hostile["payload-object"] = (None, None, "GLOBAL 'posix.system' is not a global")
    save("payload-object", {"w": torch.zeros(1), "evil": RunsCode(marker)})
    one = Storage("0", "FloatStorage", 12)
    hostile["reuse-key-past-record"] = (forged_pickle({"a": Rebuild(one, 0, [12], [1]),
                                                       "b": Rebuild(one, 0, [1 << 20, 12], [12, 1])}),
                                        {"0": f32(12)}, "reaches element")
    hostile["past-end-of-file"] = (forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 1 << 28), 0, [1 << 28], [1])}),
                                   {"0": f32(4)}, "storage record 'archive/data/0' holds 16 bytes; its storage is 1073741824")
    hostile["key-two-dtypes"] = (forged_pickle({"a": Rebuild(Storage("0", "FloatStorage", 12), 0, [12], [1]),
                                                "b": Rebuild(Storage("0", "DoubleStorage", 12), 0, [12], [1])}),
                                 {"0": f32(12)}, "storage '0' is declared as FloatStorage of 12, then as DoubleStorage of 12")
    documented_forged = {}
    documented_forged["untyped-two-dtypes"] = (forged_pickle({"a": Rebuild(Storage("0", "UntypedStorage", 8), 0, [2], [1], torch.float32),
                                                    "b": Rebuild(Storage("0", "UntypedStorage", 8), 0, [1], [1], torch.float64)}),
                                     {"0": bytes(8)}, "is read as F64, but the storage is F32")
    hostile["offset-past-storage"] = (forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 4), 3, [2], [1])}),
                                      {"0": f32(4)}, "reaches element 4, past the storage's 4 F32 elements")
    hostile["negative-offset"] = (forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 4), -1, [2], [1])}),
                                  {"0": f32(4)}, "negative storage offset")
    hostile["stride-overflow"] = (forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 4), 0, [5, 2], [1 << 62, 1])}),
                                  {"0": f32(4)}, "reaches past any storage")
    hostile["shape-stride-mismatch"] = (forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 4), 0, [2, 2], [1])}),
                                        {"0": f32(4)}, "has 2 sizes but 1 strides")
    hostile["missing-record"] = (forged_pickle({"w": Rebuild(Storage("9", "FloatStorage", 4), 0, [4], [1])}),
                                 {"0": f32(4)}, "has no record 'archive/data/9'")
    documented_forged["hooks-not-empty"] = (forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 1), 0, [1], [1],
                                                              hooks=collections.OrderedDict([(0, 1)]))}),
                                  {"0": f32(1)}, "backward hooks must be an empty OrderedDict")
    tensor_1 = forged_pickle(Rebuild(Storage("0", "FloatStorage", 1), 0, [1], [1]))[2:-1]
    storage_tuple = text_op("storage") + global_op("torch", "FloatStorage") + text_op("0") + text_op("cpu") + b"K\x01"
    hostile["persid-list"] = (state_with(text_op("w") + b"](" + storage_tuple + b"eQ"), {"0": f32(1)},
                              "persistent id list is not ('storage', type, key, location, size)")
    hostile["persid-int"] = (state_with(text_op("w") + b"K\x05Q"), {"0": f32(1)}, "persistent id int")
    hostile["persid-module"] = (state_with(text_op("w") + b"(" + text_op("module") + b"tQ"), {"0": f32(1)},
                                "is not ('storage', type, key, location, size)")
    hostile["frame-lies"] = (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"}.", {}, "opcode FRAME (0x95) is refused")
    hostile["frame-short"] = (b"\x80\x04\x95" + struct.pack("<Q", 1) + b"}(" + text_op("w") + tensor_1 + b"u.",
                              {"0": f32(1)}, "opcode FRAME (0x95) is refused")
    hostile["key-not-utf8"] = (state_with(text_op(b"w\xff") + tensor_1), {"0": f32(1)}, "a string is not valid UTF-8: 'w\\xff'")
    hostile["self-dict"] = (b"\x80\x02}q\x00(" + text_op("self") + b"h\x00u.", {}, "dicts nested deeper than 16 (the limit)")
    dag = b"\x80\x02}q\x00"  # each level holds the previous one 16 times: 16^16 paths
    for level in range(1, 17):
        dag += b"}(" + b"".join(text_op(f"k{i}") + b"h" + bytes([level - 1]) for i in range(16)) + b"uq" + bytes([level])
    hostile["dict-dag"] = (dag + b"h\x10.", {}, "entries (the limit) once flattened")
    hostile["not-a-dict"] = (forged_pickle([Rebuild(Storage("0", "FloatStorage", 1), 0, [1], [1])]), {"0": f32(1)},
                             "data.pkl holds a list, not a state dict")
    hostile["memo-slot-huge"] = (b"\x80\x02}r\xff\xff\xff\xff.", {}, "memo slot 4294967295 is past the limit")
    hostile["nones-32mib"] = (b"\x80\x02" + b"N" * (32 << 20) + b".", {}, "the stack holds 1048576 items and marks (the limit)")
    hostile["appends-objects"] = (b"\x80\x02]" + b"K\x00a" * ((1 << 21) + 1) + b".", {},
                                  "objects built (the limit)")
    for name, (data, records, _) in documented_forged.items():
        forge(folder / f"{name}.pt", data, records)
        corpus[name] = (folder / f"{name}.pt", "documented", "")
    for name, (data, records, message) in hostile.items():
        if data is not None:
            forge(folder / f"{name}.pt", data, records)
        corpus[name] = (folder / f"{name}.pt", ("hostile", message), "")

    # The zip layer.
    good = forged_pickle({"w": Rebuild(Storage("0", "FloatStorage", 4), 0, [4], [1])})
    zips = {
        "zip-dotdot": ([("archive/data.pkl", good), ("archive/data/0", f32(4)), ("../../x", b"evil")],
                       "is not a plain relative path"),
        "zip-absolute": ([("/x", b"evil"), ("archive/data.pkl", good), ("archive/data/0", f32(4))],
                         "is not a plain relative path"),
        "zip-outside-folder": ([("archive/data.pkl", good), ("archive/data/0", f32(4)), ("other/x", b"")],
                               "is outside the archive folder 'archive/'"),
        "zip-duplicate-data-pkl": ([("archive/data.pkl", forged_pickle({})), ("archive/data/0", f32(4)),
                                    ("archive/data.pkl", good)], "two members are named 'archive/data.pkl'"),
        "zip-duplicate-record": ([("archive/data.pkl", good), ("archive/data/0", f32(4)), ("archive/data/0", f32(4))],
                                 "two members are named 'archive/data/0'"),
    }
    with_version = [("archive/version", b"3\n")]
    zips = {name: (members + with_version, message) for name, (members, message) in zips.items()}
    plain = [("archive/data.pkl", good), ("archive/data/0", f32(4))] + with_version
    write_zip(folder / "zip-comment.pt", plain)
    with zipfile.ZipFile(folder / "zip-comment.pt", "a") as z:
        z.comment = b"a comment after the end record"
    corpus["zip-comment"] = (folder / "zip-comment.pt", "read", "")
    raw = bytearray(_zip_bytes(plain))
    at = raw.index(good)
    raw[at + len(good) - 2] ^= 0x01  # a byte of data.pkl, so its CRC fails
    patched = {"zip-bad-crc": (bytes(raw), "fails its CRC-32 check")}
    raw = bytearray(_zip_bytes(plain))
    for sig in (b"PK\x03\x04", b"PK\x01\x02"):  # the encryption flag, in local and central headers
        at = -1
        while (at := raw.find(sig, at + 1)) >= 0:
            raw[at + (6 if sig == b"PK\x03\x04" else 8)] |= 1
    patched["zip-encrypted"] = (bytes(raw), "is encrypted")
    raw = bytearray(_zip_bytes(plain))
    name_at = raw.index(b"archive/data.pkl")
    raw[name_at:name_at + 7] = b"archivX"  # the local name only
    patched["zip-local-name"] = (bytes(raw), "disagrees with the central directory on the name or method")
    raw = bytearray(_zip_bytes(plain))
    end = raw.rindex(b"PK\x05\x06")
    raw[end + 16:end + 20] = struct.pack("<I", struct.unpack("<I", raw[end + 16:end + 20])[0] + 7)
    patched["zip-directory-offset"] = (bytes(raw), "the central directory is said to span bytes")
    with zipfile.ZipFile(folder / "zip-bzip2.pt", "w") as z:
        z.writestr("archive/data.pkl", good, zipfile.ZIP_BZIP2)
        z.writestr("archive/data/0", f32(4))
        z.writestr("archive/version", b"3\n")
    corpus["zip-bzip2"] = (folder / "zip-bzip2.pt", ("hostile", "uses compression method 12"), "")
    for name, (data, message) in patched.items():
        (folder / f"{name}.pt").write_bytes(data)
        corpus[name] = (folder / f"{name}.pt", ("hostile", message), "")
    for name, (members, message) in zips.items():
        with pytest.warns(UserWarning) if "duplicate" in name else _nothing():
            write_zip(folder / f"{name}.pt", members)
        corpus[name] = (folder / f"{name}.pt", ("hostile", message), "")
    write_bomb(folder / "zip-bomb.pt", good)
    corpus["zip-bomb"] = (folder / "zip-bomb.pt", ("hostile", f"is {BOMB_SIZE} bytes, over the limit of 67108864"), "")
    write_bomb(folder / "zip-bomb-lying-size.pt", good, lie=True)
    corpus["zip-bomb-lying-size"] = (folder / "zip-bomb-lying-size.pt",
                                     ("hostile", "does not inflate to exactly its declared 100 bytes"), "")
    raw = (folder / "dtype-float32.pt").read_bytes()
    (folder / "truncated.pt").write_bytes(raw[: len(raw) // 2])
    corpus["truncated"] = (folder / "truncated.pt", ("hostile", "zip: no end-of-central-directory record"), "")
    (folder / "not-a-zip.pt").write_bytes(b"\x80\x02}.")
    corpus["not-a-zip"] = (folder / "not-a-zip.pt", ("hostile", "not a torch.save zip checkpoint"), "")
    write_zip(folder / "zip-no-data-pkl.pt", [("ev\x1bil/byteorder", b"little")])  # the folder named in the refusal
    corpus["zip-no-data-pkl"] = (folder / "zip-no-data-pkl.pt", ("hostile", "has no 'ev\\x1bil/data.pkl'"), "")
    return corpus


def _zip_bytes(members):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in members:
            z.writestr(zipfile.ZipInfo(name), data)
    return buffer.getvalue()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


BOMB_SIZE = 1 << 28  # 256 MiB of padding after the real pickle, deflated to about 0.5 MiB


def write_bomb(path, data_pkl, lie=False):
    """A zip whose data.pkl inflates to BOMB_SIZE bytes; `lie`: its headers say 100."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    chunk = bytes(64 << 20)
    deflated, crc = [compressor.compress(data_pkl)], zlib.crc32(data_pkl)
    left = BOMB_SIZE - len(data_pkl)
    while left:
        piece = chunk[: min(left, len(chunk))]
        deflated.append(compressor.compress(piece))
        crc = zlib.crc32(piece, crc)
        left -= len(piece)
    body = b"".join(deflated) + compressor.flush()
    name = b"archive/data.pkl"
    # version needed, flags, method (deflate), time, date, crc, sizes, name and extra lengths
    fields = struct.pack("<HHHHHIIIHH", 20, 0, 8, 0, 0, crc, len(body), 100 if lie else BOMB_SIZE, len(name), 0)
    local = b"PK\x03\x04" + fields + name
    central = b"PK\x01\x02" + struct.pack("<H", 20) + fields + struct.pack("<HHHII", 0, 0, 0, 0, 0) + name
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, len(central), len(local) + len(body), 0)
    path.write_bytes(local + body + central + end)


# --- Running vramctl with its peak memory measured -----------------------------------------------

# A process forked from this one starts with its peak RSS (torch is loaded here), and exec keeps
# it: a small launcher forks vramctl afresh and reports that child's own peak.
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write("\\npeak-rss-kib=%d\\n" % usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(*args, timeout=120):
    """(returncode, stdout, stderr, peak RSS in bytes) of vramctl with these arguments."""
    with subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, VRAMCTL, *map(str, args)], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise AssertionError(f"vramctl {' '.join(map(str, args))} hung")
    err, _, peak = err.decode(errors="replace").rpartition("\npeak-rss-kib=")
    return process.returncode, out.decode(), err, int(peak) * 1024


# --- The tests ----------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32",
                      torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
                      torch.float8_e8m0fnu: "F8_E8M0"}
NO_ORACLE = {"zip-bomb", "zip-bomb-lying-size", "nones-32mib", "appends-objects", "dict-dag"}  # vramd's own limits


def flatten(obj, prefix=""):
    """name -> tensor, as vramd flattens a state dict: dicts joined with '.', non-str keys skipped."""
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            continue
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def prefix_of(extra):
    return extra.split('"')[1] if extra.startswith("prefix") else ""


def tensor_bytes(tensor):
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def read_safetensors(path):
    raw = Path(path).read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    marker = folder / "payload-ran"
    files = build_corpus(folder, marker)
    oracle = {}
    for name, (path, expect, extra) in files.items():
        (folder / f"{name}.toml").write_text(f'checkpoint = "{path}"\n{extra}')
        if name in NO_ORACLE:
            continue
        try:
            oracle[name] = flatten(torch.load(path, weights_only=True))
        except Exception as e:  # noqa: BLE001 - any refusal is torch's verdict
            oracle[name] = e
    yield folder, files, oracle, marker
    assert not marker.exists(), "a payload ran"


def refusal_problems(name, path, command, returncode, stderr, message):
    lines = stderr.splitlines()
    if returncode != 1:
        return [f"{name}: {command} exited {returncode} (expected 1): {stderr[-500:]}"]
    if len(lines) != 1 or not lines[0].startswith(f"vramctl {command}: {path}: ") or message not in lines[0]:
        return [f"{name}: {command} refusal {stderr!r} lacks one line naming the file with {message!r}"]
    return []


def test_the_corpus_is_what_torch_says_it_is(corpus):
    _, files, oracle, _ = corpus
    counts = collections.Counter(expect if isinstance(expect, str) else expect[0] for _, expect, _ in files.values())
    assert len(files) >= 100 and counts["read"] >= 35, counts
    for name, (_, expect, _) in files.items():
        if expect in ("read", "documented"):
            assert not isinstance(oracle[name], Exception), f"{name}: torch refuses it: {oracle[name]}"
        elif name.startswith("payload-"):
            assert isinstance(oracle[name], Exception), f"{name}: torch.load(weights_only=True) accepts it"


def test_inspect_reads_every_file_torch_accepts_or_refuses_it_in_one_line(corpus):
    folder, files, oracle, marker = corpus
    _, _, _, baseline = run_measured("inspect", files["dtype-float32"][0])
    problems, peaks = [], {}
    for name, (path, expect, extra) in files.items():
        prefix = prefix_of(extra)
        args = ["inspect", path, "--json"] + (["--prefix", prefix] if prefix else [])
        returncode, out, err, peaks[name] = run_measured(*args)
        if expect == "read":
            if returncode != 0:
                problems.append(f"{name}: inspect failed: {err}")
                continue
            got = {k: (v["dtype"], v["shape"]) for k, v in json.loads(out)["tensors"].items()}
            want = {k[len(prefix):]: (SAFETENSORS_DTYPES[t.dtype], list(t.shape))
                    for k, t in oracle[name].items() if k.startswith(prefix)}
            if got != want:
                problems.append(f"{name}: inspect shows {got}, torch.load {want}")
        else:
            message = DOCUMENTED_REFUSALS[name] if expect == "documented" else expect[1]
            problems += refusal_problems(name, path, "inspect", returncode, err, message)
    heaviest = max(peaks, key=peaks.get)
    print(f"corpus: {len(files)} files; peak RSS {baseline >> 20} MiB for a small file, "
          f"{peaks[heaviest] >> 20} MiB at most ({heaviest})")
    # Under AddressSanitizer the peak is mostly its quarantine and shadow memory, not vramd's.
    if "ASAN_OPTIONS" not in os.environ:
        problems += [f"{name}: peak RSS {peak >> 20} MiB, over {baseline >> 20} MiB + {MEMORY_BOUND >> 20} MiB"
                     for name, peak in peaks.items() if peak > baseline + MEMORY_BOUND]
    assert not problems, "\n".join(problems)
    assert not marker.exists()


def test_convert_writes_every_tensor_bit_for_bit(corpus):
    folder, files, oracle, _ = corpus
    problems = []
    for name, (path, expect, extra) in files.items():
        if expect == "read" or expect == "documented" or name.startswith(("reuse-key", "past-end", "key-two", "untyped-two")):
            out = folder / f"{name}.safetensors"
            returncode, _, err, _ = run_measured("convert", folder / f"{name}.toml", "--output", out)
            if expect != "read":
                message = DOCUMENTED_REFUSALS[name] if expect == "documented" else expect[1]
                problems += refusal_problems(name, path, "convert", returncode, err, message)
                continue
            if returncode != 0:
                problems.append(f"{name}: convert failed: {err}")
                continue
            prefix = prefix_of(extra)
            got = read_safetensors(out)
            want = {k[len(prefix):]: (SAFETENSORS_DTYPES[t.dtype], list(t.shape), tensor_bytes(t))
                    for k, t in oracle[name].items() if k.startswith(prefix)}
            if got != want:
                differ = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                problems.append(f"{name}: convert differs from torch.load on {differ}")
    assert not problems, "\n".join(problems)


def test_check_takes_the_whole_corpus_in_one_run(corpus):
    folder, files, _, marker = corpus
    configs = [folder / f"{name}.toml" for name in files]
    returncode, out, err, _ = run_measured("check", *configs, "--json", timeout=300)
    verdicts = json.loads(out)
    assert returncode != 0 and len(verdicts["configs"]) == len(files), err
    by_config = {Path(v["path"]).stem: v for v in verdicts["configs"]}
    for name, (path, expect, _) in files.items():
        assert by_config[name]["ok"] == (expect == "read"), (name, by_config[name])
        if expect != "read":
            assert str(path) in json.dumps(by_config[name]), (name, by_config[name])
    assert not marker.exists()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 as pytorch_model.bin, its inputs and transformers' outputs, and a hostile copy
    whose wte reuses wpe's storage key and claims 2^20 rows."""
    folder = hf_models.make("gpt2", "float32", tmp_path_factory.mktemp("gpt2"))
    model = folder / "model"
    state = hf_models.CASES["gpt2"]()[1].from_pretrained(model).state_dict()
    (model / "model.safetensors").unlink()
    torch.save(state, model / "pytorch_model.bin")
    hostile = folder / "hostile"
    hostile.mkdir()
    shutil.copy(model / "config.json", hostile / "config.json")
    tensors, records = {}, {}
    for i, (key, tensor) in enumerate(state.items()):
        records[str(i)] = tensor_bytes(tensor)
        tensors[key] = Rebuild(Storage(str(i), "FloatStorage", tensor.numel()), 0, tensor.shape, tensor.stride())
    wpe = tensors["transformer.wpe.weight"].args[0]
    tensors["transformer.wte.weight"] = Rebuild(wpe, 0, [1 << 20, 64], [64, 1])
    forge(hostile / "pytorch_model.bin", forged_pickle(tensors), records)
    return folder


def test_a_gpt2_pytorch_model_bin_runs_like_transformers_and_a_hostile_one_is_refused(gpt2, tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(f'checkpoint = "{gpt2 / "model"}"\n')
    bad.write_text(f'checkpoint = "{gpt2 / "hostile"}"\n')
    returncode, _, err, _ = run_measured("run", good, "--input", gpt2 / "inputs.safetensors", "--output", tmp_path / "out.safetensors")
    assert returncode == 0, err
    got = read_safetensors(tmp_path / "out.safetensors")
    expected = read_safetensors(gpt2 / "expected.safetensors")
    for name, (dtype, shape, data) in expected.items():
        want = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
        have = torch.frombuffer(bytearray(got[name][2]), dtype=torch.float32).reshape(shape)
        assert torch.allclose(have, want, rtol=1e-4, atol=1e-4), name
    returncode, _, err, _ = run_measured("run", bad, "--input", gpt2 / "inputs.safetensors")
    assert refusal_problems("gpt2", gpt2 / "hostile" / "pytorch_model.bin", "run", returncode, err, "reaches element") == []


def test_the_daemon_refuses_a_hostile_pytorch_model_bin_and_keeps_serving(gpt2, tmp_path):
    daemon = Daemon(tmp_path)
    (daemon.models / "good.toml").write_text(f'checkpoint = "{gpt2 / "model"}"\n')
    (daemon.models / "bad.toml").write_text(f'checkpoint = "{gpt2 / "hostile"}"\n')
    inputs = (gpt2 / "inputs.safetensors").read_bytes()
    with daemon.start():
        status, body = request(daemon.sock, "POST", "/v1/models/bad/load")
        assert status >= 400 and b"reaches element" in body and b"pytorch_model.bin" in body, (status, body)
        status, body = request(daemon.sock, "POST", "/v1/models/bad/forward", inputs)
        assert status >= 400 and b"reaches element" in body, (status, body)
        assert daemon.healthy()
        status, body = request(daemon.sock, "POST", "/v1/models/good/forward", inputs)
        assert status == 200, body
        assert daemon.healthy()
