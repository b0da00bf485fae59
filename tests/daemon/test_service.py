"""vramd as a service: a socket handed over as systemd hands it over (the listening socket as
fd 3, LISTEN_PID the daemon's own pid, LISTEN_FDS=1; configs/systemd/vramd.socket), which
outlives the daemon's restarts, and logs for the journal and for a file."""
import os
import re
import socket
import subprocess
import sys

from daemon_support import VRAMD, Daemon, request, vramctl, wait_for


def activated(daemon, listener, listen_fds="1"):
    """Starts `daemon` on the listening socket `listener`, handed over as systemd does."""
    fd = listener.fileno()
    daemon.log_file = open(daemon.log, "ab")
    daemon.process = subprocess.Popen([sys.executable, "-c", HANDOVER, str(fd), listen_fds, VRAMD, "--config", str(daemon.config)],
                                      pass_fds=[fd], stdout=daemon.log_file, stderr=subprocess.STDOUT)
    return daemon


# The socket moved to fd 3, the variables set for this process, which then becomes vramd.
HANDOVER = """import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3)
if fd != 3:
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=sys.argv[2])
os.execv(sys.argv[3], sys.argv[3:])
"""


def unix_listener(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    return listener


def test_a_socket_handed_over_by_systemd_is_served_and_outlives_restarts(tmp_path):
    daemon = Daemon(tmp_path)
    listener = unix_listener(daemon.sock)
    with activated(daemon, listener):
        wait_for(daemon.healthy, what="vramd on the handed-over socket")
        assert "(from systemd)" in daemon.log.read_text()
        assert "vramd" in vramctl(daemon.sock, "status").stdout
        assert daemon.stop() == 0
    # The socket is systemd's: still there, and a client that connects while no daemon runs
    # waits in its queue and is answered by the next daemon started on it.
    assert daemon.sock.is_socket()
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.settimeout(30)
    waiting.connect(str(daemon.sock))
    waiting.sendall(b"GET /v1/health HTTP/1.1\r\nHost: vramd\r\nConnection: close\r\n\r\n")
    with activated(daemon, listener):
        answer = b""
        while chunk := waiting.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert request(daemon.sock, "GET", "/v1/health")[0] == 200
        assert daemon.stop() == 0
    assert daemon.sock.is_socket()
    listener.close()


def test_a_handover_vramd_cannot_serve_is_refused_naming_what_it_got(tmp_path):
    daemon = Daemon(tmp_path)

    def refused(listener, listen_fds="1"):
        with activated(daemon, listener, listen_fds):
            assert daemon.process.wait(30) == 1
        return daemon.log.read_text().splitlines()[-1]

    listener = unix_listener(daemon.sock)
    assert refused(listener, "2") == ("vramd: socket activation: LISTEN_FDS=2, and vramd serves one socket: give its "
                                      ".socket unit one ListenStream=")
    listener.close()
    elsewhere = unix_listener(tmp_path / "other.sock")
    assert refused(elsewhere) == (f"vramd: the socket systemd handed over (fd 3): listens at '{tmp_path / 'other.sock'}', "
                                  f"but this daemon's socket is '{daemon.sock}', where vramctl looks: make the daemon "
                                  "config's socket and the unit's ListenStream= the same")
    elsewhere.close()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    assert refused(tcp) == ("vramd: the socket systemd handed over (fd 3): not a Unix stream socket: vramd's .socket unit "
                            "needs ListenStream=/path/to/vramd.sock")
    tcp.close()


def test_logs_carry_journal_priorities_and_go_to_the_log_file_at_the_configured_level(tmp_path):
    daemon = Daemon(tmp_path, extra='log_file = "service.log"', log_level="info")
    daemon.log.touch()
    stream = os.stat(daemon.log)  # systemd names the journal's stream by device and inode
    with daemon.start(env={"JOURNAL_STREAM": f"{stream.st_dev}:{stream.st_ino}"}):
        request(daemon.sock, "GET", "/v1/models/absent")
        assert daemon.stop() == 0
    lines = daemon.log.read_text().splitlines()
    assert lines and all(re.match(r"<[3467]>vramd: (error|warn|info|debug): ", line) for line in lines), lines
    assert any(line.startswith("<6>vramd: info: vramd ") and "serving on" in line for line in lines), lines
    written = (tmp_path / "service.log").read_text().splitlines()
    assert [re.sub(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", "", line) for line in written] == [
        re.sub(r"^<\d>", "", line) for line in lines]
    assert not any(": debug: " in line for line in written)  # log_level = "info"
