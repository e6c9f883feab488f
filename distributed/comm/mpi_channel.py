"""MPI channels: one MPI communicator per pair of processes that move data.

A channel opens the first time a frame large enough to go over MPI is written
between two processes, never for control messages alone: a scheduler that
only exchanges small messages with its workers holds no channel to them, and
MPICH's per-connection memory and job limit do not apply to it.  The end of a
comm that dialled its peer's listener opens the channel, over a TCP connection
of its own to that listener (see ``distributed.comm.mpi_opener``); the other
end asks it to in the heads of the messages it writes.  Until the channel is open, messages travel
whole over TCP.  Every comm between the two processes, in either direction,
then uses the channel; each message's frames have a tag of their own.
Processes on different hosts open one only where MPI has an RDMA network
there (``across-hosts``, see ``mpi_policy``).

A channel is released once no comm uses it at one end: that end closes the
TCP connection the channel opened on, which both ends keep for as long as it
is open, and the other end releases it too, so that neither sends over it
again.  Each frees it :data:`FREE_AFTER` seconds later.  MPICH itself gives
back little of a connection (about 50-70 KB stay with each process, freed or
not), and aborts a process on the 1024th distinct job it connects to (its
table of jobs, ``MPIR_Worlds``, never shrinks): past :data:`MAX_JOBS`,
processes of new jobs are met over TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING

from distributed.comm import mpi_handshake as handshake, mpi_policy as policy
from distributed.comm.core import CommClosedError
from distributed.comm.mpi_liveness import LocalPeer, death_watch
from distributed.comm.mpi_progress import (
    MPIStopped,
    Orphans,
    ProgressEngine,
    cancel_requests,
    left_in_flight,
)
from distributed.comm.mpi_routes import Routes
from distributed.comm.mpi_startup import (
    before_finalize,
    get_mpi,
    mpi_stopped,
    process_id,
)
from distributed.comm.mpi_stream import SocketStream

if TYPE_CHECKING:
    from distributed.comm.mpi_hello import Peer

logger = logging.getLogger(__name__)

# A channel no comm uses is freed this many seconds later: frames written just
# before the comms at the other end closed may still be on their way
FREE_AFTER = 10

# Bytes of a channel's greeting (Channel.greet): enough for UCX's rendezvous
GREETING = 65536

# Below MPICH's 1024 jobs per process, with some to spare
MAX_JOBS = 1000

# The processes given up on that a hello names, the latest: a process with
# many more (workers killed mid-message, over hours) would outgrow the
# handshake's 64 KiB, and could connect to nobody.  One given up on earlier
# is not told: it may ask this process for a channel, which it refuses.
SHARED_UNREACHABLE = 512


class Channel:
    """An MPI communicator between this process and one peer process"""

    def __init__(self, id: int, peer: Peer | None, comm, rank: int, accepted: bool):
        self.id = id  # named in message heads
        self.peer = peer.process if peer else process_id()
        self.sender = peer and LocalPeer.find(peer)  # the peer, on this host
        self.comm = comm
        self.rank = rank  # the peer's rank in comm
        self.comms: weakref.WeakSet = weakref.WeakSet()  # mpi:// comms using it
        self.opened = time.monotonic()
        # The TCP connection it opened on, and its event loop (Channels.hold)
        self.link: tuple[SocketStream, asyncio.AbstractEventLoop] | None = None
        self.nbytes = 0  # of the frames it moved, both ways
        # The peer, on this host, copies large host frames from this
        # process's memory itself, and device frames from its GPU memory
        # (CUDA IPC): they do not go through MPI
        self.peer_copies = False
        self.peer_ipc = False
        MPI = get_mpi()
        self.gpu = policy.gpu_path(peer)  # how device frames travel
        self.routes = Routes(self)
        # The largest tag is the greeting's (see greet)
        self.greeting_tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._ntags = self.greeting_tag // 2
        # Each end tags from its own half of the tag space.  MPI reuses the
        # context of a freed communicator for a new one, which then matches
        # messages left unreceived on the old one: tags start anywhere.
        self._parity = int(accepted)
        # One draw each, even for comms of several event loops (threads)
        self._tags = itertools.count(secrets.randbelow(self._ntags))

    def tag(self) -> int:
        """A tag for the frames of one message"""
        return 2 * (next(self._tags) % self._ntags) + self._parity

    def greet(self, timeout: float) -> None:
        """Send the peer a greeting and receive its own, as the channel
        opens, right after MPI connected the two: both ends are in
        :meth:`Opener.open`, with no await, so this takes a fraction of a
        millisecond, and leaves no send pending unless the peer died in it.
        UCX wires up the shared memory of a peer on this host when it first
        meets a message of the peer's that needs it (``/proc/PID/fd``), and
        fails to once the peer died: every later call into MPI, the exit
        drain's included, then logs errors.  A process whose frames the peer
        copies (``mpi_copy``) might first meet such a message when the peer
        died sending it."""
        MPI = get_mpi()
        mine, theirs = bytearray(GREETING), bytearray(GREETING)
        if self.sender is not None and self.sender.died():
            raise CommClosedError("the peer process died")  # MPI may copy at once
        requests = [
            self.comm.Irecv([theirs, MPI.BYTE], self.rank, self.greeting_tag),
            self.comm.Isend([mine, MPI.BYTE], self.rank, self.greeting_tag),
        ]
        deadline = time.monotonic() + timeout
        # Before each call into MPI, which may copy from the peer: is it alive?
        while not (died := self.sender is not None and self.sender.died()):
            if MPI.Request.Testall(requests):
                return
            if time.monotonic() > deadline:
                break
        cancel_requests(MPI, requests)  # the receive: MPICH cannot cancel sends
        ProgressEngine.current().orphan(requests, (mine, theirs), self.sender)
        if died:
            raise CommClosedError("the peer process died")
        raise CommClosedError(f"no greeting from the peer in {timeout} s")

    def __repr__(self):
        return f"<Channel {self.id:x} to {self.peer}>"


class Jobs:
    """The MPI jobs this process met with accept/connect, which MPICH counts:
    it aborts a process that connects to its 1024th"""

    def __init__(self):
        self._lock = threading.Lock()
        self._met: set[str] = set()

    def __len__(self) -> int:
        return len(self._met)

    def met(self, job: str) -> None:
        """MPI connected this process to a process of ``job``"""
        with self._lock:
            self._met.add(job)

    def room_for(self, job: str) -> bool:
        """Whether this process may connect to a process of ``job`` with MPI"""
        if job in self._met or len(self._met) < MAX_JOBS:
            return True
        _warn_full(MAX_JOBS)
        return False


class Channels:
    """This process's channels, the peers MPI failed with, the jobs met.

    Comms on any thread use it (a comm can be closed by the garbage collector
    anywhere): every change to its collections is made under its lock, and so
    is every walk through one; a lookup of one key, atomic in CPython, takes
    no lock, since every message makes one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, Channel] = {}  # by peer process
        self._by_id: dict[int, Channel] = {}  # open or about to be freed
        self._unreachable: dict[str, None] = {}  # in the order given up on
        self.jobs = Jobs()
        self._sweeps: weakref.WeakSet = weakref.WeakSet()  # loops that sweep
        self._released_nbytes = 0  # moved by the channels to others released

    def __len__(self) -> int:
        return len(self._by_id)

    def sizes(self) -> dict[str, int]:
        """How much each of its collections holds: none may grow for good"""
        return {
            "open": len(self._open),
            "by_id": len(self._by_id),
            "unreachable": len(self._unreachable),
            "jobs": len(self.jobs),
        }

    def get(self, peer: str) -> Channel | None:
        """The open channel to process ``peer`` (to this process: once
        :meth:`to_self` opened it); none once MPI is stopped"""
        return None if mpi_stopped() else self._open.get(peer)

    def to_others(self) -> list[Channel]:
        """The open channels to other processes"""
        with self._lock:
            return [c for c in self._open.values() if c.peer != process_id()]

    def moved(self) -> int:
        """Bytes of the frames this process moved over MPI with others, both
        ways, over the channels open and those released"""
        return self._released_nbytes + sum(c.nbytes for c in self.to_others())

    def by_id(self, id: int) -> Channel | None:
        """The channel a message head names; none once MPI is stopped"""
        return None if mpi_stopped() else self._by_id.get(id)

    def to_self(self) -> Channel:
        """The channel of this process to itself, opened on first use"""
        me = process_id()
        channel = self._open.get(me)
        if channel is None:
            channel = Channel(0, None, get_mpi().COMM_SELF.Dup(), 0, True)
            self.add(channel)
            self.publish(channel)
        return channel

    def add(self, channel: Channel) -> None:
        """Register a new channel, for message heads that name it"""
        with self._lock:
            self._by_id[channel.id] = channel

    def publish(self, channel: Channel) -> None:
        """Let comms write over a channel, once both ends opened it.  Of two
        channels that the two ends opened at once (each dialled the other),
        both keep the one of lower id, whichever they opened first: each end
        releasing the one the other kept left them none.  One that the peer
        has released already is dropped."""
        with self._lock:
            old = self._open.get(channel.peer)
            live = [c for c in (old, channel) if c and not _released_by_peer(c)]
            keep = min(live, key=lambda c: c.id, default=None)
            if keep is None:
                self._open.pop(channel.peer, None)
            else:
                self._open[channel.peer] = keep
            if old is not None and old is not keep:
                self._released_nbytes += old.nbytes
        for dropped in (old, channel):
            if dropped is not None and dropped is not keep:
                self._free_later(dropped)
        self._sweep_soon()

    def _sweep_soon(self) -> None:
        """Release, now and then, the channels whose comms were all closed by
        the peer, or dropped: nobody closed them here"""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        with self._lock:
            if loop in self._sweeps:
                return
            self._sweeps.add(loop)
        loop.call_later(FREE_AFTER, self._sweep, loop)

    def _sweep(self, loop) -> None:
        with self._lock:
            self._sweeps.discard(loop)
        for channel in self.to_others():
            if time.monotonic() - channel.opened >= FREE_AFTER and all(
                c.closed() for c in channel.comms
            ):
                self.release(channel)
        if self.to_others():
            self._sweep_soon()

    def reachable(self, peer: str) -> bool:
        """Whether to try MPI with process ``peer``"""
        return peer not in self._unreachable

    def unreachable(self) -> list[str]:
        """The processes this one gave up on last, for a hello"""
        with self._lock:
            return list(self._unreachable)[-SHARED_UNREACHABLE:]

    def give_up_on(self, peer: str) -> None:
        """MPI failed with ``peer``, or stopped delivering: never try again,
        which could block this process for ``channel-timeout`` again, or
        lose messages"""
        with self._lock:
            self._unreachable[peer] = None
        channel = self._open.get(peer)
        if channel is not None:
            self.release(channel, later=False)

    def release(self, channel: Channel, later: bool = True) -> None:
        """Forget a channel that no comm uses any more; free it
        :data:`FREE_AFTER` seconds later"""
        with self._lock:
            if self._open.get(channel.peer) is not channel:
                return  # released already
            if channel.peer == process_id():
                return  # kept for good
            del self._open[channel.peer]
            self._released_nbytes += channel.nbytes
        if later:
            self._free_later(channel)
        else:
            self.free(channel)

    def hold(self, channel: Channel, stream: SocketStream) -> None:
        """Keep the TCP connection a channel opened on until the channel is
        released at either end: its close tells the other end.  (Without it,
        an end went on sending over a channel that the other had freed.)"""
        channel.link = stream, asyncio.get_running_loop()

        def closed(fut):
            if not fut.cancelled():
                fut.exception()  # a closed stream is what it waits for
            self.release(channel)

        # The peer writes nothing on it: this waits for its close, or ours
        stream.read_until_close().add_done_callback(closed)

    @staticmethod
    def _cut(channel: Channel) -> None:
        """Close a channel's TCP connection, from any thread"""
        if channel.link is None:
            return
        (stream, loop), channel.link = channel.link, None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop or loop.is_closed():
            stream.close()
        else:
            loop.call_soon_threadsafe(stream.close)

    def _free_later(self, channel: Channel) -> None:
        self._cut(channel)
        try:
            asyncio.get_running_loop().call_later(FREE_AFTER, self.free, channel)
        except RuntimeError:  # no event loop
            self.free(channel)

    def free(self, channel: Channel) -> None:
        """``Free`` is safe whether the peer lives or not (``Disconnect`` would
        wait for ever on a receive left posted)"""
        self._cut(channel)
        with self._lock:
            freed = self._by_id.pop(channel.id, None)
        if freed is None:
            return
        channel.routes.close()
        if mpi_stopped():
            return
        with contextlib.suppress(get_mpi().Exception):
            channel.comm.Free()

    def may_open(self, peer: Peer) -> bool:
        """Whether to open a channel to ``peer``: what the rules allow
        (``mpi_policy``), where MPI has not failed with it, and MPICH's table
        of jobs has room"""
        return (
            policy.mpi_refusal(peer) is None
            and self.reachable(peer.process)
            and self.jobs.room_for(peer.job)
        )

    def drain(self, MPI, quiet: float = 0.01, limit: float = 1.0) -> None:
        """At exit, for up to ``limit`` seconds: receive what peers sent that
        nobody received, until nothing came for ``quiet`` seconds, and let
        the transfers in flight complete.  UCX warns at MPI_Finalize about
        each message left unreceived and each request not complete, and a
        peer's sends complete only once this process received them.  Nothing
        is copied from a peer on this host that died: UCX would read its
        memory, and abort this process."""
        _Drain(MPI, list(self._by_id.values()), left_in_flight()).run(quiet, limit)


class _Drain:
    """The exit drain of :meth:`Channels.drain`"""

    def __init__(self, MPI, channels: list[Channel], in_flight: list):
        self.MPI = MPI
        self.channels = channels
        self.orphans = Orphans(MPI)  # everything in flight, and what came
        for requests, buffers, sender in in_flight:
            self.orphans.add(requests, buffers, math.inf, sender)

    def run(self, quiet: float, limit: float) -> None:
        with contextlib.suppress(MPIStopped):
            self._run(quiet, limit)

    def _run(self, quiet: float, limit: float) -> None:
        start = last = time.monotonic()
        while time.monotonic() - start < limit:
            came = False
            for channel in self.channels:
                came |= self._receive_leftovers(channel)
            if self.orphans.test(time.monotonic(), self._drop_dead) or came:
                last = time.monotonic()
            elif not self.orphans and time.monotonic() - last >= quiet:
                return
        # The peer stopped sending half-way, or a receiver does not read
        self.orphans.cancel_receives()

    def _drop_dead(self):
        """Before each call into MPI, which may copy from any sender: cancel
        the receives from peers that died; ``died(peer)``.  Raises
        MPIStopped if MPI is stopped (see ``Orphans.drop_dead``)"""
        died = death_watch()
        self.orphans.drop_dead(died)
        if mpi_stopped():
            raise MPIStopped("MPI is stopped in this process")
        return died

    def _receive_leftovers(self, channel: Channel) -> bool:
        """Receive what the peer sent that nobody received; whether any came.
        What a peer that died sent is matched with an empty receive: MPI
        reports it truncated and copies nothing (UCX tells the sender instead
        of fetching the data), and UCX has no unmatched message to warn of."""
        MPI, status, came = self.MPI, self.MPI.Status(), False
        while True:
            self._drop_dead()
            try:
                message = channel.comm.Improbe(channel.rank, MPI.ANY_TAG, status)
            except MPI.Exception:
                return came
            if not message:
                return came
            came = True
            if self._drop_dead()(channel.sender):
                with contextlib.suppress(MPI.Exception):
                    message.Recv([bytearray(), MPI.BYTE])
                continue
            buffer = bytearray(status.Get_count(MPI.BYTE))
            request = message.Irecv([buffer, MPI.BYTE])
            self.orphans.add([request], buffer, math.inf, channel.sender)


def _released_by_peer(channel: Channel) -> bool:
    """Whether the peer closed the TCP connection of a channel: it released
    the channel, and this end has not yet read that it did"""
    # No link: the channel to this process
    return channel.link is not None and handshake.peer_gone(channel.link[0])


@functools.cache  # once for each limit
def _warn_full(limit: int) -> None:
    logger.warning(
        "This process has connected to %d MPI jobs, the most that MPICH "
        "allows one process: comms with processes of new jobs (workers "
        "started by mpiexec -n 1, or without mpiexec) use TCP",
        limit,
    )


channels = Channels()
before_finalize(channels.drain)
