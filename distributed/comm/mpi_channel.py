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

A channel is freed (:func:`release`) once no comm uses it: its peer left, or
the two stopped talking (a new comm then opens a new channel).  MPICH itself
gives back little of a connection (about 50-70 KB stay with each process,
freed or not), and aborts a process on the 1024th distinct job it connects to
(its table of jobs, ``MPIR_Worlds``, never shrinks): past :data:`MAX_JOBS`,
processes of new jobs are met over TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
import threading
import time
import uuid
import weakref

from distributed.comm.mpi_startup import before_finalize, get_mpi, process_id

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_channels: dict[str, Channel] = {}  # open channels, by channel id
_latest: dict[str, Channel] = {}  # the last channel opened, by peer process
_addresses: dict[str, str] = {}  # peer process, by its listening address
_unreachable: set[str] = set()  # peer processes MPI could not connect to
_ports: dict[str, str] = {}  # the ports of open_port(), as MPI opened them
_jobs: set[str] = set()  # the jobs of the peers met with accept/connect
_freeing: dict[str, Channel] = {}  # released channels, freed a little later

# A released channel is freed this many seconds later: a peer that closed a
# comm at the same time as this process sends a last message (its CLOSE head)
FREE_AFTER = 10

# Below MPICH's 1024 jobs per process, with some to spare
MAX_JOBS = 1000

_MPICH_PORT_TAG = re.compile(r"^tag#\d+\$")  # the tag in an MPICH port name

# Which end of MPI_Comm_accept/connect a process was; each end allocates tags
# from its own half of the tag space, so both can add comms to one channel.
ACCEPTOR, CONNECTOR = 0, 1


class Channel:
    """An MPI communicator between this process and one peer process"""

    def __init__(self, id: str, peer: str, role: int):
        self.id = id
        self.peer = peer  # process_id() of the peer
        self.role = role  # which end of accept/connect this process was
        self.comm = None
        self.rank = 0  # the peer's rank in comm
        self.comms: weakref.WeakSet = weakref.WeakSet()  # mpi:// comms using it
        MPI = get_mpi()
        self._ntags = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1) // 4
        # MPI reuses the context of a freed communicator for a new one, which
        # then matches the messages left unreceived on the old one (comms
        # closed before reading all): tags that start anywhere do not meet
        self._next = secrets.randbelow(self._ntags)

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
    """The channel ``id``, else a channel to process ``peer`` with a comm open
    at both ends (one whose comms the peer closed it may have freed)"""
    if peer == process_id():
        return self_channel()
    channel = _channels.get(id) if id else None
    if channel is not None and channel.peer == peer:
        return channel
    channel = _latest.get(peer)
    if channel is not None and all(comm.closed() for comm in channel.comms):
        return None
    return channel


def release(channel: Channel) -> None:
    """Forget a channel that no comm uses any more, and its peer (for now);
    free it :data:`FREE_AFTER` seconds later"""
    with _lock:
        if _channels.get(channel.id) is not channel:
            return  # released already, or never opened
        del _channels[channel.id]
        if _latest.get(channel.peer) is channel:
            del _latest[channel.peer]
            for address in [a for a, p in _addresses.items() if p == channel.peer]:
                del _addresses[address]
        _freeing[channel.id] = channel
    try:
        asyncio.get_running_loop().call_later(FREE_AFTER, _free, channel)
    except RuntimeError:  # no event loop
        _free(channel)


def _free(channel: Channel) -> None:
    """``Free`` is safe whether the peer lives or not (``Disconnect`` would
    wait for ever on a receive left posted); cancelled receives complete on
    their own"""
    if _freeing.pop(channel.id, None) is None:
        return
    MPI = get_mpi()
    with contextlib.suppress(MPI.Exception):
        # Small ones only: a large one's sender may be dead (mpi_liveness)
        _receive_leftovers(MPI, channel.comm, 1024)
        channel.comm.Free()


def full() -> bool:
    """Whether this process may connect to no new job with MPI"""
    if len(_jobs) < MAX_JOBS:
        return False
    _warn_full()
    return True


def room_for(job: str) -> bool:
    """Whether this process may connect to a process of ``job`` with MPI"""
    return job in _jobs or not full()


def met(job: str) -> None:
    """A channel to a process of ``job`` was opened with accept/connect"""
    _jobs.add(job)


@functools.cache
def _warn_full() -> None:
    logger.warning(
        "This process has connected to %d MPI jobs, the most that MPICH "
        "allows one process: comms with processes of new jobs (workers "
        "started by mpiexec -n 1, or without mpiexec) use TCP",
        MAX_JOBS,
    )


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


def _receive_leftovers(MPI, comm, limit: int) -> bool:
    """Receive what peers sent to comms closed here (their CLOSE heads), up to
    ``limit`` bytes each (a larger one may wait for a sender that is gone):
    UCX would keep them, and print a warning about each at exit.  Whether
    any came."""
    status, came = MPI.Status(), False
    while message := comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        nbytes = status.Get_count(MPI.BYTE)
        if nbytes > limit:
            break
        message.Recv(bytearray(nbytes))
        came = True
    return came


def _drain(MPI, quiet: float = 0.01, limit: float = 1.0) -> None:
    """At exit, receive what is left until nothing came for ``quiet`` seconds:
    a probe on one channel may bring in the message of another"""
    start = last = time.monotonic()
    while time.monotonic() - last < quiet and time.monotonic() - start < limit:
        for channel in [*_channels.values(), *_freeing.values()]:
            if _receive_leftovers(MPI, channel.comm, 65536):
                last = time.monotonic()


before_finalize(_drain)
