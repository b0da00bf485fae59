"""HTTP/1.1 over a connected Unix socket, as much of it as vramd speaks: requests with a
Content-Length body; answers sized by Content-Length, chunked, or ended by the close."""
from __future__ import annotations

import array
import json
import socket
from dataclasses import dataclass, field

from ._errors import DaemonError, ProtocolError
from ._socket import open_socket

HEAD_LIMIT = 64 << 10
_READ_SIZE = 256 << 10
# Room for SCM_MAX_FD (253) descriptors: the most one message can carry.
_FD_SPACE = socket.CMSG_SPACE(253 * array.array("i").itemsize)


class Closed(ProtocolError):
    """The server closed the connection before the answer was complete."""

    def __init__(self):
        super().__init__("closed the connection before answering")


class Reader:
    """Buffered reads from a socket. With `fds` (a list), every read is a recvmsg that appends the
    file descriptors passed with SCM_RIGHTS, in order: a plain recv would drop them."""

    def __init__(self, sock: socket.socket, fds: list[int] | None = None):
        self.sock = sock
        self.fds = fds
        self.buffer = bytearray()
        self.received = 0

    def fill(self) -> int:
        """Reads once; the number of bytes read, 0 at the end of the stream."""
        if self.fds is None:
            data = self.sock.recv(_READ_SIZE)
        else:
            data, ancillary, flags, _ = self.sock.recvmsg(_READ_SIZE, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("sent file descriptors that were lost on the way "
                                    "(MSG_CTRUNC: too many open files in this process?)")
        self.buffer += data
        self.received += len(data)
        return len(data)

    def until(self, delimiter: bytes, limit: int) -> bytes:
        """The bytes before the next `delimiter`, which is consumed too."""
        searched = 0
        while (end := self.buffer.find(delimiter, searched)) < 0:
            if len(self.buffer) > limit:
                raise ProtocolError(f"sent more than {limit} bytes without {delimiter!r}")
            searched = max(0, len(self.buffer) - len(delimiter) + 1)
            if not self.fill():
                raise Closed()
        line = bytes(self.buffer[:end])
        del self.buffer[:end + len(delimiter)]
        return line

    def exact(self, size: int) -> bytearray:
        """The next `size` bytes."""
        out = bytearray(size)
        view = memoryview(out)
        have = 0
        while True:
            take = min(size - have, len(self.buffer))
            view[have:have + take] = self.buffer[:take]
            del self.buffer[:take]
            have += take
            if have == size:
                return out
            if self.fds is None and not self.buffer:  # straight into place, no second copy
                got = self.sock.recv_into(view[have:], size - have)
                self.received += got
                have += got
                if not got:
                    raise Closed()
            elif not self.fill():
                raise Closed()

    def rest(self) -> bytearray:
        """Everything up to the end of the stream."""
        while self.fill():
            pass
        out, self.buffer = self.buffer, bytearray()
        return out


@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case
    body: bytearray = field(default_factory=bytearray)


def send_request(sock: socket.socket, method: str, target: str, body: bytes = b"",
                 content_type: str | None = None) -> None:
    """Sends a request. A server that closes before reading all of it may have answered (a body
    too large, say): that answer is read next, so a closed connection is left for the read to tell."""
    head = f"{method} {target} HTTP/1.1\r\nHost: vramd\r\nContent-Length: {len(body)}\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    try:
        sock.sendall((head + "\r\n").encode("ascii"))
        if body:
            sock.sendall(body)
    except (BrokenPipeError, ConnectionResetError):
        pass


def read_head(reader: Reader) -> Response:
    """The status line and headers of an answer."""
    status_line = reader.until(b"\r\n", HEAD_LIMIT).decode("latin-1")
    version, _, rest = status_line.partition(" ")
    status = rest[:3]
    if not version.startswith("HTTP/1.") or len(status) != 3 or not status.isdigit():
        raise ProtocolError(f"sent a malformed answer: status line {status_line[:100]!r}")
    response = Response(int(status))
    size = len(status_line)
    while line := reader.until(b"\r\n", HEAD_LIMIT).decode("latin-1"):
        size += len(line)
        name, colon, value = line.partition(":")
        if not colon or size > HEAD_LIMIT:
            raise ProtocolError(f"sent a malformed answer: header line {line[:100]!r}")
        response.headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0":
        response.headers.setdefault("connection", "close")
    return response


def read_body(reader: Reader, response: Response, on_chunk=None) -> None:
    """Reads the body of `response` into it, or hands each piece to `on_chunk` as it comes."""
    def take(data):
        if on_chunk:
            on_chunk(data)
        else:
            response.body += data

    if response.status < 200 or response.status in (204, 304):
        return
    if "chunked" in response.headers.get("transfer-encoding", "").lower():
        while True:
            size = reader.until(b"\r\n", HEAD_LIMIT).split(b";", 1)[0].strip()
            if not size or any(c not in b"0123456789abcdefABCDEF" for c in size):
                raise ProtocolError(f"sent a malformed chunk size {size[:40]!r}")
            if int(size, 16) == 0:
                while reader.until(b"\r\n", HEAD_LIMIT):  # trailers
                    pass
                return
            take(reader.exact(int(size, 16)))
            if reader.exact(2) != b"\r\n":
                raise ProtocolError("sent a chunk longer than its size")
    length = response.headers.get("content-length")
    if length is None:
        response.headers["connection"] = "close"
        take(reader.rest())
    elif length.isascii() and length.isdigit():
        take(reader.exact(int(length)))
    else:
        raise ProtocolError(f"sent a malformed Content-Length {length[:40]!r}")


_HUNG_UP = (Closed, BrokenPipeError, ConnectionResetError)


def as_daemon_error(error: BaseException, where: str, request: str, timeout: float | None) -> BaseException:
    """The DaemonError that says what `error`, raised while talking to `where`, means; `error`
    itself when it is not about the connection."""
    if isinstance(error, _HUNG_UP):
        return DaemonError(f"{where} {Closed()}", request=request)
    if isinstance(error, ProtocolError):
        return DaemonError(f"{where} {error}", request=request)
    if isinstance(error, socket.timeout):
        return DaemonError(f"{where} did not answer within {timeout} s", request=request)
    if isinstance(error, OSError):
        return DaemonError(f"talking to {where} failed: {error}", request=request)
    return error


# The daemon's advice names its HTTP API, for curl and every client; here it is this package's.
_OUR_WORDS = [("GET /v1/models lists them", "Client.list() lists them"),
              ("leave out wait=false", "leave out wait=False"),
              ("(POST /v1/models/NAME/lease; the Python package's lease())", "(Client.lease())")]


def refusal(response: Response, request: str) -> DaemonError:
    """The daemon's refusal as a DaemonError in its words (its advice in this package's), or the
    start of the body."""
    try:
        message = json.loads(response.body)["error"]
        if not isinstance(message, str):
            raise TypeError
    except (ValueError, TypeError, KeyError):
        message = f"HTTP {response.status}: {bytes(response.body[:200]).decode('utf-8', 'replace')}"
    for api, ours in _OUR_WORDS:
        message = message.replace(api, ours)
    return DaemonError(message, response.status, request)


class Connection:
    """One keep-alive connection to vramd, opened again when the daemon closed it."""

    def __init__(self, path: str, timeout: float | None = None):
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None

    def open(self) -> None:
        if self._sock is None:
            self._sock = open_socket(self.path, self.timeout)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, method: str, target: str, body: bytes = b"", content_type: str | None = None,
                on_chunk=None) -> Response:
        """The daemon's answer, of any status. With `on_chunk`, the body of a 200 goes to it
        piece by piece instead (a stream); another status's body is kept for its message."""
        request = f"{method} {target}"
        retried = False
        while True:
            reused = self._sock is not None
            self.open()
            reader = Reader(self._sock)
            try:
                send_request(self._sock, method, target, body, content_type)
                response = read_head(reader)
                read_body(reader, response, on_chunk if response.status == 200 else None)
            except BaseException as e:  # the answer's end is unknown: this connection is done
                self.close()
                # A kept connection the daemon had closed (its idle timeout): once more on a new one.
                if isinstance(e, _HUNG_UP) and reused and not retried and reader.received == 0:
                    retried = True
                    continue
                failure = as_daemon_error(e, f"vramd at {self.path}", request, self.timeout)
                if failure is e:  # not the connection's: the caller's on_chunk raised it
                    raise
                raise failure from None
            if response.headers.get("connection", "").lower() == "close":
                self.close()
            return response
