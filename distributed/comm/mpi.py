"""The ``mpi://`` transport: Dask comms whose large frames travel over MPI.

An ``mpi://HOST:PORT`` address is a TCP listener, and every comm is a TCP
connection (between processes of one host and user, a Unix socket, which
delivers sooner and takes less CPU) that carries each message's head, and its
small frames whole, as ``tcp://`` does: the kernel wakes the reader when a
message arrives, and nothing polls MPI while no data moves. Frames of at least
``inline-size`` (on a Unix socket, host frames of at least
``local-inline-size``) take one of the routes of the MPI channel between the
two processes (see ``distributed.comm.mpi_channel`` and
``distributed.comm.mpi_routes``): over MPI in ``chunk-size`` pieces, or copied
by the reader straight from the writer's memory on one host. The writer posts
their sends as it writes the head, and the reader posts the receives as soon as
it reads it, into buffers of the right size (the rendezvous of UCX and RDMA
transports). The progress engine (``distributed.comm.mpi_progress``) tests
those transfers until they are done.

Between processes of one host whose comm is a Unix socket, frames that the
reader copies need no channel: they are lent, and their copy acknowledged, on
the socket (``distributed.comm.mpi_lending``).  A channel opens the first
time a frame needs one; until then, and between processes MPI cannot connect,
frames travel over TCP.  When MPI stops
delivering to a receive for ``stall-timeout`` (UCX's shared-memory queue of a
process can stay blocked for good when a process writing to it is killed), the
comm closes with an error, and the two processes use TCP from then on.

Between two processes with a GPU, frames of GPU data stay on the GPU: lent
on the socket by CUDA IPC between processes of one host (``mpi_ipc``), else
over MPI (see ``distributed.comm.mpi_gpu``).
"""

from __future__ import annotations

import logging
import socket
import struct
import weakref
from typing import NamedTuple, NoReturn

import dask
from dask.utils import parse_bytes, parse_timedelta
from tornado.iostream import IOStream, StreamClosedError
from tornado.tcpserver import TCPServer

from distributed.comm import mpi_copy, mpi_gpu, mpi_handshake as handshake, mpi_ipc
from distributed.comm import mpi_local
from distributed.comm import mpi_policy as policy
from distributed.comm import mpi_startup
from distributed.comm.addressing import (
    get_address_host,
    parse_host_port,
    unparse_host_port,
)
from distributed.comm.core import CommClosedError, FatalCommClosedError
from distributed.comm.mpi_buffers import socket_buffer
from distributed.comm.mpi_channel import Channel, channels
from distributed.comm.mpi_handshake import peer_gone
from distributed.comm.mpi_hello import Peer
from distributed.comm.mpi_head import Head
from distributed.comm.mpi_lending import Lender
from distributed.comm.mpi_opener import opener
from distributed.comm.mpi_progress import Stalled
from distributed.comm.mpi_routes import ORDER, DeviceIPC, LocalCopy, Message, Route
from distributed.comm.mpi_startup import config, get_mpi
from distributed.comm.mpi_stream import SocketStream
from distributed.comm.mpi_transfers import Transfers
from distributed.comm.tcp import (
    TCP,
    BaseTCPBackend,
    TCPConnector,
    TCPListener,
    convert_stream_closed_error,
)
from distributed.comm.utils import from_frames, to_frames
from distributed.utils import ensure_memoryview, wait_for

logger = logging.getLogger(__name__)


_WANT_CHANNEL_HEAD = Head(True, 0, 0, []).pack()

# Seconds a closing comm waits for its peer to copy the frames lent to it: a
# peer that reads the message later fails to copy them
LEND_AFTER_CLOSE = 10


class _Link(NamedTuple):
    """What a comm needs to move frames over MPI, from its handshake"""

    peer: Peer
    dial: str | None  # the peer's listener, when this end dialled it
    gpu: str | None  # how device frames travel (mpi_policy.gpu_path)
    inline_size: int  # smaller frames travel on TCP
    host_inline_size: int  # smaller host frames too (on a Unix socket, more)
    chunk_size: int  # larger frames travel in pieces of this size


def _connect_timeout() -> float:
    return parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))


async def _handshake(stream, dial: str | None = None) -> _Link | None:
    """The handshake of a new comm's TCP connection, at either end (``dial``:
    the address the connecting end dialled).  The comm's link; None if the
    peer only came to open an MPI channel, which is then open."""
    await mpi_startup.mpi_ready()
    # Open MPI 5 has no large-count calls: keep each message below 2 GiB
    chunk_size = min(parse_bytes(config("chunk-size")), 2**31 - 1)
    if chunk_size < 1:  # the reader would post no receive, and say nothing
        raise ValueError(
            "distributed.comm.mpi.chunk-size must be at least 1 byte, "
            f"not {config('chunk-size')!r}"
        )
    mine = {
        **handshake.hello(),
        # The processes this one gave up on use TCP with it, at both ends
        "unreachable": channels.unreachable(),
        "chunk_size": chunk_size,
    }
    try:
        peer = await handshake.exchange(
            stream, mine, None if dial else opener.may_accept
        )
    except FatalCommClosedError as e:  # a refusal, or garbage instead of a hello
        if dial is None:
            raise
        message = f"Cannot connect to {dial}: {e}"
        handshake.log_refusal(message)
        raise FatalCommClosedError(message) from e
    if peer.open is not None and dial is None:
        if not (peer.open and await opener.answer(stream, peer)):
            stream.close()
        return None  # the channel keeps the stream
    if peer.process == mpi_startup.process_id():
        if not mpi_startup.mpi_stopped():
            channels.to_self()
    elif mpi_startup.process_id() in peer.unreachable or peer.stopped:
        channels.give_up_on(peer.process)
    if peer.chunk_size and peer.chunk_size > 0:
        # Receives must match sends: both ends cut frames alike, whatever
        # each one's configuration says
        chunk_size = min(chunk_size, peer.chunk_size)
    inline_size = parse_bytes(config("inline-size"))
    host_inline_size = inline_size
    if stream.socket.family == socket.AF_UNIX:
        # Its two copies, made by the two processes at once, beat one copy
        # from the writer's memory up to a few MiB (docs/mpi-design.rst)
        host_inline_size = max(inline_size, parse_bytes(config("local-inline-size")))
    return _Link(
        peer, dial, policy.gpu_path(peer), inline_size, host_inline_size, chunk_size
    )


class MPI(TCP):
    """A TCP comm whose large frames travel over MPI.

    A message is written as a ``tcp://`` comm writes it; one some of whose
    frames travel over MPI instead starts with a :class:`Head` that says which."""

    def __init__(self, stream, local_addr: str, peer_addr: str, deserialize=True):
        if isinstance(stream, IOStream):  # from TCPConnector
            stream = SocketStream.adopt(stream)
        super().__init__(stream, local_addr, peer_addr, deserialize)
        self._link: _Link | None = None  # from the handshake
        self._channel: Channel | None = None  # the last one its data moved on
        self._transfers = Transfers(self, stream.socket)
        self._lender = Lender()  # frames lent on the socket (mpi_lending)

    def _linked(self, link: _Link | None) -> None:
        """The handshake is done"""
        self._link = link
        if link is not None:
            self._lender.start(self.stream, link.peer)

    @property
    def channel(self) -> Channel | None:
        """The MPI channel this comm's data last moved on"""
        return self._channel

    @property
    def lent(self) -> int:
        """Messages whose frames this comm lent the peer (``mpi_lending``),
        which it has not said it has yet"""
        return self._lender.lent

    @property
    def peer(self) -> Peer | None:
        """The process at the other end, as its handshake described it"""
        return self._link and self._link.peer

    @property
    def gpu_path(self) -> str | None:
        """How GPU frames travel through MPI: "direct" (CUDA-aware MPI),
        "staged" (through pinned host memory), or None: as host frames, one
        end has no GPU.  Between processes of one host, those that can be
        exported are copied by CUDA IPC instead (``mpi_routes.DeviceIPC``)"""
        return self._link and self._link.gpu

    async def read(self, deserializers=None):
        try:
            frames = await self.read_frames()
        except CommClosedError:
            self._leave_channel()  # closed by the peer, which frees it soon
            raise
        if frames and frames[0] and frames[0][0] == Head.MARK:  # inline: it is hot
            try:
                head = Head.unpack(frames[0])
            except (struct.error, IndexError, TypeError):
                self.abort()
                raise CommClosedError(f"{self}: garbled message head")
            if head.want_channel and self._link and self._link.dial:
                opener.open_soon(self._link.dial, self._link.peer)
            frames = await self._receive(head, frames[1:])
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

    async def read_frames(self) -> list:
        """The next message's frames, as ``tcp://`` frames them"""
        stream = self.stream
        if stream is None:
            raise CommClosedError()
        try:
            # Not a method of this comm: the stream, which the event loop
            # holds while it is open, must not keep the comm alive
            return await stream.read_message(socket_buffer)
        except StreamClosedError as e:
            self._hung_up()
            convert_stream_closed_error(self, e)
        except BaseException:
            self.abort()  # where the next message starts is unknown
            raise

    def write_frames(self, frames: list) -> int:
        """Queue a message's frames for sending; its size in bytes"""
        stream = self.stream
        if stream is None:
            raise CommClosedError()
        try:
            return stream.write_message(frames)
        except StreamClosedError as e:
            self._hung_up()
            convert_stream_closed_error(self, e)
        except BaseException:
            self.abort()
            raise

    async def _receive(self, head: Head, frames: list) -> list:
        """Receive the frames of a message that take a route of their own,
        and put them in their places among those that came on the socket"""
        if not head.frames:
            return frames
        if head.channel == Head.LENT:
            return await self._receive_lent(head, frames)
        link, channel = self._link, channels.by_id(head.channel)
        if channel is None or link is None:
            self.abort()
            raise CommClosedError(f"{self}: message on an unknown MPI channel")
        try:
            plan = _grouped((channel.routes.reader(f[2]), f) for f in head.frames)
        except ValueError as e:
            self.abort()
            raise CommClosedError(f"{self}: {e}")
        self._use(channel)
        msg = Message(channel, head.tag, link.chunk_size, self._transfers, True)
        msg.lease, msg.extra = head.lease, head.extra
        received, pending = [], []
        try:
            for reader, entries in plan:
                got, waits = await reader.receive(
                    [(size, word) for _, size, _, word in entries], msg
                )
                received += zip((index for index, *_ in entries), got)
                pending += waits
            for fut in pending:
                await fut
            if self._transfers.dropped:  # closed meanwhile, by this end
                raise CommClosedError(f"{self} closed")
        except Stalled:
            stream = self.stream  # None if a write found the peer gone
            if stream is None or peer_gone(stream):  # it gave the message up
                self.abort()
                raise CommClosedError(f"{self}: the peer closed mid-message")
            self._stalled(channel)
            raise CommClosedError(f"{self}: MPI stopped delivering")
        except CommClosedError:
            self.abort()
            if channel.peer in mpi_ipc.unmappable:
                # It was opened to copy the peer's GPU memory: the next will not
                channels.release(channel)
            raise
        except get_mpi().Exception as e:
            self.abort()
            raise CommClosedError(f"{self}: MPI error while reading: {e}") from e
        except Exception as e:
            self.abort()
            _failed_to_read(self, e)
        except BaseException:
            self.abort()  # cancelled half-way: the stream's position is unknown
            raise
        for index, frame in sorted(received, key=lambda x: x[0]):
            frames.insert(index, frame)
        channel.nbytes += sum(size for _, size, _, _ in head.frames)
        return frames

    async def _receive_lent(self, head: Head, frames: list) -> list:
        """Copy the frames of a message that the writer lent on the socket"""
        lender = self._lender
        host = [f for f in head.frames if f[2] == LocalCopy.code]
        device = [f for f in head.frames if f[2] == DeviceIPC.code]
        if lender.writer is None or len(host) + len(device) != len(head.frames):
            self.abort()
            raise CommClosedError(f"{self}: frames lent that this end cannot copy")
        if device and lender.mappings is None:
            self.abort()
            raise CommClosedError(
                f"{self}: device frames lent, which this end cannot copy"
            )
        try:
            copied = []
            if device:
                entries = [(size, word) for _, size, _, word in device]
                copied += await lender.mappings.copy(entries, head.extra)
            # After the device frames' copies, it checks the lease of all
            copies = [(size, address) for _, size, _, address in host]
            copied += await mpi_copy.receive(lender.writer, copies, head.lease)
            if self._transfers.dropped:  # closed meanwhile, by this end
                raise CommClosedError(f"{self} closed")
        except Exception as e:
            self.abort()  # the stream's position is unknown
            _failed_to_read(self, e)
        except BaseException:
            self.abort()
            raise
        nbytes = sum(size for _, size, _, _ in head.frames)
        lender.copied(self.stream, head.tag, nbytes)
        indices = [index for index, *_ in device + host]
        for index, frame in sorted(zip(indices, copied), key=lambda x: x[0]):
            frames.insert(index, frame)
        return frames

    async def write(self, msg, serializers=None, on_error="message"):
        # Every message passes here: each line costs a little on every
        # control message, where mpi:// may cost no more than tcp://
        link = self._link
        lender = self._lender
        # Between two processes with a GPU, GPU data stays there: lent on the
        # socket, or through the MPI channel
        gpu = link and link.gpu and (lender.peer_ipc or channels.get(link.peer.process))
        frames = await self._to_frames(
            msg, serializers or (gpu and mpi_gpu.SERIALIZERS), on_error
        )
        if link is None:
            return self.write_frames(frames)
        for frame in frames:  # no function call for the usual frames
            if type(frame) is bytes:
                size = len(frame)
            elif type(frame) is memoryview:
                size = frame.nbytes
            else:
                size = _size(frame)
            if size >= link.inline_size:
                break
        else:
            return self.write_frames(frames)
        large = _large_frames(frames, link)
        if not large:
            return self.write_frames(frames)
        if lender.peer_copies:
            # GPU data between processes that cannot map each other's GPU
            # memory takes the channel (staged, or direct): until it is open,
            # as host frames
            want = bool(link.gpu) and not gpu and self._ask_for_channel()
            nbytes = self._write_lent(frames, large, want)
            if nbytes is not None:
                return nbytes
        channel = channels.get(link.peer.process)
        if channel is None:
            want = self._ask_for_channel()
            if any(mpi_gpu.is_device(frames[i]) for i in large):
                # Device frames that could not be lent, and no channel for
                # them: as host frames, this time
                host = [s for s in serializers or mpi_gpu.SERIALIZERS if s != "cuda"]
                frames = await self._to_frames(msg, host, on_error)
                large = _large_frames(frames, link)
                if large and lender.peer_copies:
                    return self._write_lent(frames, large, want)
            return self.write_frames([_WANT_CHANNEL_HEAD, *frames] if want else frames)
        frames = [f if mpi_gpu.is_device(f) else ensure_memoryview(f) for f in frames]
        return await self._write_routed(channel, frames, large)

    async def _to_frames(self, msg, serializers, on_error: str) -> list:
        return await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={
                "sender": self.local_info,
                "recipient": self.remote_info,
                **self.handshake_options,
            },
            # Unsplit: over MPI, large frames travel in chunk-size pieces
            # anyway, and shards would be copied together again on arrival
            frame_split_size=(
                self.max_shard_size
                if self._link is None or self.handshake_options.get("compression")
                else 2**62
            ),
        )

    def _ask_for_channel(self) -> bool:
        """Have a channel opened to the peer: this end opens it if it dialled,
        else the peer, asked by the head of the message written next (True)"""
        link = self._link
        if link.dial:
            opener.open_soon(link.dial, link.peer)
            return False
        return True

    def _write_lent(
        self, frames: list, large: list, want_channel: bool = False
    ) -> int | None:
        """Write a message whose ``large`` frames the peer copies from this
        process's memory, which keeps them until the peer says it has them
        (and asks the peer to open a channel, if ``want_channel``); None,
        having written nothing, if the peer cannot copy a device frame of
        them"""
        lent, device, entries, extra, nbytes = [], [], [], bytearray(), 0
        for i in large:
            frame = frames[i]
            if mpi_gpu.is_device(frame):
                record = self._lender.peer_ipc and mpi_ipc.export(frame)
                if not record:  # from a stream-ordered pool, say
                    return None
                entries.append((i, mpi_gpu.nbytes(frame), DeviceIPC.code, len(extra)))
                extra += record
                device.append(frame)
            else:
                frame = ensure_memoryview(frame)
                entries.append(
                    (i, frame.nbytes, LocalCopy.code, mpi_copy.address(frame))
                )
            nbytes += entries[-1][1]
            lent.append(frame)
        if device:
            mpi_gpu.synchronize(device)  # their producers are done
        tag, lease = self._lender.lend(lent, nbytes)
        head = Head(want_channel, Head.LENT, tag, entries, lease.head, bytes(extra))
        head = head.pack()
        return self.write_frames([head, *_inline(frames, large)]) + nbytes

    async def _write_routed(self, channel: Channel, frames: list, large: list):
        """Write a message whose ``large`` frames take the channel's routes"""
        self._use(channel)
        chunk_size = self._link.chunk_size
        msg = Message(channel, channel.tag(), chunk_size, self._transfers, False)
        plan = _grouped((channel.routes.pick(frames[i]), i) for i in large)
        entries = []
        for route, indices in plan:
            words = route.describe([frames[i] for i in indices], msg)
            entries += [
                (i, mpi_gpu.nbytes(frames[i]), route.code, word)
                for i, word in zip(indices, words)
            ]
        lease = msg.lease.head if msg.lease else (0, 0)
        head = Head(False, channel.id, msg.tag, entries, lease, bytes(msg.extra))
        head = head.pack()
        # Like a TCP comm's write, return once the message is queued: the
        # engine keeps the frames until MPI has sent them, or the reader
        # copied them
        sent = sum(size for _, size, _, _ in entries)
        channel.nbytes += sent
        inline = _inline(frames, large)
        try:
            if not any(route.posts_as_it_goes for route, _ in plan):
                # Sends first: MPI moves the data while the head travels
                for route, indices in plan:
                    await route.send([frames[i] for i in indices], msg)
                return self.write_frames([head, *inline]) + sent
            async with self._transfers.posting:  # posted as they go
                nbytes = self.write_frames([head, *inline])
                for route, indices in plan:
                    await route.send([frames[i] for i in indices], msg)
        except get_mpi().Exception as e:
            self.abort()
            raise CommClosedError(f"{self}: MPI error while writing: {e}") from e
        except BaseException:
            self.abort()  # the peer cannot tell what was sent
            raise
        return nbytes + sent

    def _hung_up(self) -> None:
        """The peer closed the connection: this end is closed, and what it
        wrote before goes on (the peer may still be reading it), but for
        frames lent on the socket, which it can read no more"""
        super().abort()
        self._transfers.drop()
        self._lender.close()

    def _use(self, channel: Channel) -> None:
        if channel is not self._channel:
            self._leave_channel()
            self._channel = channel
            channel.comms.add(self)

    def _stalled(self, channel: Channel) -> None:
        logger.warning(
            "MPI stopped delivering from %s to %s for %s: %s closes, and "
            "comms between the two processes move their data over TCP",
            self.peer_address,
            self.local_address,
            config("stall-timeout"),
            self,
        )
        self.abort()  # cancels the receives
        channels.give_up_on(channel.peer)

    async def close(self):
        """Close after the messages written so far: the peer reads them,
        then ``CommClosedError``"""
        if self._transfers.posting.locked():
            # A frame staged through host memory is half-sent: the peer
            # would wait for the rest.  Drop the message instead.
            self.abort()
            return
        self._transfers.drop()
        # The peer copies what it read before the socket closes
        await self._lender.returned(LEND_AFTER_CLOSE)
        self._lender.close()
        await super().close()
        self._leave_channel()

    def abort(self) -> None:
        """Close now, dropping messages in flight"""
        self._transfers.drop(cancel=True)
        self._lender.close()
        super().abort()
        self._leave_channel()

    def _leave_channel(self) -> None:
        """Free the channel this comm used if no other comm uses it"""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.comms.discard(self)
            if not channel.comms:
                channels.release(channel)


def _failed_to_read(comm: MPI, e: Exception) -> NoReturn:
    """Raise what a read that failed with ``e`` raises: CommClosedError, as
    for a network failure, so that Dask fetches the data again (from this
    peer or another), where another exception marks the tasks that need it
    failed; but for what Dask handles itself (no memory for the frames)"""
    if isinstance(e, (CommClosedError, MemoryError)):
        raise e
    raise CommClosedError(f"{comm}: error while reading: {e!r}") from e


def _large_frames(frames: list, link: _Link) -> list[int]:
    """The indices of the frames that take a route of the MPI channel"""
    return [
        i
        for i, frame in enumerate(frames)
        if (size := _size(frame)) >= link.host_inline_size
        or (size >= link.inline_size and mpi_gpu.is_device(frame))
    ]


def _inline(frames: list, large: list[int]) -> list:
    """The frames of a message that travel on the socket"""
    skip = set(large)
    return [f for i, f in enumerate(frames) if i not in skip]


def _size(frame) -> int:
    """A frame's size in bytes, for whether it goes over MPI; a GPU frame's
    always does"""
    if type(frame) is memoryview:  # most buffers
        return frame.nbytes
    if type(frame) is bytes:  # msgpack's, pickle's
        return len(frame)
    return 2**63 if mpi_gpu.is_device(frame) else mpi_gpu.nbytes(frame)


def _grouped(pairs) -> list[tuple[Route, list]]:
    """(route, item) pairs grouped by route, in the order in which both ends
    post a message's transfers (``mpi_routes.ORDER``)"""
    groups: dict[Route, list] = {}
    for route, item in pairs:
        groups.setdefault(route, []).append(item)
    return sorted(groups.items(), key=lambda group: ORDER.index(type(group[0])))


class MPIConnector(TCPConnector):
    """Connects over TCP, or over a Unix socket to a listener on this host,
    which delivers a message sooner, and with less CPU"""

    prefix = "mpi://"
    comm_class = MPI

    async def connect(self, address, deserialize=True, **connection_args):
        mpi_startup.start_mpi()  # MPI starts with the first mpi:// connection
        self._check_encryption(address, connection_args)
        stream = mpi_local.connect(address)
        if stream is not None:
            # A Unix socket has no address: this host's, with no port
            local = self.prefix + unparse_host_port(parse_host_port(address)[0], 0)
            comm = self.comm_class(stream, local, self.prefix + address, deserialize)
        else:
            comm = await super().connect(address, deserialize, **connection_args)
        try:
            comm._linked(await _handshake(comm.stream, dial=address))
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
    _local_server: TCPServer | None = None  # its Unix socket's

    async def start(self):
        mpi_startup.start_mpi()  # ... or listener, without waiting for it
        # From the handshake of a stream to its comm
        self._links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        await super().start()
        self._local_server = mpi_local.serve(
            self.contact_address[len(self.prefix) :], self._handle_local_stream
        )

    def stop(self):
        server, self._local_server = self._local_server, None
        if server is not None:
            server.stop()
        super().stop()

    async def _handle_local_stream(self, stream, _):
        """As ``_handle_stream`` does for TCP, with this host's address for
        the peer, which a Unix socket does not have"""
        peer = self.prefix + unparse_host_port(
            get_address_host(self.contact_address), 0
        )
        mpi_local.widen(stream.socket)
        stream = await self._prepare_stream(stream, peer)
        if stream is None:
            return
        if self.tcp_server is None:  # stopped meanwhile
            stream.close()
            return
        comm = self.comm_class(stream, self.contact_address, peer, self.deserialize)
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("Connection from %s closed before handshake completed", peer)
            return
        await self.comm_handler(comm)

    async def _prepare_stream(self, stream, address):
        """The mpi:// handshake, before the comm exists"""
        stream = SocketStream.adopt(stream)
        try:
            link = await wait_for(_handshake(stream), _connect_timeout())
        except Exception as e:
            # A bad peer fails alone: the listener goes on serving others
            if isinstance(e, handshake.Refused):
                handshake.log_refusal(
                    f"mpi:// listener at {self.contact_address} refuses "
                    f"connections from {get_address_host(address)}: {e}"
                )
            else:
                logger.warning(
                    "mpi:// listener at %s: connection from %s failed: %s",
                    self.contact_address,
                    address,
                    e or type(e).__name__,
                )
            stream.close()
            return None
        if link is None:  # it came to open a channel, which is done
            return None
        self._links[stream] = link
        return stream

    async def on_connection(self, comm, handshake_overrides=None):
        comm._linked(self._links.pop(comm.stream, None))
        await super().on_connection(comm, handshake_overrides)


class MPIBackend(BaseTCPBackend):
    _connector_class = MPIConnector
    _listener_class = MPIListener
