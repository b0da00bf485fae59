"""Layer-by-layer weight management under [vram].limit: every architecture streamed from disk
with a limit well below its size gives the fully resident model's outputs bit for bit (and so
transformers'), the limit holds by vramd's own accounting, host memory stays flat, and limits
that cannot work are refused with the numbers."""
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
CASES = ["llama", "llama3", "mistral", "qwen2", "gpt2", "bert",  # llama3, gpt2, gemma2 tie their head
         "gemma2", "phi3", "olmo2", "clip_text", "t5_encoder", "mixtral", "qwen2_moe"]
FLOAT8_CASES = ["llama3", "gpt2", "bert", "mixtral"]


@pytest.fixture(scope="module")
def witnesses(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    # The float8 cases need bfloat16 witnesses in every run.
    return {(case, dtype): hf_models.make(case, dtype, out) for case in CASES for dtype in hf_models.DTYPES
            if dtype in hf_models.DTYPES_THIS_RUN or case in FLOAT8_CASES}


def run(folder, tmp_path, vram="", repeat=1, expect_ok=True, env=None):
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n"cuda:0" = "8GiB"\n')
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n{vram}')
    output, stats = tmp_path / "out.safetensors", tmp_path / "stats.json"
    result = subprocess.run([VRAMCTL, "run", config, "--daemon-config", tmp_path / "vramd.toml", "--input",
                             folder / "inputs.safetensors", "--output", output, "--stats-json", stats,
                             "--repeat", str(repeat)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    if not expect_ok:
        assert result.returncode != 0
        return result.stderr
    assert result.returncode == 0, result.stderr
    return load_file(output), json.loads(stats.read_text())


def streamed(limit):
    return f'[vram]\noffload = {{ device = "disk" }}\nonload = {{ device = "disk" }}\nlimit = {limit}\n'


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_streamed_outputs_equal_resident_ones_within_the_limit(witnesses, case, dtype, tmp_path):
    if (case, dtype) not in witnesses:
        pytest.skip(hf_models.SKIP_UNDER_SANITIZERS)
    folder = witnesses[case, dtype]
    resident, _ = run(folder, tmp_path)
    sizes = [t.numel() * t.element_size() for t in load_file(folder / "model" / "model.safetensors").values()]
    limit = max(sum(sizes) // 3, max(sizes) * 5 // 4)  # a third of the model, or just over its largest layer
    assert limit < sum(sizes) * 2 // 3
    got, stats = run(folder, tmp_path, streamed(limit), repeat=3)
    vram = stats["vram"]
    assert vram["limit"] == limit and vram["peak"] <= limit, vram
    assert vram["resident"] < vram["total"] and vram["loads"] > 0 and vram["bytes_streamed"] > 0, vram
    assert vram["order_learned"] and vram["prefetched"] > 0, vram
    assert got.keys() == resident.keys()
    for name in got:
        assert torch.equal(got[name], resident[name]), name  # same dtypes: bit-exact
    expected = load_file(folder / "expected.safetensors")
    for name in expected:  # and so transformers', within the parity tests' tolerance
        scale = expected[name].float().abs().max()
        assert ((got[name].float() - expected[name].float()).abs().max() / scale) <= 1.6e-2, name


def test_one_forward_reads_each_streamed_layer_once(witnesses, tmp_path):
    # The prefetch wraps into the next forward only once a second one has begun: a model run once
    # reads no layer twice (issue #26 measured a quarter more than the plan before).
    folder = witnesses["llama", "float32"]
    trace = tmp_path / "trace.json"
    sizes = [t.numel() * t.element_size() for t in load_file(folder / "model" / "model.safetensors").values()]
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    (tmp_path / "model.toml").write_text(f'checkpoint = "{folder / "model"}"\n{streamed(max(sizes) * 5 // 4)}')
    for repeat in (1, 2):
        subprocess.run([VRAMCTL, "run", tmp_path / "model.toml", "--daemon-config", tmp_path / "vramd.toml", "--input",
                        folder / "inputs.safetensors", "--repeat", str(repeat), "--trace", trace],
                       check=True, capture_output=True)
        events = json.loads(trace.read_text())["events"]
        # Prefetched after their op asked for them in this forward: for the next one.
        again = [e[2] for i, e in enumerate(events)
                 if e[3] == "prefetch" and any(a[3] == "acquire" and a[2] == e[2] for a in events[:i])]
        if repeat == 1:
            assert again == [], again
            # The first forward asks for its layers in the order they were made (the MLP's gate
            # before its up), so nothing prefetched is evicted and read again.
            assert not [e for e in events if e[3] == "evict"], [e[2] for e in events if e[3] == "evict"]
            assert len([e for e in events if e[3] == "prefetch"]) == len({e[2] for e in events if e[3] == "prefetch"})
        else:
            assert again, "a served model's next forward finds its first layers prefetched"


def test_the_largest_layer_must_fit(witnesses, tmp_path):
    error = run(witnesses["llama", "float32"], tmp_path, streamed('"100KiB"'), expect_ok=False)
    # Named where the file sets it, as every problem of a config is (line 5 of run()'s config).
    assert (f"{tmp_path / 'model.toml'}:5:1: vram.limit = 100.00 KiB cannot hold the largest layer (250.00 KiB in "
            "float32); raise it to at least that") in error, error


def test_onload_on_the_computation_device_is_refused_when_it_cannot_fit(witnesses, tmp_path):
    vram = '[vram]\noffload = { device = "disk" }\nonload = { device = "cpu" }\nlimit = "300KiB"\n'
    error = run(witnesses["llama", "float32"], tmp_path, vram, expect_ok=False)
    assert "vram.onload.device = cpu is the computation device" in error
    assert error.rstrip().endswith('set onload = { device = "disk" } or another device'), error  # offload is on disk
    # With offload there too (it defaults to onload's device), the advice names it as well.
    error = run(witnesses["llama", "float32"], tmp_path, '[vram]\nlimit = "300KiB"\n', expect_ok=False)
    assert error.rstrip().endswith('set onload = { device = "disk" } or another device, and offload with it'), error


def test_an_onload_limit_keeps_the_first_streamed_layers_in_memory_and_reads_the_rest_from_disk(witnesses, tmp_path):
    folder = witnesses["llama", "float32"]
    resident, _ = run(folder, tmp_path)
    sizes = [t.numel() * t.element_size() for t in load_file(folder / "model" / "model.safetensors").values()]
    limit, onload_limit = max(sum(sizes) // 3, max(sizes) * 5 // 4), sum(sizes) // 2
    vram = (f'[vram]\noffload = {{ device = "disk" }}\nonload = {{ device = "cpu" }}\nlimit = {limit}\n'
            f'onload_limit = {onload_limit}\n')
    got, stats = run(folder, tmp_path, vram, repeat=3)
    v = stats["vram"]
    assert 0 < v["onload"] <= onload_limit and v["disk_layers"] > 0 and v["peak"] <= limit, (v, onload_limit)
    streamed = v["layers"] - v["resident_layers"]
    assert f"{streamed - v['disk_layers']} streamed from cpu" in v["plan"], v["plan"]
    assert f"{v['disk_layers']} streamed from disk" in v["plan"], v["plan"]
    assert got.keys() == resident.keys()
    for name in got:
        assert torch.equal(got[name], resident[name]), name


def cached_bytes(path):
    """Bytes of the file in the page cache, from mincore(2) over a mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = path.stat().st_size, mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) == 0
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(p & 1 for p in pages) * page


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False, "auto"], ids=["direct", "cached", "auto"])
def test_direct_reads_leave_the_page_cache_alone(witnesses, direct, tmp_path):
    # "auto" (the default) reads this small checkpoint, which the page cache can keep, through it.
    folder = witnesses["llama", "float32"]
    resident, _ = run(folder, tmp_path)
    checkpoint = folder / "model" / "model.safetensors"
    try:
        os.close(os.open(checkpoint, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        pytest.skip(f"the file system under {checkpoint.parent} has no O_DIRECT ({e.strerror})")
    evict(checkpoint)
    if cached_bytes(checkpoint) > checkpoint.stat().st_size // 10:
        pytest.skip(f"posix_fadvise cannot evict {checkpoint} from the page cache here (a memory file system?)")
    limit = checkpoint.stat().st_size // 3
    got, stats = run(folder, tmp_path, streamed(limit) + ("" if direct == "auto" else f"direct_io = {str(direct).lower()}\n"),
                     repeat=3)
    for name in got:
        assert torch.equal(got[name], resident[name]), name
    v = stats["vram"]
    assert v["peak"] <= limit and v["bytes_streamed"] > 2 * v["total"], v
    why = {True: "O_DIRECT: direct_io = true", False: "page cache: direct_io = false",
           "auto": "page cache: the checkpoint's "}[direct]
    assert f"B; {why}" in v["plan"], v["plan"]
    direct = direct is True
    # Without O_DIRECT, streamed weights on the CPU are views of the page cache, not copies.
    assert v["bytes_mapped"] == (0 if direct else v["bytes_streamed"]), v
    assert v["bytes_moved"] == v["bytes_streamed"] - v["bytes_mapped"], v  # O_DIRECT reads copy them in
    cached = cached_bytes(checkpoint)
    if direct:  # the header, read through the cache when the index opens; no weights
        assert cached <= 64 << 10, cached
    else:
        assert cached >= checkpoint.stat().st_size * 9 // 10, cached


@pytest.mark.parametrize("vram", ["", streamed(1 << 20)], ids=["resident", "streamed"])
def test_activations_are_measured_beside_the_weights(witnesses, vram, tmp_path):
    # The outputs are allocated by the forward, and the weights are not counted: a resident
    # model maps the checkpoint, a streamed one reads into buffers vramd maps itself.
    folder = witnesses["llama", "float32"]
    outputs, stats = run(folder, tmp_path, vram, repeat=2)
    produced = sum(t.numel() * t.element_size() for t in outputs.values())
    assert produced <= stats["activations_peak"] < stats["bytes"], (produced, stats["activations_peak"], stats["bytes"])


def test_a_limit_that_holds_everything_keeps_everything_resident(witnesses, tmp_path):
    _, stats = run(witnesses["gpt2", "float32"], tmp_path, streamed('"64MiB"'), repeat=2)
    assert stats["vram"]["resident"] == stats["vram"]["total"] and stats["vram"]["loads"] == 0


def test_host_memory_stays_flat_over_hundreds_of_streamed_forwards(witnesses, tmp_path):
    # Under AddressSanitizer freed memory waits in a quarantine, which would read as growth.
    asan = os.environ.get("ASAN_OPTIONS")
    env = {"ASAN_OPTIONS": asan + ":quarantine_size_mb=0:thread_local_quarantine_size_kb=0"} if asan else None
    _, stats = run(witnesses["llama", "float32"], tmp_path, streamed('"300KiB"'), repeat=300, env=env)
    assert stats["vram"]["loads"] >= 300 * 10
    assert stats["vram"]["host_staging"] == 0  # pinned staging buffers are for reads onto a GPU
    growth = stats["rss_end"] - stats["rss_after_first_forward"]
    assert growth < 4 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 300 streamed forwards"


def through_float8(case, folder, fp8):
    """transformers' outputs with every weight rounded through `fp8` and computed in bfloat16:
    what a model whose weights wait in float8 must give."""
    _, model_class, *_ = hf_models.CASES[case]()
    model = model_class.from_pretrained(folder / "model", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(getattr(torch, fp8)).to(torch.bfloat16))
    return hf_models.outputs(model, load_file(folder / "inputs.safetensors"))


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("case", FLOAT8_CASES)
def test_float8_preparing_matches_transformers_rounded_through_float8(witnesses, case, fp8, tmp_path):
    folder = witnesses[case, "bfloat16"]
    # Weights wait in float8 and are computed in bfloat16: the model dtype says so for every state.
    resident, stats = run(folder, tmp_path, f'dtype = "{fp8}"\n')
    vram = stats["vram"]
    assert vram["resident"] == vram["total"] and vram["limit"] is None, vram
    assert f"in {fp8}" in vram["plan"] and "computed in bfloat16" in vram["plan"], vram["plan"]
    expected = through_float8(case, folder, fp8)
    for name in expected:
        scale = expected[name].float().abs().max()
        assert ((resident[name].float() - expected[name].float()).abs().max() / scale) <= 1.6e-2, name
    # Less rounding, far from the float8 model: the rounding did happen.
    plain = load_file(folder / "expected.safetensors")
    name = next(iter(plain))
    assert not torch.allclose(resident[name].float(), plain[name].float(), rtol=0, atol=1e-3)

    # Streamed under a limit from disk, read and converted to float8 layer by layer: bit-exact.
    sizes = [t.numel() for t in load_file(folder / "model" / "model.safetensors").values()]
    limit = max(sum(sizes) // 3, max(sizes) * 3 * 5 // 4)  # float8 prepared plus its bfloat16 copy
    vram_table = (f'[vram]\npreparing = {{ dtype = "{fp8}" }}\noffload = {{ device = "disk" }}\n'
                  f'onload = {{ device = "disk" }}\nlimit = {limit}\n')
    got, stats = run(folder, tmp_path, f'dtype = "bfloat16"\n{vram_table}', repeat=3)
    vram = stats["vram"]
    assert vram["peak"] <= limit and vram["resident"] < vram["total"] and vram["prefetched"] > 0, vram
    for name in got:
        assert torch.equal(got[name], resident[name]), name


def test_a_limit_must_hold_the_largest_layer_and_its_computation_copy(witnesses, tmp_path):
    vram = '[vram]\npreparing = { dtype = "float8_e4m3fn" }\nonload = { device = "disk" }\nlimit = "100KiB"\n'
    error = run(witnesses["llama", "float32"], tmp_path, vram, expect_ok=False)
    assert ("vram.limit = 100.00 KiB cannot hold the largest layer (62.50 KiB in float8_e4m3fn plus its 250.00 KiB "
            "copy in float32 while it computes); raise it to at least 312.50 KiB") in error


def test_the_trace_shows_every_change_of_the_held_bytes(witnesses, tmp_path):
    folder = witnesses["llama", "float32"]
    trace = tmp_path / "trace.json"
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    (tmp_path / "model.toml").write_text(f'checkpoint = "{folder / "model"}"\n{streamed(chr(34) + "400KiB" + chr(34))}')
    subprocess.run([VRAMCTL, "run", tmp_path / "model.toml", "--daemon-config", tmp_path / "vramd.toml", "--input",
                    folder / "inputs.safetensors", "--repeat", "2", "--trace", trace], check=True, capture_output=True)
    t = json.loads(trace.read_text())
    assert t["limit"] == 400 << 10 and 0 < t["peak"] <= t["limit"]
    kinds = {e[3] for e in t["events"]}
    assert {"acquire", "release", "prefetch", "ready"} <= kinds, kinds
    assert all(e[1] <= t["limit"] for e in t["events"])
    assert [e[0] for e in t["events"]] == sorted(e[0] for e in t["events"])
    acquired = [e[2] for e in t["events"] if e[3] == "acquire"]
    assert "model.embed_tokens" in acquired and "lm_head" in acquired


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU here: the CUDA streaming path (pinned staging buffers, copy stream) is not run")
@pytest.mark.parametrize("onload,direct", [("disk", False), ("cpu", False), ("disk", True)],
                         ids=["disk", "cpu", "disk-direct"])
def test_streamed_on_cuda_equals_resident_on_cuda(witnesses, onload, direct, tmp_path):
    folder = witnesses["llama3", "bfloat16"]
    cuda = '[vram]\ncomputation = { device = "cuda:0" }\n'
    resident, _ = run(folder, tmp_path, cuda)
    sizes = [t.numel() * t.element_size() for t in load_file(folder / "model" / "model.safetensors").values()]
    limit = max(sum(sizes) // 3, max(sizes) * 5 // 4)
    vram = (f'{cuda}offload = {{ device = "disk" }}\nonload = {{ device = "{onload}" }}\nlimit = {limit}\n'
            f'direct_io = {str(direct).lower()}\n')
    got, stats = run(folder, tmp_path, vram, repeat=3)
    assert stats["vram"]["peak"] <= limit and stats["vram"]["prefetched"] > 0, stats["vram"]
    assert stats["vram"]["host_staging"] == 128 << 20  # its resident layers were read through them
    assert stats["device_peak_allocated"] > 0 and "activations_peak" in stats
    for name in got:
        assert torch.equal(got[name], resident[name]), name
    fp8, _ = run(folder, tmp_path, cuda.replace("[vram]\n", '[vram]\npreparing = { dtype = "float8_e4m3fn" }\n'))
    cpu_fp8, _ = run(folder, tmp_path, 'dtype = "bfloat16"\n[vram]\npreparing = { dtype = "float8_e4m3fn" }\n')
    for name in fp8:  # float8 rounding is the same on both devices; the bfloat16 matmuls differ a little
        scale = cpu_fp8[name].float().abs().max()
        assert ((fp8[name].float().cpu() - cpu_fp8[name].float()).abs().max() / scale) <= 1.6e-2, name
    if onload == "cpu":
        # Resting in float8 on the host, carried across as float8 and cast on the GPU. Only the
        # streamed layers rest there, so the witness is a checkpoint whose every weight float8
        # holds exactly: its resident outputs, bit for bit, with half the bytes streamed moved.
        rounded = tmp_path / "rounded"
        shutil.copytree(folder / "model", rounded / "model")
        (rounded / "inputs.safetensors").symlink_to(folder / "inputs.safetensors")
        weights = load_file(folder / "model" / "model.safetensors")
        save_file({name: t.to(torch.float8_e4m3fn).to(t.dtype) for name, t in weights.items()},
                  rounded / "model" / "model.safetensors", metadata={"format": "pt"})
        expected, _ = run(rounded, tmp_path, cuda)
        got, stats = run(rounded, tmp_path, f'{cuda}onload = {{ device = "cpu", dtype = "float8_e4m3fn" }}\n'
                                            f'limit = {limit}\n', repeat=3)
        v = stats["vram"]
        assert v["peak"] <= limit and v["loads"] > 0 and v["bytes_moved"] * 2 == v["bytes_streamed"], v
        for name in got:
            assert torch.equal(got[name], expected[name]), name
