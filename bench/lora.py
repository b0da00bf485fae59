"""Switching LoRA adapters on a served model, against the ways to do it without vramd's switch,
measured in the same run on one checkpoint and two adapters:

    vramd switch     POST /v1/models/NAME/loras (Client.set_loras) on the loaded model, then one
                     forward: the time from the request to the first output on the new set
    vramd unfused    the same with fuse_lora = false: the factors replaced, no weight written
    vramd reload     what a switch costs without it: unload, the config's [[lora]] edited to the
                     new adapter, load, forward
    peft switch      the same model in this process under peft (transformers + PeftModel): the new
                     adapter loaded (load_adapter) and made active (set_adapter), unfused, then one
                     forward
    peft fused       the same, fused as vramd's weights are: unmerge the old adapter, load and
                     merge the new one, one forward

Then (first, or alone with --only unet) a UNet2DConditionModel, served as architecture
"weights" and managed in this process by vramd.manage, against diffusers on the same UNet and
two kohya LoRA files:

    vramd.manage     Managed.set_loras: the process's own adapters replaced, then one forward
    vramd followed   Client.set_loras on the served model, the managed module (follow=True)
                     taking the new version (wait_update), then one forward
    vramd clients    the same on the model served with fuse_lora = false, whose adapters its
                     clients apply: the daemon writes nothing, the module reads the new file
    diffusers        load_lora_adapter + set_adapters (unfused); unfuse_lora, delete_adapters,
                     load_lora_adapter, fuse_lora (fused); from_pretrained + the file fused (a
                     reload), each then one forward

each first output against diffusers' own fuse_lora of that file; and the forwards' cost.

For the LLaMA, a forward's cost with adapters against the base's: vramd's median forward with an
adapter in force, fused (its weights are W + s*B*A, computed once at the switch, so a forward
pays nothing) and unfused, against peft's unfused forward (x*W + s*(x*A)*B at each call). Every
LLaMA contender's first output is compared with peft's merge_and_unload() of the same adapter.

    .venv/bin/python bench/lora.py [--workdir /tmp/vramd-bench-lora] [--layers 8] [--rank 16]
                                   [--vocab 32000] [--tokens 32] [--repeat 5] [--device cpu]
                                   [--only llama,unet,memory] [--json FILE]

The model: a LLaMA of hidden size 1024, LAYERS layers and a vocabulary of VOCAB, random weights
saved in bfloat16 (so that a load reads and casts them) and computed in float32 by every
contender on one sequence of TOKENS; the adapters: rank RANK on q, k, v and o of every layer,
random factors. Figures are medians of REPEAT runs (one process, page cache warm). Last (or alone
with --only memory), the daemon's host memory with several configs of the LLaMA loaded at once,
each with an adapter of its own: in bfloat16 (views of the checkpoint's pages) and in float32
(copies the configs share). --only takes a comma-separated list of the parts.

--device cuda:0 (scripts/gpu-check's lora step) computes every contender there: the daemon's
models with [vram] computation on it, the managed UNets on it, peft's and diffusers' models moved
to it, each forward waited for; the witnesses are computed there too. The vramd LLaMA's forwards
are also timed as the daemon counts them (its stats' forward_seconds: the inputs read, the
forward and its outputs written, not the socket), since over the socket a small forward on a GPU
is mostly transport. The host memory rows are the CPU's alone. See docs/benchmarks.md.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from update import median_seconds  # noqa: E402
from vram import serving  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def timed_switches(repeat, switch, forward, after=lambda i: None):
    """REPEAT switches, each `switch(i)` then `forward()` (`after(i)` untimed after it): the
    medians of the switch alone and to the end of its forward, and the last forward's output."""
    alone, first = [], []
    for i in range(repeat):
        start = time.perf_counter()
        switch(i)
        alone.append(time.perf_counter() - start)
        output = forward()
        first.append(time.perf_counter() - start)
        after(i)
    return statistics.median(alone), statistics.median(first), output


def record(out, name, timed, file):
    """timed_switches' figures as `out`'s NAME alone, NAME, NAME output and the adapter's NAME file."""
    alone, first, output = timed
    out.update({f"{name} alone": alone, name: first, f"{name} output": output, f"{name} file": file})


def make(work, layers, rank, vocab):
    """The checkpoint folder, and two adapter folders saved by peft (under a folder of WORK named
    by the shape, so that runs of other shapes make their own)."""
    import peft
    import transformers
    work = work / f"llama-{layers}-layers-vocab-{vocab}-rank-{rank}"
    base = work / "model"
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    if not (base / "model.safetensors").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.02)
        model.to(torch.bfloat16).save_pretrained(base, safe_serialization=True)  # as checkpoints are: cast at load
    adapters = []
    for seed in (1, 2):
        folder = work / f"adapter{seed}"
        if not (folder / "adapter_model.safetensors").exists():
            model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
            torch.manual_seed(seed)
            lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                              init_lora_weights=False))
            with torch.no_grad():
                for name, parameter in lora.named_parameters():
                    if "lora_" in name:
                        parameter.normal_(0, 0.05)
            lora.save_pretrained(folder)
        adapters.append(folder)
    return base, adapters


def stored_bytes(base):
    """The bytes of the checkpoint's tensors."""
    return sum(t.numel() * t.element_size() for t in load((base / "model.safetensors").read_bytes()).values())


def inputs(tokens, vocab):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (1, tokens), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def waited(device, forward):
    """`forward`, which on a GPU returns once its kernels have run."""
    if torch.device(device).type != "cuda":
        return forward

    def run():
        out = forward()
        torch.cuda.synchronize(device)
        return out
    return run


def peft_contenders(base, adapters, batch, repeat, device):
    import peft
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).to(device).eval()
    batch = {k: v.to(device) for k, v in batch.items()}
    call = waited(device, lambda: model(**batch))
    with torch.no_grad():
        base_forward = median_seconds(repeat, lambda: None, call)
    model = peft.PeftModel.from_pretrained(model, adapters[0], adapter_name="a0").eval()
    call = waited(device, lambda: model(**batch))
    names = ["a0"]
    switch, switch_alone = [], []
    with torch.no_grad():
        for i in range(repeat):
            name = f"s{i}"
            start = time.perf_counter()
            model.load_adapter(adapters[(i + 1) % 2], adapter_name=name)
            model.set_adapter(name)
            switch_alone.append(time.perf_counter() - start)
            logits = call().logits
            switch.append(time.perf_counter() - start)
            model.delete_adapter(names.pop())
            names.append(name)
        unfused_forward = median_seconds(repeat, lambda: None, call)
        unfused_logits = logits
        fused, fused_alone = [], []
        model.merge_adapter()
        for i in range(repeat):
            name = f"f{i}"
            start = time.perf_counter()
            model.unmerge_adapter()
            model.load_adapter(adapters[i % 2], adapter_name=name)
            model.set_adapter(name)
            model.merge_adapter()
            fused_alone.append(time.perf_counter() - start)
            logits = call().logits
            fused.append(time.perf_counter() - start)
            model.delete_adapter(names.pop())
            names.append(name)
    last = adapters[(repeat - 1) % 2]
    return {"base forward": base_forward, "unfused forward": unfused_forward, "switch": statistics.median(switch),
            "fused switch": statistics.median(fused), "switch alone": statistics.median(switch_alone),
            "fused switch alone": statistics.median(fused_alone), "unfused logits": unfused_logits.cpu(),
            "unfused adapter": adapters[repeat % 2], "fused logits": logits.cpu(), "fused adapter": last}


def merged_logits(base, adapter, batch, device):
    import peft
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).to(device).eval()
    model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in batch.items()}).logits.cpu()


def budgets(device):
    """The daemon's [budgets] for models computed on `device`."""
    return 'cpu = "8GiB"' + (f'\n"{device}" = "64GiB"' if torch.device(device).type == "cuda" else "")


def daemon_forward(client, name, batch, repeat):
    """The median of REPEAT forwards of model NAME on `batch`, and their mean as the daemon counts them (its
    stats' forward_seconds: the inputs read, the forward and its outputs written)."""
    stats = lambda: client.status(name)["stats"]  # noqa: E731
    before = stats()
    wall = median_seconds(repeat, lambda: None, lambda: client.forward(name, batch))
    after = stats()
    return wall, (after["forward_seconds"] - before["forward_seconds"]) / (after["forwards"] - before["forwards"])


def vramd_contenders(work, base, adapters, batch, repeat, device):
    models = work / "models"
    models.mkdir(exist_ok=True)
    for old in models.glob("*.toml"):
        old.unlink()
    config = models / "m.toml"
    on = f'[vram]\ncomputation = {{ device = "{device}" }}\n' if device != "cpu" else ""
    text = f'checkpoint = "{base}"\ndtype = "float32"\n[residency]\nkeep_alive = "-1"\n{on}'
    config.write_text(text)
    with serving(work, budgets(device)) as client:
        forward = lambda: client.forward("m", batch)
        forward()
        base_forward, base_daemon = daemon_forward(client, "m", batch, repeat)
        client.set_loras("m", [adapters[0]])
        adapted_forward, adapted_daemon = daemon_forward(client, "m", batch, repeat)
        switch, switch_alone, daemon_part, written = [], [], [], 0
        for i in range(repeat):
            start = time.perf_counter()
            answer = client.set_loras("m", [adapters[(i + 1) % 2]])
            switch_alone.append(time.perf_counter() - start)
            out = forward()
            switch.append(time.perf_counter() - start)
            daemon_part.append(answer["updated"]["seconds"])
            written = answer["updated"]["tensors"]
        switched_to = adapters[repeat % 2]
        switched_logits = out["logits"]

        def reload_with(i):
            client.unload("m")
            config.write_text(text + f'[[lora]]\npath = "{adapters[i % 2]}"\n')
            client.reload()
            client.load("m")

        reload_alone, reload, out = timed_switches(repeat, reload_with, forward)
        reloaded_to = adapters[(repeat - 1) % 2]
        # Unfused (fuse_lora = false): a switch replaces the factors alone.
        client.unload("m")
        (models / "u.toml").write_text(text.replace("[residency]", "fuse_lora = false\n[residency]"))
        client.reload()
        unfused = lambda: client.forward("u", batch)
        unfused()
        client.set_loras("u", [adapters[0]])
        unfused()
        unfused_forward, unfused_daemon = daemon_forward(client, "u", batch, repeat)
        unfused_alone, unfused_switch, out_u = timed_switches(
            repeat, lambda i: client.set_loras("u", [adapters[(i + 1) % 2]]), unfused)
        return {"unfused forward": unfused_forward, "unfused switch": unfused_switch, "base daemon": base_daemon,
                "adapted daemon": adapted_daemon, "unfused daemon": unfused_daemon,
                "unfused switch alone": unfused_alone, "unfused logits": out_u["logits"],
                "unfused adapter": adapters[repeat % 2],"base forward": base_forward, "adapted forward": adapted_forward, "switch": statistics.median(switch),
                "daemon switch": statistics.median(daemon_part), "weights written": written,
                "reload": reload, "switch alone": statistics.median(switch_alone),
                "reload alone": reload_alone, "switched logits": switched_logits, "switched adapter": switched_to,
                "reloaded logits": out["logits"], "reloaded adapter": reloaded_to}


def pss(pid):
    """The daemon's proportional set size, bytes: shared file pages counted once across mappings."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in smaps_rollup")


def memory_contenders(work, base, adapters, configs, batch, dtype):
    """The daemon's memory with one config of the checkpoint loaded (no adapters), then with
    CONFIGS more of it, each with an adapter of its own (fuse_lora = false), all in `dtype`: the
    stored one (bfloat16), where their weights are views of the checkpoint's page cache, or
    float32, where they are copies the configs share. Each is loaded and runs one forward (which
    touches every weight) before the daemon's Pss is read, beside what its cpu budget counts
    (`used`, each page or copy several configs hold counted once). Returns (Pss, used) after each
    config."""
    work = work / f"memory-{dtype}"
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    for old in models.glob("*.toml"):
        old.unlink()
    plain = f'checkpoint = "{base}"\ndtype = "{dtype}"\n[residency]\nkeep_alive = "-1"\n'
    (models / "base.toml").write_text(plain)
    for i in range(configs):
        (models / f"c{i}.toml").write_text(plain.replace("[residency]", "fuse_lora = false\n[residency]") +
                                          f'[[lora]]\npath = "{adapters[i % 2]}"\nscale = {0.5 + i}\n')
    with serving(work, 'cpu = "16GiB"') as client:
        pid = client.health()["pid"]
        before = pss(pid)
        figures = []
        for name in ["base"] + [f"c{i}" for i in range(configs)]:
            client.forward(name, batch)
            figures.append((pss(pid) - before, client.status()["devices"]["cpu"]["used"]))
    return figures


def memory_rows(work, base, adapters, configs, batch, size):
    """memory_contenders in the stored dtype (views) and in float32 (copies), printed; returns
    their figures by dtype."""
    figures = {}
    for dtype, held in [("bfloat16", size), ("float32", 2 * size)]:
        memory = memory_contenders(work, base, adapters, configs, batch, dtype)
        figures[f"memory {dtype}"] = memory
        print(f"host memory, computed in {dtype}, over one base held as {held / 2**20:.0f} MiB, the base's config and "
              f"then configs unfused with an adapter of their own, the daemon's Pss after a forward of each and what "
              f"its cpu budget counts: " +
              ", ".join(f"{n} config{'s' if n != 1 else ''} {b / 2**20:.0f} MiB ({b / held:.2f}x), counted "
                        f"{used / 2**20:.0f} MiB ({used / held:.2f}x)" for n, (b, used) in enumerate(memory, 1)))
    return figures


def make_unet():
    import diffusers
    return diffusers.UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(128, 256, 256),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=256,
        attention_head_dim=8, norm_num_groups=32).eval()


def make_unet_files(work, rank):
    """A UNet's folder (save_pretrained, float32) and two kohya LoRA files of rank RANK (alpha
    RANK / 2) on every attention projection and every resnet's first convolution."""
    folder = work / "unet"
    if not (folder / "diffusion_pytorch_model.safetensors").exists():
        torch.manual_seed(0)
        make_unet().save_pretrained(folder)
    state = load((folder / "diffusion_pytorch_model.safetensors").read_bytes())
    suffixes = tuple(f"{p}.weight" for p in ("to_q", "to_k", "to_v", "to_out.0", "conv1"))
    files = []
    for seed in (1, 2):
        path = work / f"kohya{seed}.safetensors"
        if not path.exists():
            g, kohya = torch.Generator().manual_seed(seed), {}
            for name, weight in state.items():
                if not name.endswith(suffixes):
                    continue
                key = "lora_unet_" + name[: -len(".weight")].replace(".", "_")
                conv = weight.dim() == 4
                kohya[f"{key}.lora_down.weight"] = torch.randn((rank, *weight.shape[1:]) if conv else (rank, weight.shape[1]), generator=g) * 0.05
                kohya[f"{key}.lora_up.weight"] = torch.randn((weight.shape[0], rank, 1, 1) if conv else (weight.shape[0], rank), generator=g) * 0.05
                kohya[f"{key}.alpha"] = torch.tensor(rank / 2)
            save_file(kohya, path)
        files.append(path)
    return folder, files


def unet_inputs(device):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, 4, 32, 32, generator=g).to(device), 10, torch.randn(1, 16, 256, generator=g).to(device)


def diffusers_adapter(unet, path, name):
    """diffusers' own way: the file read (lora_state_dict) and loaded as adapter `name`."""
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin
    state, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(str(path))
    unet.load_lora_adapter(state, network_alphas=alphas, prefix="unet", adapter_name=name)


def diffusers_contenders(folder, files, scale, x, repeat, device):
    """diffusers on the UNet in this process: a switch unfused (load_lora_adapter + set_adapters),
    fused (unfuse_lora, delete_adapters, load_lora_adapter, fuse_lora) and a reload (from_pretrained
    + the adapter fused), each to the first output; forwards of the base, fused and unfused."""
    import diffusers
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder).to(device).eval()
    out = {}
    forward = waited(device, lambda: unet(*x).sample)
    with torch.no_grad():
        out["base forward"] = median_seconds(repeat, lambda: None, forward)
        diffusers_adapter(unet, files[0], "a0")
        unet.set_adapters(["a0"], weights=[scale])
        out["unfused forward"] = median_seconds(repeat, lambda: None, forward)
        names = ["a0"]  # the adapters loaded

        def switch(i):
            diffusers_adapter(unet, files[(i + 1) % 2], f"s{i}")
            unet.set_adapters([f"s{i}"], weights=[scale])

        def drop_old(i):
            unet.delete_adapters(names.pop())
            names.append(f"s{i}")

        record(out, "switch", timed_switches(repeat, switch, forward, drop_old), files[repeat % 2])
        unet.fuse_lora(lora_scale=scale, adapter_names=names)
        out["fused forward"] = median_seconds(repeat, lambda: None, forward)

        def fused_switch(i):
            unet.unfuse_lora()
            unet.delete_adapters(names.pop())
            diffusers_adapter(unet, files[i % 2], f"f{i}")
            unet.fuse_lora(lora_scale=scale, adapter_names=[f"f{i}"])

        record(out, "fused switch", timed_switches(repeat, fused_switch, forward, lambda i: names.append(f"f{i}")),
               files[(repeat - 1) % 2])
        del unet
        reloaded = {}

        def reload(i):
            reloaded["unet"] = diffusers.UNet2DConditionModel.from_pretrained(folder).to(device).eval()
            diffusers_adapter(reloaded["unet"], files[i % 2], "r")
            reloaded["unet"].fuse_lora(lora_scale=scale, adapter_names=["r"])

        record(out, "reload", timed_switches(repeat, reload, waited(device, lambda: reloaded["unet"](*x).sample)),
               files[(repeat - 1) % 2])
    return out


def fused_witness(folder, path, scale, x, device):
    """diffusers' output with the file fused at `scale`: what every contender's must equal."""
    import diffusers
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder).to(device).eval()
    diffusers_adapter(unet, path, "w")
    unet.fuse_lora(lora_scale=scale, adapter_names=["w"])
    with torch.no_grad():
        return unet(*x).sample


def vramd_unet_contenders(work, folder, files, scale, x, repeat, device):
    """The UNet served as architecture "weights" (no family: it runs in the client) and managed
    there by vramd.manage: its own adapters switched by Managed.set_loras, and the daemon's
    switched by Client.set_loras while the module follows the model's versions."""
    from accelerate import init_empty_weights
    import vramd
    work = work / "unet-serving"
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    served = f'checkpoint = "{folder / "diffusion_pytorch_model.safetensors"}"\narchitecture = "weights"\n'
    (models / "unet.toml").write_text(served)
    adapter = f'[[lora]]\npath = "{files[0]}"\nscale = {scale}\n'
    (models / "unet-daemon.toml").write_text(served + adapter)
    (models / "unet-clients.toml").write_text(served + "fuse_lora = false\n" + adapter)
    with init_empty_weights():
        module, following = make_unet(), make_unet()
    out = {}
    with serving(work, budgets(device)) as client, torch.no_grad():
        with vramd.manage(module, "unet", client=client, device=device) as managed:
            forward = waited(device, lambda: module(*x).sample)
            forward()
            out["base forward"] = median_seconds(repeat, lambda: None, forward)
            managed.set_loras([(files[0], scale)])
            forward()
            out["adapted forward"] = median_seconds(repeat, lambda: None, forward)
            record(out, "own switch", timed_switches(repeat, lambda i: managed.set_loras([(files[(i + 1) % 2], scale)]),
                                                     forward), files[repeat % 2])
        for name, model in (("daemon switch", "unet-daemon"), ("clients switch", "unet-clients")):
            with vramd.manage(following, model, client=client, follow=True, device=device) as managed:
                following(*x)

                def daemon_switch(i):
                    client.set_loras(model, [(files[(i + 1) % 2], scale)])
                    managed.wait_update()

                record(out, name, timed_switches(repeat, daemon_switch, waited(device, lambda: following(*x).sample)),
                       files[repeat % 2])
    return out


def unet_rows(work, rank, repeat, device):
    """The UNet against diffusers, printed."""
    scale = 0.75
    folder, files = make_unet_files(work, rank)
    x = unet_inputs(device)
    v = vramd_unet_contenders(work, folder, files, scale, x, repeat, device)
    d = diffusers_contenders(folder, files, scale, x, repeat, device)
    witnesses = {f: fused_witness(folder, f, scale, x, device) for f in files}

    def against(got, path):
        return ((got - witnesses[path]).abs().max() / witnesses[path].abs().max()).item()

    size = (folder / "diffusion_pytorch_model.safetensors").stat().st_size
    print(f"UNet2DConditionModel, {size / 2**20:.0f} MiB in float32; kohya LoRA files of rank {rank} on every attention "
          f"projection and resnet conv1 ({files[0].stat().st_size / 2**20:.1f} MiB), scale {scale}; median of {repeat}; "
          f"computed on {device}")
    rows = [("vramd.manage, Managed.set_loras", v["own switch alone"], v["own switch"], v["own switch output"], v["own switch file"]),
            ("vramd Client.set_loras, followed", v["daemon switch alone"], v["daemon switch"], v["daemon switch output"],
             v["daemon switch file"]),
            ("vramd Client.set_loras, clients apply", v["clients switch alone"], v["clients switch"],
             v["clients switch output"], v["clients switch file"]),
            ("diffusers switch (unfused)", d["switch alone"], d["switch"], d["switch output"], d["switch file"]),
            ("diffusers fused switch", d["fused switch alone"], d["fused switch"], d["fused switch output"], d["fused switch file"]),
            ("diffusers reload, fused", d["reload alone"], d["reload"], d["reload output"], d["reload file"])]
    print(f"  {'':38} {'the switch':>10} {'+ forward':>10}   first output against diffusers' fuse_lora")
    errors = {}
    for name, alone, first, got, path in rows:
        errors[f"unet error {name}"] = against(got, path)
        print(f"  {name:38} {alone:8.3f} s {first:8.3f} s   {errors[f'unet error {name}']:.1e} relative")
    fastest = min(d["switch alone"], d["fused switch alone"], d["reload alone"])
    print(f"vramd's switches against diffusers' fastest way ({fastest:.3f} s): Managed.set_loras "
          f"{fastest / v['own switch alone']:.1f}x, Client.set_loras {fastest / v['daemon switch alone']:.1f}x, "
          f"Client.set_loras with clients applying {fastest / v['clients switch alone']:.1f}x faster")
    print(f"forward: diffusers base {d['base forward']:.3f} s, fused {d['fused forward'] / d['base forward']:.2f}x, unfused "
          f"{d['unfused forward'] / d['base forward']:.2f}x; vramd.manage base {v['base forward']:.3f} s, with its own "
          f"adapter {v['adapted forward'] / v['base forward']:.2f}x")
    return errors | {f"unet vramd {k}": x for k, x in v.items() if isinstance(x, float)} | \
        {f"unet diffusers {k}": x for k, x in d.items() if isinstance(x, float)}


def llama_rows(work, args):
    """The LLaMA against peft, printed; returns its figures."""
    base, adapters = make(work, args.layers, args.rank, args.vocab)
    batch = inputs(args.tokens, args.vocab)
    size = stored_bytes(base)
    v = vramd_contenders(work, base, adapters, batch, args.repeat, args.device)
    p = peft_contenders(base, adapters, batch, args.repeat, args.device)
    witnesses = {a: merged_logits(base, a, batch, args.device) for a in adapters}

    def against(logits, adapter):
        expected = witnesses[adapter]
        return (logits - expected).abs().max().item() / expected.abs().max().item()

    print(f"LLaMA, hidden 1024, {args.layers} layers, vocabulary {args.vocab}, a bfloat16 checkpoint ({size / 2**20:.0f} MiB) "
          f"computed in float32 on {args.device}, {args.tokens} tokens; adapters rank {args.rank} on {', '.join(TARGETS)}; "
          f"median of {args.repeat}; {torch.get_num_threads()} threads")
    rows = [("vramd switch", v["switch alone"], v["switch"], against(v["switched logits"], v["switched adapter"])),
            ("vramd unfused switch", v["unfused switch alone"], v["unfused switch"],
             against(v["unfused logits"], v["unfused adapter"])),
            ("vramd reload", v["reload alone"], v["reload"], against(v["reloaded logits"], v["reloaded adapter"])),
            ("peft switch (unfused)", p["switch alone"], p["switch"], against(p["unfused logits"], p["unfused adapter"])),
            ("peft fused switch", p["fused switch alone"], p["fused switch"], against(p["fused logits"], p["fused adapter"]))]
    print(f"  {'':24} {'the switch':>10} {'+ forward':>10}   first output against peft's merge_and_unload")
    for name, alone, seconds, error in rows:
        print(f"  {name:24} {alone:8.3f} s {seconds:8.3f} s   {error:.1e} relative")
    errors = {f"llama error {name}": error for name, _, _, error in rows}
    print(f"  vramd's part of its switch: {v['daemon switch']:.3f} s ({v['weights written']} weights written)")
    others = {"a reload": v["reload alone"], "peft's switch": p["switch alone"], "peft's fused switch": p["fused switch alone"]}
    fastest = min(others, key=others.get)
    for kind, alone, first in [("fused", v["switch alone"], v["switch"]), ("unfused", v["unfused switch alone"], v["unfused switch"])]:
        print(f"vramd's {kind} switch against the fastest other way ({fastest}): {others[fastest] / alone:.1f}x faster; "
              f"to the first output: {min(v['reload'], p['switch'], p['fused switch']) / first:.2f}x")
    print(f"forward: vramd base {v['base forward']:.4f} s, with an adapter fused {v['adapted forward']:.4f} s "
          f"({v['adapted forward'] / v['base forward']:.2f}x), unfused {v['unfused forward']:.4f} s "
          f"({v['unfused forward'] / v['base forward']:.2f}x); peft base {p['base forward']:.4f} s, unfused "
          f"{p['unfused forward']:.4f} s ({p['unfused forward'] / p['base forward']:.2f}x)")
    print(f"forward as the daemon counts it: base {v['base daemon']:.4f} s, fused {v['adapted daemon']:.4f} s "
          f"({v['adapted daemon'] / v['base daemon']:.2f}x), unfused {v['unfused daemon']:.4f} s "
          f"({v['unfused daemon'] / v['base daemon']:.2f}x)")
    return errors | {k: val for k, val in {**{f"vramd {k}": x for k, x in v.items()}, **{f"peft {k}": x for k, x in p.items()}}.items()
                     if isinstance(val, (int, float))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/vramd-bench-lora")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=32, help="the LLaMA's sequence")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--configs", type=int, default=3, help="configs with adapters of their own over one base")
    parser.add_argument("--device", default="cpu", help="where every contender computes (cpu, cuda:0)")
    parser.add_argument("--only", default="unet,llama,memory",
                        help="the parts, comma-separated: the UNet's rows, the LLaMA's, its host memory rows")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if not parts or parts - {"unet", "llama", "memory"}:
        parser.error(f"--only takes unet, llama and memory, comma-separated, not {args.only!r}")
    if "memory" in parts and args.device != "cpu":
        parser.error("--only memory: the host memory rows are measured with the models on the cpu alone")
    torch.set_num_threads(torch.get_num_threads())
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    figures = {"device": args.device}
    if torch.device(args.device).type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(args.device)
    if "unet" in parts:
        figures |= unet_rows(work, args.rank, args.repeat, args.device)
    if "llama" in parts:
        figures |= llama_rows(work, args)
    if "memory" in parts:
        base, adapters = make(work, args.layers, args.rank, args.vocab)
        figures |= memory_rows(work, base, adapters, args.configs, inputs(args.tokens, args.vocab), stored_bytes(base))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
