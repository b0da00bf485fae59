"""Mixtures of experts under [vram].limit: each expert's projections are layers of their own,
brought in only when a batch is routed to them, and kept resident as often as they are routed.
Through vramctl run on real checkpoints saved by transformers; the routing is read back from the
model's own router_logits output. A resident mixture is leased and updated as any model is."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
import hf_models  # noqa: E402
from daemon_support import Daemon, request  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
EXPERT = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """16 experts a layer, 2 chosen per token, float32; and inputs of two tokens, which route to
    at most 4 experts a layer."""
    folder = hf_models.make("mixtral_wide", "float32", tmp_path_factory.mktemp("moe"))
    inputs = load_file(folder / "inputs.safetensors")
    save_file({"input_ids": inputs["input_ids"][:1, :2].contiguous(), "output_router_logits": torch.tensor(1)},
              folder / "short.safetensors")
    return folder


def sizes(folder):
    """(bytes of the layers every token runs through, bytes of one expert's three layers)."""
    weights = load_file(folder / "model" / "model.safetensors")
    shared = sum(t.numel() * t.element_size() for name, t in weights.items() if not EXPERT.search(name))
    expert = sum(t.numel() * t.element_size() for name, t in weights.items() if ".experts.0." in name and "layers.0." in name)
    return shared, expert


def run(folder, tmp_path, inputs, vram="", repeat=1, trace=False):
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n"cuda:0" = "8GiB"\n')
    config = tmp_path / "model.toml"
    config.write_text(f'checkpoint = "{folder / "model"}"\n{vram}')
    output, stats = tmp_path / "out.safetensors", tmp_path / "stats.json"
    command = [VRAMCTL, "run", config, "--daemon-config", tmp_path / "vramd.toml", "--input", inputs, "--output", output,
               "--stats-json", stats, "--repeat", str(repeat)]
    if trace:
        command += ["--trace", tmp_path / "trace.json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["events"] if trace else None
    return load_file(output), json.loads(stats.read_text()), events


def routed(router_logits, k=2):
    """{(layer, expert)} that some token chose, from router_logits [layers, tokens, experts]."""
    top = router_logits.topk(k, -1).indices
    return {(layer, int(e)) for layer in range(top.shape[0]) for e in top[layer].flatten().unique()}


def quarter(folder, device="cpu"):
    """A [vram] table whose limit holds every layer but the experts, room to stream, and a quarter
    of the experts (8 of 32), with the streamed ones resting in host memory."""
    shared, expert = sizes(folder)
    limit = shared + 8 * expert + 2 * (expert // 3)  # and room to stream two expert layers
    onload_limit = 'onload_limit = "1GiB"\n' if device == "cpu" else ""
    return (f'[vram]\ncomputation = {{ device = "{device}" }}\noffload = {{ device = "disk" }}\n'
            f'onload = {{ device = "cpu" }}\n{onload_limit}limit = {limit}\n'), limit


def test_streamed_experts_equal_resident_ones_and_only_routed_ones_move(mixtral, tmp_path):
    # The padded batch of the parity tests: most experts are routed, a quarter fit.
    resident, _, _ = run(mixtral, tmp_path, mixtral / "inputs.safetensors")
    vram, limit = quarter(mixtral)
    got, stats, _ = run(mixtral, tmp_path, mixtral / "inputs.safetensors", vram, repeat=3)
    v, experts = stats["vram"], stats["vram"]["experts"]
    assert v["peak"] <= limit, v
    assert experts["layers"] == 96 and experts["resident_layers"] == 24, experts
    assert experts["hits"] > 0 and experts["misses"] > 0, experts
    for name in resident:
        assert torch.equal(got[name], resident[name]), name

    # Two tokens: at most 4 of 16 experts a layer. The first forward brings in only those; then
    # they stay, in place of the resident experts no token chose, and the next forwards move no
    # expert at all.
    short = mixtral / "short.safetensors"
    resident, _, _ = run(mixtral, tmp_path, short)
    chosen = routed(resident["router_logits"])
    assert len(chosen) <= 8
    expert_bytes = sizes(mixtral)[1]
    misses = {}
    for repeat in (1, 3):
        got, stats, events = run(mixtral, tmp_path, short, vram, repeat=repeat, trace=True)
        for name in resident:
            assert torch.equal(got[name], resident[name]), name
        experts = misses[repeat] = stats["vram"]["experts"]
        moved = {(int(m[1]), int(m[2])) for e in events if e[3] in ("prefetch", "acquire")
                 for m in [EXPERT.search(e[2])] if m}
        assert moved <= chosen, moved - chosen  # an expert no token chose is never brought in
        # Each forward asks for each chosen expert's three layers: found resident, or brought in
        # once; every one brought in stays, in place of a resident one no token chose.
        assert experts["hits"] + experts["misses"] == repeat * len(chosen) * 3, experts
        assert experts["bytes_streamed"] == experts["misses"] * expert_bytes // 3, experts
        assert experts["swaps"] == experts["misses"], experts
        assert stats["vram"]["peak"] <= limit
    # So the forwards after the first moved no expert at all.
    assert misses[3]["misses"] == misses[1]["misses"] > 0, misses
    assert not [e for e in events if e[3] == "prefetch" and EXPERT.search(e[2])], events
    # --stats says the same in words, each count with its noun in the right number.
    config = tmp_path / "model.toml"
    printed = subprocess.run([VRAMCTL, "run", config, "--daemon-config", tmp_path / "vramd.toml", "--input", short,
                              "--stats"], capture_output=True, text=True, timeout=600)
    line = next(line for line in printed.stderr.splitlines() if line.startswith("experts: "))
    counts = re.findall(r"(\d+) (hits?|miss(?:es)?|swaps?)\b", line)
    assert len(counts) == 3, line
    for n, word in counts:
        assert (int(n) == 1) == (word in ("hit", "miss", "swap")), line


def test_the_daemon_reports_expert_hits_and_misses_and_keeps_its_experts_across_sleep(mixtral, tmp_path):
    vram, _ = quarter(mixtral)
    daemon = Daemon(tmp_path)
    (daemon.models / "moe.toml").write_text(f'checkpoint = "{mixtral / "model"}"\n{vram}')
    daemon.start()
    try:
        short = (mixtral / "short.safetensors").read_bytes()
        status, first = request(daemon.sock, "POST", "/v1/models/moe/forward", short)
        assert status == 200, first
        # Asleep and awake again, with the experts the first forward made resident: the same answer.
        for verb in ("offload", "onload"):
            status, body = request(daemon.sock, "POST", f"/v1/models/moe/{verb}")
            assert status == 200, body
        status, again = request(daemon.sock, "POST", "/v1/models/moe/forward", short)
        assert status == 200 and all(torch.equal(t, load(first)[name]) for name, t in load(again).items())
        status, body = request(daemon.sock, "GET", "/v1/models/moe")
        experts = json.loads(body)["weights"]["experts"]
        assert experts["layers"] == 96 and experts["hits"] + experts["misses"] > 0, experts
        status, body = request(daemon.sock, "GET", "/metrics")
        metrics = body.decode()
        assert f'vramd_expert_misses_total{{model="moe"}} {experts["misses"]}' in metrics
        assert f'vramd_expert_bytes_streamed_total{{model="moe"}} {experts["bytes_streamed"]}' in metrics
    finally:
        assert daemon.stop() == 0


def test_a_leased_mixture_hands_over_every_expert_and_follows_an_update(mixtral, tmp_path):
    # Resident, a mixture is leased as any model is: every expert's weights, zero-copy, under the
    # checkpoint's names. An update of one routed expert reaches a following lease, leaves its
    # layer's routing as it was and changes the logits.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    import vramd
    daemon = Daemon(tmp_path)
    (daemon.models / "moe.toml").write_text(f'checkpoint = "{mixtral / "model"}"\n')
    weights = load_file(mixtral / "model" / "model.safetensors")
    short = load_file(mixtral / "short.safetensors")
    with daemon.start(), vramd.connect(daemon.sock) as client:
        before = client.forward("moe", short)
        expert = min(e for layer, e in routed(before["router_logits"]) if layer == 0)
        name = f"model.layers.0.block_sparse_moe.experts.{expert}.w2.weight"
        lease = client.lease("moe", follow=True)
        with lease:
            assert lease.state_dict.keys() == weights.keys()
            assert all(torch.equal(lease.state_dict[key], weights[key]) for key in weights)
            client.update("moe", {name: weights[name] * 2})
            assert torch.equal(lease.wait_update(timeout=60)[name], weights[name] * 2)
        after = client.forward("moe", short)
        assert torch.equal(after["router_logits"][0], before["router_logits"][0])  # layer 0 routes as before
        assert not torch.equal(after["logits"], before["logits"])
        assert daemon.stop() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: experts streamed onto a GPU are not run")
def test_experts_streamed_onto_a_gpu_equal_resident_ones_there(mixtral, tmp_path):
    cuda = '[vram]\ncomputation = { device = "cuda:0" }\n'
    vram, limit = quarter(mixtral, "cuda:0")
    for inputs in ("inputs.safetensors", "short.safetensors"):
        resident, _, _ = run(mixtral, tmp_path, mixtral / inputs, cuda)
        got, stats, _ = run(mixtral, tmp_path, mixtral / inputs, vram, repeat=3)
        assert stats["vram"]["peak"] <= limit and stats["vram"]["experts"]["misses"] > 0, stats["vram"]
        for name in resident:
            assert torch.equal(got[name], resident[name]), name
    assert stats["vram"]["experts"]["swaps"] > 0, stats["vram"]


def test_experts_on_the_cpu_are_planned_beside_a_gpu_model_and_refused_where_they_cannot_be(mixtral, tmp_path):
    # vramctl check plans without a GPU: the experts rest in host memory, apart from the limit.
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "8GiB"\n"cuda:0" = "8GiB"\n')
    config = tmp_path / "moe.toml"

    def check(text):
        config.write_text(text)
        return subprocess.run([VRAMCTL, "check", config, "--daemon-config", tmp_path / "vramd.toml"],
                              capture_output=True, text=True, timeout=120)

    cuda = '[vram]\ncomputation = { device = "cuda:0" }\nexperts = "cpu"\n'
    done = check(f'checkpoint = "{mixtral / "model"}"\n{cuda}')
    assert done.returncode == 0, done.stdout + done.stderr
    expert_bytes = 32 * sizes(mixtral)[1]
    assert expert_bytes == int(2.25 * 2**20)
    assert "96 expert layers computed on the CPU (2.25 MiB in host memory)" in done.stdout, done.stdout
    done = check(f'checkpoint = "{mixtral / "model"}"\n[vram]\nexperts = "cpu"\n')
    assert done.returncode == 1 and "this model computes on the CPU already" in done.stdout, done.stdout
    llama = hf_models.make("llama", "float32", tmp_path)
    done = check(f'checkpoint = "{llama / "model"}"\n{cuda}')
    # Found once the model is built, and named where the file says it (line 4, column 1).
    assert done.returncode == 1 and f"{config}:4:1: vram.experts = \"cpu\", but 'llama' has no experts to compute there" \
        in done.stdout, done.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: experts computed on the CPU beside a GPU are not run")
def test_experts_computed_on_the_cpu_beside_a_gpu_model_give_its_outputs(mixtral, tmp_path):
    # llama.cpp's --cpu-moe: every expert in host memory, computed there; the rest on the GPU,
    # under a limit or not. float32 products on two devices agree to their last bits.
    cuda = '[vram]\ncomputation = { device = "cuda:0" }\n'
    for inputs in ("inputs.safetensors", "short.safetensors"):
        resident, _, _ = run(mixtral, tmp_path, mixtral / inputs, cuda)
        shared, _ = sizes(mixtral)
        for vram in (cuda + 'experts = "cpu"\n', cuda + f'experts = "cpu"\nlimit = {shared}\n'):
            got, stats, _ = run(mixtral, tmp_path, mixtral / inputs, vram, repeat=2)
            experts = stats["vram"]["experts"]
            assert experts["cpu_layers"] == 96 and experts["cpu_ops"] > 0 and experts["misses"] == 0, experts
            assert stats["vram"]["peak"] <= shared, stats["vram"]
            for name in resident:
                error = ((got[name].float() - resident[name].float()).abs().max() / resident[name].float().abs().max())
                assert error <= 1e-4, (name, error)
