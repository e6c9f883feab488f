"""The handshake of an mpi:// comm, on its TCP connection.

Each message is the magic ``DASK-MPI``, a length (u32) and that many bytes of
JSON.  The connector says hello (who it is, which MPI library, which
``mpiexec`` job and rank, whether it has a GPU and a CUDA-aware MPI); the
listener answers with its own hello, or with why the two cannot talk over MPI.
A hello that says ``"open"`` asks for an MPI channel instead of a comm (see
``distributed.comm.mpi_channel``).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import socket
import struct

from distributed.comm import mpi_gpu, mpi_startup
from distributed.comm.core import FatalCommClosedError
from distributed.comm.mpi_liveness import beacon, hung_up, pid_namespace

logger = logging.getLogger(__name__)

HEADER = struct.Struct("!8sI")  # before each message: MAGIC, its length
MAGIC = b"DASK-MPI"
PROTOCOL = 8  # both ends must speak the same
MAX_SIZE = 64 * 1024


class Refused(ValueError):
    """A peer that cannot talk to this process over MPI"""


_refusals: set[str] = set()  # logged already


def log_refusal(message: str) -> None:
    """Log why MPI cannot connect two processes, once: a refused worker
    retries for good, saying only that it waits for its scheduler"""
    if message not in _refusals:
        _refusals.add(message)
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


async def exchange(stream, mine: dict, may_open=None) -> dict:
    """Say hello (``mine``) and hear the peer's: its hello, or ``Refused`` (listening)
    or ``FatalCommClosedError`` (connecting) if the two cannot talk over MPI.
    A listener gives ``may_open(hello)``: whether it opens a channel to a peer
    that asks for one; the ``"open"`` of the hello it returns then says
    whether it does."""
    listening = may_open is not None
    if not listening:
        await send(stream, mine)
    peer = await recv(stream)
    problem = peer.get("error") or incompatibility(peer)
    if listening and problem:
        await send(stream, {"error": problem})
        raise Refused(problem)
    if problem:
        raise FatalCommClosedError(problem)
    if listening:
        if "open" in peer:
            peer["open"] = bool(peer["open"]) and may_open(peer)
        await send(stream, {**mine, "open": bool(peer.get("open"))})
    return peer


def hello() -> dict:
    across_hosts()  # a bad setting fails every handshake, and says why
    return {
        "protocol": PROTOCOL,
        "process": mpi_startup.process_id(),
        "library": mpi_startup.library(),
        "world": mpi_startup.world(),
        "beacon": beacon(),
        "pid_namespace": pid_namespace(),
        "rdma": rdma(),
        "stopped": mpi_startup.mpi_stopped() is not None,  # calls MPI no more
        "gpu": mpi_gpu.hello(mpi_startup.get_mpi()),
    }


def incompatibility(peer: dict) -> str | None:
    """Why a peer with this hello cannot talk to us over MPI, if it cannot"""
    if peer.get("protocol") != PROTOCOL:
        return (
            f"peer speaks mpi:// protocol {peer.get('protocol')!r}, this process "
            f"{PROTOCOL}: use the same version of distributed everywhere"
        )
    if peer.get("library") != mpi_startup.library():
        return (
            f"peer uses MPI library {peer.get('library')!r}, this process "
            f"{mpi_startup.library()!r}: all processes of a cluster on mpi:// "
            "must use the same MPI library"
        )
    if not isinstance(peer.get("process"), str):
        return "peer did not say which process it is"
    return None


def open_mpi_apart(peer: dict) -> bool:
    """Whether the peer is a process of another Open MPI job, or of none:
    Open MPI cannot connect the two without its ``ompi-server`` (it would
    hang in MPI_Comm_connect rather than fail), so they talk over TCP alone"""
    return (
        mpi_startup.library().startswith("Open MPI")
        and peer["process"] != mpi_startup.process_id()
        and not same_world(peer)
    )


def tcp_between_hosts(peer: dict) -> bool:
    """Whether the peer runs on another host, and its frames are to travel
    over TCP (setting ``across-hosts``).  Without an RDMA network at both
    ends MPI runs over TCP too (MPICH: UCX's tcp transport), slower than the
    comm's own connection (docs/benchmarks.rst, "Across hosts")"""
    setting = across_hosts()
    if setting == "mpi" or not _other_host(peer):
        return False
    return setting == "tcp" or not (rdma() and peer.get("rdma") is True)


def across_hosts() -> str:
    """The setting ``across-hosts``: auto, mpi or tcp"""
    setting = mpi_startup.config("across-hosts")
    if setting not in ("auto", "mpi", "tcp"):
        raise ValueError(
            "distributed.comm.mpi.across-hosts must be auto, mpi or tcp, "
            f"not {setting!r}"
        )
    return setting


@functools.cache
def rdma() -> bool:
    """Whether this host has an RDMA network port up (InfiniBand, RoCE,
    Omni-Path, EFA: what MPI uses between hosts instead of TCP)"""
    for path in glob.glob("/sys/class/infiniband/*/ports/*/state"):
        try:
            with open(path) as f:
                if "ACTIVE" in f.read():
                    return True
        except OSError:
            pass
    return False


def _other_host(peer: dict) -> bool:
    """Whether the host named in the peer's process id is not this one"""
    return peer["process"].split("/", 1)[0] != socket.gethostname()


def jobs_apart_across_hosts(peer: dict) -> bool:
    """Whether the peer is a rank of another MPICH job of several ranks, on
    another host, and this process too.  One of the two would have to call
    MPI_Comm_connect, which (MPICH 5.0, UCX: ``MPIDI_UCX_dynamic_send``)
    releases its send request twice when the send waits for UCX to connect,
    as it does between hosts: MPI_Finalize then reports a request as leaked,
    reading a stale one, and may crash.  A process alone in its job leaves
    MPI_Finalize out; a rank of a bigger job cannot, so the two talk over
    TCP alone"""
    mine, theirs = mpi_startup.world(), peer.get("world")
    return (
        mpi_startup.library().startswith("MPICH")
        and mine is not None
        and theirs is not None
        and theirs[0] != mine[0]
        and _other_host(peer)
    )


def pid_isolated(peer: dict) -> bool:
    """Whether the peer runs on this host in another PID namespace (a
    container sharing the host's name): MPICH 5.0 with UCX crashes opening a
    channel to it, so the two talk over TCP alone"""
    return not _other_host(peer) and peer.get("pid_namespace") != pid_namespace()


def job(peer: dict) -> str:
    """The mpiexec job of the peer: the process itself when alone in it"""
    world = peer.get("world")
    return world[0] if world else peer["process"]


def same_world(peer: dict) -> bool:
    """Whether the peer is another rank of this process's mpiexec job"""
    mine, theirs = mpi_startup.world(), peer.get("world")
    return mine is not None and theirs is not None and theirs[0] == mine[0]


def peer_gone(stream) -> bool:
    """Whether the peer closed the TCP connection, without reading from it"""
    return stream.closed() or hung_up(stream.socket)
