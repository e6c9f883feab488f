"""The ``mpi://`` transport: Dask comms whose messages travel over MPI.

An ``mpi://HOST:PORT`` address is a TCP listener that is only used to meet.
The two ends of a new comm exchange a short handshake over TCP, agree on an
MPI channel between their processes (see ``distributed.comm.mpi_channel``)
and on a tag for each direction, and from then on every message and frame
moves over MPI, with non-blocking buffer sends and receives driven by the
progress engine (see ``distributed.comm.mpi_progress``).

The TCP connection stays open for the comm's lifetime as a liveness signal
and a doorbell: it ends when the peer closes the comm or dies, and each end
rings it to wake the other's sleeping progress engine, saying how many
messages it has written and read so far.  Two processes that MPI failed to
connect send their messages over it instead, as ``tcp://`` does: slower, but
a cluster does not stall on a broken MPI.  So do two processes between which
MPI stopped delivering (UCX's shared-memory queue of a process can stay
blocked for good when a process writing to it is killed): when a message
rung for has not arrived within ``distributed.comm.mpi.stall-timeout``, the
comm moves to TCP, and each end writes again there what the other has not
read; a writer keeps its messages until the reader's doorbell says it read
them.

One Dask message is, on the sender's tag:

- a head: flags (u8), three padding bytes, the number of frames (u32), how
  many messages the sender has read from the comm so far (u64), each frame's
  size (u64) and where it lives (u8: 0 host memory, 1 a GPU); the frames
  follow inside the head when they are all in host memory and the whole
  message fits in ``distributed.comm.mpi.inline-size``;
- otherwise one MPI message per ``chunk-size`` piece of each non-empty frame.

Between two processes with a GPU, frames of GPU data stay on the GPU: see
``distributed.comm.mpi_gpu``.

A head with the CLOSE flag ends the stream.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import struct
import weakref
from time import monotonic
from typing import NamedTuple

import dask
from dask.utils import format_time, parse_bytes, parse_timedelta
from tornado.iostream import StreamClosedError

from distributed.comm import mpi_channel, mpi_gpu, mpi_handshake as handshake
from distributed.comm import mpi_startup
from distributed.comm.addressing import get_address_host
from distributed.comm.core import CommClosedError, FatalCommClosedError
from distributed.comm.mpi_channel import ACCEPTOR
from distributed.comm.mpi_liveness import LocalPeer
from distributed.comm.mpi_progress import ProgressEngine
from distributed.comm.mpi_startup import config, get_mpi
from distributed.comm.tcp import (
    TCP,
    BaseTCPBackend,
    TCPConnector,
    TCPListener,
    convert_stream_closed_error,
)
from distributed.comm.utils import from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_memoryview, wait_for

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<BxxxIQ")
_INLINE = 1
_CLOSE = 2

# On the TCP connection after the handshake, a byte then its numbers (u64):
# a doorbell, with the messages written and read so far; a move to TCP,
# with the messages read; or a closing byte, before a graceful close
_DOORBELL, _MOVE, _CLOSING = 1, 2, 0
_COUNT = struct.Struct("!Q")
_COUNTS = struct.Struct("!QQ")


class _MovedToTCP(Exception):
    """A read over MPI gave up: the message comes again over TCP"""


def _connect_timeout() -> float:
    return parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))


def _weakly(method):
    """A callback that calls a comm's method, without keeping the comm alive:
    a comm dropped without close() is collected, as a tcp:// comm is"""
    ref = weakref.WeakMethod(method)

    def call(*args):
        if (alive := ref()) is not None:
            alive(*args)

    return call


def _pack(frames: list, read: int, inline_size: int):
    """A message's head, and the frames to send after it: none when they fit
    in the head.  Frames are memoryviews, or device buffers (on a GPU)."""
    sizes = [mpi_gpu.nbytes(frame) for frame in frames]
    locations = bytes(map(mpi_gpu.location, frames))
    inline = (
        not any(locations) and _HEAD.size + 9 * len(frames) + sum(sizes) <= inline_size
    )
    head = [
        _HEAD.pack(_INLINE if inline else 0, len(frames), read),
        struct.pack(f"<{len(sizes)}Q", *sizes),
        locations,
    ]
    if inline:
        return b"".join([*head, *frames]), []
    return b"".join(head), frames


def _chunks(frame, size: int) -> list:
    """``size`` pieces of a frame, for MPI: memoryviews, or views of a device
    buffer that mpi4py passes on as device pointers"""
    if mpi_gpu.is_device(frame):
        return [
            mpi_gpu.DeviceSlice(frame, offset, n)
            for offset, n in mpi_gpu.pieces(mpi_gpu.nbytes(frame), size)
        ]
    return [frame[i : i + size] for i in range(0, frame.nbytes, size)]


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a done future's exception as seen: nobody may await it"""
    if not fut.cancelled():
        fut.exception()


class State(enum.Enum):
    """Where an mpi:// comm's messages travel.  Transitions: OPENING to ON_MPI
    or ON_TCP (the handshake); ON_MPI to MOVING (:meth:`MPI._move_to_tcp`),
    then ON_TCP; ON_MPI to PEER_CLOSED (the peer closed its end: read what it
    sent before, write nothing); any state to CLOSED (:meth:`MPI.close`,
    :meth:`MPI.abort`, the peer's CLOSE head)."""

    OPENING = "opening"
    ON_MPI = "on MPI"
    MOVING = "moving to TCP"
    ON_TCP = "on TCP"
    PEER_CLOSED = "closed by the peer"
    CLOSED = "closed"


class _Route(NamedTuple):
    """Where a comm's MPI messages go: its channel, tags and progress engine"""

    channel: mpi_channel.Channel
    send_tag: int
    recv_tag: int
    engine: ProgressEngine
    sender: LocalPeer | None  # the peer, when it is on this host
    inline_size: int  # messages up to this size travel inside their head
    chunk_size: int  # larger frames travel in pieces of this size
    gpu: str | None  # how device frames travel (mpi_gpu.path); None: not at all


class _Ledger:
    """How many messages each end of a comm wrote and read, and the messages
    this end wrote that the peer has not said it read: they are written again
    over TCP should the comm move there"""

    def __init__(self):
        self.written = 0  # messages this end wrote over MPI
        self.read = 0  # ... and read
        self.announced = 0  # messages the peer wrote, as it last said
        self.unread: collections.deque = collections.deque()  # (number, write args)

    def wrote(self, *write_args) -> None:
        self.written += 1
        self.unread.append((self.written, write_args))

    def peer_wrote(self, written: int) -> None:
        self.announced = max(self.announced, written)

    def peer_read(self, read: int) -> None:
        """The peer read the first ``read`` messages: never write them again"""
        while self.unread and self.unread[0][0] <= read:
            self.unread.popleft()

    @property
    def behind(self) -> bool:
        """Whether the peer wrote messages this end has not read"""
        return self.announced > self.read

    def counts(self) -> tuple[int, int]:
        return self.written, self.read


class _Doorbell:
    """Wakes the peer's progress engine: a byte on the comm's TCP connection,
    with the messages written and read so far.  Rings at most once per
    ``interval`` (a woken engine polls for ``idle-after``: twice as long), and
    once more at its end with what changed in between."""

    def __init__(self, stream, ledger: _Ledger, interval: float):
        self.stream = stream  # None once the connection carries no doorbells
        self._ledger = ledger
        self._interval = interval
        self._rung = float("-inf")
        self._told = (0, 0)  # what the peer was told: messages written, read
        self._later: asyncio.TimerHandle | None = None

    def ring(self, news_only: bool = False) -> None:
        counts = self._ledger.counts()
        if self.stream is None or (news_only and counts == self._told):
            return
        wait = self._rung + self._interval - monotonic()
        if wait > 0:
            if self._later is None:
                self._later = asyncio.get_running_loop().call_later(wait, self._again)
            return
        self._rung, self._told = monotonic(), counts
        try:
            self.stream.write(bytes([_DOORBELL]) + _COUNTS.pack(*counts))
        except StreamClosedError:
            pass

    def ring_soon(self) -> None:
        """Within ``interval``, unless a doorbell goes out sooner: the peer
        may forget what this end read (a message's head tells it sooner)"""
        if self._later is None:
            loop = asyncio.get_running_loop()
            self._later = loop.call_later(self._interval, self._again)

    def ring_until_sent(self, sent: asyncio.Future) -> None:
        """Ring, and again every ``interval`` until the message is sent: MPI
        may put it on the wire only in a later call (a connection still being
        set up, a full queue), when the peer, woken too early, has gone back
        to sleep"""
        self.ring()
        if not sent.done():
            loop = asyncio.get_running_loop()
            loop.call_later(self._interval, self.ring_until_sent, sent)

    def told_read(self) -> None:
        """A message's head told the peer how many messages this end read"""
        self._told = (self._told[0], self._ledger.read)

    def silence(self) -> None:
        """The connection carries TCP messages from now on, or nothing"""
        self.stream = None
        if self._later is not None:
            self._later.cancel()

    def _again(self) -> None:
        self._later = None
        self.ring(news_only=True)


class _StallWatch:
    """Notices that MPI stopped delivering to a comm: the peer rang for
    messages that were not read, a read waits, and MPI delivered nothing to
    it for ``stall-timeout`` (as when a killed process left UCX's
    shared-memory queue of this one blocked)"""

    def __init__(self, comm: MPI, timeout: float):
        self._comm = weakref.ref(comm)
        self._timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        self._progress_at = 0.0  # a read started or received something
        self.receiving: list = []  # requests of the frames being read
        self._receiving_seen = 0  # how many of them were pending, last check
        self._suspect = False

    def progress(self) -> None:
        self._progress_at = monotonic()

    def start(self) -> None:
        """Check now and then while the peer wrote messages not read yet"""
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._timeout / 4, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _check(self) -> None:
        self._timer = None
        comm = self._comm()
        if comm is None or comm._state is not State.ON_MPI or not comm._ledger.behind:
            return
        now = monotonic()
        receiving = sum(map(bool, self.receiving))  # completed ones are null
        if receiving != self._receiving_seen:
            self._progress_at = now
            self._receiving_seen = receiving
        if not comm._reads or now - self._progress_at < self._timeout:
            self._suspect = False
        elif not self._suspect:
            # This event loop may have been busy: let the engine poll once
            # more before concluding
            self._suspect = True
            comm._route.engine.wake()
        else:
            comm._stalled(self._timeout)
            return
        self.start()


class MPI(TCP):
    """A comm whose messages travel over an MPI channel.

    It is a ``TCP`` comm, and takes from it: the TCP connection (``stream``)
    made by the connector or listener, and the finalizer that closes it
    when the comm is collected; the addresses and ``extra_info``; and, in
    state ON_TCP, ``read``, ``write``, ``close`` and ``closed`` as they are.
    In every other state (see :class:`State`) the TCP connection carries the
    handshake, then doorbells and the end of the comm, and messages travel
    over MPI."""

    def __init__(self, stream, local_addr: str, peer_addr: str, deserialize=True):
        self._state = State.OPENING  # before TCP's __init__, whose repr() asks
        super().__init__(stream, local_addr, peer_addr, deserialize)
        self._route: _Route | None = None  # once ON_MPI
        self._ledger = _Ledger()
        self._doorbell = _Doorbell(
            stream, self._ledger, parse_timedelta(config("idle-after")) / 2
        )
        self._stall_watch = _StallWatch(self, parse_timedelta(config("stall-timeout")))
        self._reads: set = set()  # engine futures of the read in progress
        self._writes: set = set()  # ... and of writes not sent yet
        self._reading: asyncio.Future | None = None  # done when a read leaves MPI
        self._moved: asyncio.Task | None = None  # finishes MOVING
        self._peer_moved: asyncio.Future | None = None  # what the peer read
        self._watcher: asyncio.Task | None = None  # follows the TCP connection
        self._posting = asyncio.Lock()  # held while a message's sends are posted

    @property
    def state(self) -> State:
        """Where this comm's messages travel now"""
        return self._state

    @property
    def gpu_path(self) -> str | None:
        """How GPU frames travel: "direct" (CUDA-aware MPI), "staged" (through
        pinned host memory), or None: as host frames, one end has no GPU"""
        return self._route and self._route.gpu

    def closed(self):
        if self._state in (State.OPENING, State.ON_TCP):
            return super().closed()
        return self._state in (State.PEER_CLOSED, State.CLOSED)

    # Setting up

    async def _accept(self) -> None:
        """The listening end of the handshake"""
        await mpi_startup.mpi_ready()
        stream = self.stream
        peer = await handshake.recv(stream)
        problem = handshake.incompatibility(peer)
        if problem:
            await handshake.send(stream, {"error": problem})
            handshake.log_refusal(
                f"mpi:// listener at {self._local_addr} refuses connections "
                f"from {get_address_host(self._peer_addr)}: {problem}"
            )
            raise handshake.Refused(problem)
        # MPI failed between these two processes before: do not wait for it again
        gave_up = peer.get("gave_up_on") == mpi_startup.process_id()
        channel = new = None
        if not gave_up and mpi_channel.reachable(peer["process"]):
            channel = mpi_channel.find_channel(peer.get("channel"), peer["process"])
            new = channel is None
            if new and (
                handshake.same_world(peer)
                or (not peer.get("full") and mpi_channel.room_for(handshake.job(peer)))
            ):
                channel = mpi_channel.new_channel(peer["process"])
        if channel is None:
            await handshake.send(stream, {**handshake.hello(), "mpi": False})
            self._state = State.ON_TCP
            return
        channel.comms.add(self)  # in use: not to be freed meanwhile
        tag = channel.allocate_tags()
        reply = {**handshake.hello(), "channel": channel.id, "tag": tag, "new": new}
        await handshake.send(stream, reply)
        if not new or await self._open(channel, peer):
            self._start(channel, peer, recv_tag=tag, send_tag=tag + 1)

    async def _connect(self) -> None:
        """The connecting end of the handshake"""
        await mpi_startup.mpi_ready()
        stream = self.stream
        last = mpi_channel.peer_at(self._peer_addr)  # may since have restarted
        known = last and mpi_channel.find_channel(None, last)
        if known:
            known.comms.add(self)  # in use: not to be freed meanwhile
        hello = {
            **handshake.hello(),
            "channel": known and known.id,
            "gave_up_on": None if mpi_channel.reachable(last) else last,
            "full": mpi_channel.full(),  # of jobs: a new one must use TCP
        }
        await handshake.send(stream, hello)
        reply = await handshake.recv(stream)
        problem = reply.get("error") or handshake.incompatibility(reply)
        if problem:
            message = f"Cannot connect to {self._peer_addr}: {problem}"
            handshake.log_refusal(message)
            raise FatalCommClosedError(message)
        peer = reply["process"]
        mpi_channel.remember_address(self._peer_addr, peer)
        if reply.get("mpi") is False:
            self._state = State.ON_TCP
            return
        if reply["new"]:
            channel = mpi_channel.new_channel(peer, reply["channel"])
            channel.comms.add(self)
            if not await self._open(channel, reply):
                return
        else:
            channel = mpi_channel.find_channel(reply["channel"], peer)
            if channel is None or channel.id != reply["channel"]:
                # Freed here just now, as its last comm closed: the peer will
                # not propose it again once it has seen that comm close
                raise CommClosedError(
                    f"{self._peer_addr} proposed an MPI channel freed here"
                )
        tag = reply["tag"]
        self._start(channel, reply, recv_tag=tag + 1, send_tag=tag)

    async def _open(self, channel, peer: dict) -> bool:
        """Open a new channel with the peer: the acceptor sends a port name
        (none for another rank of its own job) and enters MPI at once; the
        connector follows when it reads the port, if the acceptor is still
        there (see ``distributed.comm.mpi_channel`` for why this order).

        Whether both ends opened it.  If MPI failed at either end, both say
        so, and this comm, and every later one between the two processes,
        moves its messages over TCP: MPI that cannot connect two processes
        may slow a cluster down, but must not stop it."""
        stream = self.stream
        same_world = handshake.same_world(peer)
        timeout = parse_timedelta(config("channel-timeout"))
        error = None
        try:
            if channel.role == ACCEPTOR:
                port = None if same_world else mpi_channel.open_port()
                try:
                    await handshake.send(stream, {"port": port})
                except BaseException:
                    if port is not None:
                        mpi_channel.close_port(port)
                    raise
            else:
                port = (await handshake.recv(stream))["port"]
                acceptor = LocalPeer.find(peer)
                if handshake.peer_gone(stream) or (acceptor and acceptor.died()):
                    raise CommClosedError(
                        f"{self._peer_addr} went away while opening an MPI channel"
                    )
            # No await from here on: the acceptor is waiting, or about to.
            # MPI progresses every receive while it blocks here
            ProgressEngine.current().drop_dead_senders()
            if same_world:
                channel.join(peer["world"][1])
            elif channel.role == ACCEPTOR:
                channel.accept(port, timeout)
            else:
                channel.connect(port, timeout)
        except get_mpi().Exception as e:
            error = e
        try:
            await handshake.send(stream, {"opened": error is None})
            opened = (await handshake.recv(stream))["opened"] is True
        except StreamClosedError:
            if error is None:
                raise
            raise CommClosedError(
                f"{self._peer_addr} went away while opening an MPI channel: {error}"
            ) from error
        if error is None and opened:
            if not same_world:
                mpi_channel.met(handshake.job(peer))
            return True
        logger.warning(
            "MPI could not connect %s to %s (%s): their comms move their "
            "messages over TCP from now on",
            self._local_addr,
            self._peer_addr,
            error or "it failed at the other end",
        )
        mpi_channel.give_up_on(channel)
        self._state = State.ON_TCP
        return False

    def _start(self, channel, peer: dict, recv_tag: int, send_tag: int) -> None:
        self._route = _Route(
            channel,
            send_tag,
            recv_tag,
            ProgressEngine.current(),
            LocalPeer.find(peer),
            parse_bytes(config("inline-size")),
            # Open MPI 5 has no large-count calls: keep each message below 2 GiB
            min(parse_bytes(config("chunk-size")), 2**31 - 1),
            mpi_gpu.path(mpi_gpu.hello(get_mpi()), peer.get("gpu")),
        )
        self._state = State.ON_MPI
        self._peer_moved = asyncio.get_running_loop().create_future()
        channel.comms.add(self)
        self._watcher = asyncio.ensure_future(
            _watch_peer(weakref.ref(self), self.stream)
        )

    # What the peer says over TCP (see _watch_peer)

    def _heard_doorbell(self, written: int, read: int) -> None:
        self._ledger.peer_wrote(written)
        self._ledger.peer_read(read)
        self._route.engine.wake()
        if self._ledger.behind and self._state is State.ON_MPI:
            self._stall_watch.start()

    def _heard_move(self, read: int) -> None:
        """The peer moves to TCP, having read this many messages"""
        self._move_to_tcp()
        if not self._peer_moved.done():
            self._peer_moved.set_result(read)

    def _peer_closed(self, graceful: bool) -> None:
        """The TCP connection ended: the peer closed the comm or is gone"""
        if self._state is State.CLOSED:
            return  # closed here
        self._fail(self._writes, "peer closed the connection")
        if not graceful or self._state is not State.ON_MPI:
            self.abort()
            return
        # Reads go on until the CLOSE head, sent before the TCP connection
        # was closed; should it never come, give up after a while.
        self._state = State.PEER_CLOSED
        asyncio.get_running_loop().call_later(_connect_timeout(), _weakly(self.abort))

    # Reading and writing

    async def _on_tcp(self) -> bool:
        """Whether messages travel over TCP, once a move under way is done"""
        if self._state is State.MOVING:
            await self._moved
        return self._state is State.ON_TCP

    async def read(self, deserializers=None):
        if await self._on_tcp():
            return await super().read(deserializers)
        if self._state is State.CLOSED:
            raise CommClosedError(f"{self} is closed")
        reading = self._reading = asyncio.get_running_loop().create_future()
        try:
            frames = await self._read_over_mpi()
        except _MovedToTCP:
            frames = None
        finally:
            reading.set_result(None)
        if frames is None:  # it comes again over TCP
            await self._moved
            return await super().read(deserializers)
        self._doorbell.ring_soon()
        try:
            return await from_frames(
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError:
            self.abort()
            raise CommClosedError("aborted stream on truncated data")

    async def _read_over_mpi(self) -> list:
        route, watch = self._route, self._stall_watch
        channel, engine = route.channel, route.engine
        watch.progress()
        try:
            message, nbytes = await self._await_read(
                engine.probe(channel.comm, channel.rank, route.recv_tag)
            )
            watch.progress()
            self._check_sender()
            head = bytearray(nbytes)
            request = message.Irecv([head, get_mpi().BYTE])
            await self._await_read(engine.transfer([request], head, route.sender))

            flags, nframes, read = _HEAD.unpack_from(head)
            self._ledger.peer_read(read)
            sizes = struct.unpack_from(f"<{nframes}Q", head, _HEAD.size)
            offset = _HEAD.size + 8 * nframes
            locations = head[offset : offset + nframes]
            offset += nframes
            if flags & _CLOSE:
                self.abort()
                raise CommClosedError(f"{self} closed by peer")
            if flags & _INLINE:
                view = memoryview(head)
                frames = []
                for size in sizes:
                    frames.append(view[offset : offset + size])
                    offset += size
            else:
                frames = await self._read_frames(sizes, locations)
            self._ledger.read += 1
        except (CommClosedError, _MovedToTCP):
            raise
        except get_mpi().Exception as e:
            self.abort()
            raise CommClosedError(f"{self}: MPI error while reading: {e}") from e
        except BaseException:
            # Cancelled half-way: the stream's position is unknown
            self.abort()
            raise
        return frames

    async def _read_frames(self, sizes, locations) -> list:
        """Receive the frames of a message, whose head gave their sizes and
        where they live, in order"""
        route = self._route
        if any(locations) and route.gpu is None:
            self.abort()
            raise CommClosedError(
                f"{self}: the peer sent GPU frames, which this process cannot "
                "hold (it has no GPU or no CuPy)"
            )
        frames = [
            mpi_gpu.device_buffer(size) if where else host_array(size)
            for size, where in zip(sizes, locations)
        ]
        if any(locations):
            mpi_gpu.synchronize()  # the allocations, before anything writes
        pending, chunks = [], []
        for frame, where in zip(frames, locations):
            if where and route.gpu == "staged":
                if chunks:
                    pending.append(self._post_recv(chunks))
                    chunks = []
                await mpi_gpu.recv_staged(
                    frame,
                    route.chunk_size,
                    lambda slot: self._post_recv([slot]),
                    self._await_read,
                )
            else:
                chunks += _chunks(frame, route.chunk_size)
        if chunks:
            pending.append(self._post_recv(chunks))
        for fut in pending:
            await self._await_read(fut)
        self._stall_watch.receiving = []
        return frames

    def _post_recv(self, chunks: list) -> asyncio.Future:
        """Start receiving the next ``chunks`` of a message"""
        self._check_sender()
        route, MPI = self._route, get_mpi()
        channel = route.channel
        requests = [
            channel.comm.Irecv([chunk, MPI.BYTE], channel.rank, route.recv_tag)
            for chunk in chunks
        ]
        self._stall_watch.progress()
        self._stall_watch.receiving = requests
        fut = route.engine.transfer(requests, chunks, route.sender)
        self._reads.add(fut)  # until awaited (_await_read), or failed (_fail)
        return fut

    def _check_sender(self) -> None:
        """Before a receive, which may start to copy at once: the sender lives
        (see ``distributed.comm.mpi_liveness``)"""
        sender = self._route.sender
        if sender is not None and sender.died():
            self.abort()
            raise CommClosedError(f"{self}: the peer process died")

    async def _await_read(self, fut):
        """Await an engine future of a read; give up if the comm is moving
        to TCP, even if it completed: the peer will send it again there"""
        self._reads.add(fut)
        try:
            result = await fut
        finally:
            self._reads.discard(fut)
        if self._state in (State.MOVING, State.ON_TCP):
            raise _MovedToTCP()
        return result

    async def write(self, msg, serializers=None, on_error="message"):
        if await self._on_tcp():
            return await super().write(msg, serializers, on_error)
        if self._state is not State.ON_MPI:
            raise CommClosedError(f"{self} is closed")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            # Between two processes with a GPU, GPU data stays there
            serializers=serializers or (self._route.gpu and mpi_gpu.SERIALIZERS),
            on_error=on_error,
            context={
                "sender": self.local_info,
                "recipient": self.remote_info,
                **self.handshake_options,
            },
            # Large frames travel in chunk-size pieces anyway, and shards would
            # be copied together again on arrival: shard only to compress
            frame_split_size=(
                None if self.handshake_options.get("compression") else 2**62
            ),
        )
        # The comm may have moved, or started to, while the message was serialised
        if await self._on_tcp():
            return await super().write(msg, serializers, on_error)
        frames = [
            frame if mpi_gpu.is_device(frame) else ensure_memoryview(frame)
            for frame in frames
        ]
        nbytes = sum(map(mpi_gpu.nbytes, frames))
        device = [frame for frame in frames if mpi_gpu.is_device(frame)]
        if device:
            mpi_gpu.synchronize(device)  # their producers are done
        try:
            async with self._posting:  # a staged frame posts as it goes
                if self._state is not State.ON_MPI:
                    raise CommClosedError(f"{self} is closed")
                head, frames = _pack(frames, self._ledger.read, self._route.inline_size)
                self._doorbell.told_read()
                self._ledger.wrote(msg, serializers, on_error)
                sends = await self._post_message(head, frames)
        except get_mpi().Exception as e:
            self.abort()
            raise CommClosedError(f"{self}: MPI error while writing: {e}") from e
        except CommClosedError:
            if await self._on_tcp():
                return nbytes  # the move writes it again over TCP
            raise
        # Like a TCP comm's write, return once the message is queued: waiting
        # until MPI completed the sends would deadlock two ends that both
        # write before they read.  The engine keeps the frames alive.
        sent = sends[0] if len(sends) == 1 else asyncio.gather(*sends)
        if not sent.done():
            sent.add_done_callback(_weakly(self._sent))
        self._doorbell.ring_until_sent(sent)
        return nbytes

    async def _post_message(self, head: bytes, frames: list) -> list:
        """Start sending a message's head and frames, in order; the futures
        of their transfers"""
        route = self._route
        sends, chunks = [], [head]
        for frame in frames:
            if mpi_gpu.is_device(frame) and route.gpu == "staged":
                if chunks:
                    sends.append(self._post_send(chunks))
                    chunks = []
                sends += await mpi_gpu.send_staged(
                    frame, route.chunk_size, lambda slot: self._post_send([slot])
                )
            else:
                chunks += _chunks(frame, route.chunk_size)
        if chunks:
            sends.append(self._post_send(chunks))
        return sends

    def _post_send(self, chunks: list) -> asyncio.Future:
        if self._state is not State.ON_MPI:
            raise CommClosedError(f"{self} stopped sending over MPI")
        route, MPI = self._route, get_mpi()
        channel = route.channel
        requests = [
            channel.comm.Isend([chunk, MPI.BYTE], channel.rank, route.send_tag)
            for chunk in chunks
        ]
        fut = route.engine.transfer(requests, chunks)
        if not fut.done():
            self._writes.add(fut)
            fut.add_done_callback(self._writes.discard)
        return fut

    def _sent(self, fut) -> None:
        failed = fut.cancelled() or fut.exception() is not None
        if failed and self._state is State.ON_MPI:
            self.abort()  # MPI failed to send: the stream is broken

    # Moving to TCP, when MPI stopped delivering

    def _stalled(self, timeout: float) -> None:
        channel = self._route.channel
        logger.warning(
            "MPI delivered nothing from %s to %s for %s, though %d message(s) "
            "were written: their comms move their messages over TCP from now on",
            self._peer_addr,
            self._local_addr,
            format_time(timeout),
            self._ledger.announced - self._ledger.read,
        )
        for comm in list(channel.comms):
            comm._move_to_tcp()
        mpi_channel.give_up_on(channel)

    def _move_to_tcp(self) -> None:
        """Move this comm to TCP, once: reads and writes in MPI give up, both
        ends say over TCP how many messages they read, and write there again
        those the other did not read"""
        if self._state is not State.ON_MPI or self.stream is None:
            return
        self._state = State.MOVING
        self._doorbell.silence()
        self._stall_watch.stop()
        self._fail(self._reads, "moved to TCP", _MovedToTCP())
        self._fail(self._writes, "moved to TCP")
        self._moved = asyncio.ensure_future(self._finish_move())

    async def _finish_move(self) -> None:
        try:
            if self._reading is not None:
                await self._reading  # and with it, what was read
            self.stream.write(bytes([_MOVE]) + _COUNT.pack(self._ledger.read))
            read = await wait_for(self._peer_moved, _connect_timeout())
            for number, write_args in self._ledger.unread:
                if number > read:
                    await super().write(*write_args)
            self._ledger.unread.clear()
            self._state = State.ON_TCP
        except Exception as e:
            logger.warning("%s: moving to TCP failed: %r", self, e)
            self.abort()

    # Closing

    def _fail(self, pending: set, reason: str, exc: BaseException | None = None):
        """Give up the engine futures ``pending``"""
        for fut in list(pending):
            self._route.engine.cancel(fut, exc or CommClosedError(f"{self}: {reason}"))
            _retrieve(fut)  # a read posted ahead may never be awaited

    async def close(self):
        """Close after the messages written so far: the peer reads them,
        then ``CommClosedError``"""
        if await self._on_tcp():
            return await super().close()
        if self._posting.locked():
            # A frame staged through host memory is half-sent: a CLOSE head
            # would land in one of its chunks.  Drop the message instead.
            self.abort()
            return
        stream, self.stream = self.stream, None
        was_open = self._state is State.ON_MPI
        self._state = State.CLOSED
        self._doorbell.silence()
        self._stall_watch.stop()
        if self._route is not None:
            self._fail(self._reads, "closed")
        if stream is None or stream.closed():
            self._leave_channel()
            return
        try:
            if was_open:
                channel, tag = self._route.channel, self._route.send_tag
                head = _HEAD.pack(_CLOSE, 0, self._ledger.read)
                request = channel.comm.Isend([head, get_mpi().BYTE], channel.rank, tag)
                # Nobody waits for it: a peer that closed too never reads it
                self._route.engine.orphan([request], head)
                await stream.write(bytes([_CLOSING]))
        except (StreamClosedError, get_mpi().Exception):
            pass
        finally:
            self._finalizer.detach()
            stream.close()
            self._leave_channel()

    def abort(self) -> None:
        """Close now, dropping messages in flight"""
        stream, self.stream = self.stream, None
        self._state = State.CLOSED
        self._ledger.unread.clear()
        self._doorbell.silence()
        self._stall_watch.stop()
        if self._peer_moved is not None and not self._peer_moved.done():
            self._peer_moved.set_exception(CommClosedError(f"{self}: aborted"))
            self._peer_moved.exception()  # retrieved, though nobody may wait
        if self._route is not None:
            self._fail(self._reads | self._writes, "aborted")
        if stream is not None and not stream.closed():
            self._finalizer.detach()
            stream.close()
        self._leave_channel()

    def _leave_channel(self) -> None:
        """A closed comm uses its channel no more: free the channel if no
        other comm does (see mpi_channel.release)"""
        channel = self._route and self._route.channel
        if channel is None:
            return
        channel.comms.discard(self)
        if not channel.comms and channel.peer != mpi_startup.process_id():
            mpi_channel.release(channel)


async def _watch_peer(ref: weakref.ref[MPI], stream) -> None:
    """Follow a comm's TCP connection: a doorbell wakes the progress engine,
    a move takes the comm to TCP, the end means the peer closed the comm or
    is gone.  Holds the comm only between bytes, so that a comm dropped
    without close() is collected (and its finalizer closes the connection)"""
    graceful = False
    try:
        while True:
            kind = (await stream.read_bytes(1))[0]
            if kind == _CLOSING:
                graceful = True
            elif kind == _DOORBELL:
                counts = _COUNTS.unpack(await stream.read_bytes(_COUNTS.size))
                if comm := ref():
                    comm._heard_doorbell(*counts)
                del comm
            elif kind == _MOVE:
                (read,) = _COUNT.unpack(await stream.read_bytes(_COUNT.size))
                if comm := ref():
                    comm._heard_move(read)
                return  # what follows is TCP messages, for read()
            else:
                raise ValueError(f"unexpected byte {kind} after the handshake")
    except StreamClosedError:
        pass
    except ValueError as e:
        logger.warning("%s: %s", ref(), e)
    if comm := ref():
        comm._peer_closed(graceful)


class MPIConnector(TCPConnector):
    prefix = "mpi://"
    comm_class = MPI

    async def connect(self, address, deserialize=True, **connection_args):
        mpi_startup.start_mpi()  # MPI starts with the first mpi:// connection
        comm = await super().connect(address, deserialize, **connection_args)
        try:
            await comm._connect()
        except StreamClosedError as e:
            comm.abort()
            convert_stream_closed_error(self, e)
        except BaseException:
            comm.abort()
            raise
        return comm


class MPIListener(TCPListener):
    prefix = "mpi://"
    comm_class = MPI

    async def start(self):
        mpi_startup.start_mpi()  # ... or listener, without waiting for it
        await super().start()

    async def on_connection(self, comm, handshake_overrides=None):
        try:
            await wait_for(comm._accept(), _connect_timeout())
        except Exception as e:
            # A bad peer fails alone: the listener goes on serving others
            if not isinstance(e, handshake.Refused):  # logged once, by _accept
                logger.warning(
                    "mpi:// listener at %s: connection from %s failed: %s",
                    self.contact_address,
                    comm.peer_address,
                    e or type(e).__name__,
                )
            comm.abort()
            raise CommClosedError(f"MPI handshake failed: {e}") from e
        await super().on_connection(comm, handshake_overrides)


class MPIBackend(BaseTCPBackend):
    _connector_class = MPIConnector
    _listener_class = MPIListener
