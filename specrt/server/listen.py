"""The listening socket, bound before the server starts, so "serving on ..." is only said once
true, and a port in use names the process that holds it."""

from specrt.errors import SpecrtError


def bind_socket(host: str, port: int):
    """A listening socket on host:port, or a SpecrtError that says what holds the port and what
    to change. Binding before the server starts means "serving on ..." is only said once true."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            holder = _port_holder(port)
            raise SpecrtError(
                f"port {port} on {host} is already in use{f' by {holder}' if holder else ''}; stop that process "
                f"or choose another port with --port"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
            raise SpecrtError(
                f"cannot listen on {host}: no such address on this machine; use --host 127.0.0.1 or 0.0.0.0"
            ) from None
        raise SpecrtError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --host or --port") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _port_holder(port: int) -> str | None:
    """'process NAME (pid N)' listening on `port`, read from /proc (Linux; None elsewhere or when unreadable)."""
    import os
    from pathlib import Path

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                    inodes.add(f[9])
        except (OSError, ValueError, IndexError):
            continue
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    return f"process {name} (pid {pid})"
        except OSError:
            continue
    return None
