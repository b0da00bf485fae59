"""Plot the weight bytes on the computation device over one forward, with the limit.

    .venv/bin/python bench/plot_vram.py [--trace TRACE.json] [--output bench/vram_trace.png]

Without --trace, runs the streamed contender of bench/vram.py (the same ~1B-parameter LLaMA
checkpoint, offload = onload = disk, limit a quarter of the file, 3 forwards) with
`vramctl run ... --trace` into a temporary file and plots its last forward. With --trace, plots
an existing trace: vramctl's, or DiffSynth's from `bench/vram.py --diffsynth-trace FILE`.

Trace format: {"limit": bytes, "events": [[seconds since the forward began, bytes held after the
event, "layer.path", kind], ...]}, kind one of acquire, release, prefetch, ready, evict;
optional "model" (a name for the title) and "peak" (the run's peak, all forwards).
Needs matplotlib (pip install --no-deps -r bench/requirements.txt).
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("acquire", "release", "prefetch", "ready", "evict")
MIB = 2**20


def load_trace(path):
    trace = json.loads(Path(path).read_text())
    events = trace.get("events")
    if not isinstance(events, list) or not events:
        sys.exit(f"{path}: no events (expected {{\"limit\": bytes, \"events\": [[t, held, layer, kind], ...]}})")
    for i, event in enumerate(events):
        if not (isinstance(event, list) and len(event) == 4 and all(isinstance(x, (int, float)) for x in event[:2])):
            sys.exit(f"{path}: event {i} is {event!r}, expected [seconds, held bytes, layer path, kind]")
        if event[3] not in KINDS:
            print(f"{path}: event {i} has an unknown kind {event[3]!r}", file=sys.stderr)
    trace["events"] = sorted(events, key=lambda e: e[0])
    return trace


def run_streamed(trace_path, workdir, forwards, tokens):
    """The streamed configuration of bench/vram.py, with --trace: returns the trace's label."""
    sys.path.insert(0, str(ROOT / "bench"))
    import vram
    try:
        help_text = subprocess.run([vram.VRAMCTL, "run", "--help"], capture_output=True, text=True).stdout
    except OSError as e:
        sys.exit(f"{vram.VRAMCTL}: {e} (build it with scripts/setup)")
    if "--trace" not in help_text:
        sys.exit(f"{vram.VRAMCTL} has no --trace option: build a tree that has it (scripts/setup), "
                 "or plot an existing trace with --trace FILE")
    folder = Path(workdir) / "llama1b"
    vram.load_bench.make_checkpoint(folder)
    limit = (folder / "model.safetensors").stat().st_size // 4
    subprocess.run(["cat", folder / "model.safetensors"], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    with tempfile.TemporaryDirectory() as tmp:
        stats, error = vram.vramd_contender(folder, tokens, forwards, Path(tmp), vram.streamed_vram(limit),
                                            extra_args=("--trace", trace_path))
    if error:
        sys.exit(f"vramctl run failed:\n{error}")
    if not Path(trace_path).exists():
        sys.exit(f"vramctl run wrote no trace to {trace_path}")
    print(f"vramd streamed: forward median {stats['forward_median_seconds']:.2f} s, "
          f"peak weights {stats['vram']['peak'] / MIB:.0f} MiB of limit {limit / MIB:.0f} MiB over {forwards} forwards")
    return "llama1b (1.1B LLaMA, bfloat16), vramd streamed from disk"


def plot(trace, output, label):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = trace["events"]
    limit = trace.get("limit") or 0
    times = [e[0] * 1e3 for e in events]
    held = [e[1] / MIB for e in events]
    peak = max(e[1] for e in events)
    fig, ax = plt.subplots(figsize=(12, 4.5), dpi=120)
    ax.step(times, held, where="post", color="tab:blue", linewidth=1.2, label="weights held")
    markers = {"acquire": ("o", "tab:green"), "release": ("v", "tab:gray"), "prefetch": ("^", "tab:purple"),
               "ready": ("s", "tab:cyan"), "evict": ("x", "tab:red")}
    for kind, (marker, color) in markers.items():
        points = [(t, h) for t, h, e in zip(times, held, events) if e[3] == kind]
        if points:
            ax.scatter(*zip(*points), s=6, marker=marker, color=color, label=f"{kind} ({len(points)})", zorder=3)
    if limit:
        ax.axhline(limit / MIB, color="tab:red", linestyle="--", linewidth=1.2, label=f"limit {limit / MIB:.0f} MiB")
    ax.set_xlabel("time since the forward began (ms)")
    ax.set_ylabel("weight bytes on the computation device (MiB)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0, top=max(limit, peak) / MIB * 1.12)
    title = f"{label}: limit {limit / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB"
    if limit:
        title += f" ({peak / limit:.1%} of the limit)"
    if trace.get("peak") and trace["peak"] != peak:
        title += f"; run peak {trace['peak'] / MIB:.0f} MiB"
    ax.set_title(title + f"\none forward, {len(events)} events, {times[-1]:.0f} ms", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, markerscale=2, borderaxespad=0)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
    return peak, limit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", help="an existing trace (else run vramd's streamed configuration with --trace)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "vram_trace.png"))
    parser.add_argument("--label", default="", help="name in the title (default: the trace's \"model\", or its file name)")
    parser.add_argument("--workdir", default="/tmp/vramd-bench")
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("matplotlib is not installed: pip install --no-deps -r bench/requirements.txt")

    if args.trace:
        trace = load_trace(args.trace)
        label = args.label or trace.get("model") or Path(args.trace).stem
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            label = run_streamed(path, args.workdir, args.forwards, args.tokens)
            trace = load_trace(path)
        label = args.label or label
    peak, limit = plot(trace, args.output, label)
    print(f"{args.output}: {len(trace['events'])} events, peak {peak / MIB:.0f} MiB"
          + (f" of limit {limit / MIB:.0f} MiB" if limit else ""))


if __name__ == "__main__":
    main()
