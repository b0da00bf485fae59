"""Where vramd listens, and whether whoever listens there may be trusted, decided as vramctl
decides both (lib/client/client.cpp)."""
from __future__ import annotations

import os
import socket
import struct

from ._errors import DaemonError, DaemonUnreachable

_UCRED = "iII"  # struct ucred: pid_t pid; uid_t uid; gid_t gid
_SUN_PATH_MAX = 108


def default_socket_path() -> str:
    """The daemon's default socket: $XDG_RUNTIME_DIR/vramd/vramd.sock, else /tmp/vramd-UID/vramd.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return f"{runtime}/vramd/vramd.sock"
    return f"/tmp/vramd-{os.getuid()}/vramd.sock"


def socket_path(explicit: str | os.PathLike | None = None) -> str:
    """`explicit`, else $VRAMD_SOCKET, else the default. Unlike vramctl, no daemon config is read
    (`--daemon-config`, or configs/vramd.toml in the working folder); the shipped one names the
    default socket, and a daemon on another one is reached with socket= or $VRAMD_SOCKET."""
    if explicit:
        return os.fspath(explicit)
    return os.environ.get("VRAMD_SOCKET") or default_socket_path()


def trusted_uids() -> list[int]:
    """The users a server may run as: this process's, root, and those in $VRAMD_TRUST_UIDS."""
    listed = os.environ.get("VRAMD_TRUST_UIDS", "")
    uids = [os.getuid(), 0]
    items = listed.split(",") if listed else []
    if items and items[-1] == "":  # vramctl reads "1001," as "1001"
        items.pop()
    for item in items:
        if not (item.isascii() and item.isdigit()) or int(item) > 0xFFFFFFFF:
            raise DaemonError(f"VRAMD_TRUST_UIDS={listed}: expected numeric uids separated by commas")
        uids.append(int(item))
    return uids


def open_socket(path: str, timeout: float | None = None) -> socket.socket:
    """A connection to `path` whose server runs as a trusted user; nothing is sent before that is
    known. Raises DaemonUnreachable when nothing answers, DaemonError when the server is refused."""
    if len(os.fsencode(path)) >= _SUN_PATH_MAX:
        raise DaemonError(f"{path}: socket path too long")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise DaemonUnreachable(
            f"cannot reach vramd at {path}: {e.strerror or e}; is the daemon running? "
            "(start it with scripts/run, or pass socket= / set VRAMD_SOCKET)") from None
    try:
        check_server(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


def check_server(sock: socket.socket, path: str) -> None:
    """Raises DaemonError unless the process serving `sock` runs as a trusted user."""
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(_UCRED))
    except OSError as e:
        raise DaemonError(f"{path}: cannot tell who serves this socket (SO_PEERCRED: {e.strerror}); refused") from None
    pid, uid, _ = struct.unpack(_UCRED, credentials)
    if uid not in trusted_uids():
        raise DaemonError(f"{path}: served by uid {uid} (pid {pid}), which is neither you (uid {os.getuid()}) "
                          f"nor root; refused. If that user runs your vramd, set VRAMD_TRUST_UIDS={uid}")
