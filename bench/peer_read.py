"""One read of a safetensors file into host memory by a Python loader, timed inside this fresh
process after its imports (bench/storage.py runs it, one contender a process):

    .venv/bin/python bench/peer_read.py {safetensors,runai,fastsafetensors} FILE

Prints {"seconds": ..., "bytes": ...}: the bytes of the tensors it holds at the end. bench/load.py
loads a model from the same reads (read()).
  safetensors      load_file, each tensor cloned into memory of its own (load_file maps the file)
  runai            runai-model-streamer's SafetensorsStreamer (its reader threads, its chunks),
                   each tensor cloned as it comes (its buffer is reused for the next ones)
  fastsafetensors  SafeTensorsFileLoader(nogds=True) on the cpu: the file read into its own
                   buffer, which the tensors are views of
"""
import json
import sys
import time


def read(which, path):
    """`path`'s tensors read by loader `which`, by name (bench/load.py loads a model from them)."""
    if which == "safetensors":
        from safetensors.torch import load_file
        return {k: v.clone() for k, v in load_file(path).items()}
    if which == "runai":
        from runai_model_streamer import SafetensorsStreamer
        tensors = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor.clone()
        return tensors
    if which == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        loader.add_filenames({0: [path]})
        buffer = loader.copy_files_to_device()
        return {k: buffer.get_tensor(k) for k in buffer.key_to_rank_lidx}
    raise SystemExit(f"peer_read.py: no contender {which!r}")


def imports(which):
    """The loader's modules imported, so that a timing leaves them out."""
    modules = {"safetensors": "safetensors.torch", "runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}
    __import__(modules[which])


def main():
    which, path = sys.argv[1], sys.argv[2]
    imports(which)
    start = time.perf_counter()
    tensors = read(which, path)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}))


if __name__ == "__main__":
    main()
