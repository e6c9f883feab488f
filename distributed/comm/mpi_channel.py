"""MPI channels: one MPI communicator per pair of processes.

Two processes get a channel the first time one connects to the other.  Ranks
of one ``mpiexec`` job make a communicator of the two of them with
``MPI_Comm_create_group`` (only they take part); processes of different jobs,
or started without ``mpiexec``, use ``MPI_Comm_accept``/``MPI_Comm_connect``
over ``MPI_COMM_SELF``.  Neither needs a collective call over all ranks or
costs anything at start-up.  Every later comm between the same two processes,
in either direction, reuses the channel; comms are kept apart by tags.  A
process talks to itself over a duplicate of ``MPI_COMM_SELF``.

These calls block, and MPICH holds its global lock while they wait, so a
process in one can do no other MPI call: running them in helper threads would
not help.  Instead they run on the event loop, under rules that rule out any
cycle of processes waiting for each other, and that keep MPICH alive when a
peer dies half-way:

- of two processes, the one whose ``process_id()`` sorts first accepts; a
  process waits in accept only for peers that sort after it;
- the acceptor enters MPI first, as soon as it has sent its port name over
  TCP, and gives up after ``channel-timeout``;
- so the connector connects only to an acceptor that is waiting: at once on
  reading the port, and only if the acceptor is still there.  MPICH with UCX
  crashes in a connect to a process that is gone;
- every port has a tag of its own (see :func:`open_port`);
- after a channel failed to open, whichever end failed, the two processes
  do not try again (:func:`give_up_on`): a second failure would block both
  for as long, and two processes that keep failing to connect, each blocked
  while the other tries, would block each other for good.

MPI is initialised by :func:`start_mpi`, on first use of an ``mpi://`` address,
never on ``import distributed``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import functools
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
import uuid
import weakref

import dask
import psutil
from dask.utils import parse_bytes

from distributed.comm import mpi_pmi

logger = logging.getLogger(__name__)

_init: concurrent.futures.Future | None = None
_process: tuple[int, str] | None = None
_lock = threading.Lock()
_channels: dict[str, Channel] = {}  # by channel id
_latest: dict[str, Channel] = {}  # by peer process
_addresses: dict[str, str] = {}  # peer process by listening address
_unreachable: set[str] = set()  # peer processes MPI could not connect to

# Which end of MPI_Comm_accept/connect a process was; each end allocates tags
# from its own half of the tag space, so both can add comms to one channel.
ACCEPTOR, CONNECTOR = 0, 1

# Warn when MPI_Init waits this long for the other ranks of an mpiexec job
INIT_WARNING_DELAY = 10


def _initialize():
    from mpi4py import MPI

    if not MPI.Is_initialized():
        # mpi4py would hold the GIL in MPI_Init and MPI_Finalize; ctypes lets
        # go of it, so this process goes on while MPI_Init waits for the
        # other ranks, and a process manager thread (mpi_pmi) can answer.
        provided = ctypes.c_int()
        init_thread = ctypes.CDLL(MPI.__file__).MPI_Init_thread
        failed = init_thread(None, None, MPI.THREAD_MULTIPLE, ctypes.byref(provided))
        mpi_pmi.initialized()
        if failed:
            raise RuntimeError("MPI_Init_thread failed")
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        atexit.register(_finalize, MPI)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "The mpi:// transport needs MPI_THREAD_MULTIPLE, but MPI was "
            f"initialised with thread level {MPI.Query_thread()}. Do not "
            "initialise MPI with a lower thread level before using mpi://."
        )
    return MPI


def _finalize(MPI) -> None:
    if MPI.Is_finalized():
        return
    _drain(MPI)
    mpi_pmi.finalizing()
    ctypes.CDLL(MPI.__file__).MPI_Finalize()
    mpi_pmi.finalized()


def _drain(MPI, quiet: float = 0.01, limit: float = 1.0) -> None:
    """Receive what peers sent to comms closed here (their CLOSE heads), which
    UCX would print a warning about at exit, until nothing came for ``quiet``
    seconds: a probe on one channel may bring in the message of another."""
    status = MPI.Status()
    start = last = time.monotonic()
    while time.monotonic() - last < quiet and time.monotonic() - start < limit:
        for channel in list(_channels.values()):
            while message := channel.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                nbytes = status.Get_count(MPI.BYTE)
                if nbytes > 65536:  # may wait for a sender that is gone
                    break
                message.Recv(bytearray(nbytes))
                last = time.monotonic()


def start_mpi() -> concurrent.futures.Future:
    """Initialise MPI in a helper thread, once; a future for ``mpi4py.MPI``.

    Under ``mpiexec``, MPI_Init returns only once every rank of the job has
    called it.  Ranks use mpi:// at different times (workers wait for the
    scheduler file that the scheduler writes once it listens), so nobody may
    block on it: listeners listen while MPI starts.
    """
    global _init
    with _lock:
        if _init is None:
            try:
                import mpi4py
            except ImportError as e:
                raise ImportError(
                    "The mpi:// transport needs mpi4py and an MPI library: "
                    "pip install mpi4py mpich (or `pip install distributed[mpi]`)"
                ) from e
            if "mpi4py.MPI" not in sys.modules:
                mpi4py.rc.initialize = False  # _initialize does it
            from mpi4py import MPI

            # Now, not in the helper thread: a nanny may start its worker
            # process next, and that inherits the environment
            mpi_pmi.prepare_environment(MPI)
            if not MPI.Is_initialized():
                _configure_ucx()
            _init = concurrent.futures.Future()
            threading.Thread(target=_run_init, args=(_init,), name="MPI-init").start()
    return _init


def _configure_ucx() -> None:
    """UCX copies a message from a peer on this host in segments, one per
    call into MPI; a chunk in one segment is copied within one call, after
    we checked that its sender lives (see ``distributed.comm.mpi_liveness``)"""
    os.environ.setdefault("UCX_CMA_SEG_SIZE", str(parse_bytes(config("chunk-size"))))


def _run_init(fut: concurrent.futures.Future) -> None:
    try:
        fut.set_result(_initialize())
    except BaseException as e:
        fut.set_exception(e)


async def mpi_ready():
    """``mpi4py.MPI``, once MPI is initialised"""
    fut = asyncio.wrap_future(start_mpi())
    done, _ = await asyncio.wait([fut], timeout=INIT_WARNING_DELAY)
    if not done:
        logger.warning(
            "MPI_Init has been waiting for %ds: under mpiexec it returns once "
            "every rank of the job called it, so every rank must use mpi:// "
            "(or initialise MPI itself)",
            INIT_WARNING_DELAY,
        )
    return await fut


def get_mpi():
    """``mpi4py.MPI``; MPI must have been started with :func:`start_mpi`"""
    return start_mpi().result()


def process_id() -> str:
    """A name for this process, unique across hosts, jobs and forks"""
    global _process
    if _process is None or _process[0] != os.getpid():
        pid = os.getpid()
        _process = (pid, f"{socket.gethostname()}/{pid}/{uuid.uuid4().hex}")
    return _process[1]


def config(key: str):
    """The ``distributed.comm.mpi`` setting ``key``"""
    return dask.config.get(f"distributed.comm.mpi.{key}")


@functools.cache
def world() -> tuple[str, int] | None:
    """The mpiexec job of this process and its rank there; None when it is
    alone in its MPI_COMM_WORLD (a plain ``python``, or ``mpiexec -n 1``).
    Every handshake asks, and finding Hydra's proxy walks the process tree:
    it is worked out once."""
    comm = get_mpi().COMM_WORLD
    if comm.size == 1:
        return None
    env = os.environ
    if "PMIX_NAMESPACE" in env:  # Open MPI, and launchers speaking PMIx
        job = env["PMIX_NAMESPACE"]
    elif "SLURM_STEP_ID" in env:
        job = f"slurm/{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    else:  # ranks on one host share their job's proxy (Hydra)
        job = f"{socket.gethostname()}/{_launcher_pid()}"
    return f"{job}/{comm.size}", comm.rank


def _launcher_pid() -> int:
    """Hydra's proxy that started this process, perhaps through a wrapper
    script (``mpiexec -n 4 ./run.sh``); else the parent process"""
    for parent in psutil.Process().parents():
        with contextlib.suppress(psutil.Error):
            if parent.name().startswith("hydra_pmi_prox"):
                return parent.pid
    return os.getppid()


def library() -> str:
    """The MPI library and version; peers must agree on it"""
    name, version = get_mpi().get_vendor()
    return f"{name} {'.'.join(map(str, version))}"


class Channel:
    """An MPI communicator between this process and one peer process"""

    def __init__(self, id: str, peer: str, role: int):
        self.id = id
        self.peer = peer  # process_id() of the peer
        self.role = role  # which end of accept/connect this process was
        self.comm = None
        self.rank = 0  # the peer's rank in comm
        self.comms: weakref.WeakSet = weakref.WeakSet()  # mpi:// comms using it
        self._next = 0
        MPI = get_mpi()
        self._ntags = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1) // 4

    def allocate_tags(self) -> int:
        """A base tag for a new comm: the listening end receives on ``base``
        and sends on ``base + 1``"""
        with _lock:
            n, self._next = self._next, (self._next + 1) % self._ntags
        return 4 * n + 2 * self.role

    def accept(self, port: str, timeout: float) -> None:
        """Open the channel; blocks until the peer connects to ``port``, or
        for ``timeout`` seconds (MPICH honours it; a peer that died in
        between would block us forever otherwise)"""
        info = _timeout_info(timeout)
        try:
            self._opened(get_mpi().COMM_SELF.Accept(port, info))
        finally:
            info.Free()
            close_port(port)

    def connect(self, port: str, timeout: float) -> None:
        """Open the channel with a peer waiting in accept, or give up
        after ``timeout`` seconds"""
        info = _timeout_info(timeout)
        try:
            self._opened(get_mpi().COMM_SELF.Connect(port, info))
        finally:
            info.Free()

    def join(self, peer_rank: int) -> None:
        """Open the channel with a rank of this process's own mpiexec job:
        a communicator of the two, made by both of them alone, without
        MPICH's machinery for connecting separate jobs"""
        world = get_mpi().COMM_WORLD
        ranks = sorted([world.rank, peer_rank])
        group = world.group.Incl(ranks)
        try:
            # Both ends derive the same tag, distinct for concurrent calls
            comm = world.Create_group(group, int(self.id[:4], 16) % 32768)
        finally:
            group.Free()
        self._opened(comm, ranks.index(peer_rank))

    def _opened(self, comm, rank: int = 0) -> None:
        self.comm = comm
        self.rank = rank
        with _lock:
            _channels[self.id] = self
            _latest[self.peer] = self

    def __repr__(self):
        return f"<Channel {self.id} to {self.peer}>"


def _timeout_info(timeout: float):
    info = get_mpi().Info.Create()
    info.Set("timeout", str(max(1, round(timeout))))
    return info


def self_channel() -> Channel:
    """The channel of this process to itself"""
    me = process_id()
    channel = _channels.get(me)
    if channel is None:
        channel = Channel(me, me, ACCEPTOR)
        channel._opened(get_mpi().COMM_SELF.Dup())
    return channel


def remember_address(address: str, peer: str) -> None:
    _addresses[address] = peer


def peer_at(address: str) -> str | None:
    """The process last met at the listening ``address``, if any"""
    return _addresses.get(address)


def reachable(peer: str | None) -> bool:
    """Whether to try MPI with process ``peer``"""
    return peer not in _unreachable


def give_up_on(channel: Channel) -> None:
    """After MPI failed to open ``channel``, here or at the other end, or
    stopped delivering on it: its peer is not worth another try, which would
    block this process for ``channel-timeout`` again, or lose messages"""
    with _lock:
        _unreachable.add(channel.peer)
        opened = _channels.pop(channel.id, None) is not None  # here, at least
        if opened:
            _latest.pop(channel.peer, None)
    if opened:
        with contextlib.suppress(get_mpi().Exception):
            channel.comm.Free()


def find_channel(id: str | None, peer: str) -> Channel | None:
    """The channel ``id``, else any open channel to process ``peer``"""
    if peer == process_id():
        return self_channel()
    channel = _channels.get(id) if id else None
    if channel is not None and channel.peer == peer:
        return channel
    return _latest.get(peer)


def new_channel(peer: str, id: str | None = None) -> Channel:
    """A channel to open to process ``peer``, which this process accepts
    if its ``process_id()`` sorts first"""
    role = ACCEPTOR if process_id() < peer else CONNECTOR
    return Channel(id or uuid.uuid4().hex, peer, role)


def open_port() -> str:
    """A port to accept one peer on, with a tag no other port is likely to
    have.  MPICH (5.0, UCX netmod) gives every port of a process the lowest
    free tag, 0 unless several are open, and matches the messages of accept
    and connect by tag alone; an accept or connect that times out leaves its
    receive posted, into memory it has freed, and the next one to use that
    tag, in any pair of processes, would complete it instead of its own."""
    port = get_mpi().Open_port()
    tag = 1 + secrets.randbelow(2**28 - 1)  # forks share random's state
    unique = _MPICH_PORT_TAG.sub(f"tag#{tag}$", port, 1)
    _ports[unique] = port
    return unique


def close_port(port: str) -> None:
    get_mpi().Close_port(_ports.pop(port, port))


_MPICH_PORT_TAG = re.compile(r"^tag#\d+\$")
_ports: dict[str, str] = {}  # the ports of open_port(), as MPI opened them
