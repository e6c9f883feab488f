"""Drive the MPI transfers of an event loop.

MPI only moves data when a process calls into it, so someone has to test the
outstanding requests.  One :class:`ProgressEngine` per event loop does so
cooperatively, in short callbacks between the loop's other work (the MPI4Dask
idea of ``Test()`` plus ``await asyncio.sleep(0)``), instead of a thread that
would compete for the GIL.

The engine polls only while a transfer is in flight: a message's head arrives
on the comm's TCP connection, which wakes the event loop through the kernel,
and its reader posts the receives of the frames (see ``distributed.comm.mpi``).
Nothing polls while no data moves.  While this process receives, the engine
polls on every loop iteration for ``busy-poll-time`` after any progress, then
backs off exponentially, up to ``poll-interval`` between polls; so does a
sender to another host, which pushes the data in its own calls into MPI when
the network is TCP.  While it only sends to processes on this host, it polls
every ``poll-interval``: the receiver copies the data out of the sender's
memory in its own calls into MPI (CMA), so a sender that polled on would only
take a core from it (and from the tasks) to learn a little earlier that its
buffers are free.

Before each call into MPI the engine cancels the receives from peer processes
on this host that died (see ``distributed.comm.mpi_liveness``).  A receive
that MPI matched already cannot be cancelled, and the next call into MPI would
copy from the dead process and abort this one: then this process calls MPI no
more (``mpi_startup.stop_mpi``).
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import math
import weakref
from typing import Any, ClassVar

import dask
from dask.utils import parse_timedelta

from distributed.comm.core import CommClosedError
from distributed.comm.mpi_liveness import LocalPeer, death_watch, hung_up
from distributed.comm.mpi_startup import config, get_mpi, mpi_stopped, stop_mpi

# A receive whose writer hung up, and to which MPI delivered nothing for this
# many seconds, stalled: the sends of a writer that closed its comm go on
# delivering, those of one that aborted it, or died on another host, never
# will (rather than wait for stall-timeout)
HUNG_UP_STALL = 1.0


class Stalled(CommClosedError):
    """A receive to which MPI delivered nothing for ``stall-timeout`` (or
    :data:`HUNG_UP_STALL`, once its writer hung up)"""


class MPIStopped(CommClosedError):
    """This process calls MPI no more (see ``mpi_startup.stop_mpi``)"""


def completion_check(MPI):
    """``complete(request)``: whether a request is complete, without a call
    into MPI that progresses anything (MPICH's MPIX_Request_is_complete);
    None where the MPI library has no such call"""
    try:
        function = ctypes.CDLL(MPI.__file__).MPIX_Request_is_complete
    except AttributeError:
        return None
    function.restype = ctypes.c_int
    int_handles = MPI._sizeof(MPI.Request) == ctypes.sizeof(ctypes.c_int)
    function.argtypes = [ctypes.c_int if int_handles else ctypes.c_void_p]
    return lambda request: bool(function(request.handle))


def stop_if_doomed(requests: list, complete) -> bool:
    """After cancelling receives from a sender on this host that died: stop
    MPI in this process (``mpi_startup.stop_mpi``) if one is not complete,
    since MPI had matched it, and copies from the dead sender in its next
    call (``complete``: :func:`completion_check`'s); whether it did"""
    if complete is None or all(map(complete, requests)):
        return False
    stop_mpi("MPI had begun to receive a message from a process on this host that died")
    return True


class _Transfer:
    __slots__ = (
        "requests",
        "keepalive",
        "busy",
        "sender",
        "stall_after",
        "last",
        "sizes",
        "socket",
    )

    def __init__(
        self, requests, keepalive, busy, sender, stall_after, now, sizes, socket
    ):
        self.requests = requests
        self.keepalive = keepalive  # the buffers, until MPI is done with them
        self.busy = busy  # this process moves the data: poll without sleeping
        self.sender = sender  # a LocalPeer this receives from
        self.stall_after = stall_after
        self.last = now  # when a request of it last completed
        self.sizes = sizes  # of receives: the bytes each must get
        self.socket = socket  # of receives awaited: their comm's, to its writer


class Orphans:
    """Transfers that nobody waits for, and the buffers MPI may still touch,
    until their requests complete: tested together, those receiving from a
    sender on this host that died cancelled, those past their deadline
    cancelled too (nobody will match them).  The progress engine's, and the
    exit drain's."""

    def __init__(self, MPI):
        self.MPI = MPI
        self._complete = completion_check(MPI)
        # requests, their buffers, deadline, and the sender on this host of
        # receives
        self.entries: list[tuple[list, Any, float, LocalPeer | None]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, requests: list, keepalive: Any, deadline: float, sender) -> None:
        self.entries.append((requests, keepalive, deadline, sender))

    def drop_dead(self, died) -> None:
        """Cancel the receives from senders that died (``died(sender)``); stop
        MPI in this process if one that MPI had matched is left"""
        for requests, _, _, sender in self.entries:
            if died(sender):
                cancel_requests(self.MPI, requests)
                if stop_if_doomed(requests, self._complete):
                    return

    def test(self, now: float, before_mpi) -> bool:
        """Test them all in one call into MPI (each alone if that fails,
        after ``before_mpi()``), and cancel those past their deadline;
        whether any completed"""
        before_mpi()
        everything = [request for entry in self.entries for request in entry[0]]
        try:
            self.MPI.Request.Testsome(everything)
            alone = False
        except self.MPI.Exception:
            alone = True  # one of them failed: test each alone
        pending = []
        for entry in self.entries:
            requests, _, deadline, _ = entry
            try:
                if alone:
                    before_mpi()
                    if self.MPI.Request.Testall(requests):
                        continue
                elif not any(requests):  # Testsome nulled the completed
                    continue
                if now > deadline:
                    for request in filter(None, requests):  # not completed
                        request.Cancel()
            except self.MPI.Exception:
                continue
            pending.append(entry)
        completed = len(pending) < len(self.entries)
        self.entries = pending
        return completed

    def cancel_receives(self) -> None:
        """Cancel the receives left (MPICH cannot cancel sends)"""
        for requests, _, _, sender in self.entries:
            if sender is not None:
                cancel_requests(self.MPI, requests)


class Waited:
    """The transfers that someone waits for, each with its future, tested
    together: a future is set once its requests complete, and fails through
    ``fail(future, exception)`` (the engine's :meth:`ProgressEngine.cancel`)
    when a receive gets other than its size or stalls"""

    def __init__(self, MPI, fail):
        self.MPI = MPI
        self._fail = fail
        self.entries: dict[asyncio.Future, _Transfer] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def busy(self) -> bool:
        """Whether this process moves the data of one of them"""
        return any(entry.busy for entry in self.entries.values())

    def drop_dead(self, died) -> None:
        """Fail those receiving from senders that died (``died(sender)``)"""
        for fut, entry in list(self.entries.items()):
            if died(entry.sender):
                self._fail(fut, CommClosedError("the peer process died"))

    def to_orphans(self, orphans: Orphans) -> None:
        """Fail them all, MPI being stopped; their buffers stay with the
        ``orphans``, for good: MPI may hold them"""
        for fut, entry in self.entries.items():
            orphans.add(entry.requests, entry.keepalive, math.inf, entry.sender)
            if not fut.done():
                fut.set_exception(MPIStopped("MPI is stopped in this process"))
                fut.exception()  # retrieved: nobody may wait for it
        self.entries.clear()

    def test(self, now: float, before_mpi) -> bool:
        """Test them all in one call into MPI, after ``before_mpi()`` (a
        call per transfer, each after its own check of the senders, cost the
        square of their number in each poll); whether any request completed.
        Any counts as progress: frames are sent in chunks, so the engine
        keeps polling without sleeping while data flows."""
        before_mpi()
        entries = list(self.entries.items())
        if not entries:  # their senders died
            return False
        if len(entries) == 1:
            return self.test_one(*entries[0], now)
        requests, starts = [], []  # where each transfer's requests start
        for _, entry in entries:
            starts.append(len(requests))
            requests += entry.requests
        statuses: list = []
        try:
            completed = self.MPI.Request.Testsome(requests, statuses)
        except self.MPI.Exception:
            # One of them failed: test each alone to find which
            progressed = False
            for fut, entry in entries:
                before_mpi()
                if fut in self.entries:
                    progressed |= self.test_one(fut, entry, now)
            return progressed
        if completed is None:  # none was left active
            for fut, entry in entries:
                self._settle(fut, entry, None, [], now)
            return True
        # Each transfer's share of what completed, in its own indices
        shares: list[tuple[list, list]] = [([], []) for _ in entries]
        for index, status in zip(completed, statuses):
            n = bisect.bisect_right(starts, index) - 1
            shares[n][0].append(index - starts[n])
            shares[n][1].append(status)
        progressed = False
        for (fut, entry), (mine, theirs) in zip(entries, shares):
            progressed |= self._settle(fut, entry, mine, theirs, now)
        return progressed

    def test_one(self, fut: asyncio.Future, entry: _Transfer, now: float) -> bool:
        """Test the requests of one transfer; whether any completed"""
        statuses = [] if entry.sizes else None
        try:
            completed = self.MPI.Request.Testsome(entry.requests, statuses)
        except self.MPI.Exception as e:
            # Its other requests may still be active: cancelled, and their
            # buffers kept until MPI lets go
            self._fail(fut, CommClosedError(f"MPI transfer failed: {e}"))
            return True
        return self._settle(fut, entry, completed, statuses, now)

    def _settle(
        self,
        fut: asyncio.Future,
        entry: _Transfer,
        completed: list[int] | None,
        statuses: list | None,
        now: float,
    ) -> bool:
        """Act on a test of one transfer, whose requests at ``completed``
        completed with ``statuses`` (None: none was left active); whether
        any did"""
        if completed and entry.sizes:
            if wrong := wrong_size(self.MPI, completed, statuses, entry.sizes):
                self._fail(fut, CommClosedError(wrong))
                return True
        # Testsome set the completed requests to MPI_REQUEST_NULL (falsy); it
        # returns None once none is left active
        if completed is None or (completed and not any(entry.requests)):
            del self.entries[fut]
            if not fut.done():
                fut.set_result(None)
            return True
        if completed:
            entry.last = now
            return True
        idle = now - entry.last
        if entry.stall_after and (
            idle > entry.stall_after
            or (idle > HUNG_UP_STALL and entry.socket and hung_up(entry.socket))
        ):
            self._fail(fut, Stalled("MPI delivered nothing"))
        return False


class ProgressEngine:
    """Tests the MPI requests of one event loop while any is pending"""

    _engines: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()
    # What the engines of collected loops left in flight
    _left: ClassVar[list[tuple[list, Any, LocalPeer | None]]] = []

    @classmethod
    def current(cls) -> ProgressEngine:
        loop = asyncio.get_running_loop()
        try:
            return cls._engines[loop]
        except KeyError:
            engine = cls._engines[loop] = cls(loop)
            return engine

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.busy_poll_time = parse_timedelta(config("busy-poll-time"))
        self.poll_interval = parse_timedelta(config("poll-interval"))
        self.stall_timeout = parse_timedelta(config("stall-timeout"))
        self.orphan_timeout = parse_timedelta(
            dask.config.get("distributed.comm.timeouts.connect")
        )
        self.MPI = get_mpi()
        # A proxy: the engines' dict must not keep closed loops alive
        self._loop = weakref.proxy(loop)
        self._waited = Waited(self.MPI, self.cancel)
        self._orphans = Orphans(self.MPI)  # abandoned transfers
        self._handle: asyncio.Handle | None = None
        self._last_progress = loop.time()
        self._delay = 0.0

    def transfer(
        self,
        requests: list,
        keepalive: Any = None,
        local: bool = False,
        sender: LocalPeer | None = None,
    ) -> asyncio.Future:
        """A future that is done when all ``requests`` have completed;
        ``keepalive`` (their buffers) is referenced until then.  ``local``:
        with a process on this host, which copies the data itself.
        ``sender``: of receives from a process on this host, which fail
        should it die"""
        return self._add(requests, keepalive, not local, sender, None)

    def receive(
        self,
        requests: list,
        keepalive: Any,
        sender: LocalPeer | None,
        sizes: list[int],
        socket=None,
    ) -> asyncio.Future:
        """Like :meth:`transfer`, for receives from a peer, which fail should
        the ``sender`` (on this host) die, or a receive get other than its
        size in ``sizes`` (MPI fills a larger receive from a smaller send,
        silently).  The peer posted its sends as it wrote the message's head,
        so a receive that gets nothing for ``stall-timeout``, or for
        :data:`HUNG_UP_STALL` once the peer hung up its end of ``socket``
        (the comm's), means that MPI stopped delivering: it fails with
        :class:`Stalled`"""
        stall = self.stall_timeout
        return self._add(requests, keepalive, True, sender, stall, sizes, socket)

    def _add(
        self, requests, keepalive, busy, sender, stall_after, sizes=None, socket=None
    ):
        fut = self._loop.create_future()
        try:
            self.drop_dead_senders()  # just before MPI may start to copy
        except MPIStopped:
            self._orphans.add(requests, keepalive, math.inf, sender)
            raise
        statuses = [] if sizes else None
        if self.MPI.Request.Testall(requests, statuses):
            if sizes and (
                wrong := wrong_size(self.MPI, range(len(sizes)), statuses, sizes)
            ):
                fut.set_exception(CommClosedError(wrong))
            else:
                fut.set_result(None)
            return fut
        now = self._loop.time()
        entry = _Transfer(
            requests, keepalive, busy, sender, stall_after, now, sizes, socket
        )
        self._waited.entries[fut] = entry
        fut.add_done_callback(self._abandon_if_cancelled)
        if sizes:
            # MPICH with UCX copies a message from this host in the second
            # call into MPI after its receive was posted, at the earliest
            # (the first matches it with the sender's rendezvous): make that
            # call now rather than an iteration of the event loop later
            try:
                self.drop_dead_senders()
            except MPIStopped:
                return fut  # failed, with every transfer
            if fut in self._waited.entries:
                self._waited.test_one(fut, entry, now)
            if fut.done():
                return fut
        if busy:
            self.wake()
        elif self._handle is None and not self._loop.is_closed():
            self._handle = self._loop.call_later(self.poll_interval, self._poll)
        return fut

    def orphan(
        self, requests: list, keepalive: Any = None, sender: LocalPeer | None = None
    ) -> None:
        """Let ``requests`` complete in their own time, keeping ``keepalive``
        until they do, without anyone waiting (``sender``: of receives, on
        this host).  Those still pending after the connect timeout are
        cancelled: nobody will match them."""
        deadline = self._loop.time() + self.orphan_timeout
        self._orphans.add(requests, keepalive, deadline, sender)
        self.wake()

    def cancel(
        self, fut: asyncio.Future, exc: BaseException, drain: bool = False
    ) -> None:
        """Abandon a transfer, failing it with ``exc``: cancel its requests,
        and keep their buffers until MPI is done with them.  ``drain``: let a
        receive from a sender on this host complete instead, unless the
        sender dies or stalls: what the sender posted would otherwise stay
        queued in MPI, and UCX warns of each such message at exit.  Receives
        from other hosts are cancelled: nothing here would see their sender
        die."""
        entry = self._waited.entries.pop(fut, None)
        if entry is not None and drain and entry.sender is not None:
            entry.busy = False  # nobody waits for it
            entry.socket = None  # closed at this end: stall-timeout alone
            self._waited.entries[self._loop.create_future()] = entry
        elif entry is not None:
            if mpi_stopped() is None:
                cancel_requests(self.MPI, entry.requests)
            self.orphan(entry.requests, entry.keepalive, entry.sender)
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: a read posted ahead may never be awaited

    def abandon(self, fut: asyncio.Future) -> None:
        """Stop waiting for a transfer, and let it complete in its own time
        (see :meth:`orphan`)"""
        entry = self._waited.entries.pop(fut, None)
        if entry is not None:
            self.orphan(entry.requests, entry.keepalive, entry.sender)

    def _abandon_if_cancelled(self, fut: asyncio.Future) -> None:
        # Cancelled with the task that awaited it (a read, say), which then
        # cannot abandon it: its requests would be waited for on and on
        if fut.cancelled():
            self.abandon(fut)

    def pending(self) -> int:
        """How many transfers and abandoned ones are not complete"""
        return len(self._waited) + len(self._orphans)

    @classmethod
    def sizes(cls) -> dict[str, int]:
        """The transfers someone waits for, and abandoned ones, over every
        loop's engine"""
        engines = list(cls._engines.values())
        waited = sum(len(e._waited) for e in engines)
        return {"transfers": waited, "orphans": sum(len(e._orphans) for e in engines)}

    def in_flight(self) -> list[tuple[list, Any, LocalPeer | None]]:
        """The requests not complete, their buffers, and the peer on this
        host they receive from (None for sends and abandoned transfers)"""
        return [
            (entry.requests, entry.keepalive, entry.sender)
            for entry in self._waited.entries.values()
        ] + [
            (requests, keepalive, sender)
            for requests, keepalive, _, sender in self._orphans.entries
        ]

    def __del__(self):  # at shutdown, globals may be None: no module names
        # Its loop is gone, but MPI may still use the buffers: the exit drain
        # completes what is left (see mpi_channel.Channels.drain)
        self._left.extend(entry for entry in self.in_flight() if any(entry[0]))

    def wake(self) -> None:
        """Poll soon: something was posted"""
        self._last_progress = self._loop.time()
        self._delay = 0.0
        if isinstance(self._handle, asyncio.TimerHandle):
            self._handle.cancel()
            self._handle = None
        if self._handle is None and not self._loop.is_closed():
            self._handle = self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        self._handle = None
        now = self._loop.time()
        try:
            if self._waited.test(now, self.drop_dead_senders):
                self._last_progress = now
                self._delay = 0.0
            if self._orphans:
                self._orphans.test(now, self.drop_dead_senders)
        except MPIStopped:
            return  # every transfer failed; MPI keeps the orphans for good
        if self._handle is not None:
            return  # woken meanwhile (a transfer abandoned): one poll is due
        if not self._waited and not self._orphans:
            return  # nothing in flight: sleep until something is posted
        if not self._waited:
            # Only abandoned ones, which nobody waits for
            self._handle = self._loop.call_later(0.1, self._poll)
        elif not self._waited.busy():
            self._handle = self._loop.call_later(self.poll_interval, self._poll)
        elif now - self._last_progress < self.busy_poll_time:
            self._handle = self._loop.call_soon(self._poll)
        else:
            self._delay = min(max(2 * self._delay, 1e-5), self.poll_interval)
            self._handle = self._loop.call_later(self._delay, self._poll)

    def drop_dead_senders(self) -> None:
        """Cancel the receives from senders that died: before every call into
        MPI, any of which may copy from any of them.  UCX cancels only a
        receive still waiting for its message; should one that MPI matched
        be left, MPI is stopped in this process (``mpi_startup.stop_mpi``).
        Raises :class:`MPIStopped` (every transfer failed) once it is."""
        if mpi_stopped() is None:
            died = death_watch()
            self._waited.drop_dead(died)
            self._orphans.drop_dead(died)
        if mpi_stopped() is not None:
            self._waited.to_orphans(self._orphans)
            raise MPIStopped(f"MPI is stopped in this process: {mpi_stopped()}")


def wrong_size(MPI, indices, statuses: list, sizes: list[int]) -> str | None:
    """What is wrong with the receives at ``indices`` that completed with
    ``statuses``, if one got other than its size in ``sizes``"""
    for index, status in zip(indices, statuses):
        got = status.Get_count(MPI.BYTE)
        if got != sizes[index]:
            return f"MPI delivered {got} bytes to a receive of {sizes[index]}"
    return None


def cancel_requests(MPI, requests: list) -> None:
    """Cancel those of ``requests`` not complete, where MPI can"""
    for request in filter(None, requests):  # not completed
        try:
            request.Cancel()
        except MPI.Exception:
            pass  # not cancellable


def left_in_flight() -> list[tuple[list, Any, LocalPeer | None]]:
    """At exit: what the engines of loops that stopped left in flight (see
    :meth:`ProgressEngine.in_flight`); engines of loops still running in other
    threads test their own"""
    left = list(ProgressEngine._left)
    for loop, engine in list(ProgressEngine._engines.items()):
        if not loop.is_running():
            left += engine.in_flight()
    return left
