"""How soon a model is free again once the client of its forward hangs up (issue #26's cancelled
forward with reads in flight), on the checkpoint bench/stream.py builds: the real daemon serves
it streamed from disk with O_DIRECT under a 2 GiB limit, and Python clients (the vramd package)
give up on a forward after --after seconds each. For each: the seconds from the client's
timeout to the model's forwards_cancelled count moving, against a whole forward's time measured
in the same run.

    .venv/bin/python bench/cancel.py [--workdir /tmp/vramd-stream] [--after 8 20]

Run bench/stream.py first (it makes the checkpoint, about 24 GiB, once).
"""
import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests" / "daemon"), str(ROOT / "bench")]
os.environ.setdefault("VRAMD", str(ROOT / "build" / "bin" / "vramd"))
os.environ.setdefault("VRAMCTL", str(ROOT / "build" / "bin" / "vramctl"))

import torch  # noqa: E402

import vramd  # noqa: E402
from daemon_support import Daemon, model, wait_for  # noqa: E402
from stream import checkpoint_folder, evict, shard_files  # noqa: E402

SHAPE = {"hidden": 5120, "intermediate": 13824, "layers": 40, "heads": 40, "vocab": 32000}  # stream.py's default


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/vramd-stream")
    parser.add_argument("--after", type=float, nargs="+", default=[8, 20], help="seconds each client waits")
    args = parser.parse_args()
    folder = checkpoint_folder(args.workdir, SHAPE)
    if not (folder / "model.safetensors.index.json").exists():
        sys.exit(f"no checkpoint at {folder}: run bench/stream.py first")
    evict(shard_files(folder))
    d = Daemon(Path(args.workdir) / "cancel", budgets='cpu = "16GiB"', log_level="info")
    (d.models / "big.toml").write_text(
        f'checkpoint = "{folder}"\ndtype = "bfloat16"\n[vram]\noffload = {{ device = "disk" }}\n'
        'onload = { device = "disk" }\nlimit = "2GiB"\ndirect_io = true\n')
    ids = {"input_ids": torch.randint(0, SHAPE["vocab"], (1, 16), generator=torch.Generator().manual_seed(0))}
    with d.start():
        with vramd.connect(d.sock) as client:
            client.load("big")
            start = time.monotonic()
            client.forward("big", ids)
            whole = time.monotonic() - start
        print(f"a whole forward: {whole:.2f} s", flush=True)
        for after in args.after:
            cancelled = model(d.sock, "big")["stats"]["forwards_cancelled"]
            with vramd.connect(d.sock, timeout=after) as client:
                try:
                    client.forward("big", ids)
                    print(f"the forward ended within {after} s: nothing to cancel")
                    continue
                except vramd.DaemonError:
                    gone = time.monotonic()
            wait_for(lambda: model(d.sock, "big")["stats"]["forwards_cancelled"] > cancelled, timeout=whole * 2,
                     what="the forward to stop")
            free = time.monotonic() - gone
            print(f"client gone after {after} s: the model was free {free:.2f} s later "
                  f"({free / whole:.3f} of a whole forward)", flush=True)
        for line in d.log.read_text().splitlines():
            if "stopped after" in line:
                print(line)
        d.stop()


if __name__ == "__main__":
    main()
