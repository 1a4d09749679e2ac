"""Joining a Ray cluster, for ``accel serve --ray`` and ``accel bench --ray`` (docs/SCALE.md)."""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["connect", "import_ray", "CONNECT_TIMEOUT_S"]

#: Seconds an address gets to accept a connection before :func:`connect` gives up.
CONNECT_TIMEOUT_S = 10.0


def import_ray(command: str) -> Any:
    """The ``ray`` module, or an ImportError that names the extra to install."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"{command} needs the 'ray' extra: pip install 'accel[ray]' ({err})") from None
    return ray


def connect(address: str | None, **init: Any) -> None:
    """Join the Ray cluster at ``address`` (``HOST:PORT``, ``ray://HOST:PORT`` or ``auto``;
    None: ``$RAY_ADDRESS``, else start a local cluster with ``init``'s ``ray.init`` options).
    Does nothing when this process is connected already. An address that does not accept a
    connection within :data:`CONNECT_TIMEOUT_S` seconds is a ``ValueError`` naming it, before
    ``ray.init`` (which would retry for minutes)."""
    ray = import_ray("--ray")
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as err:
            raise ValueError(f"cannot reach the Ray cluster at {address}: {err}") from None
    try:
        ray.init(address=address, **init)
    except ConnectionError as err:
        raise ValueError(f"cannot join the Ray cluster at {address}: {err}") from None
