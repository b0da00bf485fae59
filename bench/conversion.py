"""transformers' load-time conversions done once in the daemon (issue #69): what the one
materialisation costs, and whether processes managing the converted model hold it once.

A Mixtral (random weights, float32) saved by its own save_pretrained, so its experts are one
tensor each as on the Hub, and served with the converter `python -m vramd.transformers_converter`
writes from transformers' rules (experts stacked, w1 and w3 concatenated, renames):

  * load: the daemon's load of the converted config (the stacks materialised in the resting
    dtype, the renames views of the checkpoint) against its load of the same file unconverted
    (every tensor a view) and against transformers' own from_pretrained of the folder (which
    converts the same way as it loads), medians of REPEAT, page cache warm; and the bytes the
    conversion materialised (the model's resting bytes less those that are views of the file);
  * converter = "transformers": the same config naming transformers' conversion instead of the
    written file: the time the daemon's check of it takes (its Python writing the converter),
    and its load;
  * memory: PROCESSES processes each managing a MixtralForCausalLM built on the meta device from
    the model served as saved, with no converter (no limit: each computes on the leased values),
    after one forward each: vramd.manage sends transformers' rules and the daemon derives the
    converted model once (POST /v1/models/plain/derive), which every process leases.
    What holds the converted weights: the daemon's memfd (the materialised stacks, which every
    process maps), the checkpoint's pages the renames view (the model's `views.bytes`), and what
    the processes' own anonymous memory grew by in manage() (a copy of a weight would be there);
    against the resting bytes, goal 1.1x. Printed beside it: the forward's buffers, and the
    proportional set size of the checkpoint's mappings (the daemon maps only what its weights
    view: the pages a conversion read to copy are given back).

    .venv/bin/python bench/conversion.py [--workdir /tmp/vramd-bench-conversion] [--layers 4]
                                         [--experts 8] [--processes 3] [--repeat 3]

See docs/benchmarks.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "python"))
from vram import serving  # noqa: E402


def config(args):
    import transformers
    return transformers.MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=256)


def make(work, args):
    import transformers
    folder = work / "mixtral"
    if not (folder / "model.safetensors").exists():
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(config(args)).save_pretrained(folder, safe_serialization=True)
    converter = work / "mixtral.lua"
    subprocess.run([sys.executable, "-m", "vramd.transformers_converter", folder, "-o", converter],
                   check=True, cwd=ROOT / "python")
    models = work / "models"
    models.mkdir(exist_ok=True)
    served = f'checkpoint = "{folder}"\narchitecture = "weights"\ndtype = "float32"\n[residency]\nkeep_alive = "-1"\n'
    (models / "converted.toml").write_text(f'converter = "{converter}"\n' + served)
    (models / "plain.toml").write_text(served)
    return folder


INPUT = [[1, 5, 9, 33, 2, 60, 7, 11]]


def rollup(pid):
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def mapped_pss(pid, names):
    """The Pss of the mappings whose path contains one of `names`, bytes."""
    total, counting = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            counting = any(n in line for n in names)
        elif counting and line.startswith("Pss:"):
            total += int(head[1]) * 1024
    return total


def memfd_bytes(pid, name):
    """The sizes of the memfds named `name` that process `pid` holds open."""
    total, seen = 0, set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if name in os.readlink(fd):
                st = fd.stat()
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        except OSError:
            pass
    return total


def holder(args):
    """One managing process: prints its anonymous memory before manage(), then after a forward
    its Pss of the lease's mappings and its anonymous memory, then holds until told."""
    from accelerate import init_empty_weights
    import transformers
    import vramd
    with init_empty_weights():
        module = transformers.MixtralForCausalLM(config(args)).eval()
    before = rollup(os.getpid())["Pss_Anon"]
    with vramd.connect(args.sock) as client, vramd.manage(module, "plain", client=client) as done, torch.no_grad():
        managed = rollup(os.getpid())["Pss_Anon"]
        logits = module(torch.tensor(INPUT)).logits
        print(json.dumps({"anon_before": before, "anon_managed": managed, "anon_after": rollup(os.getpid())["Pss_Anon"],
                          "logits": logits.flatten()[:8].tolist(), "model": done.lease.manifest["model"]}), flush=True)
        sys.stdin.readline()


def load_seconds(client, name, repeat):
    seconds = []
    for _ in range(repeat):
        client.unload(name)
        start = time.perf_counter()
        client.load(name)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/vramd-bench-conversion")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sock", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        return holder(args)
    import transformers
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    folder = make(work, args)
    size = (folder / "model.safetensors").stat().st_size
    (folder / "model.safetensors").read_bytes()  # warm the page cache for every contender
    (work / "models" / "rules.toml").unlink(missing_ok=True)
    with serving(work, 'cpu = "16GiB"', extra=f'python = "{sys.executable}"') as client:
        converted = load_seconds(client, "converted", args.repeat)
        plain = load_seconds(client, "plain", args.repeat)
        client.unload("plain")
        client.unload("converted")
        # converter = "transformers": the daemon's Python writes the converter as it checks the config.
        (work / "models" / "rules.toml").write_text((work / "models" / "converted.toml").read_text().replace(
            f'converter = "{work / "mixtral.lua"}"', 'converter = "transformers"'))
        start = time.perf_counter()
        client.reload()
        checked = time.perf_counter() - start
        assert client.status("rules")["state"] == "unloaded", client.status("rules")
        rules = load_seconds(client, "rules", args.repeat)
        client.unload("rules")
        # What vramd.manage does first for a module of the file as saved: the converter written
        # from transformers' rules, and the daemon's check of the model it derives with it.
        from accelerate import init_empty_weights
        from vramd.transformers_converter import checkpoint_keys, lua_converter
        with init_empty_weights():
            empty = transformers.MixtralForCausalLM(config(args))
        start = time.perf_counter()
        text = lua_converter(empty, checkpoint_keys(folder))
        written = time.perf_counter() - start
        start = time.perf_counter()
        made = client.derive("plain", text)
        derive = time.perf_counter() - start
        hf = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            reference = transformers.MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            hf.append(time.perf_counter() - start)
        with torch.no_grad():
            expected = reference(torch.tensor(INPUT)).logits.flatten()[:8]
        del reference
        daemon_pid = client.health()["pid"]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        processes = [subprocess.Popen([sys.executable, __file__, "--hold", "--sock", str(work / "vramd.sock"),
                                       "--layers", str(args.layers), "--experts", str(args.experts)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                     for _ in range(args.processes)]
        try:
            lines = [json.loads(p.stdout.readline()) for p in processes]
            derived = {line["model"] for line in lines}
            assert derived == {made["name"]}, (derived, made)  # one model the daemon derived, for all
            model = client.status(derived.pop())
            resting = model["devices"]["cpu"]
            views = model.get("views", {}).get("bytes", 0)
            memfds = memfd_bytes(daemon_pid, "memfd:vramd:" + model["name"])
            checkpoint = str(folder / "model.safetensors")
            daemon_file = mapped_pss(daemon_pid, [checkpoint])
            clients_file = sum(mapped_pss(p.pid, [checkpoint]) for p in processes)
            clients_memfd = sum(mapped_pss(p.pid, ["memfd:vramd"]) for p in processes)
        finally:
            for p in processes:
                p.communicate("\n", timeout=120)
    error = max((torch.tensor(line["logits"]) - expected).abs().max().item() for line in lines)
    print(f"Mixtral, hidden 512, {args.layers} layers of {args.experts} experts, {size / 2**20:.0f} MiB in float32 "
          f"(save_pretrained: one tensor per expert); medians of {args.repeat}")
    print(f"load: converted {converted:.3f} s, the same file unconverted {plain:.3f} s, transformers' from_pretrained "
          f"{statistics.median(hf):.3f} s; the conversion materialised {(resting - views) / 2**20:.0f} MiB "
          f"(resting {resting / 2**20:.0f} MiB, {views / 2**20:.0f} MiB of them views of the checkpoint)")
    print(f"converter = \"transformers\": the config checked in {checked:.2f} s (the daemon's Python writing the "
          f"converter), then loaded in {rules:.3f} s")
    print(f"derive: the converter written from transformers' rules in {written:.3f} s ({len(text) / 1024:.0f} KiB of "
          f"Lua), the derived model checked by the daemon in {derive:.3f} s")
    managing = sum(line["anon_managed"] - line["anon_before"] for line in lines)
    forwarding = sum(line["anon_after"] - line["anon_managed"] for line in lines)
    held = memfds + views + managing
    print(f"{args.processes} processes managing the file as saved, the daemon converting it once "
          f"({model['name']}), after a forward each: the daemon's memfd {memfds / 2**20:.0f} MiB "
          f"(the materialised stacks, mapped by every process: their Pss of it {clients_memfd / 2**20:.0f} MiB, the "
          f"experts they touched), the checkpoint's viewed pages {views / 2**20:.0f} MiB, the processes' own anonymous "
          f"memory grown by manage() {managing / 2**20:.2f} MiB: {held / resting:.3f}x the resting bytes (goal 1.1x). "
          f"Beside them: the forwards' buffers {forwarding / 2**20:.1f} MiB in all; the checkpoint's pages mapped, "
          f"Pss: the daemon {daemon_file / 2**20:.0f} MiB, "
          f"the processes {clients_file / 2**20:.0f} MiB; their logits against from_pretrained's {error:.1e}")


if __name__ == "__main__":
    main()
