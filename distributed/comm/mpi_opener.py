"""Opening an MPI channel between two processes (see ``mpi_channel``).

The end of a comm that dialled its peer's listener opens the channel, over a
TCP connection of its own to that listener (:meth:`Opener.open_soon`), which
the channel keeps while it is open.  Ranks of one ``mpiexec`` job make a communicator of the two of them with
``MPI_Comm_create_group`` (only they take part); processes of different jobs,
or started without ``mpiexec``, use ``MPI_Comm_accept``/``MPI_Comm_connect``
over ``MPI_COMM_SELF``.  A process talks to itself over a duplicate of
``MPI_COMM_SELF``.

These calls block, and MPICH holds its global lock while they wait, so they
run on the event loop, under rules that keep MPICH alive when a peer dies:

- a process alone in its job connects to a rank of a bigger one (after a
  connect to another host, MPICH's MPI_Finalize can crash, and only a
  process alone in its job may leave it out); else, of two processes, the
  one whose ``process_id()`` sorts first (``mpi_startup.sorts_first``)
  accepts.  Ranks of two jobs of several ranks on different hosts do not
  meet (TCP only);
- the acceptor enters MPI first, as soon as it has sent its port name over
  TCP, and gives up after ``channel-timeout``;
- so the connector connects only to an acceptor that is waiting: at once on
  reading the port, and only if the acceptor is still there.  MPICH with UCX
  crashes in a connect to a process that is gone;
- every port has a tag of its own (see :meth:`Opener.open_port`);
- ``MPI_Comm_create_group`` has no timeout: a rank whose peer died before
  joining waits for good (under ``mpiexec`` the job ends with the dead rank),
  and a watchdog says so;
- after a channel failed to open, or stopped delivering, the two processes
  use TCP only (``Channels.give_up_on``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import secrets
import threading
from typing import TYPE_CHECKING

from dask.utils import parse_timedelta
from tornado.tcpclient import TCPClient

from distributed.comm import mpi_handshake as handshake, mpi_policy as policy
from distributed.comm.addressing import parse_host_port
from distributed.comm.core import CommClosedError
from distributed.comm.mpi_channel import Channel, Channels, channels
from distributed.comm.mpi_liveness import LocalPeer
from distributed.comm.mpi_progress import ProgressEngine
from distributed.comm.mpi_startup import (
    config,
    get_mpi,
    process_id,
    skip_finalize,
    sorts_first,
    world,
)
from distributed.comm.mpi_stream import SocketStream

if TYPE_CHECKING:
    from distributed.comm.mpi_hello import Peer

logger = logging.getLogger(__name__)

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
# accept, connect or join that has not returned this many seconds after
# channel-timeout is reported, and a process alone in its job exits (see
# _stuck_in_mpi)
MEET_GRACE = 30

# MPICH 5.0 with UCX leaves the receive of an accept or connect that failed
# posted (see Opener.open_port), and the peer's late message unmatched:
# UCX warns of both at MPI_Finalize
MEET_FAILED = "an MPI_Comm_accept or MPI_Comm_connect of this process failed"


class _AcceptorGaveUp(CommClosedError):
    """The acceptor's accept timed out before this process read the port"""


class _AcceptorFailed(CommClosedError):
    """MPI failed at the acceptor before its accept (``MPI_Open_port``): its
    ``answer`` came instead of a port"""

    def __init__(self, answer: dict):
        super().__init__("MPI failed at the other end")
        self.answer = answer


class Opener:
    """Opens this process's channels, into the registry ``channels``"""

    def __init__(self, channels: Channels):
        self.channels = channels
        self._lock = threading.Lock()  # for the three below: any thread
        self._opening: dict[str, asyncio.Task] = {}  # by peer process
        # The peers whose dials for a channel this process is answering
        self._answering: collections.Counter[str] = collections.Counter()
        self._ports: dict[str, str] = {}  # open_port()'s, as MPI opened them

    def sizes(self) -> dict[str, int]:
        """How many channels it is opening, and ports it holds open"""
        with self._lock:
            opening = self._opening.keys() | self._answering.keys()
        return {"opening": len(opening), "ports": len(self._ports)}

    def may_accept(self, peer: Peer) -> bool:
        """Whether to open the channel that the process of this hello came
        to open.  Not while this process, which sorts first, dials it for
        one: that one opens, not two (when each end first writes large
        frames to the other on a comm it dialled, they dial each other)."""
        process = peer.process
        crossing = process in self._opening and sorts_first(process_id(), process)
        return not crossing and self.channels.may_open(peer)

    def open_soon(self, address: str, peer: Peer) -> None:
        """Open a channel to the process listening at ``address``, in the
        background, unless one is open or opening (at either end's dial: a
        second would cost another MPI connect, one of them kept)"""
        process = peer.process
        if (
            self.channels.get(process)
            or process in self._opening
            or process in self._answering
        ):
            return
        if not self.channels.may_open(peer):
            return
        task = asyncio.ensure_future(self._dial(address, peer))
        with self._lock:
            self._opening[process] = task
        task.add_done_callback(lambda _: self._opened(process))

    def _opened(self, process: str) -> None:
        with self._lock:
            self._opening.pop(process, None)

    async def answer(self, stream, peer: Peer) -> Channel | None:
        """Open the channel that ``peer`` dialled this process for (see
        :meth:`open`)"""
        with self._lock:
            self._answering[peer.process] += 1
        try:
            return await self.open(stream, peer)
        finally:
            with self._lock:
                self._answering[peer.process] -= 1
                if not self._answering[peer.process]:
                    del self._answering[peer.process]

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
            mine = {**handshake.hello(), "open": peer.process}
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
                if "port" not in msg:
                    raise _AcceptorFailed(msg)
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
                comm, rank = _join(peer.world[1], id, timeout)
            else:
                if not accepts and acceptor is None:
                    skip_finalize(_CONNECTED_ACROSS_HOSTS)
                comm, rank = self.meet(port, accepts, timeout), 0
                self.channels.jobs.met(peer.job)  # MPICH counts it now
            channel = Channel(id, peer, comm, rank, accepts)
            self.channels.add(channel)  # before any message head can name it
            channel.greet(timeout)
        except (MPI.Exception, CommClosedError) as e:
            if channel is None and not isinstance(
                e, (MPI.Exception, _AcceptorGaveUp, _AcceptorFailed)
            ):
                raise  # before MPI: the peer went away
            error = e
        try:
            # Each end says whether it can copy from the other's memory
            await handshake.send(
                stream,
                {
                    "opened": error is None,
                    "copies": policy.copies_from(peer),
                    "ipc": policy.ipc_from(peer),
                },
            )
            if isinstance(error, _AcceptorFailed):
                reply = error.answer  # it had no port to send
            else:
                reply = await handshake.recv(stream)
        except BaseException:
            if channel is not None:
                self.channels.free(channel)
            raise
        if error is None and reply.get("opened") is True:
            channel.peer_copies = reply.get("copies") is True
            channel.peer_ipc = reply.get("ipc") is True
            self.channels.hold(channel, stream)
            self.channels.publish(channel)  # comms may write over it now
            return channel
        if channel is not None:
            self.channels.free(channel)
        logger.warning(
            "MPI could not connect this process to %s (%s): their comms move "
            "their data over TCP from now on",
            process,
            error or "it failed at the other end",
        )
        self.channels.give_up_on(process)
        return None

    def meet(self, port: str, accepts: bool, timeout: float):
        """Accept on ``port``, or connect to it; give up after ``timeout``
        seconds (MPICH honours it; a peer that died in between would block
        this process forever otherwise)"""
        MPI = get_mpi()
        info = MPI.Info.Create()
        timeout = max(1, round(timeout))
        info.Set("timeout", str(timeout))
        call = "MPI_Comm_accept" if accepts else "MPI_Comm_connect"
        try:
            with _watchdog(call, timeout + MEET_GRACE):
                if accepts:
                    return MPI.COMM_SELF.Accept(port, info)
                return MPI.COMM_SELF.Connect(port, info)
        except MPI.Exception:
            skip_finalize(MEET_FAILED)
            raise
        finally:
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
        with self._lock:
            self._ports[unique] = port
        return unique

    def close_port(self, port: str) -> None:
        with self._lock:
            port = self._ports.pop(port, port)
        get_mpi().Close_port(port)


def _join(peer_rank: int, id: int, timeout: float):
    """A communicator of this rank and another of its own mpiexec job, made
    by both of them alone; the peer's rank in it.  ``id``: the channel's,
    which both ends know"""
    everyone = get_mpi().COMM_WORLD
    ranks = sorted([everyone.rank, peer_rank])
    group = everyone.group.Incl(ranks)
    try:
        # Concurrent calls of one process (on two event loops) need distinct
        # tags; MPI guarantees tags up to 32767
        with _watchdog("MPI_Comm_create_group", timeout + MEET_GRACE):
            comm = everyone.Create_group(group, id % 32768)
    finally:
        group.Free()
    return comm, ranks.index(peer_rank)


@contextlib.contextmanager
def _watchdog(call: str, seconds: float):
    """Report ``call`` if it blocks for longer than ``seconds``: it has no
    timeout of its own, or outlived it (see :func:`_stuck_in_mpi`)"""
    watchdog = threading.Timer(seconds, _stuck_in_mpi, [call, seconds])
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _stuck_in_mpi(call: str, seconds: float) -> None:
    """A watchdog's: ``call`` has blocked the event loop for ``seconds``, past
    its timeout, and will not return.  A process alone in its job exits; a
    rank of a bigger one cannot without taking the whole job down with it
    (its launcher ends the job), and says so, to be dropped by the scheduler
    when its heartbeats stop."""
    alone = world() is None
    logger.critical(
        "%s has not returned after %.0f s: MPI is stuck (MPICH with UCX can "
        "spin for good in a connect to another host; a rank of this job can "
        "die before it joins a channel). %s",
        call,
        seconds,
        "This process exits." if alone else "This process cannot go on.",
    )
    if alone:
        os._exit(1)


opener = Opener(channels)
