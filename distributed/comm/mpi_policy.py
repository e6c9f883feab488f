"""Which routes two processes may use for their large frames.

Every rule about a pair of processes is here, asked of the peer that a
handshake describes (``mpi_hello.Peer``) and of this process:

- whether the two may open an MPI channel at all (:func:`mpi_refusal`):
  not where the MPI library cannot connect them, or is known to crash doing
  so, nor between hosts without an RDMA network (``across-hosts``);
- which way device frames travel between them (:func:`gpu_path`);
- whether this process copies their host frames straight from the peer's
  memory (:func:`copies_from`), and their device frames from the peer's GPU
  memory (:func:`ipc_from`).

What the two processes learnt of each other (a channel that failed, MPICH's
table of jobs) is the channel registry's, which asks these rules first.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import socket
from typing import TYPE_CHECKING

from distributed.comm import mpi_gpu, mpi_ipc, mpi_library, mpi_startup
from distributed.comm.mpi_liveness import LocalPeer, pid_namespace

if TYPE_CHECKING:
    from distributed.comm.mpi_hello import Peer

logger = logging.getLogger(__name__)


def mpi_refusal(peer: Peer) -> str | None:
    """Why this process may not open an MPI channel to ``peer``; None if it
    may.  Each refusal is logged once, where a user should hear of it."""
    if mpi_startup.mpi_stopped() or peer.stopped:
        return "MPI is stopped at one end"
    if open_mpi_apart(peer):
        _warn_open_mpi_apart()
        return "Open MPI cannot connect processes of different jobs"
    if other_job(peer) and not (mpi_library.no_ports() is None and peer.ports):
        if mpi_library.no_ports():
            _warn_no_ports(mpi_library.no_ports())
        return "MPI cannot open ports at one end"
    if tcp_between_hosts(peer):
        _log_tcp_between_hosts(mpi_startup.config("across-hosts"))
        return "across-hosts keeps frames between hosts on TCP"
    if jobs_apart_across_hosts(peer):
        _warn_jobs_apart()
        return "ranks of two MPICH jobs on different hosts"
    if pid_isolated(peer):
        return "the peer runs in another PID namespace of this host"
    return None


def open_mpi_apart(peer: Peer) -> bool:
    """Whether the peer is a process of another Open MPI job, or of none:
    Open MPI cannot connect the two without its ``ompi-server`` (it would
    hang in MPI_Comm_connect rather than fail), so they talk over TCP alone"""
    return mpi_startup.library().startswith("Open MPI") and other_job(peer)


def other_job(peer: Peer) -> bool:
    """Whether the peer is another process, not a rank of this process's
    job: the two meet with MPI ports (accept and connect)"""
    return peer.process != mpi_startup.process_id() and not same_world(peer)


def tcp_between_hosts(peer: Peer) -> bool:
    """Whether the peer runs on another host, and its frames are to travel
    over TCP (setting ``across-hosts``).  Without an RDMA network at both
    ends MPI runs over TCP too (MPICH: UCX's tcp transport), slower than the
    comm's own connection (docs/benchmarks.rst, "Across hosts")"""
    setting = across_hosts()
    if setting == "mpi" or not other_host(peer):
        return False
    return setting == "tcp" or not (rdma() and peer.rdma)


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
def rdma(sysfs: str = "/sys") -> str | None:
    """The RDMA network up on this host (what MPI uses between hosts instead
    of TCP), named by its kind and device: a port up in
    ``/sys/class/infiniband`` (InfiniBand, RoCE, Omni-Path, EFA), or an HPE
    Slingshot NIC (``/sys/class/cxi``, libfabric's cxi provider); None
    without one"""
    for path in sorted(glob.glob(f"{sysfs}/class/infiniband/*/ports/*/state")):
        try:
            with open(path) as f:
                if "ACTIVE" in f.read():
                    return f"infiniband {path.split('/')[-4]}"
        except OSError:
            pass
    cxi = sorted(glob.glob(f"{sysfs}/class/cxi/cxi*"))
    return f"slingshot {os.path.basename(cxi[0])}" if cxi else None


def other_host(peer: Peer) -> bool:
    """Whether the peer runs on another host than this process"""
    return peer.host != socket.gethostname()


def jobs_apart_across_hosts(peer: Peer) -> bool:
    """Whether the peer is a rank of another MPICH job of several ranks, on
    another host, and this process too.  One of the two would have to call
    MPI_Comm_connect, which (MPICH 5.0, UCX: ``MPIDI_UCX_dynamic_send``)
    releases its send request twice when the send waits for UCX to connect,
    as it does between hosts: MPI_Finalize then reports a request as leaked,
    reading a stale one, and may crash.  A process alone in its job leaves
    MPI_Finalize out; a rank of a bigger job cannot, so the two talk over
    TCP alone"""
    mine, theirs = mpi_startup.world(), peer.world
    return (
        mpi_startup.library().startswith("MPICH")
        and mine is not None
        and theirs is not None
        and theirs[0] != mine[0]
        and other_host(peer)
    )


def pid_isolated(peer: Peer) -> bool:
    """Whether the peer runs on this host in another PID namespace (a
    container sharing the host's name): MPICH 5.0 with UCX crashes opening a
    channel to it, so the two talk over TCP alone"""
    return not other_host(peer) and peer.pid_namespace != pid_namespace()


def same_world(peer: Peer) -> bool:
    """Whether the peer is another rank of this process's mpiexec job"""
    mine, theirs = mpi_startup.world(), peer.world
    return mine is not None and theirs is not None and theirs[0] == mine[0]


def accepts(peer: Peer) -> bool:
    """Whether this process accepts, and the peer connects, as their channel
    opens: a process alone in its job connects to a rank of a bigger one
    (after a connect to another host MPICH's MPI_Finalize can crash, and only
    a process alone in its job may leave it out); else the process whose id
    sorts first accepts"""
    alone, peer_alone = mpi_startup.world() is None, peer.world is None
    if alone != peer_alone:
        return peer_alone
    return mpi_startup.sorts_first(mpi_startup.process_id(), peer.process)


def gpu_path(peer: Peer | None) -> str | None:
    """How device frames travel to ``peer`` (None: to this process itself),
    which both ends work out alike: "direct" where both MPI libraries are
    CUDA-aware, "staged" through host memory where not, None where one end
    has no GPU (its frames are host frames)"""
    mine = mpi_gpu.hello(mpi_startup.get_mpi())
    return mpi_gpu.path(mine, mine if peer is None else peer.gpu)


def copies_from(peer: Peer) -> bool:
    """Whether this process will copy the large host frames that ``peer``
    writes to it straight from its memory (``local-copy``): on this host,
    where the kernel lets it read the peer's memory"""
    if not mpi_startup.config("local-copy"):
        return False
    local = LocalPeer.find(peer)
    return local is not None and local.readable()


def ipc_from(peer: Peer) -> bool:
    """Whether this process will copy the device frames that ``peer`` writes
    to it from the peer's GPU memory (``device-ipc``, CUDA IPC): both have a
    GPU and say they may, on this host and in one PID namespace (legacy IPC
    handles do not cross them), this process may map the peer's GPU's memory
    (its own, or one it sees and can access as a peer; not where each sees
    its own alone: Slurm's ``--gpus-per-task``), and mapping the
    peer's memory did not fail before (MIG, containers).  The host backend
    copies with ``process_vm_readv``: the kernel must let it read the peer's
    memory."""
    mine = mpi_gpu.hello(mpi_startup.get_mpi())
    if not (mine and mine["ipc"] and peer.gpu and peer.gpu.get("ipc") is True):
        return False
    theirs = peer.gpu.get("devices")
    if not theirs or theirs[0] not in mine["devices"]:
        return False
    if peer.process in mpi_ipc.unmappable:
        return False
    local = LocalPeer.find(peer)
    if local is None:
        return False
    return mpi_startup.config("device-backend") != "host" or local.readable()


@functools.cache
def _warn_open_mpi_apart() -> None:
    logger.warning(
        "Open MPI cannot connect processes of different mpiexec jobs, nor "
        "processes not started by mpiexec (a nanny's worker process is not): "
        "comms between them move their data over TCP. Start them all in one "
        "mpiexec job, workers with --no-nanny (dask-mpi: --worker-class "
        "distributed.Worker), or use MPICH"
    )


@functools.cache
def _warn_no_ports(why: str) -> None:
    logger.warning(
        "%s: comms between this process and processes of other mpiexec jobs, "
        "or started without mpiexec (as a nanny's worker is), move their data "
        "over TCP",
        why,
    )


@functools.cache
def _log_tcp_between_hosts(setting: str) -> None:
    logger.info(
        "Frames between this process and processes on other hosts travel over "
        "TCP (distributed.comm.mpi.across-hosts: %s; auto uses MPI between "
        "hosts that both have an RDMA network up: without one, MPI runs over "
        "TCP too, and more slowly)",
        setting,
    )


@functools.cache
def _warn_jobs_apart() -> None:
    logger.warning(
        "MPICH cannot connect ranks of different mpiexec jobs of several "
        "ranks on different hosts without crashing at exit: comms between "
        "them move their data over TCP. Start them in one mpiexec job, or "
        "each worker alone (mpiexec -n 1, or with a nanny)"
    )
