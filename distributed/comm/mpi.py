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
  follow inside the head when the whole message fits in
  ``distributed.comm.mpi.inline-size``;
- otherwise one MPI message per ``chunk-size`` piece of each non-empty frame.

A head with the CLOSE flag ends the stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import socket
import struct
import weakref
from time import monotonic

import dask
from dask.utils import format_time, parse_bytes, parse_timedelta
from tornado.iostream import StreamClosedError

from distributed.comm import mpi_channel, mpi_startup
from distributed.comm.addressing import get_address_host
from distributed.comm.core import CommClosedError, FatalCommClosedError
from distributed.comm.mpi_channel import ACCEPTOR
from distributed.comm.mpi_liveness import LocalPeer, beacon
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

# Handshake messages on the TCP connection: magic, length, JSON
_HANDSHAKE = struct.Struct("!8sI")
_MAGIC = b"DASK-MPI"
_PROTOCOL = 3
_MAX_HANDSHAKE = 64 * 1024

# On the TCP connection after the handshake, a byte then its numbers (u64):
# a doorbell, with the messages written and read so far; a switch to TCP,
# with the messages read; or a closing byte, before a graceful close
_DOORBELL, _SWITCH, _CLOSING = 1, 2, 0
_COUNT = struct.Struct("!Q")
_COUNTS = struct.Struct("!QQ")


class _MovedToTCP(Exception):
    """A read over MPI gave up: the message comes again over TCP"""


class _Refused(ValueError):
    """A peer that cannot talk to this process over MPI"""


_refusals: set[str] = set()


def _log_refusal(message: str) -> None:
    """Log why MPI cannot connect two processes, once: a refused worker
    retries for good, saying only that it waits for its scheduler"""
    if message not in _refusals:
        _refusals.add(message)
        logger.warning(message)


def _connect_timeout() -> float:
    return parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))


async def _send_handshake(stream, msg: dict) -> None:
    body = json.dumps(msg).encode()
    await stream.write(_HANDSHAKE.pack(_MAGIC, len(body)) + body)


async def _recv_handshake(stream) -> dict:
    """The peer's next handshake message; FatalCommClosedError if what it
    sent is not one: it does not speak mpi://, and will not when asked again"""
    magic, size = _HANDSHAKE.unpack(await stream.read_bytes(_HANDSHAKE.size))
    if magic != _MAGIC or size > _MAX_HANDSHAKE:
        raise FatalCommClosedError(
            "the peer did not answer with an mpi:// handshake: is its address "
            "an mpi:// address?"
        )
    try:
        msg = json.loads(await stream.read_bytes(size))
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        raise FatalCommClosedError("the peer sent a malformed mpi:// handshake")
    return msg


def _hello() -> dict:
    return {
        "protocol": _PROTOCOL,
        "process": mpi_startup.process_id(),
        "library": mpi_startup.library(),
        "world": mpi_startup.world(),
        "beacon": beacon(),
    }


def _incompatibility(peer: dict) -> str | None:
    """Why a peer with this hello cannot talk to us over MPI, if it cannot"""
    if peer.get("protocol") != _PROTOCOL:
        return (
            f"peer speaks mpi:// protocol {peer.get('protocol')!r}, this process "
            f"{_PROTOCOL}: use the same version of distributed everywhere"
        )
    if peer.get("library") != mpi_startup.library():
        return (
            f"peer uses MPI library {peer.get('library')!r}, this process "
            f"{mpi_startup.library()!r}: all processes of a cluster on mpi:// "
            "must use the same MPI library"
        )
    if not isinstance(peer.get("process"), str):
        return "peer did not say which process it is"
    if (
        mpi_startup.library().startswith("Open MPI")
        and peer["process"] != mpi_startup.process_id()
        and not _same_world(peer)
    ):
        # It would hang in MPI_Comm_connect rather than fail
        return (
            "Open MPI cannot connect processes of different mpiexec jobs, nor "
            "processes not started by mpiexec (a nanny's worker process is "
            "not): start them all in one mpiexec job, workers with --no-nanny "
            "(dask-mpi: --worker-class distributed.Worker), or use MPICH"
        )
    return None


def _same_world(peer: dict) -> bool:
    """Whether the peer is another rank of this process's mpiexec job"""
    mine, theirs = mpi_startup.world(), peer.get("world")
    return mine is not None and theirs is not None and theirs[0] == mine[0]


def _peer_gone(stream) -> bool:
    """Whether the peer closed the TCP connection, without reading from it"""
    if stream.closed():
        return True
    try:
        return stream.socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _weakly(method):
    """A callback that calls a comm's method, without keeping the comm alive:
    a comm dropped without close() is collected, as a tcp:// comm is"""
    ref = weakref.WeakMethod(method)

    def call(*args):
        if (alive := ref()) is not None:
            alive(*args)

    return call


def _chunks(frame: memoryview, size: int) -> list[memoryview]:
    return [frame[i : i + size] for i in range(0, frame.nbytes, size)]


class MPI(TCP):
    """A comm whose messages travel over an MPI channel; over its TCP
    connection, like a ``tcp://`` comm, between two processes that MPI could
    not connect"""

    def __init__(self, stream, local_addr: str, peer_addr: str, deserialize=True):
        super().__init__(stream, local_addr, peer_addr, deserialize)
        self._over_tcp = False
        self._inline_size = parse_bytes(config("inline-size"))
        # Open MPI 5 has no large-count calls: keep each message below 2 GiB
        self._chunk_size = min(parse_bytes(config("chunk-size")), 2**31 - 1)
        # A woken engine polls for idle-after: ring at least twice as often
        self._ring_interval = parse_timedelta(config("idle-after")) / 2
        self._rung = float("-inf")
        self._told = (0, 0)  # what the peer was told: messages written, read
        self._ring_later: asyncio.TimerHandle | None = None
        self._written = 0  # messages written over MPI
        self._received = 0  # ... and read
        self._announced = 0  # messages the peer wrote, as last rung
        # Messages written, until the peer rings that it read them:
        # (number, msg, serializers, on_error)
        self._unread: collections.deque = collections.deque()
        self._reading: asyncio.Future | None = None  # done when a read leaves MPI
        self._switch: asyncio.Future | None = None  # moving to TCP; done when moved
        self._peer_switched: asyncio.Future | None = None  # its messages read
        self._stall_timeout = parse_timedelta(config("stall-timeout"))
        self._stall_check: asyncio.TimerHandle | None = None
        self._progress_at = 0.0  # a read started or received something
        self._receiving: list = []  # requests of the frames being read
        self._receiving_seen = 0  # how many of them were pending, last check
        self._suspect_stall = False
        self._channel: mpi_channel.Channel | None = None
        self._engine: ProgressEngine | None = None
        self._sender: LocalPeer | None = None  # the peer, if on this host
        self._send_tag = self._recv_tag = -1
        self._closed = False  # no more writes: closed here, or by the peer
        self._reads_over = False  # no more reads: the stream has ended
        self._reads: set = set()  # engine futures of reads in progress
        self._writes: set = set()  # ... and of writes

    # Setting up

    async def _accept(self) -> None:
        """The listening end of the handshake"""
        await mpi_startup.mpi_ready()
        stream = self.stream
        peer = await _recv_handshake(stream)
        problem = _incompatibility(peer)
        if problem:
            await _send_handshake(stream, {"error": problem})
            _log_refusal(
                f"mpi:// listener at {self._local_addr} refuses connections "
                f"from {get_address_host(self._peer_addr)}: {problem}"
            )
            raise _Refused(problem)
        # MPI failed between these two processes before: do not wait for it again
        gave_up = peer.get("gave_up_on") == mpi_startup.process_id()
        if gave_up or not mpi_channel.reachable(peer["process"]):
            await _send_handshake(stream, {**_hello(), "mpi": False})
            self._over_tcp = True
            return
        channel = mpi_channel.find_channel(peer.get("channel"), peer["process"])
        new = channel is None
        if new:
            channel = mpi_channel.new_channel(peer["process"])
        tag = channel.allocate_tags()
        reply = {**_hello(), "channel": channel.id, "tag": tag, "new": new}
        await _send_handshake(stream, reply)
        if new and not await self._open(channel, peer):
            return
        self._start(channel, peer, recv_tag=tag, send_tag=tag + 1)

    async def _connect(self) -> None:
        """The connecting end of the handshake"""
        await mpi_startup.mpi_ready()
        stream = self.stream
        last = mpi_channel.peer_at(self._peer_addr)  # may since have restarted
        known = last and mpi_channel.find_channel(None, last)
        hello = {
            **_hello(),
            "channel": known and known.id,
            "gave_up_on": None if mpi_channel.reachable(last) else last,
        }
        await _send_handshake(stream, hello)
        reply = await _recv_handshake(stream)
        problem = reply.get("error") or _incompatibility(reply)
        if problem:
            message = f"Cannot connect to {self._peer_addr}: {problem}"
            _log_refusal(message)
            raise FatalCommClosedError(message)
        peer = reply["process"]
        mpi_channel.remember_address(self._peer_addr, peer)
        if reply.get("mpi") is False:
            self._over_tcp = True
            return
        if reply["new"]:
            channel = mpi_channel.new_channel(peer, reply["channel"])
            if not await self._open(channel, reply):
                return
        else:
            channel = mpi_channel.find_channel(reply["channel"], peer)
            if channel is None or channel.id != reply["channel"]:
                raise FatalCommClosedError(
                    f"{self._peer_addr} proposed an unknown MPI channel"
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
        same_world = _same_world(peer)
        timeout = parse_timedelta(config("channel-timeout"))
        error = None
        try:
            if channel.role == ACCEPTOR:
                port = None if same_world else mpi_channel.open_port()
                try:
                    await _send_handshake(stream, {"port": port})
                except BaseException:
                    if port is not None:
                        mpi_channel.close_port(port)
                    raise
            else:
                port = (await _recv_handshake(stream))["port"]
                acceptor = LocalPeer.find(peer)
                if _peer_gone(stream) or (acceptor and acceptor.died()):
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
            await _send_handshake(stream, {"opened": error is None})
            opened = (await _recv_handshake(stream))["opened"] is True
        except StreamClosedError:
            if error is None:
                raise
            raise CommClosedError(
                f"{self._peer_addr} went away while opening an MPI channel: {error}"
            ) from error
        if error is None and opened:
            return True
        logger.warning(
            "MPI could not connect %s to %s (%s): their comms move their "
            "messages over TCP from now on",
            self._local_addr,
            self._peer_addr,
            error or "it failed at the other end",
        )
        mpi_channel.give_up_on(channel)
        self._over_tcp = True
        return False

    def _start(self, channel, peer: dict, recv_tag: int, send_tag: int) -> None:
        self._channel = channel
        self._recv_tag = recv_tag
        self._send_tag = send_tag
        self._engine = ProgressEngine.current()
        self._sender = LocalPeer.find(peer)
        self._peer_switched = asyncio.get_running_loop().create_future()
        channel.comms.add(self)
        self._watcher = asyncio.ensure_future(
            _watch_peer(weakref.ref(self), self.stream)
        )

    def _heard_doorbell(self, written: int, read: int) -> None:
        """The peer wrote and read this many messages"""
        self._announced = max(self._announced, written)
        self._forget_read(read)
        self._engine.wake()
        if self._announced > self._received:
            self._watch_for_stall()

    def _heard_switch(self, read: int) -> None:
        """The peer moves to TCP, having read this many messages"""
        self._move_to_tcp()
        if not self._peer_switched.done():
            self._peer_switched.set_result(read)

    def _peer_closed(self, graceful: bool) -> None:
        """The TCP connection ended: the peer closed the comm or is gone"""
        if self._reads_over:
            return  # closed here
        # Whatever the peer still had in flight will never be received
        self._closed = True
        self._fail(self._writes, "peer closed the connection")
        if not graceful or self._switch is not None:
            self.abort()
            return
        # Reads go on until the CLOSE head, sent before the TCP connection
        # was closed; should it never come, give up after a while.
        asyncio.get_running_loop().call_later(_connect_timeout(), _weakly(self.abort))

    # Reading and writing

    async def read(self, deserializers=None):
        if self._switch is not None:
            await self._switch
        if self._over_tcp:
            return await super().read(deserializers)
        if self._reads_over:
            raise CommClosedError(f"{self} is closed")
        reading = self._reading = asyncio.get_running_loop().create_future()
        try:
            frames = await self._read_over_mpi()
        except _MovedToTCP:
            frames = None
        finally:
            reading.set_result(None)
        if frames is None:
            await self._switch
            return await super().read(deserializers)
        # Tell the peer that it may forget the message: in the head of the
        # next message this end writes, or else in a doorbell
        self._ring_soon()
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
        channel, engine, sender = self._channel, self._engine, self._sender
        self._progress_at = monotonic()
        try:
            message, nbytes = await self._await_read(
                engine.probe(channel.comm, channel.rank, self._recv_tag)
            )
            self._progress_at = monotonic()
            self._check_sender()
            head = bytearray(nbytes)
            request = message.Irecv([head, get_mpi().BYTE])
            await self._await_read(engine.transfer([request], head, sender))

            flags, nframes, read = _HEAD.unpack_from(head)
            self._forget_read(read)
            sizes = struct.unpack_from(f"<{nframes}Q", head, _HEAD.size)
            offset = _HEAD.size + 8 * nframes
            if flags & _CLOSE:
                self._reads_over = self._closed = True
                self.abort()
                raise CommClosedError(f"{self} closed by peer")
            if any(head[offset : offset + nframes]):
                self.abort()
                raise CommClosedError(f"{self}: GPU frames are not supported yet")
            offset += nframes
            if flags & _INLINE:
                view = memoryview(head)
                frames = []
                for size in sizes:
                    frames.append(view[offset : offset + size])
                    offset += size
                self._received += 1
            else:
                frames = [host_array(size) for size in sizes]
                self._check_sender()
                requests = [
                    channel.comm.Irecv(
                        [chunk, get_mpi().BYTE], channel.rank, self._recv_tag
                    )
                    for frame in frames
                    for chunk in _chunks(frame, self._chunk_size)
                ]
                self._receiving = requests
                await self._await_read(engine.transfer(requests, frames, sender))
                self._receiving = []
                self._received += 1
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

    def _check_sender(self) -> None:
        """Before a receive, which may start to copy at once: the sender lives
        (see ``distributed.comm.mpi_liveness``)"""
        if self._sender is not None and self._sender.died():
            self.abort()
            raise CommClosedError(f"{self}: the peer process died")

    async def write(self, msg, serializers=None, on_error="message"):
        if self._switch is not None:
            await self._switch
        if self._over_tcp:
            return await super().write(msg, serializers, on_error)
        if self._closed:
            raise CommClosedError(f"{self} is closed")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
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
        frames = [ensure_memoryview(frame) for frame in frames]
        sizes = [frame.nbytes for frame in frames]
        nbytes = sum(sizes)
        # mpi:// comms do not use distributed's "cuda" serializers (yet), so
        # every frame is in host memory: location 0
        head = [
            _HEAD.pack(0, len(frames), self._received),
            struct.pack(f"<{len(sizes)}Q", *sizes),
            bytes(len(frames)),
        ]
        if _HEAD.size + 9 * len(sizes) + nbytes <= self._inline_size:
            head[0] = _HEAD.pack(_INLINE, len(frames), self._received)
            head.extend(frames)
            frames = []
        if self._closed:
            raise CommClosedError(f"{self} is closed")
        if self._switch is not None:  # while the message was serialised
            await self._switch
            return await super().write(msg, serializers, on_error)

        channel, MPI = self._channel, get_mpi()
        self._told = (self._told[0], self._received)
        try:
            head = b"".join(head)
            requests = [
                channel.comm.Isend([head, MPI.BYTE], channel.rank, self._send_tag)
            ]
            requests.extend(
                channel.comm.Isend([chunk, MPI.BYTE], channel.rank, self._send_tag)
                for frame in frames
                for chunk in _chunks(frame, self._chunk_size)
            )
        except MPI.Exception as e:
            self.abort()
            raise CommClosedError(f"{self}: MPI error while writing: {e}") from e
        # Like a TCP comm's write, return once the message is queued: waiting
        # until MPI completed the sends would deadlock two ends that both
        # write before they read.  The engine keeps the frames alive.
        self._written += 1
        self._unread.append((self._written, msg, serializers, on_error))
        sent = self._engine.transfer(requests, (head, frames))
        if not sent.done():
            self._writes.add(sent)
            sent.add_done_callback(_weakly(self._sent))
        self._ring_until_sent(sent)
        return nbytes

    def _sent(self, fut) -> None:
        self._writes.discard(fut)
        failed = fut.exception() is not None  # also marks it as retrieved
        if failed and not self._closed and self._switch is None:
            self.abort()  # MPI failed to send: the stream is broken

    async def _await_read(self, fut):
        """Await an engine future of a read; give up if the comm is moving
        to TCP, even if it completed: the peer will send it again there"""
        self._reads.add(fut)
        try:
            result = await fut
        finally:
            self._reads.discard(fut)
        if self._switch is not None:
            raise _MovedToTCP()
        return result

    def _forget_read(self, read: int) -> None:
        """The peer read the first ``read`` messages: they are not written
        again, should the comm move to TCP"""
        unread = self._unread
        while unread and unread[0][0] <= read:
            unread.popleft()

    def _ring_until_sent(self, sent: asyncio.Future) -> None:
        """Ring, and again every ``_ring_interval`` until the message is
        sent: MPI may put it on the wire only in a later call (a connection
        still being set up, a full queue), when the peer, woken too early,
        has gone back to sleep"""
        self._ring()
        if not sent.done():
            loop = asyncio.get_running_loop()
            loop.call_later(self._ring_interval, _weakly(self._ring_until_sent), sent)

    def _ring(self, news_only: bool = False) -> None:
        """Wake the peer's progress engine and tell it how many messages this
        end wrote and read: at most once per ``_ring_interval``, and once
        more at its end with what changed in between"""
        counts = (self._written, self._received)
        if self._switch is not None or self.stream is None:
            return  # the TCP connection carries TCP messages now, or nothing
        if news_only and counts == self._told:
            return
        wait = self._rung + self._ring_interval - monotonic()
        if wait > 0:
            if self._ring_later is None:
                loop = asyncio.get_running_loop()
                self._ring_later = loop.call_later(wait, _weakly(self._ring_again))
            return
        self._rung, self._told = monotonic(), counts
        try:
            self.stream.write(bytes([_DOORBELL]) + _COUNTS.pack(*counts))
        except StreamClosedError:
            pass

    def _ring_again(self) -> None:
        self._ring_later = None
        self._ring(news_only=True)

    def _ring_soon(self) -> None:
        """Ring within ``_ring_interval``, unless a doorbell goes out sooner"""
        if self._ring_later is None:
            loop = asyncio.get_running_loop()
            self._ring_later = loop.call_later(
                self._ring_interval, _weakly(self._ring_again)
            )

    # Noticing that MPI stopped delivering

    def _watch_for_stall(self) -> None:
        """The peer wrote messages not read yet: check that they arrive"""
        if self._stall_check is None and not self._reads_over:
            loop = asyncio.get_running_loop()
            self._stall_check = loop.call_later(
                self._stall_timeout / 4, _weakly(self._check_stall)
            )

    def _check_stall(self) -> None:
        """Whether MPI delivered nothing for ``stall-timeout`` to a read
        waiting for messages that the peer wrote: then it will not"""
        self._stall_check = None
        if self._reads_over or self._switch is not None:
            return
        if self._announced <= self._received:
            return
        now = monotonic()
        receiving = sum(map(bool, self._receiving))  # completed ones are null
        if receiving != self._receiving_seen:
            self._progress_at = now
            self._receiving_seen = receiving
        if not self._reads or now - self._progress_at < self._stall_timeout:
            self._suspect_stall = False
        elif not self._suspect_stall:
            # This event loop may have been busy: let the engine poll once
            # more before concluding
            self._suspect_stall = True
            self._engine.wake()
        else:
            self._stalled()
            return
        self._watch_for_stall()

    def _stalled(self) -> None:
        channel = self._channel
        logger.warning(
            "MPI delivered nothing from %s to %s for %s, though %d message(s) "
            "were written: their comms move their messages over TCP from now on",
            self._peer_addr,
            self._local_addr,
            format_time(self._stall_timeout),
            self._announced - self._received,
        )
        for comm in list(channel.comms):
            comm._move_to_tcp()
        mpi_channel.give_up_on(channel)

    def _move_to_tcp(self) -> None:
        """Start to move this comm to TCP, once: reads and writes in MPI give
        up, both ends say over TCP how many messages they read, and write
        there again those the other did not read"""
        if self._switch is not None or self.stream is None:
            return
        self._switch = asyncio.get_running_loop().create_future()
        for fut in list(self._reads):
            self._engine.cancel(fut, _MovedToTCP())
        for fut in list(self._writes):
            self._engine.cancel(fut, CommClosedError(f"{self}: moved to TCP"))
        asyncio.ensure_future(self._switch_to_tcp())

    async def _switch_to_tcp(self) -> None:
        try:
            if self._reading is not None:
                await self._reading  # and with it, what was read
            self.stream.write(bytes([_SWITCH]) + _COUNT.pack(self._received))
            read = await wait_for(self._peer_switched, _connect_timeout())
            for number, msg, serializers, on_error in self._unread:
                if number > read:
                    await super().write(msg, serializers, on_error)
            self._unread.clear()
            self._over_tcp = True
            self._switch.set_result(None)
        except Exception as e:
            logger.warning("%s: moving to TCP failed: %r", self, e)
            self.abort()

    # Closing

    def _fail(self, pending: set, reason: str) -> None:
        for fut in list(pending):
            self._engine.cancel(fut, CommClosedError(f"{self}: {reason}"))

    async def close(self):
        """Close after the messages written so far: the peer reads them,
        then ``CommClosedError``"""
        if self._switch is not None:
            with contextlib.suppress(CommClosedError):
                await self._switch
        if self._over_tcp:
            return await super().close()
        stream, self.stream = self.stream, None
        was_open = not self._closed
        self._closed = self._reads_over = True
        if self._engine is not None:
            self._fail(self._reads, "closed")
        if stream is None or stream.closed():
            return
        try:
            if was_open and self._channel is not None:
                head = _HEAD.pack(_CLOSE, 0, self._received)
                channel = self._channel
                request = channel.comm.Isend(
                    [head, get_mpi().BYTE], channel.rank, self._send_tag
                )
                # Nobody waits for it: a peer that closed too never reads it
                self._engine.orphan([request], head)
                await stream.write(bytes([_CLOSING]))
        except (StreamClosedError, get_mpi().Exception):
            pass
        finally:
            self._finalizer.detach()
            stream.close()

    def abort(self) -> None:
        """Close now, dropping messages in flight"""
        stream, self.stream = self.stream, None
        self._closed = self._reads_over = True
        self._unread.clear()
        for timer in (self._stall_check, self._ring_later):
            if timer is not None:
                timer.cancel()
        for fut in (self._switch, self._peer_switched):
            if fut is not None and not fut.done():
                fut.set_exception(CommClosedError(f"{self}: aborted"))
                fut.exception()  # retrieved, though nobody may wait for it
        if self._engine is not None:
            self._fail(self._reads | self._writes, "aborted")
        if stream is not None and not stream.closed():
            self._finalizer.detach()
            stream.close()


async def _watch_peer(ref: weakref.ref[MPI], stream) -> None:
    """Follow a comm's TCP connection: a doorbell wakes the progress engine,
    a switch moves the comm to TCP, the end means the peer closed the comm
    or is gone.  Holds the comm only between bytes, so that a comm dropped
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
            elif kind == _SWITCH:
                (read,) = _COUNT.unpack(await stream.read_bytes(_COUNT.size))
                if comm := ref():
                    comm._heard_switch(read)
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
            if not isinstance(e, _Refused):  # logged once, by _accept
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
