"""Python client for vramd, the daemon that keeps PyTorch models loaded.

    import vramd
    with vramd.connect() as c:
        c.load("minilm")
        out = c.forward("minilm", {"input_ids": torch.tensor([[101, 2023, 102]])})
        with c.lease("minilm") as state_dict:   # read-only, zero-copy views of the daemon's memory
            model.load_state_dict(state_dict, assign=True)

See python/README.md and docs/api.md."""
from ._errors import DaemonError, DaemonUnreachable
from ._gguf import Packed, unpack
from ._socket import default_socket_path, socket_path
from ._units import format_bytes, parse_size
from .client import Client, connect
from .lease import Lease
from .manage import Managed, ManageError, manage

__version__ = "0.1.0"
__all__ = ["Client", "DaemonError", "DaemonUnreachable", "Lease", "ManageError", "Managed", "Packed", "connect",
           "default_socket_path", "format_bytes", "manage", "parse_size", "socket_path", "unpack"]
