"""The MPI transfers of one comm's messages.

A comm moves the frames of a message that travel over MPI as non-blocking
sends and receives, which its event loop's progress engine tests until they
complete (see ``distributed.comm.mpi_progress``).  :class:`Transfers` posts
them for one comm, after checking that MPI may be called for its peer, and
keeps the futures of those in flight: a send that fails aborts the comm (the
peer cannot tell what was sent), and a comm that closes gives up the rest.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from distributed.comm.core import CommClosedError
from distributed.comm.mpi_gpu import nbytes
from distributed.comm.mpi_liveness import hung_up
from distributed.comm.mpi_progress import ProgressEngine
from distributed.comm.mpi_startup import mpi_stopped

if TYPE_CHECKING:
    from distributed.comm.mpi_channel import Channel

# Seconds between two looks at the socket while a write waits for a send
HANG_UP_CHECK = 1.0


class Transfers:
    """The MPI transfers of one comm, whose TCP connection is ``sock``"""

    def __init__(self, comm, sock):
        # Weak: the comm holds this, and a comm nobody else holds must be
        # collected at once, not by the cycle collector (its finalizer
        # closes its stream)
        self._comm = weakref.ref(comm)
        self._socket = sock  # to see the peer hang up before the comm reads
        self.engine: ProgressEngine | None = None  # once a transfer is posted
        # Once the comm closed at this end; the peer's close leaves the
        # messages it wrote before readable, as on tcp://
        self.dropped = False
        self.posting = asyncio.Lock()  # held while a message's sends are posted
        self._receives: set[asyncio.Future] = set()  # of the read in progress
        # Of writes not complete: whether each is kept past an abort
        self._sends: dict[asyncio.Future, bool] = {}

    def poster(
        self, channel: Channel, tag: int, receive: bool
    ) -> Callable[[list], asyncio.Future]:
        """A function that posts the sends (or receives) of some chunks of a
        message with ``tag`` on ``channel``, and returns the engine's future
        of them"""
        comm = self._comm()
        # Its loop's engine tests the transfers: found once per comm, since
        # on a message's path every lookup costs
        engine = self.engine = self.engine or ProgressEngine.current()
        MPI = engine.MPI
        start = channel.comm.Irecv if receive else channel.comm.Isend

        def post(chunks: list) -> asyncio.Future:
            if self.dropped:
                raise CommClosedError(f"{comm} is closed")
            if mpi_stopped():
                comm.abort()
                raise CommClosedError(f"{comm}: MPI is stopped in this process")
            if receive and channel.sender is not None and channel.sender.died():
                comm.abort()  # MPI may start to copy at once
                raise CommClosedError(f"{comm}: the peer process died")
            if not receive:
                # MPICH's UCX can crash sending to a process that died
                self._check_peer(comm)
            requests = [start([c, MPI.BYTE], channel.rank, tag) for c in chunks]
            if receive:
                sizes = [nbytes(c) for c in chunks]
                fut = engine.receive(
                    requests, chunks, channel.sender, sizes, self._socket
                )
                self._receives.add(fut)
                fut.add_done_callback(self._receives.discard)
            else:
                fut = engine.transfer(requests, chunks, channel.sender is not None)
                self.track(fut)
            return fut

        return post

    async def sent(self, fut: asyncio.Future) -> None:
        """Wait for a send of this comm's, which never completes once the
        reader is gone: the socket says whether it is, every
        :data:`HANG_UP_CHECK` seconds"""
        while not fut.done():
            await asyncio.wait([fut], timeout=HANG_UP_CHECK)
            if not fut.done():
                self._check_peer(self._comm())  # alive: it is writing
        await fut

    def _check_peer(self, comm) -> None:
        """Abort ``comm`` and raise CommClosedError if its peer hung up: it
        reads no more, or died (on another host, nothing else tells)"""
        if hung_up(self._socket):
            comm.abort()
            raise CommClosedError(f"{comm}: the peer closed the connection")

    def track(self, fut: asyncio.Future, keep: bool = False) -> None:
        """Abort the comm should a send, or a lease, fail.  ``keep``: a
        lease of frames that the reader copies without checking it (device
        frames by IPC), kept, should the comm abort, until the reader says it
        has them, dies, or the connect timeout passes"""
        if not fut.done():
            self._sends[fut] = keep
            fut.add_done_callback(self._sent)

    def _sent(self, fut: asyncio.Future) -> None:
        self._sends.pop(fut, None)
        if fut.cancelled() or fut.exception() is not None:
            comm = self._comm()
            if comm is not None:
                comm.abort()  # MPI failed to send: the stream is broken

    def drop(self, cancel: bool = False) -> None:
        """Give up the receives in progress; leave sends to the engine, which
        lets the peer read them until the connect timeout, and receives from
        this host, which it lets complete (cancels both now if ``cancel``);
        post no more"""
        self.dropped = True
        if not (self._receives or self._sends):
            return
        engine, reason = self.engine, f"{self._comm()} closed"
        for fut in list(self._receives):
            engine.cancel(fut, CommClosedError(reason), drain=not cancel)
        for fut, keep in list(self._sends.items()):
            fut.remove_done_callback(self._sent)
            if cancel and not keep:
                engine.cancel(fut, CommClosedError(reason))
            else:
                engine.abandon(fut)
        self._receives.clear()
        self._sends.clear()
