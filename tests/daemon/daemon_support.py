"""Starting a real vramd on a temporary folder and talking to it over its real socket."""
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VRAMD = os.environ["VRAMD"]
VRAMCTL = os.environ["VRAMCTL"]
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "parity"))



def free_port():
    """A loopback TCP port no socket holds now, for a process about to bind it: drawn below the
    kernel's ephemeral range. A port bound to 0 comes from that range, which every outgoing
    connection (each Gloo rank's) draws from too, so one found free there can be taken by another
    test's connection before its own process binds it."""
    import random
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    candidates = list(range(10000, low)) if low > 11000 else list(range(1024, low))
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")

class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=60):
        super().__init__("vramd", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def request(sock, method, path, body=None, timeout=60):
    """(status, body bytes) of one request on a fresh connection."""
    connection = UnixConnection(str(sock), timeout)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def get_json(sock, path):
    status, body = request(sock, "GET", path)
    assert status == 200, body
    return json.loads(body)


def model(sock, name):
    return get_json(sock, f"/v1/models/{name}")


def raw(sock, data, timeout=10, shutdown=False):
    """Sends bytes as they are; returns whatever comes back until the daemon closes or times out."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(sock))
    try:
        s.sendall(data)
    except BrokenPipeError:  # the daemon refused before reading everything: read its answer
        pass
    if shutdown:
        s.shutdown(socket.SHUT_WR)
    received = b""
    try:
        while chunk := s.recv(65536):
            received += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    s.close()
    return received


def as_user(uid, function, gid=None, wait=True):
    """Runs `function` in a forked child as `uid` (root only). With `wait`, returns the bytes it
    returned (or the repr of what it raised); else the child's pid, for the caller to kill."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(gid if gid is not None else uid)
            os.setuid(uid)
            result = function()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = repr(e).encode()
        os.write(write, result)
        os._exit(0)
    os.close(write)
    if not wait:
        os.close(read)
        return pid
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return data


@contextlib.contextmanager
def public_folder(prefix):
    """A new folder under the temporary directory that other users can reach (tmp_path's parents
    are its owner's only), removed with what it holds at the end of the block."""
    public = Path(tempfile.mkdtemp(prefix=prefix))
    public.chmod(0o755)
    try:
        yield public
    finally:
        shutil.rmtree(public, ignore_errors=True)


@contextlib.contextmanager
def squatter(uid, answer):
    """A server run by `uid` (root only) on a socket in a folder that user owns, answering every
    request with the bytes `answer` until the block ends: what a client must refuse. Yields the
    socket's path."""
    def serve(sock):  # until killed (or 20 s idle)
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(sock))
        os.chmod(sock, 0o666)
        server.listen(8)
        server.settimeout(20)
        while True:
            client, _ = server.accept()
            client.settimeout(5)
            try:
                client.recv(65536)
                client.sendall(answer)
            except OSError:
                pass
            client.close()
    with public_folder("vramd-squat-") as public:
        folder = public / "squat"
        folder.mkdir()
        os.chown(folder, uid, uid)
        sock = folder / "vramd.sock"
        pid = as_user(uid, lambda: serve(sock), wait=False)
        try:
            wait_for(sock.exists, what="the fake daemon")
            yield sock
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def wait_for(predicate, timeout=20, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def thread_held(pid, name):
    """Holds the thread of process `pid` named `name` (a daemon's Worker) still until the block
    ends, as a debugger would (ptrace's interrupt), the rest of the process running on: an event
    the test controls, where timing would otherwise decide whether a window is hit. Skips the
    test where this process may not trace its child."""
    import ctypes
    import pytest
    tasks = Path(f"/proc/{pid}/task")
    tid = next((int(t.name) for t in tasks.iterdir() if (t / "comm").read_text().strip() == name), None)
    assert tid is not None, f"process {pid} has no thread named {name!r}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    seize, interrupt, detach, wall = 0x4206, 0x4207, 17, 0x40000000
    if libc.ptrace(seize, tid, None, None) != 0:
        pytest.skip(f"ptrace may not hold a thread of the daemon here: {os.strerror(ctypes.get_errno())}")
    try:
        assert libc.ptrace(interrupt, tid, None, None) == 0, os.strerror(ctypes.get_errno())
        os.waitpid(tid, wall)  # stopped
        yield tid
    finally:
        libc.ptrace(detach, tid, None, None)


def vramctl(sock, *args, check=True, timeout=120):
    result = subprocess.run([VRAMCTL, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "VRAMD_SOCKET": str(sock)})
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


class Daemon:
    """vramd on `folder`/vramd.toml with models in `folder`/models, driven through its socket."""

    def __init__(self, folder, extra="", budgets='cpu = "8GiB"', sock=None, log_level="debug"):
        self.folder = Path(folder)
        self.models = self.folder / "models"
        self.models.mkdir(parents=True, exist_ok=True)
        self.sock = Path(sock) if sock else self.folder / "vramd.sock"
        self.config = self.folder / "vramd.toml"
        self.config.write_text(f'socket = "{self.sock}"\nmodels = "models"\nlog_level = "{log_level}"\n'
                               f"{extra}\n[budgets]\n{budgets}\n")
        self.process = None
        self.log = self.folder / "vramd.log"

    def start(self, wait=True, env=None):
        self.log_file = open(self.log, "ab")
        self.process = subprocess.Popen([VRAMD, "--config", str(self.config)], stdout=self.log_file,
                                        stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        if wait:
            # It serves once every config is checked, which for converter = "transformers" runs
            # Python (seconds each, more on a loaded machine); `healthy` fails at once if it exits,
            # so the timeout only bounds a daemon that hangs.
            wait_for(self.healthy, timeout=300, what=f"vramd to serve (log: {self.log})")
        return self

    def healthy(self):
        if self.process.poll() is not None:
            raise AssertionError(f"vramd exited with {self.process.returncode}:\n{self.log.read_text()}")
        try:
            return request(self.sock, "GET", "/v1/health", timeout=5)[0] == 200
        except OSError:
            return False

    def stop(self, timeout=30):
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout)
        self.log_file.close()
        if self.process.returncode != 0:  # pytest shows this when the test's assertion fails
            print(f"vramd exited with {self.process.returncode}; the end of its log:\n{self.log.read_text()[-20000:]}")
        return self.process.returncode

    def rss(self):
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def __enter__(self):  # `with Daemon(...).start() as d:` kills it at the end, whatever happened
        return self

    def __exit__(self, *exc):
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log_file.close()
