"""MPI channels: one MPI communicator per pair of processes that move data.

A channel opens the first time a frame large enough to go over MPI is written
between two processes, never for control messages alone: a scheduler that
only exchanges small messages with its workers holds no channel to them, and
MPICH's per-connection memory and job limit do not apply to it.  The end of a
comm that dialled its peer's listener opens the channel, over a TCP connection
of its own to that listener (:func:`dial`); the other end asks it to in the
heads of the messages it writes.  Until the channel is open, messages travel
whole over TCP.  Every comm between the two processes, in either direction,
then uses the channel; each message's frames have a tag of their own.
Processes on different hosts open one only where MPI has an RDMA network
there (``across-hosts``, see ``mpi_policy``).

Ranks of one ``mpiexec`` job make a communicator of the two of them with
``MPI_Comm_create_group`` (only they take part); processes of different jobs,
or started without ``mpiexec``, use ``MPI_Comm_accept``/``MPI_Comm_connect``
over ``MPI_COMM_SELF``.  A process talks to itself over a duplicate of
``MPI_COMM_SELF``.

These calls block, and MPICH holds its global lock while they wait, so they
run on the event loop, under rules that keep MPICH alive when a peer dies:

- a process alone in its job connects to a rank of a bigger one (after a
  connect to another host, MPICH's MPI_Finalize can crash, and only a
  process alone in its job may leave it out); else, of two processes, the
  one whose ``process_id()`` sorts first accepts.  Ranks of two jobs of
  several ranks on different hosts do not meet (TCP only);
- the acceptor enters MPI first, as soon as it has sent its port name over
  TCP, and gives up after ``channel-timeout``;
- so the connector connects only to an acceptor that is waiting: at once on
  reading the port, and only if the acceptor is still there.  MPICH with UCX
  crashes in a connect to a process that is gone;
- every port has a tag of its own (see :meth:`Channels.open_port`);
- after a channel failed to open, or stopped delivering, the two processes
  use TCP only (:meth:`Channels.give_up_on`).

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
import logging
import os
import re
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING

from dask.utils import parse_timedelta
from tornado.tcpclient import TCPClient

from distributed.comm import mpi_handshake as handshake, mpi_policy as policy
from distributed.comm.addressing import parse_host_port
from distributed.comm.core import CommClosedError
from distributed.comm.mpi_liveness import LocalPeer, death_watch
from distributed.comm.mpi_progress import (
    MPIStopped,
    ProgressEngine,
    cancel_requests,
    completion_check,
    left_in_flight,
    stop_if_doomed,
)
from distributed.comm.mpi_startup import (
    before_finalize,
    config,
    get_mpi,
    mpi_stopped,
    process_id,
    skip_finalize,
    world,
)
from distributed.comm.mpi_routes import Routes
from distributed.comm.mpi_stream import SocketStream

if TYPE_CHECKING:
    from distributed.comm.mpi_handshake import Peer

logger = logging.getLogger(__name__)

# A channel no comm uses is freed this many seconds later: frames written just
# before the comms at the other end closed may still be on their way
FREE_AFTER = 10

# Bytes of a channel's greeting (Channel.greet): enough for UCX's rendezvous
GREETING = 65536

# Below MPICH's 1024 jobs per process, with some to spare
MAX_JOBS = 1000

_MPICH_PORT_TAG = re.compile(r"^tag#\d+\$")  # the tag in an MPICH port name

# MPICH 5.0 with UCX: MPI_Comm_connect to a process on another host releases
# a UCX request twice (MPIDI_UCX_dynamic_send, when its send waits for UCX to
# connect), which takes another out of UCX's pool for good; MPI_Finalize
# (ucp_worker_destroy) reports that one as leaked, reading what it last held:
# a warning, or a segmentation fault, after the work is done.  Nothing that
# MPI offers (Comm_disconnect, Comm_free, progress) puts it back.
_CONNECTED_ACROSS_HOSTS = (
    "this process connected to a process on another host with "
    "MPI_Comm_connect, after which MPICH's MPI_Finalize can crash"
)
# MPICH 5.0.2 with UCX once spun for good in an MPI_Comm_connect to another
# host, its timeout long past (in ucp_request_release, on a spin lock): an
# accept or connect that has not returned this many seconds after its timeout
# is reported, and a process alone in its job exits (see _stuck_in_mpi)
MEET_GRACE = 30

# MPICH 5.0 with UCX leaves the receive of an accept or connect that failed
# posted (see Channels.open_port), and the peer's late message unmatched:
# UCX warns of both at MPI_Finalize
_MEET_FAILED = "an MPI_Comm_accept or MPI_Comm_connect of this process failed"


class _AcceptorGaveUp(CommClosedError):
    """The acceptor's accept timed out before this process read the port"""


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
        # The TCP connection it opened on, and its event loop (Channels._hold)
        self.link: tuple[SocketStream, asyncio.AbstractEventLoop] | None = None
        self.nbytes = 0  # of the frames it moved, both ways
        # The peer, on this host, copies large host frames from this
        # process's memory itself: they do not go through MPI
        self.peer_copies = False
        MPI = get_mpi()
        self.gpu = policy.gpu_path(peer)  # how device frames travel
        self.routes = Routes(self)
        # The largest tag is the greeting's (see greet)
        self._greeting = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._ntags = self._greeting // 2
        # Each end tags from its own half of the tag space.  MPI reuses the
        # context of a freed communicator for a new one, which then matches
        # messages left unreceived on the old one: tags start anywhere.
        self._parity = int(accepted)
        self._next = secrets.randbelow(self._ntags)

    def tag(self) -> int:
        """A tag for the frames of one message"""
        n, self._next = self._next, (self._next + 1) % self._ntags
        return 2 * n + self._parity

    def greet(self, timeout: float) -> None:
        """Send the peer a greeting and receive its own, as the channel
        opens, right after MPI connected the two: both ends are in
        :meth:`Channels.open`, with no await, so this takes a fraction of a
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
            self.comm.Irecv([theirs, MPI.BYTE], self.rank, self._greeting),
            self.comm.Isend([mine, MPI.BYTE], self.rank, self._greeting),
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


class Channels:
    """This process's channels, the peers MPI failed with, the jobs met"""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, Channel] = {}  # by peer process
        self._by_id: dict[int, Channel] = {}  # open or about to be freed
        self._opening: dict[str, asyncio.Task] = {}  # by peer process
        self._unreachable: set[str] = set()
        self._jobs: set[str] = set()  # of the peers met with accept/connect
        self._ports: dict[str, str] = {}  # open_port()'s, as MPI opened them
        self._sweeps: weakref.WeakSet = weakref.WeakSet()  # loops that sweep
        self._released_nbytes = 0  # moved by the channels to others released

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, peer: str) -> Channel | None:
        """The open channel to process ``peer`` (to this process: once
        :meth:`to_self` opened it); none once MPI is stopped"""
        return None if mpi_stopped() else self._open.get(peer)

    def to_others(self) -> list[Channel]:
        """The open channels to other processes"""
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
            self._add(channel)
            self._publish(channel)
        return channel

    def _add(self, channel: Channel) -> None:
        """Register a new channel, for message heads that name it"""
        with self._lock:
            self._by_id[channel.id] = channel

    def _publish(self, channel: Channel) -> None:
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
        if loop not in self._sweeps:
            self._sweeps.add(loop)
            loop.call_later(FREE_AFTER, self._sweep, loop)

    def _sweep(self, loop) -> None:
        self._sweeps.discard(loop)
        me = process_id()
        for channel in list(self._open.values()):
            if (
                channel.peer != me
                and time.monotonic() - channel.opened >= FREE_AFTER
                and all(c.closed() for c in channel.comms)
            ):
                self.release(channel)
        if any(peer != me for peer in self._open):
            self._sweep_soon()

    def reachable(self, peer: str) -> bool:
        """Whether to try MPI with process ``peer``"""
        return peer not in self._unreachable

    def unreachable(self) -> list[str]:
        """The processes this one gave up on"""
        return sorted(self._unreachable)

    def give_up_on(self, peer: str) -> None:
        """MPI failed with ``peer``, or stopped delivering: never try again,
        which could block this process for ``channel-timeout`` again, or
        lose messages"""
        self._unreachable.add(peer)
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
            self._free(channel)

    def _hold(self, channel: Channel, stream: SocketStream) -> None:
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
            asyncio.get_running_loop().call_later(FREE_AFTER, self._free, channel)
        except RuntimeError:  # no event loop
            self._free(channel)

    def _free(self, channel: Channel) -> None:
        """``Free`` is safe whether the peer lives or not (``Disconnect`` would
        wait for ever on a receive left posted)"""
        self._cut(channel)
        if self._by_id.pop(channel.id, None) is None or mpi_stopped():
            return
        with contextlib.suppress(get_mpi().Exception):
            channel.comm.Free()

    def room_for(self, job: str) -> bool:
        """Whether this process may connect to a process of ``job`` with MPI"""
        if job in self._jobs or len(self._jobs) < MAX_JOBS:
            return True
        _warn_full()
        return False

    def may_open(self, peer: Peer) -> bool:
        """Whether to open a channel to ``peer``: what the rules allow
        (``mpi_policy``), where MPI has not failed with it, and MPICH's table
        of jobs has room"""
        return (
            policy.mpi_refusal(peer) is None
            and self.reachable(peer.process)
            and self.room_for(peer.job)
        )

    def may_accept(self, peer: Peer) -> bool:
        """Whether to open the channel that the process of this hello came
        to open.  Not while this process, which sorts first, dials it for
        one: that one opens, not two (when each end first writes large
        frames to the other on a comm it dialled, they dial each other)."""
        process = peer.process
        crossing = process in self._opening and process_id() < process
        return not crossing and self.may_open(peer)

    def open_soon(self, address: str, peer: Peer) -> None:
        """Open a channel to the process listening at ``address``, in the
        background, unless one is open or opening"""
        process = peer.process
        if process in self._open or process in self._opening:
            return
        if not self.may_open(peer):
            return
        task = asyncio.ensure_future(self._dial(address, peer))
        self._opening[process] = task
        task.add_done_callback(lambda _: self._opening.pop(process, None))

    async def _dial(self, address: str, peer: Peer) -> None:
        timeout = parse_timedelta(config("channel-timeout"))
        try:
            stream = SocketStream.adopt(
                await asyncio.wait_for(
                    TCPClient().connect(*parse_host_port(address)), timeout
                )
            )
        except (OSError, asyncio.TimeoutError) as e:
            logger.info("Cannot reach %s to open an MPI channel: %s", address, e)
            return
        channel = None
        try:
            mine = {**handshake.hello(), "open": True}
            reply = await asyncio.wait_for(handshake.exchange(stream, mine), timeout)
            if reply.process == peer.process and reply.open:
                channel = await self.open(stream, reply)
        except Exception as e:
            logger.info("Opening an MPI channel to %s failed: %r", address, e)
        finally:
            if channel is None:
                stream.close()

    async def open(self, stream, peer: Peer) -> Channel | None:
        """Open the channel to ``peer``, both ends with this, on a TCP
        ``stream`` of their own, which the channel keeps: the acceptor sends
        a port name (none for another rank of its own job) and enters MPI at
        once; the connector follows when it reads the port, if the acceptor
        is still there and has not given up.  If MPI fails at either end,
        both say so, and give up on each other."""
        process = peer.process
        same_world = policy.same_world(peer)
        accepts = policy.accepts(peer)
        timeout = parse_timedelta(config("channel-timeout"))
        MPI, channel, error = get_mpi(), None, None
        try:
            if accepts:
                id = secrets.randbits(63)
                port = None if same_world else self.open_port()
                try:
                    await handshake.send(stream, {"port": port, "id": id})
                except BaseException:
                    if port is not None:
                        self.close_port(port)
                    raise
            else:
                msg = await handshake.recv(stream)
                port, id = msg["port"], msg["id"]
                acceptor = LocalPeer.find(peer)
                if handshake.peer_gone(stream) or (acceptor and acceptor.died()):
                    raise CommClosedError("the peer went away")
                if stream.unread():
                    # The acceptor's answer came already: its accept timed
                    # out before this process read the port.  A connect now
                    # would meet only the receive that accept left posted,
                    # and wait in MPI for its own timeout
                    raise _AcceptorGaveUp("the accept timed out before the connect")
            # No await from here on: the acceptor is waiting, or about to.
            # MPI progresses every receive while it blocks here
            ProgressEngine.current().drop_dead_senders()
            if same_world:
                comm, rank = _join(peer.world[1], process_id() if accepts else process)
            else:
                if not accepts and acceptor is None:
                    skip_finalize(_CONNECTED_ACROSS_HOSTS)
                comm, rank = self._meet(port, accepts, timeout), 0
                self._jobs.add(peer.job)  # MPICH counts it now
            channel = Channel(id, peer, comm, rank, accepts)
            self._add(channel)  # before any message head can name it
            channel.greet(timeout)
        except (MPI.Exception, CommClosedError) as e:
            if channel is None and not isinstance(e, (MPI.Exception, _AcceptorGaveUp)):
                raise  # before MPI: the peer went away
            error = e
        try:
            # Each end says whether it can copy from the other's memory
            await handshake.send(
                stream, {"opened": error is None, "copies": policy.copies_from(peer)}
            )
            reply = await handshake.recv(stream)
        except BaseException:
            if channel is not None:
                self._free(channel)
            raise
        if error is None and reply.get("opened") is True:
            channel.peer_copies = reply.get("copies") is True
            self._hold(channel, stream)
            self._publish(channel)  # comms may write over it now
            return channel
        if channel is not None:
            self._free(channel)
        logger.warning(
            "MPI could not connect this process to %s (%s): their comms move "
            "their data over TCP from now on",
            process,
            error or "it failed at the other end",
        )
        self.give_up_on(process)
        return None

    def _meet(self, port: str, accepts: bool, timeout: float):
        """Accept on ``port``, or connect to it; give up after ``timeout``
        seconds (MPICH honours it; a peer that died in between would block
        this process forever otherwise)"""
        MPI = get_mpi()
        info = MPI.Info.Create()
        timeout = max(1, round(timeout))
        info.Set("timeout", str(timeout))
        call = "MPI_Comm_accept" if accepts else "MPI_Comm_connect"
        watchdog = threading.Timer(
            timeout + MEET_GRACE, _stuck_in_mpi, [call, timeout + MEET_GRACE]
        )
        watchdog.daemon = True
        watchdog.start()
        try:
            if accepts:
                return MPI.COMM_SELF.Accept(port, info)
            return MPI.COMM_SELF.Connect(port, info)
        except MPI.Exception:
            skip_finalize(_MEET_FAILED)
            raise
        finally:
            watchdog.cancel()
            info.Free()
            if accepts:
                self.close_port(port)

    def open_port(self) -> str:
        """A port to accept one peer on, with a tag no other port is likely
        to have.  MPICH (5.0, UCX netmod) gives every port of a process the
        lowest free tag, 0 unless several are open, and matches the messages
        of accept and connect by tag alone; an accept or connect that times
        out leaves its receive posted, into memory it has freed, and the next
        one to use that tag, in any pair of processes, would complete it
        instead of its own."""
        port = get_mpi().Open_port()
        tag = 1 + secrets.randbelow(2**28 - 1)  # forks share random's state
        unique = _MPICH_PORT_TAG.sub(f"tag#{tag}$", port, 1)
        self._ports[unique] = port
        return unique

    def close_port(self, port: str) -> None:
        get_mpi().Close_port(self._ports.pop(port, port))

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
        self.in_flight = in_flight  # (requests, buffers, sender on this host)
        self.complete = completion_check(MPI)

    def run(self, quiet: float, limit: float) -> None:
        with contextlib.suppress(MPIStopped):
            self._run(quiet, limit)

    def _run(self, quiet: float, limit: float) -> None:
        start = last = time.monotonic()
        while time.monotonic() - start < limit:
            came = False
            for channel in self.channels:
                came |= self._receive_leftovers(channel)
            if self._test():
                last = time.monotonic()
            if came:
                last = time.monotonic()
            elif not self.in_flight and time.monotonic() - last >= quiet:
                return
        # The peer stopped sending half-way, or a receiver does not read
        for requests, _, sender in self.in_flight:
            if sender is not None:  # a receive; MPICH cannot cancel sends
                cancel_requests(self.MPI, requests)

    def _cancel_dead(self):
        """Before each call into MPI, which may copy from any sender: cancel
        the receives from peers that died; ``died(peer)``.  Raises
        MPIStopped if one that MPI had matched is left (see
        ``ProgressEngine.drop_dead_senders``)"""
        died = death_watch()
        for requests, _, sender in self.in_flight:
            if died(sender):
                cancel_requests(self.MPI, requests)
                if stop_if_doomed(requests, self.complete):
                    raise MPIStopped("MPI is stopped in this process")
        self.in_flight = [x for x in self.in_flight if not died(x[2])]
        return died

    def _receive_leftovers(self, channel: Channel) -> bool:
        """Receive what the peer sent that nobody received; whether any came.
        What a peer that died sent is matched with an empty receive: MPI
        reports it truncated and copies nothing (UCX tells the sender instead
        of fetching the data), and UCX has no unmatched message to warn of."""
        MPI, status, came = self.MPI, self.MPI.Status(), False
        while True:
            self._cancel_dead()
            try:
                message = channel.comm.Improbe(channel.rank, MPI.ANY_TAG, status)
            except MPI.Exception:
                return came
            if not message:
                return came
            came = True
            if self._cancel_dead()(channel.sender):
                with contextlib.suppress(MPI.Exception):
                    message.Recv([bytearray(), MPI.BYTE])
                continue
            buffer = bytearray(status.Get_count(MPI.BYTE))
            request = message.Irecv([buffer, MPI.BYTE])
            self.in_flight.append(([request], buffer, channel.sender))

    def _test(self) -> bool:
        """Test the transfers in flight; whether any completed"""
        completed = False
        for entry in list(self.in_flight):
            self._cancel_dead()
            if not any(entry is e for e in self.in_flight):
                continue  # from a peer that died
            try:
                done = self.MPI.Request.Testall(entry[0])
            except self.MPI.Exception:
                done = True
            if done:
                self.in_flight = [e for e in self.in_flight if e is not entry]
                completed = True
        return completed


def _released_by_peer(channel: Channel) -> bool:
    """Whether the peer closed the TCP connection of a channel: it released
    the channel, and this end has not yet read that it did"""
    # No link: the channel to this process
    return channel.link is not None and handshake.peer_gone(channel.link[0])


def _join(peer_rank: int, acceptor: str):
    """A communicator of this rank and another of its own mpiexec job, made
    by both of them alone; the peer's rank in it"""
    everyone = get_mpi().COMM_WORLD
    ranks = sorted([everyone.rank, peer_rank])
    group = everyone.group.Incl(ranks)
    try:
        # Both ends derive the same tag, distinct for concurrent calls
        tag = int.from_bytes(acceptor.encode()[-2:], "big") % 32768
        comm = everyone.Create_group(group, tag)
    finally:
        group.Free()
    return comm, ranks.index(peer_rank)


def _stuck_in_mpi(call: str, seconds: float) -> None:
    """A watchdog's: ``call`` has blocked the event loop for ``seconds``, past
    its timeout, and will not return.  A process alone in its job exits; a
    rank of a bigger one cannot without taking the whole job down with it
    (its launcher ends the job), and says so, to be dropped by the scheduler
    when its heartbeats stop."""
    alone = world() is None
    logger.critical(
        "%s has not returned after %.0f s, past its timeout: MPI is stuck "
        "(MPICH with UCX can spin for good in a connect to another host). %s",
        call,
        seconds,
        "This process exits." if alone else "This process cannot go on.",
    )
    if alone:
        os._exit(1)


@functools.cache
def _warn_full() -> None:
    logger.warning(
        "This process has connected to %d MPI jobs, the most that MPICH "
        "allows one process: comms with processes of new jobs (workers "
        "started by mpiexec -n 1, or without mpiexec) use TCP",
        MAX_JOBS,
    )


channels = Channels()
before_finalize(channels.drain)
