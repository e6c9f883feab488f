"""The handshake of an mpi:// comm, on its TCP connection.

Each message is the magic ``DASK-MPI``, a length (u32) and that many bytes of
JSON.  The connector says hello (who it is, which MPI library, which
``mpiexec`` job and rank, whether it has a GPU and a CUDA-aware MPI); the
listener answers with its own hello, or with why the two cannot talk over MPI.
A hello that says ``"open"``, naming the process it is meant for, asks for
an MPI channel instead of a comm (see ``distributed.comm.mpi_channel``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import struct

from distributed.comm import mpi_gpu, mpi_library, mpi_policy, mpi_startup
from distributed.comm.core import FatalCommClosedError
from distributed.comm.mpi_hello import PROTOCOL, Peer
from distributed.comm.mpi_liveness import beacon, hung_up, pid_namespace

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!8sI")  # before each message: MAGIC, its length
MAGIC = b"DASK-MPI"
MAX_SIZE = 64 * 1024


class Refused(ValueError):
    """A peer that cannot talk to this process over MPI"""


@functools.cache  # once for each message
def log_refusal(message: str) -> None:
    """Log why MPI cannot connect two processes, once: a refused worker
    retries for good, saying only that it waits for its scheduler"""
    logger.warning(message)


async def send(stream, msg: dict) -> None:
    body = json.dumps(msg).encode()
    await stream.write(HEADER.pack(MAGIC, len(body)) + body)


async def recv(stream) -> dict:
    """The peer's next handshake message; FatalCommClosedError if what it
    sent is not one: it does not speak mpi://, and will not when asked again"""
    magic, size = HEADER.unpack(await stream.read_bytes(HEADER.size))
    if magic != MAGIC or size > MAX_SIZE:
        raise FatalCommClosedError(
            "the peer did not answer with an mpi:// handshake: is its address "
            "an mpi:// address?"
        )
    try:
        msg = json.loads(await stream.read_bytes(size))
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        raise FatalCommClosedError("the peer sent a malformed mpi:// handshake")
    return msg


async def exchange(stream, mine: dict, may_open=None) -> Peer:
    """Say hello (``mine``) and hear the peer's: its hello, or ``Refused`` (listening)
    or ``FatalCommClosedError`` (connecting) if the two cannot talk over MPI.
    A listener gives ``may_open(peer)``: whether it opens a channel to a peer
    that asks for one; the ``open`` of the peer it returns then says
    whether it does."""
    listening = may_open is not None
    if not listening:
        await send(stream, mine)
    hello = await recv(stream)
    try:
        problem = hello.get("error")
        peer = None if problem else Peer.parse(hello, mpi_startup.library())
    except (ValueError, TypeError) as e:
        problem = str(e)
    if listening and problem:
        await send(stream, {"error": problem})
        raise Refused(problem)
    if problem:
        raise FatalCommClosedError(problem)
    if listening:
        if peer.open is not None:
            # Not for a process that listened at this address before (a
            # worker restarted on its port): it would wait in MPI for nobody
            meant = hello["open"] == mpi_startup.process_id()
            peer = dataclasses.replace(peer, open=meant and may_open(peer))
        await send(stream, {**mine, "open": bool(peer.open)})
    return peer


def hello() -> dict:
    mpi_policy.across_hosts()  # a bad setting fails every handshake, and says why
    return {
        "protocol": PROTOCOL,
        "process": mpi_startup.process_id(),
        "library": mpi_startup.library(),
        "world": mpi_startup.world(),
        "beacon": beacon(),
        "pid_namespace": pid_namespace(),
        "rdma": mpi_policy.rdma(),
        "stopped": mpi_startup.mpi_stopped() is not None,  # calls MPI no more
        "ports": mpi_library.no_ports() is None,
        "gpu": mpi_gpu.hello(mpi_startup.get_mpi()),
    }


def peer_gone(stream) -> bool:
    """Whether the peer closed the TCP connection, without reading from it"""
    return stream.closed() or hung_up(stream.socket)
