"""Updating a loaded model's weights (POST /v1/models/NAME/weights) against the bounds of the same
machine, measured in the same run:

    memcpy       one copy of the model's bytes in memory (torch's copy_ of a tensor that size)
    mapped memfd the same copy out of a memfd mapped just before (each page then faults in:
                 what the daemon must do to read a client's memfd)
    disk read    the updated checkpoint read cold, in 8 MiB reads (the page cache dropped first)

and the ways to get new weights into a model the daemon serves:

    update from a path, cold   the daemon reads the checkpoint (page cache dropped first)
    update from a path, warm   the same with the checkpoint in the page cache
    update from a memfd        Client.update(name, dict): the tensors written once into a sealed
                               memfd that the daemon maps; and the daemon's own part of it
                               (`updated.seconds`: checking the memfd, whose pages the weights
                               then keep as their values; the version before is freed after)
    update from a kept memfd   Client.update(name, dict, keep=True), after a first one: the tensors
                               written into the memfd this client keeps, which the daemon mapped
                               (and page-locked on a GPU) once; the daemon copies them into the
                               weights where they are; and the daemon's own part of it
    update from a body         Client.update(name, dict, via="body"): the tensors in the request
    unload + load + forward    what a user does without updates: the new checkpoint's config loaded

Each prints seconds and GB/s of the model's bytes, and the ratio to its bound (memcpy for what
reads memory, the disk read for a cold path). Last, the time from the request to the first
forward's answer on the new weights: update (from a path, a memfd, a kept memfd) + forward
against unload + load + forward.

With --device cuda:N the model is computed there and its weights rest there, and the bounds of
what reaches the GPU are measured too:

    pinned copy      the model's bytes from pinned host memory to the device (non_blocking): the
                     bus's speed, the issue's bound (an update from memfds: at least 85% of it)
    pageable copy    the same out of a memfd mapped just before, as plain (pageable) memory
    registered copy  the same out of a memfd mapped just before and registered with the driver
                     (cudaHostRegister) for the copy: what pinning a client's pages costs
    staged copy      the same out of a memfd mapped just before through 4 pinned buffers of 16 MiB:
                     each chunk copied into a free buffer on the host (torch's copy_, on every
                     core) while the bus takes the chunks before it

    .venv/bin/python bench/update.py [--device cpu|cuda:0] [--workdir /tmp/vramd-bench-update] [--layers 8]
                                     [--repeat 3] [--json FILE]

The model: a LLaMA of hidden size 1024 and LAYERS layers in bfloat16 (297 MiB at 8 layers),
random weights; its update, the same shapes with other values. Every figure is the median of
REPEAT runs. See docs/benchmarks.md.
"""
import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from vram import evict, serving  # noqa: E402

VRAMD = ROOT / "build" / "bin" / "vramd"
GB = 1e9


def checkpoint(folder, layers, seed):
    """A LLaMA checkpoint of random bfloat16 weights, as save_pretrained lays it out."""
    path = folder / "model.safetensors"
    if path.exists():
        return path
    import transformers
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    save_file({k: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16) for k, shape in shapes.items()},
              path)
    return path


def median_seconds(repeat, setup, timed):
    seconds = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        timed()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def disk_read(path):
    evict(path)
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass


def memfd_of(nbytes):
    """A memfd of `nbytes` bytes, every page written (as a client's update is)."""
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    with mmap.mmap(fd, nbytes) as filled:
        torch.frombuffer(filled, dtype=torch.uint8).fill_(1)
    return fd


def host_bounds(model_bytes, repeat):
    """memcpy, and the same copy out of a memfd mapped just before."""
    source = torch.empty(model_bytes, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source).fill_(0)
    memcpy = median_seconds(repeat, lambda: None, lambda: target.copy_(source))
    fd = memfd_of(model_bytes)

    def copy_mapped():
        with mmap.mmap(fd, model_bytes) as mapped:
            view = torch.frombuffer(mapped, dtype=torch.uint8)
            target.copy_(view)
            del view

    mapped = median_seconds(repeat, lambda: None, copy_mapped)
    os.close(fd)
    return memcpy, mapped


STAGING_BUFFERS, STAGING_BYTES = 4, 16 << 20


def device_bounds(model_bytes, repeat, device):
    """The model's bytes onto `device`: from pinned memory, and out of a freshly mapped memfd as
    pageable memory, registered with the driver for the copy, and staged through pinned buffers."""
    target = torch.empty(model_bytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(model_bytes, dtype=torch.uint8, pin_memory=True).fill_(1)

    def copy(source):
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)

    figures = {"pinned": median_seconds(repeat, lambda: None, lambda: copy(pinned))}
    del pinned
    fd = memfd_of(model_bytes)

    def from_memfd(register):
        with mmap.mmap(fd, model_bytes) as mapped:
            view = torch.frombuffer(mapped, dtype=torch.uint8)
            if register:
                cudart = torch.cuda.cudart()
                status = cudart.cudaHostRegister(view.data_ptr(), model_bytes, 0)
                if int(status) != 0:
                    raise RuntimeError(f"cudaHostRegister: {status}")
                try:
                    copy(view)
                finally:
                    cudart.cudaHostUnregister(view.data_ptr())
            else:
                copy(view)
            del view

    figures["pageable"] = median_seconds(repeat, lambda: None, lambda: from_memfd(False))
    buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(STAGING_BUFFERS)]
    copied = [torch.cuda.Event() for _ in buffers]  # each buffer's last copy to the device

    def staged():
        with mmap.mmap(fd, model_bytes) as mapped:
            view = torch.frombuffer(mapped, dtype=torch.uint8)
            for first in range(0, model_bytes, STAGING_BYTES):
                i, n = first // STAGING_BYTES % STAGING_BUFFERS, min(STAGING_BYTES, model_bytes - first)
                copied[i].synchronize()  # the bus is done with this buffer (at once before its first use)
                buffers[i][:n].copy_(view[first:first + n])
                target[first:first + n].copy_(buffers[i][:n], non_blocking=True)
                copied[i].record()
            torch.cuda.synchronize(device)
            del view

    figures["staged"] = median_seconds(repeat, lambda: None, staged)
    del buffers
    try:
        figures["registered"] = median_seconds(repeat, lambda: None, lambda: from_memfd(True))
    except (RuntimeError, AttributeError) as e:  # said, not fatal: a bound the others do not need
        figures["registered_error"] = str(e)
    os.close(fd)
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vramd-bench-update"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    work, device = args.workdir, args.device
    gpu = device.startswith("cuda")
    old = checkpoint(work / f"old-{args.layers}", args.layers, 0)
    new = checkpoint(work / f"new-{args.layers}", args.layers, 1)
    model_bytes = old.stat().st_size
    new_tensors = load_file(new)
    inputs = {"input_ids": torch.arange(16).view(1, 16)}

    memcpy, mapped = host_bounds(model_bytes, args.repeat)
    bounds = device_bounds(model_bytes, args.repeat, device) if gpu else {}
    disk = median_seconds(args.repeat, lambda: None, lambda: disk_read(new))

    models = work / "models"
    models.mkdir(exist_ok=True)
    table = f'[vram]\ncomputation = {{ device = "{device}" }}\n' if gpu else ""
    (models / "m.toml").write_text(f'checkpoint = "{old}"\n{table}')
    (models / "m-new.toml").write_text(f'checkpoint = "{new}"\n{table}')
    budgets = 'cpu = "16GiB"' + (f'\n"{device}" = "{8 * model_bytes}"' if gpu else "")
    with serving(work, budgets, VRAMD) as client:
        client.load("m")
        client.forward("m", inputs)

        def update_path():
            client.update("m", new)

        cold = median_seconds(args.repeat, lambda: evict(new), update_path)
        warm = median_seconds(args.repeat, lambda: None, update_path)
        daemon_seconds = []

        def update_memfd():
            daemon_seconds.append(client.update("m", new_tensors)["updated"]["seconds"])

        update_memfd()
        daemon_seconds.clear()
        memfd = median_seconds(args.repeat, lambda: None, update_memfd)
        memfd_daemon = statistics.median(daemon_seconds)
        body = median_seconds(args.repeat, lambda: None, lambda: client.update("m", new_tensors, via="body"))
        kept_seconds = []

        def update_kept():
            answer = client.update("m", new_tensors, keep=True)["updated"]
            kept_seconds.append(answer["seconds"])
            return answer["kept"]["page_locked"]

        update_kept()  # maps the memfd (and page-locks it on a GPU), and makes the weights the daemon's own
        kept_seconds.clear()
        kept = median_seconds(args.repeat, lambda: None, update_kept)
        kept_daemon = statistics.median(kept_seconds)
        page_locked = update_kept()

        def update_forward():
            client.update("m", new)
            return client.forward("m", inputs)

        def reload_forward():
            client.unload("m-new")
            client.load("m-new")
            return client.forward("m-new", inputs)

        to_first = median_seconds(args.repeat, lambda: client.update("m", old), update_forward)
        old_tensors = load_file(old)

        def update_memfd_forward():
            client.update("m", new_tensors)
            return client.forward("m", inputs)

        to_first_memfd = median_seconds(args.repeat, lambda: client.update("m", old_tensors), update_memfd_forward)

        def update_kept_forward():
            client.update("m", new_tensors, keep=True)
            return client.forward("m", inputs)

        to_first_kept = median_seconds(args.repeat, lambda: client.update("m", old_tensors, keep=True),
                                       update_kept_forward)
        client.unload("m")
        to_first_reload = median_seconds(args.repeat, lambda: None, reload_forward)
        client.load("m")
        got = update_forward()
        expected = client.forward("m-new", inputs)
        assert all(torch.equal(got[k], expected[k]) for k in got), "the updated model differs from a fresh load"

    def rate(seconds):
        return model_bytes / seconds / GB

    where = f"on {device}" + (f" ({torch.cuda.get_device_name(device)})" if gpu else "")
    lines = [f"model: LLaMA, {args.layers} layers, bfloat16, {model_bytes / 2**20:.0f} MiB, {where}; "
             f"median of {args.repeat}",
             f"memcpy:                      {memcpy:7.3f} s  {rate(memcpy):6.2f} GB/s",
             f"copy out of a mapped memfd:  {mapped:7.3f} s  {rate(mapped):6.2f} GB/s"]
    if gpu:
        pinned = bounds["pinned"]
        lines += [f"pinned copy to {device}:     {pinned:7.3f} s  {rate(pinned):6.2f} GB/s",
                  f"pageable copy out of a mapped memfd to {device}: {bounds['pageable']:7.3f} s  "
                  f"{rate(bounds['pageable']):6.2f} GB/s  {pinned / bounds['pageable']:.2f} of the pinned copy"]
        if "registered" in bounds:
            lines.append(f"registered copy out of a mapped memfd to {device} (cudaHostRegister + copy): "
                         f"{bounds['registered']:7.3f} s  {rate(bounds['registered']):6.2f} GB/s  "
                         f"{pinned / bounds['registered']:.2f} of the pinned copy")
        else:
            lines.append(f"registered copy: not measured ({bounds['registered_error']})")
        lines.append(f"staged copy out of a mapped memfd to {device} ({STAGING_BUFFERS} pinned buffers of "
                     f"{STAGING_BYTES >> 20} MiB): {bounds['staged']:7.3f} s  {rate(bounds['staged']):6.2f} GB/s  "
                     f"{pinned / bounds['staged']:.2f} of the pinned copy")
    # What an update from memory is held against: the bus on a GPU, memcpy on the CPU.
    bound, bound_name = (bounds["pinned"], "the pinned copy") if gpu else (memcpy, "memcpy")
    lines += [f"disk read (cold):            {disk:7.3f} s  {rate(disk):6.2f} GB/s",
              f"update from a path, cold:    {cold:7.3f} s  {rate(cold):6.2f} GB/s  {disk / cold:.2f} of the disk read",
              f"update from a path, warm:    {warm:7.3f} s  {rate(warm):6.2f} GB/s  {bound / warm:.2f} of {bound_name}",
              f"update from a memfd:         {memfd:7.3f} s  {rate(memfd):6.2f} GB/s  {bound / memfd:.2f} of {bound_name}",
              f"  of which the daemon's:     {memfd_daemon:7.3f} s  {rate(memfd_daemon):6.2f} GB/s  "
              f"{bound / memfd_daemon:.2f} of {bound_name}"
              + ("" if gpu else f", {mapped / memfd_daemon:.2f} of the copy out of a mapped memfd"),
              f"update from a kept memfd:    {kept:7.3f} s  {rate(kept):6.2f} GB/s  {bound / kept:.2f} of {bound_name}",
              f"  of which the daemon's:     {kept_daemon:7.3f} s  {rate(kept_daemon):6.2f} GB/s  "
              f"{bound / kept_daemon:.2f} of {bound_name}; page-locked for {', '.join(page_locked) or 'no GPU'}",
              f"update from a body:          {body:7.3f} s  {rate(body):6.2f} GB/s  {bound / body:.2f} of {bound_name}",
              f"request to first forward on new weights: update from a path + forward {to_first:.3f} s, "
              f"from a memfd + forward {to_first_memfd:.3f} s, from a kept memfd + forward {to_first_kept:.3f} s, "
              f"unload + load + forward {to_first_reload:.3f} s ({to_first_reload / to_first:.2f}x, "
              f"{to_first_reload / to_first_memfd:.2f}x, {to_first_reload / to_first_kept:.2f}x)",
              "the updated model's logits equal a fresh load of the new checkpoint"]
    print("\n".join(lines))
    if args.json:
        seconds = {"memcpy": memcpy, "mapped_memfd": mapped, "disk": disk, "path_cold": cold, "path_warm": warm,
                   "memfd": memfd, "memfd_daemon": memfd_daemon, "kept": kept, "kept_daemon": kept_daemon, "body": body, "to_first_path": to_first,
                   "to_first_memfd": to_first_memfd, "to_first_kept": to_first_kept, "to_first_reload": to_first_reload,
                   **{f"{name}_copy": value for name, value in bounds.items() if name != "registered_error"}}
        args.json.write_text(json.dumps({"device": device, "model_bytes": model_bytes, "layers": args.layers,
                                         "seconds": seconds, "daemon_of_bound": bound / memfd_daemon,
                                         "kept_daemon_of_bound": bound / kept_daemon,
                                         "bound": bound_name, "summary": lines}, indent=1))


if __name__ == "__main__":
    main()
