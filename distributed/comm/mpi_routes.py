"""The routes a large frame of an mpi:// comm can take between two processes.

Frames below ``inline-size`` travel on the comm's socket, after the message's
head (host frames below ``local-inline-size`` too, where that socket is a Unix
socket, between processes of one host).  Each larger frame takes one of the
routes of the channel between the two processes (:class:`Routes`), which the
writer picks and names in the head, so that the reader takes it too:

- :class:`OverMPI`: host memory, in ``chunk-size`` pieces over MPI's
  non-blocking sends and receives;
- :class:`LocalCopy`: host memory that the reader copies straight from the
  writer's memory, between processes of one host (``mpi_copy``);
- :class:`DeviceIPC`: device memory that the reader copies from the writer's
  GPU memory, mapped by CUDA IPC, between processes of one host (``mpi_ipc``);
- :class:`Direct`: device memory, handed to a CUDA-aware MPI as it is;
- :class:`Staged`: device memory, through pinned host memory (``mpi_gpu``).

MPI matches a message's receives with its sends by their order alone (one
tag per message), so both ends post them in the same order: route by route
as :data:`ORDER` lists them, frame by frame.  A writer posts its sends before
it writes the head, so that MPI moves data while the head travels, except
for a route that posts as it goes (staged: a piece at a time, as pinned
slots free up), whose sends follow the head.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from distributed.comm import mpi_copy, mpi_gpu, mpi_ipc
from distributed.comm.mpi_buffers import host_buffer


class Message:
    """One message's transfers over a channel: its tag, the size of its MPI
    pieces, and ``post(chunks)``, which posts the sends (or receives, for a
    message read) of some of its pieces and returns the future of their
    completion"""

    def __init__(self, channel, tag: int, chunk_size: int, transfers, receive: bool):
        self.channel = channel
        self.tag = tag
        self.chunk_size = chunk_size
        self.transfers = transfers
        self.post = transfers.poster(channel, tag, receive)
        # Of its copied frames: the writer's Lease; the reader's head of it
        self.lease = None
        self.extra = bytearray()  # what routes say beyond a word


class Route:
    """One way for large frames to travel; its ``code`` names it in heads"""

    code: ClassVar[int]
    posts_as_it_goes: ClassVar[bool] = False

    def __init__(self, channel):
        self.channel = channel

    def takes(self, frame) -> bool:
        """Whether a frame may travel this way to the peer"""
        raise NotImplementedError

    def refusal(self) -> str | None:
        """Why this end cannot read frames that came this way, if it cannot"""
        return None

    def describe(self, frames: list, msg: Message) -> list[int]:
        """What the head says of each frame besides its size"""
        return [0] * len(frames)

    async def send(self, frames: list, msg: Message) -> None:
        """Post the frames' sends; their completion is the engine's"""
        raise NotImplementedError

    async def receive(
        self, frames: list[tuple[int, int]], msg: Message
    ) -> tuple[list, list[asyncio.Future]]:
        """Receive the frames of these (size, word) entries of a head: the
        frames, and what to await until they are filled"""
        raise NotImplementedError

    def close(self) -> None:
        """The channel is freed"""

    def __repr__(self):
        return f"<{type(self).__name__} to {self.channel.peer}>"


class OverMPI(Route):
    code = 1

    def takes(self, frame) -> bool:
        return not mpi_gpu.is_device(frame)

    async def send(self, frames, msg):
        msg.post([c for frame in frames for c in chunks(frame, msg.chunk_size)])

    async def receive(self, frames, msg):
        received = self._allocate([size for size, _ in frames])
        pieces = [c for frame in received for c in chunks(frame, msg.chunk_size)]
        return received, [msg.post(pieces)] if pieces else []

    def _allocate(self, sizes: list[int]) -> list:
        return [host_buffer(size) for size in sizes]


class LocalCopy(Route):
    """The reader copies the frames from the writer's memory (see
    ``mpi_copy``), which keeps them until the reader says it has them"""

    code = 2

    def takes(self, frame) -> bool:
        return self.channel.peer_copies and not mpi_gpu.is_device(frame)

    def refusal(self):
        return (
            "frames to copy from another host" if self.channel.sender is None else None
        )

    def describe(self, frames, msg):
        msg.lease = mpi_copy.Lease(frames)
        return [mpi_copy.address(frame) for frame in frames]

    async def send(self, frames, msg):
        transfers = msg.transfers
        lent = mpi_copy.lend(transfers.engine, self.channel, msg.tag, msg.lease)
        transfers.track(lent)

    async def receive(self, frames, msg):
        copied = await mpi_copy.receive(self.channel.sender, frames, msg.lease)
        mpi_copy.acknowledge(msg.transfers.engine, self.channel, msg.tag)
        return copied, []


class DeviceIPC(Route):
    """Device memory that the reader copies from the writer's allocation,
    which it maps by the allocation's IPC handle (``mpi_ipc``); the writer
    keeps the frames until the reader says it has them"""

    code = 5

    def __init__(self, channel):
        super().__init__(channel)
        self._exports: dict[int, bytes] = {}  # picked frames, until described
        self._mappings: mpi_ipc.Mappings | None = None  # of the writer's

    def takes(self, frame) -> bool:
        if not (self.channel.peer_ipc and mpi_gpu.is_device(frame)):
            return False
        exported = mpi_ipc.export(frame)
        if exported is None:  # from a stream-ordered pool, say
            return False
        self._exports[id(frame)] = exported
        return True

    def refusal(self):
        if self.channel.sender is None:
            return "device frames to copy from another host"
        return None

    def describe(self, frames, msg):
        words, exports = [], {}
        for frame in frames:  # one buffer may be several of a message's frames
            if id(frame) not in exports:
                # This message's alone: comms of other event loops may be
                # picking theirs meanwhile, the same buffer too, and have
                # taken its export already
                exports[id(frame)] = self._exports.pop(
                    id(frame), None
                ) or mpi_ipc.export(frame)
            words.append(len(msg.extra))
            msg.extra += exports[id(frame)]
        return words

    async def send(self, frames, msg):
        mpi_gpu.synchronize(frames)  # their producers are done
        # The reader checks no lease on this route (where it lends on the
        # socket instead, it does): the frames stay until it has them,
        # whatever becomes of the comm
        lent = mpi_copy.lend(
            msg.transfers.engine, self.channel, msg.tag, mpi_copy.Lease(frames)
        )
        msg.transfers.track(lent, keep=True)

    async def receive(self, frames, msg):
        if self._mappings is None:
            channel = self.channel
            self._mappings = mpi_ipc.Mappings.of(channel.peer, channel.sender)
        received = await self._mappings.copy(frames, msg.extra)
        mpi_copy.acknowledge(msg.transfers.engine, self.channel, msg.tag)
        return received, []

    def close(self):
        if self._mappings is not None:
            self._mappings.release()
            self._mappings = None


class Direct(OverMPI):
    """Device memory, to and from a CUDA-aware MPI"""

    code = 3

    def takes(self, frame) -> bool:
        return mpi_gpu.is_device(frame)

    async def send(self, frames, msg):
        mpi_gpu.synchronize(frames)  # their producers are done
        await super().send(frames, msg)

    def _allocate(self, sizes):
        received = [mpi_gpu.device_buffer(size) for size in sizes]
        mpi_gpu.synchronize()  # the allocations, before anything writes
        return received


class Staged(Route):
    """Device memory, a piece at a time through pinned host slots"""

    code = 4
    posts_as_it_goes = True

    def takes(self, frame) -> bool:
        return mpi_gpu.is_device(frame)

    def describe(self, frames, msg):
        # Their producers are done before the head goes: the reader's
        # receives, posted as it reads the head, would count a long kernel
        # as a stall of MPI
        mpi_gpu.synchronize(frames)
        return super().describe(frames, msg)

    async def send(self, frames, msg):
        await mpi_gpu.send_staged(
            frames, msg.chunk_size, lambda slot: msg.post([slot]), msg.transfers.sent
        )

    async def receive(self, frames, msg):
        received = [mpi_gpu.device_buffer(size) for size, _ in frames]
        mpi_gpu.synchronize()  # the allocations, before anything writes
        await mpi_gpu.recv_staged(
            received, msg.chunk_size, lambda slot: msg.post([slot])
        )
        return received, []


# The order in which a message's frames are posted, at both ends (the writer
# posts a receive of the reader's "copied" for each of the last two)
ORDER = (OverMPI, Direct, Staged, DeviceIPC, LocalCopy)
_DEVICE = {Direct.code, Staged.code}


class Routes:
    """The routes of one channel: the writer picks the first that takes a
    frame, the reader the one the head names"""

    def __init__(self, channel):
        device = {"direct": [Direct], "staged": [Staged]}.get(channel.gpu, [])
        if device:
            device.insert(0, DeviceIPC)
        self._preference = [cls(channel) for cls in (LocalCopy, OverMPI, *device)]
        self._by_code = {route.code: route for route in self._preference}

    def pick(self, frame) -> Route:
        for route in self._preference:
            if route.takes(frame):
                return route
        raise TypeError(f"no mpi:// route takes a frame of type {type(frame)}")

    def reader(self, code: int) -> Route:
        """The route a head names; ValueError if this end cannot take it"""
        route = self._by_code.get(code)
        if route is None and code in _DEVICE:
            raise ValueError(
                "the peer sent GPU frames, which this process cannot hold "
                "(it has no GPU or no CuPy), or not that way"
            )
        if route is None:
            raise ValueError(f"a frame on an unknown route ({code})")
        why = route.refusal()
        if why:
            raise ValueError(why)
        return route

    def close(self) -> None:
        """The channel is freed"""
        for route in self._preference:
            route.close()


def chunks(frame, size: int) -> list:
    """``size`` pieces of a frame, for MPI: memoryviews, or views of a device
    buffer that mpi4py passes on as device pointers"""
    if mpi_gpu.is_device(frame):
        return [
            mpi_gpu.DeviceSlice(frame, offset, n)
            for offset, n in mpi_gpu.pieces(mpi_gpu.nbytes(frame), size)
        ]
    frame = memoryview(frame).cast("B")
    return [frame[i : i + size] for i in range(0, frame.nbytes, size)]
