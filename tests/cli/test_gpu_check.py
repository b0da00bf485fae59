"""scripts/gpu-check where there is no GPU, as CI and every CPU machine run it: the same steps on
the CPU, every skip named with its reason in the report, exit 0. (On a GPU machine the same script
must run every CUDA test; tests/conftest.py makes a skip fail there.)"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent


def built(name):
    """The build's executable `name`, beside the vramctl under test."""
    return Path(os.environ.get("VRAMCTL", ROOT / "build" / "bin" / "vramctl")).parent / name


def dying(tmp_path, name):
    """The build's executable `name` behind a wrapper that aborts once it has ended, as every
    process of ours that links LibTorch did at exit on the first GPU machine lent."""
    real = built(name)
    wrapper = tmp_path / name
    wrapper.write_text(f'#!/bin/sh\n"{real}" "$@"\nkill -ABRT $$\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu-check runs for real, not this test")
def test_gpu_check_on_the_cpu_runs_what_it_can_and_names_every_skip(tmp_path):
    out, temporary = tmp_path / "out", tmp_path / "tmp"
    temporary.mkdir()
    done = subprocess.run([ROOT / "scripts" / "gpu-check", "--no-setup", "--forwards", "2", "--workdir", tmp_path / "work",
                           out], capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert report.startswith("# vramd GPU check: passed"), report
    assert "**No CUDA GPU here**" in report
    # Every CUDA test is listed, each as skipped with why.
    assert report.count("- skipped: `parity.test_vram.test_streamed_on_cuda_equals_resident_on_cuda[") == 3, report
    assert "- skipped: `parity.test_partition.test_partitioned_on_cuda" in report
    assert "- skipped: `storage.test_gguf.test_every_block_type_kept_packed_unpacks_on_cuda" in report
    assert report.count("- skipped: `storage.test_gguf.test_a_gguf_model_streamed_packed_on_cuda") == 2, report
    assert report.count("- skipped: `client.test_lease_cuda.") == 9, report
    assert report.count("- skipped: `parity.test_lora_cuda.") == 3, report
    assert ("- skipped: `vramd_tests: DeviceStaging reads and copies onto a GPU through registered huge pages or pinned memory`: "
            "no CUDA device here") in report, report
    assert "- passed: `vramd_tests: LibTorch's CUDA half is opened only where a CUDA driver is`" in report, report
    assert "FAILED" not in report

    figures = json.loads((out / "figures.json").read_text())
    assert figures["device"] == "cpu" and "gpu" not in figures and "torch:" in figures["environment"]
    for step in ("resident", "vramd_disk", "vramd_disk_direct", "vramd_disk_buffered", "accelerate_disk", "diffsynth_disk",
                 "transformers_ready",
                 "sleep_wake", "lease", "load_file", "staged_reads"):
        assert "error" not in figures[step], (step, figures[step])
    assert 0 < figures["vramd_disk"]["vram"]["peak"] <= figures["limit"]
    assert figures["vramd_disk_direct"]["vram"]["bytes_streamed"] > 0
    assert set(figures["skipped"]) == {"vramd_host", "vramd_host_float8", "accelerate_cpu", "copy_bound", "diffsynth_host",
                                       "fast_loaders"}
    for name, why in figures["skipped"].items():
        assert f"- skipped {name}: {why}" in report
    assert any(line.startswith("streaming from disk: vramd ") and "accelerate" in line and "DiffSynth" in line
               for line in figures["summary"]), figures["summary"]
    assert any(line.startswith("ready on cpu: vramd ") for line in figures["summary"])
    assert any(line.startswith("forward streamed from disk (direct_io): ") and "x the larger" in line
               for line in figures["summary"]), figures["summary"]
    # direct_io "auto" against true and false, with the path auto's plan chose: here the page
    # cache, as the small checkpoint fits it.
    assert any(line.startswith("direct_io from disk: auto ") and "s a forward (page cache: " in line
               and " the better" in line for line in figures["summary"]), figures["summary"]
    assert figures["staged_reads"]["pages"] > 0 and figures["staged_reads"]["huge"] > 0
    assert any(line.startswith("staged reads alone (16 of 8 MiB in flight, O_DIRECT): ") for line in figures["summary"])
    assert figures["lease"]["tensors"] == figures["load_file"]["tensors"] > 0
    assert figures["lease"]["bytes"] == figures["load_file"]["bytes"] > 0
    assert any(line.startswith("a state dict on cpu in a fresh process: lease ") for line in figures["summary"])
    moe = json.loads((out / "moe.json").read_text())  # bench/moe.py, a small model on the CPU
    assert moe["device"] == "cpu" and moe["vramd"]["moved"] > 0 and moe["accelerate"]["moved"] > 0, moe
    assert any(line.startswith("- forward: vramd ") and "accelerate" in line for line in report.splitlines()), report
    update = json.loads((out / "update.json").read_text())  # bench/update.py, one layer on the CPU
    assert update["device"] == "cpu" and update["bound"] == "memcpy" and update["seconds"]["memfd_daemon"] > 0, update
    assert update["seconds"]["kept_daemon"] > 0 and update["kept_daemon_of_bound"] > 0, update
    assert "- the updated model's logits equal a fresh load of the new checkpoint" in report, report
    # bench/manage.py on the CPU: the diffusion transformer managed by vramd, from GGUF too, and
    # diffusers' own loading of that GGUF file
    manage = json.loads((out / "manage.json").read_text())
    assert manage["model"] == "dit" and manage["done"], manage
    vramd_manage, gguf_manage = manage["results"]["vramd"], manage["results"]["vramd-gguf"]
    assert 0 < vramd_manage["managed"]["peak"] <= manage["limit"], manage
    assert set(vramd_manage["phases"]) == {"context", "ready", "first_forward"}, manage
    assert len(vramd_manage["forward_seconds"]) == 1, manage  # --forwards 2: the first one is not timed
    # Q8_0 blocks read in place of the Linear layers' bfloat16: fewer bytes from host memory.
    assert 0 < gguf_manage["managed"]["bytes_read"] < vramd_manage["managed"]["bytes_read"], manage
    assert manage["results"]["diffusers-gguf"]["forward_median_seconds"] > 0, manage
    assert any(line.startswith("- vramd's manager: peak ") and " s in its hooks, " in line for line in report.splitlines())
    assert manage["results"]["resident"]["forward_median_seconds"] > 0, manage
    assert any(line.startswith("- forward against the module resident on cpu (") and "vramd-gguf " in line
               for line in report.splitlines()), report
    assert any(line.startswith("- diffusers-gguf's first output against vramd-gguf's: ") for line in report.splitlines())
    # bench/hooks.py: each hook's cost a layer, every contender's output the resident chain's
    hooks = json.loads((out / "hooks.json").read_text())
    assert set(hooks["results"]) == {"resident", "vramd", "vramd-lean", "vramd-all", "vramd-sync", "accelerate",
                                     "diffusers", "diffsynth"}, hooks
    assert hooks["results"]["vramd"]["managed"]["peak"] <= hooks["limit"], hooks
    for peer in ("diffusers", "diffsynth", "accelerate"):
        assert any(line.startswith(f"- vramd against {peer}: forward ") for line in report.splitlines()), report
    assert sum("output equal to resident's" in line for line in report.splitlines()) == 8, report
    # The sd15 step on the CPU: its wiring, on the small UNet (a new process's first output, vramd's
    # against diffusers')
    sd15 = json.loads((out / "sd15.json").read_text())
    assert sd15["model"] == "unet" and sd15["done"] and set(sd15["results"]) == {"vramd", "diffusers"}, sd15
    assert sd15["results"]["vramd"]["managed"]["pin_seconds"] == 0, sd15  # nothing page-locked on the CPU
    assert sd15["results"]["vramd"]["managed"]["pinned_bytes"] == 0, sd15
    assert any(line.startswith("- vramd against diffusers: forward ") and " first output " in line
               for line in report.split("## A new process's first output")[1].splitlines()), report
    # The loaders step on the CPU: the disk's read bound alone, the GPU's loaders skipped saying why.
    loaders = json.loads((out / "loaders.json").read_text())
    assert loaders["read_bound_bytes_per_second"] > 0 and set(loaders["skipped"]) == {"copy_bound", "fast_loaders"}, loaders
    bound = loaders["read_bound_bytes_per_second"] / 1e9
    assert ("## The fastest loaders onto the device (bench/gpu.py's fast_loaders)\n\n"
            f"On cpu, LLaMA-shaped {loaders['checkpoint_bytes'] / 2**30:.2f} GiB bfloat16; the disk's read bound {bound:.2f} GB/s.\n\n"
            "- skipped copy_bound: no CUDA device: the pinned host-to-GPU copy bound\n"
            "- skipped fast_loaders: no CUDA device: instanttensor, runai-model-streamer and fastsafetensors to a GPU\n") in report, report
    # The lora step on the CPU: its wiring (a LLaMA of one layer, the small UNet), every output
    # its witness's (peft's merge_and_unload, diffusers' fuse_lora) to float32 rounding.
    lora = json.loads((out / "lora.json").read_text())
    assert lora["device"] == "cpu" and lora["vramd unfused daemon"] > 0 and lora["unet vramd clients switch alone"] > 0, lora
    errors = {name: error for name, error in lora.items() if " error " in name}
    assert len(errors) == 11 and max(errors.values()) < 1e-5, errors
    section = report.split("## Switching LoRA adapters (bench/lora.py)\n")[1].split("\n## ")[0]
    for line in ("- vramd Client.set_loras, clients apply ", "- vramd's unfused switch against the fastest other way ",
                 "- forward as the daemon counts it: base "):
        assert line in section, section
    for log in ("catch2.log", "catch2.xml", "tests.log", "tests.xml", "bench.log", "environment.txt", "moe.log",
                "update.log", "manage.log", "hooks.log", "lora.log", "sd15.log", "loaders.log"):
        assert (out / log).exists(), log
    assert not list(temporary.glob("vramd-*")), list(temporary.iterdir())  # the daemon's socket folder, say


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu-check runs for real, not this test")
def test_gpu_check_out_of_time_still_reports_what_ran_out(tmp_path):
    """A lent machine stops a command at 10 minutes: past --budget the check stops its tests and
    benchmarks and still writes its report, failing and saying what did not finish."""
    out = tmp_path / "out"
    done = subprocess.run([ROOT / "scripts" / "gpu-check", "--no-setup", "--forwards", "1", "--budget", "1",
                           "--workdir", tmp_path / "work", out], capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert report.startswith("# vramd GPU check: FAILED"), report
    figures = json.loads((out / "figures.json").read_text())
    assert figures["skipped"]["resident"] == "out of the GPU check's time budget (--deadline)", figures["skipped"]
    assert "- FAILED: the CUDA tests ran out of their 1 s (--budget 1)" in report, report
    assert "- skipped daemon: out of the GPU check's time budget (--deadline)" in report, report


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu-check runs for real, not this test")
def test_gpu_check_names_a_test_binary_that_dies_at_exit(tmp_path):
    """On the first GPU machine lent, vramd_tests passed every case and then aborted at exit: the
    report must say the process died, not only that its cases passed, and keep a backtrace
    where a debugger is installed. The real vramd_tests runs, then its process aborts."""
    out = tmp_path / "out"
    done = subprocess.run([ROOT / "scripts" / "gpu-check", "--no-setup", "--forwards", "1", "--budget", "1",
                           "--workdir", tmp_path / "work", out], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VRAMD_TESTS": str(dying(tmp_path, "vramd_tests"))})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "- passed: `vramd_tests: LibTorch's CUDA half is opened only where a CUDA driver is`" in report, report
    died = [line for line in report.splitlines() if line.startswith("- FAILED: vramd_tests died of signal 6")]
    assert len(died) == 1, report
    # Which part of a process it takes to die: here only the wrapped vramd_tests dies.
    assert "  - a plain C++ program linked to LibTorch, its CUDA half opened: exit 0 (said: opened)" in report, report
    assert "  - vramd_exit_probe (LibTorch linked, nothing opened): exit 0" in report, report
    assert ("  - vramd_exit_probe libraries (LibTorch's CUDA half opened whatever the driver): exit 0 "
            "(said: LibTorch's CUDA half is open)") in report, report
    preloaded = [line for line in report.splitlines()
                 if line.startswith("  - vramd_exit_probe driver with the other libraries of vramd_tests preloaded (")]
    assert len(preloaded) == 1 and ": exit 0" in preloaded[0], report
    # LuaJIT is in that process either way: preloaded, or linked by the probe itself where the
    # compiler links every library named (GCC does under a sanitizer: no --as-needed).
    linked = subprocess.run(["readelf", "-d", built("vramd_exit_probe")], capture_output=True, text=True,
                            check=True).stdout
    assert "libluajit-5.1.so.2" in preloaded[0] or "[libluajit-5.1.so.2]" in linked, (report, linked)
    assert ('  - vramd_tests "sizes read in binary and decimal units" (a case that makes no tensor): '
            "died of signal 6") in report, report
    assert "  - python: import torch, a tensor on cpu: exit 0" in report, report
    # Which copies the dynamic linker chose for libstdc++'s symbols: libtorch_cpu's own, at least.
    bindings = (out / "catch2-bindings.log").read_text()
    assert "libtorch_cpu.so: std::" in bindings, bindings[:3000]
    if shutil.which("gdb") or shutil.which("cuda-gdb"):
        assert "(backtrace: catch2-backtrace.log; bindings: catch2-bindings.log)" in died[0], report
        assert (out / "catch2-backtrace.log").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu-check runs for real, not this test")
def test_gpu_check_explains_a_death_only_within_its_time(tmp_path):
    """Finding out why vramd_tests died (probes, a debugger, the linker's bindings) must not eat
    the tests' and benchmarks' time on a lent machine: past --explain seconds each step is cut,
    and the report and logs say so instead of what the step would have found."""
    out = tmp_path / "out"
    done = subprocess.run([ROOT / "scripts" / "gpu-check", "--no-setup", "--forwards", "1", "--budget", "1",
                           "--explain", "0", "--workdir", tmp_path / "work", out], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VRAMD_TESTS": str(dying(tmp_path, "vramd_tests"))})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert len([line for line in report.splitlines() if line.startswith("- FAILED: vramd_tests died of signal 6")]) == 1
    probes = [line for line in report.splitlines() if line.startswith("  - ")]
    assert len(probes) == 7 and all(line.endswith(": out of time") for line in probes), report
    assert "# out of time: bindings logged until then" in (out / "catch2-bindings.log").read_text()
    if shutil.which("gdb") or shutil.which("cuda-gdb"):
        assert "gpu-check: the debugger ran out of time" in (out / "catch2-backtrace.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: scripts/gpu-check runs for real, not this test")
def test_gpu_check_runs_the_steps_named_and_says_which_it_did_not(tmp_path):
    """A whole check no longer fits a lent machine's 10 minutes a command: `--steps` splits it
    into calls, and the report names each step left out. A name that is no step is refused
    before anything runs."""
    check = [ROOT / "scripts" / "gpu-check", "--no-setup", "--workdir", tmp_path / "work"]
    refused = subprocess.run(check + ["--steps", "update,bench", tmp_path / "refused"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--steps names no step: bench (steps: tests,manage,update,lora,loaders,sd15,moe,gpu)" in refused.stderr
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "out"
    out.mkdir()
    (out / "figures.json").write_text("{}")  # an earlier run's, which the report must not take for this one's
    done = subprocess.run(check + ["--steps", "update", out], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert report.startswith("# vramd GPU check: passed"), report
    assert "- the updated model's logits equal a fresh load of the new checkpoint" in report, report
    for title in ("CUDA tests", "A managed module (bench/manage.py, bench/hooks.py)", "Mixture of experts (bench/moe.py)",
                  "Switching LoRA adapters (bench/lora.py)",
                  "A new process's first output, Stable Diffusion 1.5's UNet (bench/manage.py)",
                  "The fastest loaders onto the device (bench/gpu.py's fast_loaders)", "Benchmarks (bench/gpu.py)"):
        assert f"## {title}\n\n- not run (--steps update)\n" in report, report
    assert {path.name for path in out.iterdir()} == {"environment.txt", "update.json", "update.log", "report.md"}

def test_gpu_bench_keeps_the_figures_of_a_vramctl_run_that_dies_at_exit(tmp_path, monkeypatch):
    """On the first GPU machine lent, every `vramctl run` aborted at exit after writing its
    figures, and the bench kept none of them. Now such a run is still a failure, but its figures
    stay in figures.json beside the error. The real vramctl runs, then its process aborts."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu as bench
    monkeypatch.setattr(bench, "VRAMCTL", dying(tmp_path, "vramctl"))
    folder = tmp_path / "llama"
    bench.load_bench.warm_checkpoint(folder, dict(bench.SMALL, num_hidden_layers=2))
    torch.manual_seed(0)
    from safetensors.torch import save_file
    save_file({"input_ids": torch.randint(0, 1000, (1, 8))}, tmp_path / "inputs.safetensors")
    got = bench.vramctl_run(tmp_path, folder, "resident", 'computation = { device = "cpu" }\n',
                            argparse.Namespace(forwards=1))
    assert got["error"].endswith("vramctl run resident died of signal 6 after writing its figures (kept in figures.json)")
    assert got["forwards"] == 1 and got["forward_median_seconds"] > 0, got
    summary = bench.summarise({"resident": got, "skipped": {}})
    assert [line for line in summary if line.startswith("FAILED resident: vramctl run resident died of signal 6")], summary


def test_gpu_bench_runs_only_the_steps_named(tmp_path):
    """`--only` reruns one comparison on a lent machine without the rest; a name that is no step
    is refused before anything runs, with the steps there are."""
    bench = [sys.executable, ROOT / "bench" / "gpu.py", "--device", "cpu", "--size", "small", "--workdir", tmp_path]
    refused = subprocess.run(bench + ["--only", "resident,vramd_fp8"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--only names no step: vramd_fp8 (steps: resident, vramd_disk," in refused.stderr
    assert not list(tmp_path.iterdir())
    figures = tmp_path / "figures.json"
    done = subprocess.run(bench + ["--only", "resident", "--forwards", "1", "--json", figures],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(figures.read_text())
    assert got["resident"]["forwards"] == 1 and "gpu bench: resident" in done.stderr, got
    assert not {"vramd_disk", "accelerate_disk", "lease", "staged_reads"} & got.keys(), got.keys()
