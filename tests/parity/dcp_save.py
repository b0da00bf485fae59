"""Saves a Hugging Face model as an FSDP2 trainer does: each of RANKS Gloo processes (CPU) wraps
the model with fully_shard, and torch.distributed.checkpoint writes the sharded state dict.

    python dcp_save.py MODEL_DIR OUT_DIR RANKS {torch,safetensors} [--optimizer]

OUT_DIR gets the DCP folder (.metadata, __R_0.distcp) and MODEL_DIR's config.json. The state
dict is {"model": ...}, with {"optim": ...} beside it under --optimizer (AdamW after one step at
learning rate 0, so the weights stay as saved and the optimizer holds state of every weight).
"""
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def save(rank, ranks, port, model_dir, out, serialization, optimizer):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    print(f"rank {rank}: in the group", file=sys.stderr, flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    if optimizer:
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optim.step()
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, **({"optim": optim_state} if optimizer else {})}
    if serialization == "safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat
        writer = dcp.FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS)
    else:
        writer = dcp.FileSystemWriter(out)
    dcp.save(state, storage_writer=writer)
    print(f"rank {rank}: saved", file=sys.stderr, flush=True)  # where a rank that dies did, in its stderr
    dist.destroy_process_group()
    print(f"rank {rank}: group destroyed", file=sys.stderr, flush=True)


def main():
    model_dir, out, ranks, serialization = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    # The ranks' store listens here, on a port it holds from the start: a port found free and
    # then bound by rank 0 seconds later (once torch is imported) could be another test's by then.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(save, args=(ranks, store.port, model_dir, out, serialization, "--optimizer" in sys.argv), nprocs=ranks)
    shutil.copy(Path(model_dir) / "config.json", Path(out) / "config.json")


if __name__ == "__main__":
    main()
