"""What would make a launch fail before any rank runs, checked before torchrun starts.

Without these checks a launch that cannot work looked like an empty run: with no torch for the ranks'
interpreter every rank died at once, and with the rendezvous port taken torchrun connected to whatever held
it and waited for a rendezvous that never came. Each check is one clear line and exit 2.
"""

from __future__ import annotations

import errno
import importlib.util
import socket
import sys

from ..errors import UserError
from .torchrun_args import TorchrunCommand

# torchrun's defaults (torch/distributed/run.py, elastic rendezvous): where each backend listens
C10D_DEFAULT_PORT = 29400
STATIC_DEFAULT_PORT = 29500


def check_launch(cmd: TorchrunCommand) -> None:
    check_torch()
    hosted = hosted_endpoint(cmd)
    if hosted is not None:
        check_port_free(*hosted)


def check_torch() -> None:
    """torchrun and every rank run under this interpreter (``sys.executable -m torch.distributed.run``)."""
    if importlib.util.find_spec("torch") is None:
        raise UserError(
            f"torch is not importable by {sys.executable} (which torchrun and the ranks run under): "
            "install it in this environment (pip install torch)"
        )


def _split_endpoint(endpoint: str, default_port: int) -> tuple[str, int] | None:
    if endpoint.count(":") == 1 or "]:" in endpoint:  # host:port, [v6]:port
        host, _, port = endpoint.rpartition(":")
    else:  # a bare host or v6 address: the backend's default port
        host, port = endpoint, ""
    host = host.strip("[]") or "127.0.0.1"
    try:
        return host, int(port) if port else default_port
    except ValueError:
        return None


def hosted_endpoint(cmd: TorchrunCommand) -> tuple[str, int] | None:
    """The rendezvous address torchrun on this node will itself listen on, when that is certain: a single
    node's c10d endpoint (several nodes race to host it), or node 0's static master address. ``--standalone``
    and port 0 pick a free port."""
    if cmd.standalone:
        return None
    single = cmd.nnodes in ("1", "1:1")
    if cmd.rdzv_backend == "c10d":
        if not single or not cmd.rdzv_endpoint:
            return None
        found = _split_endpoint(cmd.rdzv_endpoint, C10D_DEFAULT_PORT)
    elif cmd.rdzv_backend == "static":
        if cmd.node_rank != 0:
            return None
        if cmd.rdzv_endpoint:
            found = _split_endpoint(cmd.rdzv_endpoint, STATIC_DEFAULT_PORT)
        else:
            found = (cmd.master_addr or "127.0.0.1", cmd.master_port or STATIC_DEFAULT_PORT)
    else:
        return None
    if found is None or found[1] == 0:
        return None
    return found


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on; an address that is not this node's is not ours to check."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # torchrun will say it cannot resolve the host
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: TIME_WAIT is free
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UserError(
                        f"the rendezvous port {host}:{port} is in use by another process (another job?): "
                        "pick a free one (--rdzv-endpoint HOST:PORT, --master-port PORT)"
                    ) from exc
