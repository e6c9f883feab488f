"""Drive outstanding MPI operations from the asyncio event loop.

MPI only moves data when a process calls into it, so someone has to test the
outstanding requests.  One :class:`ProgressEngine` per event loop does so
cooperatively, in short callbacks between the loop's other work (the MPI4Dask
idea of ``Test()`` plus ``await asyncio.sleep(0)``), instead of a thread that
would compete for the GIL.

Polling costs CPU, so the engine adapts:

- right after any progress it polls on every loop iteration for
  ``busy-poll-time``, which keeps ping-pong latency low;
- then it backs off exponentially, up to ``poll-interval`` between polls;
- once only probes for new messages are left (no data in flight) and nothing
  happened for ``idle-after``, it stops polling altogether.  A sender rings a
  doorbell on the comm's TCP connection (see ``distributed.comm.mpi``) which
  calls :meth:`ProgressEngine.wake`, so an idle process uses no CPU.

``progress-mode: busy`` never stops polling, as MPI4Dask did.

Before each call into MPI the engine cancels the receives from peer processes
on this host that died (see ``distributed.comm.mpi_liveness``).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, ClassVar

import dask
from dask.utils import parse_timedelta

from distributed.comm.core import CommClosedError
from distributed.comm.mpi_startup import config, get_mpi
from distributed.comm.mpi_liveness import LocalPeer


class ProgressEngine:
    """Tests the MPI requests and matched probes of one event loop"""

    _engines: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    @classmethod
    def current(cls) -> ProgressEngine:
        loop = asyncio.get_running_loop()
        try:
            return cls._engines[loop]
        except KeyError:
            engine = cls._engines[loop] = cls(loop)
            return engine

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.busy = config("progress-mode") == "busy"
        self.busy_poll_time = parse_timedelta(config("busy-poll-time"))
        self.poll_interval = parse_timedelta(config("poll-interval"))
        self.idle_after = parse_timedelta(config("idle-after"))
        self.orphan_timeout = parse_timedelta(
            dask.config.get("distributed.comm.timeouts.connect")
        )
        self._MPI = get_mpi()
        # A proxy: the engines' dict must not keep closed loops alive
        self._loop = weakref.proxy(loop)
        # future -> (requests, objects that must stay alive until they complete)
        self._transfers: dict[asyncio.Future, tuple[list, Any]] = {}
        # future -> (communicator, source, tag)
        self._probes: dict[asyncio.Future, tuple[Any, int, int]] = {}
        # future of a receive -> the LocalPeer it receives from
        self._senders: dict[asyncio.Future, LocalPeer] = {}
        # requests of cancelled transfers: MPI may still touch their buffers
        self._orphans: list[tuple[list, Any, float]] = []
        self._handle: asyncio.Handle | None = None
        self._last_progress = loop.time()
        self._delay = 0.0

    def transfer(
        self, requests: list, keepalive: Any = None, sender: LocalPeer | None = None
    ) -> asyncio.Future:
        """A future that is done when all ``requests`` have completed.

        ``keepalive`` (the buffers of the requests) is referenced until then.
        Receives from a ``sender`` fail should it die.
        """
        fut = self._loop.create_future()
        self._transfers[fut] = (requests, keepalive)
        if sender is not None:
            self._senders[fut] = sender
            fut.add_done_callback(self._senders.pop)
        # Just before MPI may start to copy: the less time in between, the
        # smaller the chance that a sender dies unseen
        self.drop_dead_senders()
        if fut.done():
            return fut
        if self._MPI.Request.Testall(requests):
            del self._transfers[fut]
            fut.set_result(None)
        else:
            self.wake()
        return fut

    def orphan(self, requests: list, keepalive: Any = None) -> None:
        """Let ``requests`` complete in their own time, keeping ``keepalive``
        until they do, without anyone waiting or the engine polling for them.
        Those still pending after the connect timeout are cancelled: nobody
        will receive them (a send to this same process is only complete once
        received)."""
        deadline = self._loop.time() + self.orphan_timeout
        self._orphans.append((requests, keepalive, deadline))

    def probe(self, comm, source: int, tag: int) -> asyncio.Future:
        """A future for ``(message, nbytes)``: the next message matching
        ``source`` and ``tag`` on ``comm``, removed from MPI's matching queue"""
        fut = self._loop.create_future()
        self._probes[fut] = (comm, source, tag)
        self.wake()
        return fut

    def cancel(self, fut: asyncio.Future, exc: BaseException) -> None:
        """Abandon a transfer or probe, failing it with ``exc``: cancel its
        requests, and keep their buffers until MPI is done with them"""
        self._probes.pop(fut, None)
        entry = self._transfers.pop(fut, None)
        if entry is not None:
            for request in entry[0]:
                try:
                    request.Cancel()
                except self._MPI.Exception:
                    pass  # completed already, or not cancellable
            self.orphan(*entry)
        if not fut.done():
            fut.set_exception(exc)

    def wake(self) -> None:
        """Poll soon: something was posted, or a peer rang the doorbell"""
        self._last_progress = self._loop.time()
        self._delay = 0.0
        if isinstance(self._handle, asyncio.TimerHandle):
            self._handle.cancel()
            self._handle = None
        if self._handle is None and not self._loop.is_closed():
            self._handle = self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        self._handle = None
        progressed = self._test_transfers() | self._test_probes()
        if self._orphans:
            self._test_orphans()

        now = self._loop.time()
        if progressed:
            self._last_progress = now
            self._delay = 0.0
        if not self._transfers and not self._probes:
            return
        quiet = now - self._last_progress
        if self.busy or quiet < self.busy_poll_time:
            self._handle = self._loop.call_soon(self._poll)
        elif self._transfers or quiet < self.idle_after:
            self._delay = min(max(2 * self._delay, 1e-5), self.poll_interval)
            self._handle = self._loop.call_later(self._delay, self._poll)
        # else: only waiting for new messages, and idle: sleep until woken

    def drop_dead_senders(self) -> None:
        """Cancel the receives from senders that died: before every call into
        MPI, any of which may copy from any of them (a poll makes several)"""
        if not self._senders:
            return
        peers = {peer.pid: peer for peer in self._senders.values()}
        dead = {pid for pid, peer in peers.items() if peer.died()}
        if not dead:
            return
        for fut, peer in list(self._senders.items()):
            if peer.pid in dead and not fut.done():
                self.cancel(fut, CommClosedError("the peer process died"))

    def _test_transfers(self) -> bool:
        # Any completed request counts as progress: frames are sent in chunks,
        # so the engine keeps polling without sleeping while data flows.
        progressed = False
        for fut, (requests, _) in list(self._transfers.items()):
            self.drop_dead_senders()
            if fut not in self._transfers:
                continue  # its sender died
            try:
                completed = self._MPI.Request.Testsome(requests)
            except self._MPI.Exception as e:
                del self._transfers[fut]
                if not fut.done():
                    fut.set_exception(CommClosedError(f"MPI transfer failed: {e}"))
                progressed = True
                continue
            if completed:
                progressed = True
            # Testsome set the completed requests to MPI_REQUEST_NULL (falsy);
            # it returns None once none is left active
            if completed is None or (completed and not any(requests)):
                del self._transfers[fut]
                if not fut.done():
                    fut.set_result(None)
                progressed = True
        return progressed

    def _test_probes(self) -> bool:
        progressed = False
        for fut, (comm, source, tag) in list(self._probes.items()):
            if fut.cancelled():
                # Nobody wants the message any more: leave it in MPI's queue
                del self._probes[fut]
                continue
            status = self._MPI.Status()
            self.drop_dead_senders()
            try:
                message = comm.Improbe(source, tag, status)
            except self._MPI.Exception as e:
                del self._probes[fut]
                fut.set_exception(CommClosedError(f"MPI probe failed: {e}"))
                continue
            if message is not None:
                del self._probes[fut]
                fut.set_result((message, status.Get_count(self._MPI.BYTE)))
                progressed = True
        return progressed

    def _test_orphans(self) -> None:
        now = self._loop.time()
        pending = []
        for requests, keepalive, deadline in self._orphans:
            self.drop_dead_senders()
            try:
                if self._MPI.Request.Testall(requests):
                    continue
                if now > deadline:
                    for request in requests:
                        request.Cancel()
            except self._MPI.Exception:
                continue
            pending.append((requests, keepalive, deadline))
        self._orphans = pending
