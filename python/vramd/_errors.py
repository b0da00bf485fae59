"""The exceptions the client raises for what the daemon, or the way to it, refused."""
from __future__ import annotations


class DaemonError(Exception):
    """vramd refused a request, answered what docs/api.md does not document, or could not be
    reached or trusted.

    status: the HTTP status of the daemon's refusal; None where there was none (no connection,
        an untrusted server, a malformed answer, a streamed load that failed after it started).
    message: the daemon's own words (its {"error": ...}), or the client's.
    request: the request it is about ("POST /v1/models/minilm/load"); None before any was sent.
    """

    def __init__(self, message: str, status: int | None = None, request: str | None = None):
        super().__init__(f"{request}: {message}" if request else message)
        self.message = message
        self.status = status
        self.request = request


class DaemonUnreachable(DaemonError, ConnectionError):
    """Nothing answers on the socket: the daemon is not running, or the path is not its."""


class ProtocolError(Exception):
    """Inside the client: the bytes that came back are not the answer HTTP or docs/api.md
    describe. Becomes a DaemonError naming the request at the boundary."""
