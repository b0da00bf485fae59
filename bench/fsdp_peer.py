"""The PyTorch FSDP2 (`fully_shard`) peer of bench/partition.py: one rank of a group that torchrun
starts. The Hugging Face model is built on the meta device and sharded (every decoder layer,
then the root), each rank materialises only its shards, and each parameter is read from the
checkpoint one at a time (positioned reads, as vramd reads: no mapped file pages counted in
RSS) and cut to the rank's shard. Then the same forwards as vramd's.

    python -m torch.distributed.run --standalone --nproc-per-node N bench/fsdp_peer.py \\
        --checkpoint FOLDER --input in.safetensors --forwards 3 --threads T --out result.json \\
        --logits logits.safetensors

Rank 0 writes {"forward_median_seconds", "ranks": [{"peak_rss", "peak_rss_loading",
"rss_before_load", "load_seconds"}]} to --out and the last forward's logits to --logits; a
rank's load_seconds run from its process group's start to every rank's shards in place.
"""
import argparse
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import peak_rss, rss_now  # noqa: E402

DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def read_tensors(path):
    """{name: function returning the tensor}: each reads its own byte range when called."""
    import torch
    fd = os.open(path, os.O_RDONLY)
    (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, size, 8))
    header.pop("__metadata__", None)

    def reader(entry):
        begin, end = entry["data_offsets"]
        data = bytearray(end - begin)
        os.preadv(fd, [data], 8 + size + begin)
        return torch.frombuffer(data, dtype=getattr(torch, DTYPES[entry["dtype"]])).reshape(entry["shape"])
    return {name: (lambda entry=entry: reader(entry)) for name, entry in header.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--logits", required=True)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    before = rss_now()
    load_start = time.perf_counter()

    config = transformers.AutoConfig.from_pretrained(args.checkpoint)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    tensors = read_tensors(Path(args.checkpoint) / "model.safetensors")
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = tensors[name]()  # one whole parameter at a time, then only this rank's shard
            shard = distribute_tensor(full, mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
            del full, shard
    if config.tie_word_embeddings:
        model.tie_weights()
    # to_empty left the rotary embedding's computed buffers as garbage: build it afresh.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model.eval()
    dist.barrier()
    loaded = peak_rss()
    load_seconds = time.perf_counter() - load_start

    input_ids = load_file(args.input)["input_ids"]
    times = []
    with torch.no_grad():
        for _ in range(args.forwards):
            start = time.perf_counter()
            logits = model(input_ids).logits
            times.append(time.perf_counter() - start)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"peak_rss": peak_rss(), "peak_rss_loading": loaded, "rss_before_load": before,
                                "load_seconds": load_seconds})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"forward_median_seconds": statistics.median(times), "ranks": ranks}))
        save_file({"logits": logits.contiguous()}, args.logits)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
