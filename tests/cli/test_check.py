"""vramctl check, driven as a user would: real files, the real executable."""
import json
import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file

VRAMCTL = os.environ["VRAMCTL"]


def vramctl(*args, cwd=None):
    return subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)


def setup(tmp_path):
    save_file({"model.w": torch.zeros(4, 4, dtype=torch.bfloat16), "vae.w": torch.zeros(2)}, tmp_path / "ck.safetensors")
    (tmp_path / "vramd.toml").write_text('models = "models"\n[budgets]\ncpu = "1GiB"\n')
    models = tmp_path / "models"
    models.mkdir()
    (models / "good.toml").write_text(
        'checkpoint = "../ck.safetensors"\nprefix = "model."\n[vram]\noffload = { device = "disk" }\nlimit = "512MiB"\n')
    (models / "typo.toml").write_text('checkpoint = "../ck.safetensors"\n[vram]\nofload = { device = "disk" }\n')
    (models / "missing.toml").write_text('checkpoint = "../gone.safetensors"\n')
    (models / "wrong-prefix.toml").write_text('checkpoint = "../ck.safetensors"\nprefix = "unet."\n')
    return models


def test_check_passes_a_good_config_and_reports_its_checkpoint(tmp_path):
    models = setup(tmp_path)
    result = vramctl("check", models / "good.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"ok    {models / 'good.toml'}: model 'good', 1 tensor, 32 B\n"


def test_check_reports_every_bad_config_and_still_checks_the_others(tmp_path):
    models = setup(tmp_path)
    files = sorted(models.glob("*.toml"))
    result = vramctl("check", *files, "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1
    out = result.stdout
    assert f"ok    {models / 'good.toml'}" in out
    assert f"FAIL  {models / 'typo.toml'}\n      {models / 'typo.toml'}:3:1: unknown key 'ofload' in [vram]; did you mean 'offload'?" in out
    assert f"{models / 'missing.toml'}: checkpoint: {tmp_path / 'gone.safetensors'}: no such file or folder" in out
    assert "no key starts with the prefix 'unet.'" in out


def test_sentence_transformers_files_of_the_wrong_shape_are_refused_naming_them(tmp_path):
    cases = {"number": ("[1]", "modules.json: module 0 is number: expected an object"),
             "type": ('[{"type": 5}]', "modules.json: module 0: 'type' is number, not string"),
             "pooling": ('[{"type": "x.Pooling", "path": "p"}]',
                         "p/config.json: 'pooling_mode_mean_tokens' is string, not boolean")}
    for name, (modules, _) in cases.items():
        (tmp_path / name / "p").mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, tmp_path / name / "model.safetensors")
        (tmp_path / name / "modules.json").write_text(modules)
        (tmp_path / name / "p" / "config.json").write_text('{"pooling_mode_mean_tokens": "yes"}')
        (tmp_path / f"{name}.toml").write_text(f'checkpoint = "{name}"\n')
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "1GiB"\n')
    result = vramctl("check", *[tmp_path / f"{name}.toml" for name in cases], "--json",
                     "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1, result.stderr
    assert [entry["problems"] for entry in json.loads(result.stdout)["configs"]] == [
        [f"{tmp_path / name}/{message}"] for name, (_, message) in cases.items()]


def test_check_json_has_one_entry_per_config(tmp_path):
    models = setup(tmp_path)
    result = vramctl("check", models / "good.toml", models / "typo.toml", "--json", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert [entry["ok"] for entry in doc["configs"]] == [True, False]
    assert doc["configs"][0]["tensors"] == 1
    assert "did you mean 'offload'?" in doc["configs"][1]["problems"][0]


def test_vramctl_ends_without_libtorchs_teardown_and_all_it_printed_arrives(tmp_path):
    """vramctl-torch ends once its command is done without static destructors (util/exit.hpp):
    LibTorch's cost each exit 0.1-0.2 s, and aborted every process of ours on the H200. All it
    printed must still arrive, here over 64 KiB through a pipe."""
    models = setup(tmp_path)
    for i in range(300):
        (models / f"copy{i:03}.toml").write_text((models / "good.toml").read_text())
    files = sorted(models.glob("copy*.toml"))

    def run_logging_fini(name, *args):
        log = tmp_path / name
        done = subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LD_DEBUG": "files", "LD_DEBUG_OUTPUT": str(log)})
        return done, "".join(p.read_text() for p in tmp_path.glob(name + ".*"))

    result, loader = run_logging_fini("check", VRAMCTL, "check", *files, "--json", "--daemon-config",
                                      tmp_path / "vramd.toml")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) > 65536
    assert [entry["name"] for entry in json.loads(result.stdout)["configs"]] == [f.stem for f in files]
    assert "libtorch_cpu.so" in loader and "calling fini" not in loader, loader[-3000:]
    # The witness that this test sees a teardown: the exit probe returns from main as usual.
    _, loader = run_logging_fini("probe", Path(VRAMCTL).parent / "vramd_exit_probe")
    assert "calling fini: " in loader and "libtorch_cpu.so" in loader


def test_a_limit_without_a_budget_is_refused_with_the_daemon_config_named(tmp_path):
    models = setup(tmp_path)
    (models / "gpu.toml").write_text('checkpoint = "../ck.safetensors"\n[vram]\ncomputation = { device = "cuda:0" }\nlimit = "1GiB"\n')
    result = vramctl("check", models / "gpu.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1
    assert f"a limit on cuda:0, for which {tmp_path / 'vramd.toml'} sets no budget (budgets: cpu 1.00 GiB)" in result.stdout
    # Without --daemon-config and away from the repository, what was looked for and the flag.
    result = vramctl("check", models / "gpu.toml", cwd=models)
    assert result.returncode == 1
    assert (f"a limit on cuda:0 needs the daemon config's budget for it, and no daemon config was found (looked for "
            f"'{models / 'configs' / 'vramd.toml'}'): give one with --daemon-config") in result.stdout, result.stdout


def test_a_model_that_could_never_fit_its_budget_is_refused_as_its_load_would_be(tmp_path):
    # #66: check said "valid", and the load then failed. vramctl check, vramd --check and the
    # daemon's own validation refuse it, naming the key and what it would hold.
    save_file({f"{i}.w": torch.zeros(1024, 30) for i in range(10)}, tmp_path / "big.safetensors")  # 1.17 MiB
    (tmp_path / "vramd.toml").write_text(f'socket = "{tmp_path / "run" / "vramd.sock"}"\nmodels = "models"\n'
                                         '[budgets]\ncpu = "1MiB"\n')
    models = tmp_path / "models"
    models.mkdir()
    (models / "big.toml").write_text('architecture = "weights"\ncheckpoint = "../big.safetensors"\n')
    said = (f"{models / 'big.toml'}:2:1: model 'big' holds up to 1.17 MiB on cpu (weights 1.17 MiB), more than the "
            f"daemon's whole budget for it (1.00 MiB, {tmp_path / 'vramd.toml'}): it could never load; give it a "
            "[vram] limit or raise the budget")
    result = vramctl("check", models / "big.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1 and f"      {said}\n" in result.stdout, result.stdout
    result = subprocess.run([os.environ["VRAMD"], "--config", tmp_path / "vramd.toml", "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and f"         {said}\n" in result.stdout, result.stdout
    # Under a limit it rests for the clients that manage it, and fits.
    (models / "big.toml").write_text('architecture = "weights"\ncheckpoint = "../big.safetensors"\n'
                                     '[vram]\nonload = { device = "cpu", dtype = "bfloat16" }\nlimit = "128KiB"\n')
    assert vramctl("check", models / "big.toml", "--daemon-config", tmp_path / "vramd.toml").returncode == 0


def test_a_broken_daemon_config_is_one_clear_error(tmp_path):
    setup(tmp_path)
    (tmp_path / "vramd.toml").write_text('[budgets]\ncpu = "lots"\n')
    result = vramctl("check", tmp_path / "models" / "good.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1
    assert f"{tmp_path / 'vramd.toml'}:2:7: budgets.cpu = 'lots': 'lots' is not a size" in result.stderr


def test_check_runs_the_converter_dry_and_reports_its_errors(tmp_path):
    models = setup(tmp_path)
    (tmp_path / "good.lua").write_text('return { w = src["w"]:t() }\n')
    (tmp_path / "bad.lua").write_text('local out = {}\nout.w = src["w"]:chunk(3, 0)\nreturn out\n')
    (models / "converted.toml").write_text('checkpoint = "../ck.safetensors"\nprefix = "model."\nconverter = "../good.lua"\n')
    (models / "broken.toml").write_text('checkpoint = "../ck.safetensors"\nprefix = "model."\nconverter = "../bad.lua"\n')
    result = vramctl("check", models / "converted.toml", models / "broken.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1
    assert f"ok    {models / 'converted.toml'}: model 'converted', 1 tensor, 32 B" in result.stdout
    assert (f"{models / 'broken.toml'}: converter: {(tmp_path / 'bad.lua')}:2: chunk of src['w'] (shape [4, 4]): "
            "dimension 0 (size 4) does not split into 3 equal parts") in result.stdout


def test_check_plans_a_model_resting_for_its_clients_and_refuses_a_limit_below_its_largest_unit(tmp_path):
    # The "weights" architecture holds the checkpoint's tensors as they are: one unit of 1.27 KiB,
    # which each managing client computes whole.
    save_file({"a": torch.zeros(16, 16), "b": torch.zeros(4), "c": torch.zeros(8, 8)}, tmp_path / "ck.safetensors")
    (tmp_path / "vramd.toml").write_text('models = "models"\n[budgets]\ncpu = "1GiB"\n')
    models = tmp_path / "models"
    models.mkdir()
    table = '[vram]\nonload = { device = "cpu", dtype = "bfloat16" }\nlimit = "%s"\n'
    for name, limit in (("fits", "2KiB"), ("tight", "1KiB")):
        (models / f"{name}.toml").write_text('checkpoint = "../ck.safetensors"\narchitecture = "weights"\n' + table % limit)
    result = vramctl("check", models / "fits.toml", models / "tight.toml", "--daemon-config", tmp_path / "vramd.toml")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == (
        f"ok    {models / 'fits.toml'}: model 'fits', 3 tensors, 1.27 KiB (weights, float32)\n"
        "      plan: rests in host memory in bfloat16 (648 B) for the clients that manage it: 1 unit, the largest 1.27 KiB in "
        "float32 on cpu; limit 2.00 KiB\n"
        f"FAIL  {models / 'tight.toml'}\n"
        f"      {models / 'tight.toml'}:5:1: vram.limit = 1.00 KiB cannot hold the largest unit (1.27 KiB in float32), which "
        "each client that manages the model computes whole; raise it to at least that\n")
    doc = json.loads(vramctl("check", models / "fits.toml", "--json", "--daemon-config", tmp_path / "vramd.toml").stdout)
    assert doc["configs"][0]["plan"].startswith("rests in host memory in bfloat16")


def test_vramctl_runs_tensor_commands_in_vramctl_torch_and_says_when_it_is_missing(tmp_path):
    """vramctl links no LibTorch: check, convert, plan and run are executed by vramctl-torch from
    its folder. Without it they fail saying so; the client commands still work."""
    models = setup(tmp_path)
    maps = subprocess.run(["ldd", VRAMCTL], capture_output=True, text=True, check=True).stdout
    assert "libtorch" not in maps and "libc10" not in maps, maps
    alone = tmp_path / "bin"
    alone.mkdir()
    (alone / "vramctl").write_bytes(open(VRAMCTL, "rb").read())
    (alone / "vramctl").chmod(0o755)
    result = subprocess.run([alone / "vramctl", "check", models / "good.toml"], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == (f"vramctl check: cannot start {alone}/vramctl-torch (No such file or directory), "
                             "which runs check, convert, plan and run: it is built beside vramctl\n")
    result = subprocess.run([alone / "vramctl", "health", "--socket", tmp_path / "none.sock"], capture_output=True, text=True)
    assert result.returncode != 0 and "none.sock" in result.stderr
