"""Comms between processes of one host over a Unix socket.

An mpi:// listener also listens on a Unix socket named after its address, in
Linux's abstract namespace, and a connector tries that name first: a message
is delivered sooner, and with less CPU, than over TCP's loopback.  A
network namespace has its own abstract names, so a name found is a listener
on this host; ``SO_PEERCRED`` tells whether it runs as this user.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys

import dask
from tornado.tcpserver import TCPServer

from distributed.comm.mpi_stream import SocketStream
from distributed.comm.tcp import MAX_BUFFER_SIZE

logger = logging.getLogger(__name__)


def widen(sock: socket.socket) -> None:
    """Let a Unix socket hold as much as TCP's does by default (4 MiB): with
    Linux's default, messages of some hundred KB took longer than over TCP
    (docs/mpi-design.rst, "Comms on one host").  Linux caps it at
    ``net.core.wmem_max``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 2**20)


def _name(address: str) -> str:
    """The Unix socket of the mpi:// listener at ``address`` (host:port), in
    Linux's abstract namespace: a network namespace's own, so a name found is
    a listener on this host"""
    return "\0distributed-mpi:" + address


def connect(address: str) -> SocketStream | None:
    """A stream to the listener at ``address`` over its Unix socket, if it is
    on this host and runs as this user; else None"""
    if not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        # Completes at once, or fails: no such listener, or its backlog is full
        sock.connect(_name(address))
        _, uid, _ = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
        if uid != os.getuid():
            raise PermissionError("the listener runs as another user")
        widen(sock)
    except OSError:
        sock.close()
        return None
    return SocketStream(sock)


def serve(address: str, handle_stream) -> TCPServer | None:
    """A server of the Unix socket of the mpi:// listener at ``address``
    (host:port), for connections from this host, which ``handle_stream``
    takes; None where there is none (not Linux, or a listener of this
    address in another process)"""
    if not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_name(address))
        sock.listen(int(dask.config.get("distributed.comm.socket-backlog")))
    except OSError as e:
        logger.debug("mpi://%s listens on TCP only: %s", address, e)
        sock.close()
        return None
    sock.setblocking(False)
    server = TCPServer(max_buffer_size=MAX_BUFFER_SIZE)
    server.handle_stream = handle_stream
    server.add_sockets([sock])
    return server
