"""The docs run: every block of the user docs that a user can copy is run as written, as the HTML
comment before it says (docs/development.md, "Tests", has the markers), and a copyable block
without one fails. One daemon, started from the shipped configs/vramd.toml on a private
XDG_RUNTIME_DIR, serves every page; each page runs in a scratch folder of its own."""
import difflib
import grp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_support import request, wait_for  # noqa: E402
from fixtures import GIVEN, checkpoint  # noqa: E402

VRAMCTL = os.environ["VRAMCTL"]
VRAMD = os.environ["VRAMD"]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "python/README.md",
         "scripts/converters/README.md"]
COPYABLE = {"sh", "bash", "shell", "console", "toml", "python", "py", "lua"}
KINDS = {"sh", "transcript", "python", "check", "daemon-config", "prepend", "save", "convert", "bench", "skip"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!-- (docs-test|walkthrough): (.*?) -->\s*$")
# /models/NAME where a path starts (not in http://localhost/v1/models/...)
MODELS = re.compile(r"""(?<=["'\s=])/models/([\w.-]+)""")
LINKED_FROM_SCRATCH = ["build", ".venv", "scripts", "examples", "bench", "python"]


@dataclass
class Block:
    page: str
    line: int      # of the opening fence, from 1
    language: str
    marker: str    # the comment's text after "docs-test: " ("" when there is none)
    text: str

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    @property
    def kind(self):
        return re.match(r"[\w-]*", self.marker).group()

    @property
    def argument(self):
        """What follows the kind, up to "; given"."""
        return self.marker.partition("; given ")[0][len(self.kind):].strip()

    @property
    def given(self):
        _, _, files = self.marker.partition("; given ")
        return [f.strip() for f in files.split(",") if f.strip()]


def blocks(page):
    lines = (ROOT / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2)
        end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]) and not FENCE.match(lines[j]).group(2))
        text = "".join(line[len(indent):] + "\n" if line.startswith(indent) else line.lstrip() + "\n"
                       for line in lines[i + 1:end])
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        if marker and marker.group(1) == "walkthrough":
            marker_text = f"save configs/{marker.group(2)}"  # relative to the daemon config, as the page says
        else:
            marker_text = marker.group(2) if marker else ""
        found.append(Block(page, i + 1, language, marker_text, text))
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def test_every_copyable_block_says_how_it_runs():
    unmarked = [f"{b.where} ({b.language})" for b in ALL if b.language in COPYABLE and not b.marker]
    assert not unmarked, ("these blocks have no <!-- docs-test: ... --> before them (docs/development.md, "
                          f"\"Tests\"): {unmarked}")
    unknown = [f"{b.where}: {b.marker}" for b in ALL if b.marker and b.kind not in KINDS]
    assert not unknown, f"unknown markers: {unknown}"
    reasonless = [b.where for b in ALL if b.kind in ("skip", "bench") and not re.fullmatch(r"\(.+\)", b.argument)]
    assert not reasonless, f"a skip or bench marker must say why in parentheses: {reasonless}"
    for page in PAGES:
        lines = (ROOT / page).read_text().splitlines()
        for n, line in enumerate(lines):
            if MARKER.match(line):
                following = next((l for l in lines[n + 1:] if l.strip()), "")
                assert FENCE.match(following), f"{page}:{n + 1}: a marker with no code block after it"


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lstrip("#").strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(path, inline_code=False):
    """The page without its code blocks, and without its inline code unless asked."""
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)
    return text if inline_code else re.sub(r"`[^`\n]*`", "", text)


def test_every_link_between_pages_leads_somewhere():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(ROOT / page)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = ((ROOT / page).parent / file).resolve() if file else ROOT / page
            if not path.exists():
                broken.append(f"{page}: {target}: no such file")
            elif anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", prose(path, inline_code=True), re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page}: {target}: no such heading")
    assert not broken, broken


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def scratch(folder):
    """A folder the docs' relative paths work in: a copy of configs/ beside links to the rest."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "configs", folder / "configs")
    (folder / "configs" / "families").mkdir()  # the folder docs/architectures.md has the user make
    for name in LINKED_FROM_SCRATCH:
        (folder / name).symlink_to(Path(VRAMCTL).resolve().parents[1] if name == "build" else ROOT / name)
    return folder


@dataclass
class Serving:
    env: dict    # what every block runs with
    root: Path   # the daemon's folder: its configs/ (and configs/models/, which it watches)


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """The environment every block runs in, with one daemon started from the shipped config."""
    base = tmp_path_factory.mktemp("daemon")
    runtime = base / "run"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "VRAMD_SOCKET"} | {"XDG_RUNTIME_DIR": str(runtime)}
    folder = scratch(base / "root")
    with open(base / "vramd.log", "wb") as log:
        daemon = subprocess.Popen([VRAMD, "--config", "configs/vramd.toml"], cwd=folder, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    sock = runtime / "vramd" / "vramd.sock"

    def serving():
        assert daemon.poll() is None, (base / "vramd.log").read_text()
        try:
            return request(sock, "GET", "/v1/health", timeout=5)[0] == 200
        except OSError:
            return False
    wait_for(serving, timeout=60, what="vramd with configs/vramd.toml")
    yield Serving(env, folder)
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(60) == 0, (base / "vramd.log").read_text()[-5000:]


def placeholders(text, models):
    """The block with /models/NAME made real, and this machine's interface and group in a daemon config."""
    text = MODELS.sub(lambda m: str(checkpoint(models, m.group(1))), text)
    text = text.replace('interface = "eth1"', 'interface = "lo"')
    return text.replace('group = "vramd"', f'group = "{grp.getgrgid(os.getgid()).gr_name}"')


def run(command, folder, env, **kwargs):
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=180, **kwargs)


def shell(block, folder, env):
    """The block in bash, with the variables earlier blocks of the page set, and its own kept for the next."""
    state = folder / ".docs-test-variables"
    script = (f'__before=" $(compgen -v | tr "\\n" " ") "; [ ! -f {state} ] || source {state}\n'
              f'{block.text}\n'
              'for __v in $(compgen -v); do\n'
              '  case "$__v" in __v|__before) continue;; esac\n'
              '  case "$__before" in *" $__v "*) ;; *) declare -p "$__v" | grep -v "^declare -[a-zA-Z]*r" || true;; esac\n'
              f'done > {state}\n')
    result = run(["bash", "-euo", "pipefail", "-c", script], folder, env)
    assert result.returncode == 0, f"{block.where} failed ({result.returncode}):\n{result.stdout}{result.stderr}"


def transcript(block, folder, env):
    """`$ ` lines are commands; the lines under each, what it prints."""
    steps = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"{block.where}: a transcript starts with a `$ ` line"
            steps[-1][1].append(line.rstrip())
    for command, expected in steps:
        result = run(["bash", "-c", command], folder, env)
        got = [line.rstrip() for line in (result.stdout + result.stderr).rstrip("\n").splitlines()]
        assert got == expected, f"{block.where}: `{command}` printed otherwise:\n" + "\n".join(
            difflib.unified_diff(expected, got, "the page", "the command", lineterm=""))


def python(block, folder, env, monkeypatch):
    """The block in this process, in the page's folder, or in the daemon's with
    `python in the daemon's folder` (a block that drops a model config where the daemon sees it)."""
    monkeypatch.chdir(env.root if block.argument == "in the daemon's folder" else folder)
    env = env.env
    for key in os.environ.keys() - env.keys():
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    exec(compile(block.text, block.where, "exec"), {"__name__": "__main__"})


def bench(block, folder, env):
    """Each `.venv/bin/python bench/NAME.py ARGS` of the block: its arguments parsed by the script's
    own parser, which then stops it (the benchmarks take minutes)."""
    commands = []
    for line in block.text.replace("\\\n", " ").splitlines():
        for part in line.split("#")[0].split("&&"):
            words = part.split()
            if words[:1] == [".venv/bin/python"] and len(words) > 1 and words[1].startswith("bench/"):
                commands.append(words[1:])
    assert commands, f"{block.where}: a bench block without a `.venv/bin/python bench/...` command"
    probe = ("import argparse, json, runpy, sys\n"
             "class Parsed(Exception): pass\n"
             "parse = argparse.ArgumentParser.parse_args\n"
             "def parse_and_stop(self, *args, **kwargs):\n"
             "    parse(self, *args, **kwargs)\n"
             "    raise Parsed\n"
             "argparse.ArgumentParser.parse_args = parse_and_stop\n"
             "for command in json.loads(sys.argv[1]):\n"
             "    sys.argv = command\n"
             "    try:\n"
             "        runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "    except Parsed:\n"
             "        continue\n"
             "    raise SystemExit(f'{sys.argv[0]} ran without parsing its arguments')\n")
    result = run([sys.executable, "-c", probe, json.dumps(commands)], folder, env)
    assert result.returncode == 0, f"{block.where}: {result.stdout}{result.stderr}"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def vramctl_check(block, folder, env, path):
    result = run([VRAMCTL, "check", path], folder, env)
    assert result.returncode == 0, f"{block.where}: vramctl check {path}:\n{result.stdout}{result.stderr}"


def daemon_check(block, folder, env, path):
    result = run([VRAMD, "--check", "--config", path], folder, env)
    assert result.returncode == 0, f"{block.where}: vramd --check --config {path}:\n{result.stdout}{result.stderr}"


def run_block(block, folder, serving, models, monkeypatch):
    env = serving.env
    kind, argument = block.kind, block.argument
    for given in block.given:
        if not (folder / given).exists():
            assert given in GIVEN, f"{block.where}: no fixture for 'given {given}' in tests/docs/fixtures.py"
            (folder / given).parent.mkdir(parents=True, exist_ok=True)
            GIVEN[given](folder / given, models)
    block.text = placeholders(block.text, models)
    if kind == "sh":
        shell(block, folder, env)
    elif kind == "transcript":
        transcript(block, folder, env)
    elif kind == "python":
        python(block, folder, serving, monkeypatch)
    elif kind == "bench":
        bench(block, folder, env)
    elif kind == "check":
        write(folder / argument, block.text)
        vramctl_check(block, folder, env, argument)
    elif kind == "daemon-config":
        write(folder / argument, block.text)
        daemon_check(block, folder, env, argument)
    elif kind == "prepend":
        write(folder / argument, block.text + (folder / argument).read_text())
        daemon_check(block, folder, env, argument)
    elif kind == "save":
        write(folder / argument, block.text)
    elif kind == "convert":
        script = folder / f"converter-{block.line}.lua"
        write(script, block.text)
        config = folder / f"converter-{block.line}.toml"
        write(config, f'checkpoint = "{checkpoint(models, argument.strip("/").removeprefix("models/"))}/"\n'
                      f'converter = "{script}"\n')
        result = run([VRAMCTL, "convert", config], folder, env)
        assert result.returncode == 0, f"{block.where}: vramctl convert:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("page", PAGES)
def test_the_blocks_of_each_page_run_as_written(page, environment, models, tmp_path, monkeypatch):
    folder = scratch(tmp_path / "root")
    for block in blocks(page):
        if block.marker and block.kind != "skip":
            run_block(block, folder, environment, models, monkeypatch)
