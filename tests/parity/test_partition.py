"""Partitioned loading, DeepSpeed ZeRO-3 style: a model split across 2 and 4 processes on c10d's
Gloo over loopback gives the single-process model's outputs bit for bit (float32), each rank
holds its 1/N and gathers one layer at a time, and a rank that never joins or dies mid-load
fails the load with an error naming it."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
import hf_models  # noqa: E402
from daemon_support import free_port  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
CASES = ["llama3", "gpt2", "bert", "gemma3", "t5_encoder", "mixtral"]  # llama3, gpt2, gemma3 tie their head to the embedding


@pytest.fixture(scope="module")
def witnesses(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    return {case: hf_models.make(case, "float32", out) for case in CASES}


def write_config(tmp_path, folder, extra=""):
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    config = tmp_path / "model.toml"
    config.write_text(f'name = "m"\ncheckpoint = "{folder / "model"}"\n{extra}')
    return config


def run(config, inputs, tmp_path, *args, env=None, expect_ok=True):
    output, stats = tmp_path / "out.safetensors", tmp_path / "stats.json"
    output.unlink(missing_ok=True)
    result = subprocess.run([VRAMCTL, "run", config, "--daemon-config", config.parent / "vramd.toml", "--input", inputs,
                             "--output", output, "--stats-json", stats, "--threads", "1", *map(str, args)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    if not expect_ok:
        assert result.returncode != 0, result.stderr
        return result.stderr
    assert result.returncode == 0, result.stderr
    return load_file(output), json.loads(stats.read_text())


def partition(world_size, more=""):
    return f'[partition]\nworld_size = {world_size}\ntimeout = "20s"\n{more}'


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_partitioned_outputs_equal_the_single_process_ones(witnesses, case, ranks, tmp_path):
    folder = witnesses[case]
    inputs = folder / "inputs.safetensors"
    single, _ = run(write_config(tmp_path, folder), inputs, tmp_path)
    got, stats = run(write_config(tmp_path, folder, partition(ranks)), inputs, tmp_path, "--ranks", ranks, "--repeat", 3)
    assert got.keys() == single.keys()
    for name in got:
        assert torch.equal(got[name], single[name]), name  # float32: bit for bit

    total = stats["bytes"]
    largest = stats["vram"]["streaming_room"]  # the largest layer gathered whole
    assert len(stats["ranks"]) == ranks
    for rank in stats["ranks"]:
        # Each rank holds its 1/N (each layer padded to a multiple of N elements)...
        assert total / ranks <= rank["slices"] <= total / ranks + 4 * 64 * ranks, rank
        # ...and never more than that plus the layer it computes and the one it prefetches.
        assert rank["peak_weights"] <= rank["slices"] + 2 * largest, rank
        assert rank["peak_weights"] < total or ranks == 2 and case == "bert", rank
    vram = stats["vram"]
    assert vram["order_learned"] and vram["prefetched"] > 0 and vram["loads"] > 0, vram
    assert f"rank 0 of {ranks}: holds 1/{ranks} of" in vram["plan"]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("vram", ['direct_io = true', 'direct_io = true\nonload = { device = "cpu", dtype = "bfloat16" }',
                                  'direct_io = false\nonload = { device = "cpu", dtype = "bfloat16" }'])
def test_slices_read_with_o_direct_or_in_another_dtype_are_the_checkpoints(witnesses, vram, ranks, tmp_path):
    # Every rank's slices are read together, several in flight: with O_DIRECT into buffers at
    # the bytes' phase in a page, and in the stored dtype first where they rest in another. The
    # witness is the single process on the float32 checkpoint, whose values bfloat16 holds
    # exactly, so that resting in it changes nothing; 4 ranks pad the layers' ends.
    folder = tmp_path / "rounded"
    shutil.copytree(witnesses["bert"], folder)
    weights = folder / "model" / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(weights).items()}, weights)
    inputs = folder / "inputs.safetensors"
    single, _ = run(write_config(tmp_path, folder), inputs, tmp_path)
    got, stats = run(write_config(tmp_path, folder, f"[vram]\n{vram}\n" + partition(ranks)), inputs, tmp_path,
                     "--ranks", ranks)
    for name in got:
        assert torch.equal(got[name], single[name]), name
    if "bfloat16" in vram:  # the slices rest in bfloat16: half the bytes
        assert stats["ranks"][0]["slices"] <= stats["bytes"] / 2 / ranks + 4 * 64 * ranks, stats["ranks"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: gathers on a CUDA device (Gloo) not run")
def test_partitioned_on_cuda_equals_the_single_process_model_on_cuda(witnesses, tmp_path):
    # Two ranks share the one GPU of a test machine: Gloo carries CUDA tensors (NCCL would need a
    # GPU per rank).
    folder = witnesses["llama3"]
    inputs = folder / "inputs.safetensors"
    on_cuda = '[vram]\ncomputation = { device = "cuda" }\n'
    single, _ = run(write_config(tmp_path, folder, on_cuda), inputs, tmp_path)
    got, stats = run(write_config(tmp_path, folder, on_cuda + partition(2)), inputs, tmp_path, "--ranks", 2)
    for name in got:
        assert torch.equal(got[name], single[name]), name
    assert stats["vram"]["loads"] > 0, stats["vram"]


def test_a_converter_reads_only_its_rows_and_gives_the_same_model(witnesses, tmp_path):
    # nanoGPT's layout (transposed projections, torch.save) through the shipped converter: the
    # slices come through converter expressions rather than plain byte ranges.
    folder = witnesses["gpt2"]
    tensors = load_file(folder / "model" / "model.safetensors")
    linear = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    nano = {k: (v.t().contiguous() if k.endswith(linear) else v) for k, v in tensors.items()}
    torch.save(nano, tmp_path / "ckpt.pt")
    converter = Path(__file__).resolve().parents[2] / "scripts" / "converters" / "nanogpt.lua"
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n')
    base = (f'checkpoint = "ckpt.pt"\narchitecture = "gpt2"\nconverter = "{converter}"\n'
            "[arch]\nn_embd = 64\nn_head = 4\nn_layer = 2\nvocab_size = 1000\nn_positions = 64\n")
    config = tmp_path / "nano.toml"
    config.write_text(base)
    single, _ = run(config, folder / "inputs.safetensors", tmp_path)
    config.write_text(base + partition(2))
    got, _ = run(config, folder / "inputs.safetensors", tmp_path, "--ranks", 2)
    assert torch.equal(got["logits"], single["logits"])


def test_replicated_parameters_and_slices_resting_on_disk(witnesses, tmp_path):
    folder = witnesses["llama3"]
    inputs = folder / "inputs.safetensors"
    single, _ = run(write_config(tmp_path, folder), inputs, tmp_path)
    plain_config = write_config(tmp_path, folder, partition(2))
    _, plain = run(plain_config, inputs, tmp_path, "--ranks", 2)
    config = write_config(tmp_path, folder, '[vram]\nonload = { device = "disk" }\n' + partition(2, 'replicate = ["*norm*"]\n'))
    got, stats = run(config, inputs, tmp_path, "--ranks", 2, "--repeat", 2)
    assert torch.equal(got["logits"], single["logits"])
    # The norms are whole on every rank, so the slices are smaller; on disk, nothing rests here
    # but the replicated norms, and each gather reads the rank's slice again.
    assert stats["ranks"][0]["slices"] < plain["ranks"][0]["slices"]
    assert "replicated parameters" in stats["vram"]["plan"] and "read from disk at each gather" in stats["vram"]["plan"]
    norms = sum(t.numel() * 4 for k, t in load_file(folder / "model" / "model.safetensors").items() if "norm" in k)
    assert stats["vram"]["resident"] == norms


def test_a_limit_is_kept_and_one_too_small_is_refused_with_the_numbers(witnesses, tmp_path):
    folder = witnesses["llama3"]
    inputs = folder / "inputs.safetensors"
    _, stats = run(write_config(tmp_path, folder, partition(2)), inputs, tmp_path, "--ranks", 2)
    base, largest = stats["vram"]["resident"], stats["vram"]["streaming_room"]
    # Room for one gathered layer but not two: no prefetch, and the limit holds.
    limit = base + largest + largest // 2
    config = write_config(tmp_path, folder, f"[vram]\nlimit = {limit}\n" + partition(2))
    _, stats = run(config, inputs, tmp_path, "--ranks", 2, "--repeat", 2)
    assert all(rank["peak_weights"] <= limit for rank in stats["ranks"]), stats["ranks"]
    config = write_config(tmp_path, folder, f"[vram]\nlimit = {base + largest - 1}\n" + partition(2))
    error = run(config, inputs, tmp_path, "--ranks", 2, expect_ok=False)
    assert "plus the largest layer gathered whole" in error and "or partition across more ranks" in error


def test_partition_needs_a_group(witnesses, tmp_path):
    config = write_config(tmp_path, witnesses["llama3"], partition(2))
    error = run(config, witnesses["llama3"] / "inputs.safetensors", tmp_path, expect_ok=False)
    assert "[partition].world_size = 2 needs a group of 2 vramd processes, and this one runs alone" in error
    error = run(config, witnesses["llama3"] / "inputs.safetensors", tmp_path, "--ranks", 4, expect_ok=False)
    assert "[partition].world_size = 2, but this group has 4 ranks" in error


def rank_env(rank, world_size, port):
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def start_rank(config, folder, rank, world_size, port, *args):
    return subprocess.Popen([VRAMCTL, "run", config, "--daemon-config", config.parent / "vramd.toml", "--input",
                             folder / "inputs.safetensors", "--threads", "1", *args],
                            env=rank_env(rank, world_size, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_rank_that_never_joins_fails_the_load_naming_it(witnesses, tmp_path):
    folder = witnesses["llama3"]
    config = write_config(tmp_path, folder, '[partition]\nworld_size = 2\ntimeout = "2s"\n')
    rank0 = start_rank(config, folder, 0, 2, free_port())  # rank 1 is never started
    _, err = rank0.communicate(timeout=60)
    assert rank0.returncode == 1
    assert "run/m: rank 1 of 2 did not join within 2s (is a process running with RANK=1 and WORLD_SIZE=2?)" in err


def test_a_rank_killed_mid_load_fails_the_load_naming_it(witnesses, tmp_path):
    folder = witnesses["llama3"]
    config = write_config(tmp_path, folder, '[partition]\nworld_size = 2\ntimeout = "10s"\n')
    port = free_port()
    # Forwards without end: however fast rank 1 loads, it is killed before the run is over.
    rank0 = start_rank(config, folder, 0, 2, port, "--repeat", "1000000")
    rank1 = start_rank(config, folder, 1, 2, port, "--repeat", "1000000")
    # Rank 1 is killed as soon as it has joined this model's group, as rank 0's store shows.
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=__import__("datetime").timedelta(seconds=30))
    deadline = time.monotonic() + 30
    while not store.check(["run/m/joined/1"]):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    rank1.send_signal(signal.SIGKILL)
    rank1.wait()
    _, err = rank0.communicate(timeout=60)
    assert rank0.returncode == 1, err
    assert f"rank 1 (pid {rank1.pid}) has exited" in err, err
    assert "run/m: " in err and "failed on rank 0 of 2" in err, err
