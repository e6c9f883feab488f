"""A process to test mpi:// against, meant to run under ``mpiexec``.

``python -m distributed.comm.tests.mpi_peer serve FILE`` listens on mpi://,
writes its address to FILE and echoes every message back, except
``{"op": "sum", "x": array}`` which it answers with the array's sum, and
``{"op": "echo", "x": data}``, whose data it sends back with its type.
With ``distributed.comm.mpi.device-backend: host``, it answers
``{"op": "device", "x": [...], "make": [(size, seed), ...]}`` with the
digests of the :class:`OnDevice` items of ``x``, ``x`` itself, and the
``OnDevice.random`` frames asked for (keeping them, with ``"keep": True``;
as pieces of one allocation, with ``"pool": True``, of the same one for
every such message, with ``"pool": "shared"``):
device frames go each way checked, not
only there and back, where a fault on the way out could undo one on the way
back.

``{"op": "write-and-abort", "size": n}`` makes it write n bytes and abort the
comm at once, keeping the bytes in memory; ``{"op": "device-and-abort",
"size": n, "after": s}`` write a device frame of n bytes, and abort the comm s
seconds later.  ``{"op": "stop-reading"}`` makes it read no more from that comm (and
abort it after ``"close-after"`` seconds, if given); it exits, normally,
once FILE.exit exists.  ``{"op": "pending"}`` asks how many of its
MPI transfers are not complete; ``{"op": "mappings"}`` how many IPC handles
its device opened, and how many it maps now.  ``{"op": "drop", ...}`` gets no
answer.
``{"op": "cross", "address": A, "size": n}`` makes it connect to the mpi://
listener at A and write n bytes there, at once; ``{"op": "channel"}`` asks
for the id of its open channel to the asking process (None: none).
``{"op": "dial-stale", "address": A}`` makes it dial the listener at A for a
channel to a process that is not the one listening there (a predecessor).

``python -m distributed.comm.tests.mpi_peer serve-late FILE`` serves so, but
reads the port of each channel it connects 2.5 s late (:func:`late_for_ports`).

``python -m distributed.comm.tests.mpi_peer flood ADDRESS FILE`` connects to
such a server, sends large frames over MPI until a channel is open, asks it to
stop reading, writes three more messages whose frames stay pending in MPI,
writes FILE and waits to be killed, or exits once FILE.exit exists.

``python -m distributed.comm.tests.mpi_peer ask-device ADDRESS FILE SIZE``
connects to such a server, and once an MPI channel is open asks it for a
device frame of SIZE bytes, writes FILE and reads nothing more; it exits once
FILE.exit exists.

``python -m distributed.comm.tests.mpi_peer ping ADDRESS`` connects to such a
server from another process and checks a few round trips; it prints "over
MPI" once large frames moved over an MPI channel.

``python -m distributed.comm.tests.mpi_peer port FILE`` opens an MPI port,
writes it to FILE and never accepts on it.

``python -m distributed.comm.tests.mpi_peer ping-after-timeout FILE ADDRESS``
first tries to connect to the port in FILE, which must time out, then pings.

``python -m distributed.comm.tests.mpi_peer stuck-connect FILE`` connects to the
port in FILE, and its watchdog of stuck MPI calls goes off before MPI's timeout.

``python -m distributed.comm.tests.mpi_peer ping-astray FILE ADDRESS`` pings
twice, with every MPI accept or connect of its own sent to the port in FILE
instead: MPI fails to open the channel at both ends, for real.

``python -m distributed.comm.tests.mpi_peer ping-without-greeting ADDRESS``
pings with channels over which it receives the peer's greeting, and sends none.

``python -m distributed.comm.tests.mpi_peer receive-from-the-dying FILE``
accepts a connect on a port it writes to FILE, and receives a 64 MiB message
of ones through the progress engine; once MPI has begun to copy it (with
``UCX_CMA_SEG_SIZE`` small, a piece per call into MPI), it writes FILE.die
and waits, calling nothing, until the sender is dead; then lets the engine
go on, and says what became of the receive.
``python -m distributed.comm.tests.mpi_peer send-and-die FILE`` is that sender:
it connects, sends, writes FILE.sender, and kills itself once FILE.die exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import os
import signal
import sys
import time

import numpy as np

from distributed.comm import (
    CommClosedError,
    connect,
    listen,
    mpi_channel,
    mpi_gpu,
    mpi_handshake,
    mpi_opener,
    mpi_startup,
)
from distributed.comm.mpi_liveness import LocalPeer, beacon
from distributed.comm.mpi_progress import ProgressEngine
from distributed.protocol import dask_deserialize, dask_serialize, to_serialize
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize


class OnDevice:
    """A device frame, which the "cuda" serializers send as it is"""

    def __init__(self, frame):
        self.frame = frame

    @classmethod
    def random(cls, size: int, seed: int, pool=None) -> OnDevice:
        """Random bytes in a device frame of the host backend: an allocation
        of its own, or a piece of the allocation ``pool``"""
        if pool is None:
            frame = mpi_gpu.device_buffer(size)
        else:
            offset = seed * 2**16 % (pool.nbytes - size)  # pieces under 64 KiB apart
            frame = mpi_gpu.HostBuffer(size, pool, offset)
        frame.array[:] = np.random.default_rng(seed).integers(0, 256, size, "u1")
        return cls(frame)

    def digest(self) -> str:
        return hashlib.sha256(self.frame.array).hexdigest()


cuda_serialize.register(OnDevice)(lambda x: ({}, [x.frame]))
cuda_deserialize.register(OnDevice)(lambda header, frames: OnDevice(frames[0]))


class OnDeviceOrHost(OnDevice):
    """A device frame that travels as host bytes too, where it must (as CuPy
    arrays do, without the "cuda" serializers)"""

    @classmethod
    def from_host(cls, data) -> OnDeviceOrHost:
        frame = mpi_gpu.device_buffer(len(data))
        frame.array[:] = np.frombuffer(data, "u1")
        return cls(frame)


cuda_serialize.register(OnDeviceOrHost)(lambda x: ({}, [x.frame]))
cuda_deserialize.register(OnDeviceOrHost)(lambda h, frames: OnDeviceOrHost(frames[0]))
dask_serialize.register(OnDeviceOrHost)(lambda x: ({}, [x.frame.array.data]))
dask_deserialize.register(OnDeviceOrHost)(
    lambda h, frames: OnDeviceOrHost.from_host(frames[0])
)


_kept: list = []


@functools.cache
def _pool():
    """An allocation of the host device that frames are pieces of"""
    return mpi_gpu.HostBuffer(4 * 2**20)


@functools.cache
def _shared_pool():
    return _pool()


async def handle(comm):
    try:
        while True:
            msg = await comm.read()
            if isinstance(msg, dict) and msg.get("op") == "stop-reading":
                if "close-after" not in msg:
                    await asyncio.Event().wait()
                await asyncio.sleep(msg["close-after"])
                comm.abort()
                return
            if isinstance(msg, dict) and msg.get("op") == "drop":
                continue
            if isinstance(msg, dict) and msg.get("op") == "write-and-abort":
                # The frame stays in memory as it was: only the lease says
                # that it was given up
                _kept.append(np.ones(msg["size"], "u1"))
                await comm.write({"x": to_serialize(_kept[-1])})
                comm.abort()
                return
            if isinstance(msg, dict) and msg.get("op") == "device-and-abort":
                # A device frame of "size" bytes, given up "after" seconds
                # (staged, a piece at a time: half-way)
                made = to_serialize([OnDevice.random(msg["size"], 1)])
                writing = asyncio.ensure_future(comm.write({"made": made}))
                await asyncio.sleep(msg["after"])
                comm.abort()
                await asyncio.gather(writing, return_exceptions=True)
                return
            if isinstance(msg, dict) and msg.get("op") == "write-and-close":
                # Nothing but the comm keeps the frame
                await comm.write({"x": to_serialize(np.ones(msg["size"], "u1"))})
                await comm.close()
                return
            if isinstance(msg, dict) and msg.get("op") == "ones":
                msg = {"x": to_serialize(np.ones(msg["size"], "u1"))}
            elif isinstance(msg, dict) and msg.get("op") == "sum":
                msg = {"sum": int(msg["x"].sum()), "nbytes": msg["x"].nbytes}
            elif isinstance(msg, dict) and msg.get("op") == "echo":
                x = msg["x"]
                kind = f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"
                msg = {"x": to_serialize(x), "type": kind}
            elif isinstance(msg, dict) and msg.get("op") == "cross":
                # Dial back at once, with large frames, while the writer of
                # this message opens a channel to this process
                back = await connect(msg["address"])
                _kept.append(back)
                await back.write({"x": to_serialize(np.ones(msg["size"], "u1"))})
                await back.read()
                msg = {"crossed": True}
            elif isinstance(msg, dict) and msg.get("op") == "dial-stale":
                gone = f"{comm.peer.host}/1/gone"
                stale = dataclasses.replace(comm.peer, process=gone)
                await mpi_opener.opener._dial(msg["address"], stale)
                msg = {"dialled": True}
            elif isinstance(msg, dict) and msg.get("op") == "channel":
                channel = mpi_channel.channels.get(comm.peer.process)
                msg = {"channel": channel and channel.id}
            elif isinstance(msg, dict) and msg.get("op") == "pending":
                msg = {"pending": ProgressEngine.current().pending()}
            elif isinstance(msg, dict) and msg.get("op") == "mappings":
                device = mpi_gpu.device()
                msg = {"opened": device.opened, "mapped": len(device.mapped)}
            elif isinstance(msg, dict) and msg.get("op") == "device":
                pool = None
                if msg.get("pool"):
                    pool = _shared_pool() if msg["pool"] == "shared" else _pool()
                made = [OnDevice.random(*x, pool) for x in msg["make"]]
                if msg.get("keep"):
                    _kept.append(made)
                msg = {
                    "digests": [
                        x.digest() if isinstance(x, OnDevice) else None
                        for x in msg["x"]
                    ],
                    "x": to_serialize(msg["x"]),
                    "made": to_serialize(made),
                }
            await comm.write(msg)
    except CommClosedError:
        pass
    except Exception:
        # A message it cannot read (GPU data without a GPU, say): the test
        # sees the comm close instead of waiting for a reply
        comm.abort()
        raise


async def serve(path):
    async with listen("mpi://127.0.0.1:0", handle) as listener:
        write(path, listener.contact_address)
        while not os.path.exists(path + ".exit"):  # or until killed
            await asyncio.sleep(0.1)


def late_for_ports() -> None:
    """Read the port of each channel this process connects 2.5 s late, its
    event loop busy meanwhile, and say so if it calls MPI_Comm_connect"""
    recv, meet = mpi_handshake.recv, mpi_opener.Opener.meet

    async def recv_late(stream):
        msg = await recv(stream)
        if "port" in msg:
            time.sleep(2.5)
        return msg

    def meet_and_say(self, port, accepts, timeout):
        if not accepts:
            print("MPI_Comm_connect called", flush=True)
        return meet(self, port, accepts, timeout)

    mpi_handshake.recv, mpi_opener.Opener.meet = recv_late, meet_and_say


async def serve_late(path):
    late_for_ports()
    await serve(path)


def without_ports() -> None:
    """MPI_Open_port fails in this process, as in an MPI without ports"""

    def open_port(self):
        MPI = mpi_startup.get_mpi()
        raise MPI.Exception(MPI.ERR_PORT)

    mpi_opener.Opener.open_port = open_port


async def serve_without_ports(path):
    without_ports()
    await serve(path)


async def ping_without_ports(address):
    without_ports()
    await ping(address)


async def stuck_join():
    """Rank 0 joins a channel with rank 1, which never joins, the watchdog
    of stuck MPI calls set to go off 0.5 s into the join"""
    MPI = await mpi_startup.mpi_ready()
    if MPI.COMM_WORLD.rank == 0:
        mpi_opener.MEET_GRACE = -4.5
        mpi_opener._join(1, 7, timeout=5)
        print("join returned", flush=True)
    await asyncio.Event().wait()  # until killed


async def flood(address, path):
    comm = await connect(address)
    array = np.arange(600_000)
    while comm.channel is None:
        await comm.write({"op": "sum", "x": to_serialize(array)})
        await comm.read()
        await asyncio.sleep(0.05)
    await comm.write({"op": "stop-reading"})
    for _ in range(3):
        await comm.write({"op": "sum", "x": to_serialize(array)})
    write(path, "flooded")
    while not os.path.exists(path + ".exit"):  # or until killed
        await asyncio.sleep(0.1)


async def ask_device(address, path, size):
    comm = await connect(address)
    while comm.channel is None:  # until host frames are copied both ways
        await comm.write({"op": "echo", "x": to_serialize(np.zeros(2**19))})
        await comm.read()
        await asyncio.sleep(0.05)
    await comm.write({"op": "device", "x": [], "make": [(int(size), 0)]})
    write(path, "asked")
    while not os.path.exists(path + ".exit"):  # the reply stays unread
        await asyncio.sleep(0.1)


async def ping(address):
    comm = await connect(address)
    for i in range(100):
        await comm.write({"i": i})
        assert await comm.read() == {"i": i}
    array = np.arange(3_000_000)
    # The first large frame asks for an MPI channel, which opens meanwhile
    for _ in range(50):
        await comm.write({"op": "sum", "x": to_serialize(array)})
        assert (await comm.read())["sum"] == array.sum()
        if comm.channel is not None or not mpi_channel.channels.reachable(
            comm.peer.process
        ):
            break
        await asyncio.sleep(0.05)
    if comm.channel is not None:
        print("over MPI", flush=True)
    elif not mpi_channel.channels.reachable(comm.peer.process):
        print("gave MPI up", flush=True)
    await comm.close()
    print("ping ok", flush=True)


async def port(path):
    await mpi_startup.mpi_ready()
    write(path, mpi_opener.opener.open_port())
    # As an acceptor that gave up: connects to the port stay unmatched
    mpi_startup.skip_finalize(mpi_opener.MEET_FAILED)
    await asyncio.Event().wait()  # until killed


async def ping_after_timeout(path, address):
    MPI = await mpi_startup.mpi_ready()
    with open(path) as f:
        port = f.read()
    try:
        mpi_opener.opener.meet(port, accepts=False, timeout=1)
    except MPI.Exception:
        print("connect timed out", flush=True)
    await ping(address)


async def stuck_connect(path):
    """Connect to the port in FILE, with the watchdog of stuck MPI calls set
    to go off while MPI still waits: as if MPI never returned"""
    await mpi_startup.mpi_ready()
    with open(path) as f:
        port = f.read()
    mpi_opener.MEET_GRACE = -1.5  # 0.5 s into a connect that times out at 2 s
    try:
        mpi_opener.opener.meet(port, accepts=False, timeout=2)
    finally:
        print("connect returned", flush=True)


async def ping_astray(path, address):
    with open(path) as f:
        astray = f.read()
    meet = mpi_opener.opener.meet
    mpi_opener.opener.meet = lambda port, accepts, timeout: meet(astray, False, timeout)
    await ping(address)
    await ping(address)


async def ping_without_greeting(address):
    def greet(channel, timeout):
        """Receives the peer's greeting, and sends none"""
        MPI, theirs = mpi_startup.get_mpi(), bytearray(mpi_channel.GREETING)
        channel.comm.Recv([theirs, MPI.BYTE], channel.rank, channel.greeting_tag)

    mpi_channel.Channel.greet = greet
    await ping(address)


async def receive_from_the_dying(path):
    MPI = await mpi_startup.mpi_ready()
    write(path, mpi_opener.opener.open_port())
    with open(path) as f:
        comm = mpi_opener.opener.meet(f.read(), accepts=True, timeout=60)
    comm.Recv([bytearray(1), MPI.BYTE], 0, 6)
    while not os.path.exists(path + ".sender"):
        await asyncio.sleep(0.01)
    with open(path + ".sender") as f:
        sender = LocalPeer(*map(int, f.read().split()))
    buffer = bytearray(2**26)
    request = comm.Irecv([buffer, MPI.BYTE], 0, 7)
    fut = ProgressEngine.current().receive([request], buffer, sender, [2**26])
    while buffer[0] != 1:  # until MPI has begun to copy, a piece per poll
        await asyncio.sleep(0)
    print(f"copying, done: {fut.done()}", flush=True)
    write(path + ".die", "")
    while not sender.died():  # the event loop waits too: nothing calls MPI
        time.sleep(0.001)
    try:
        await asyncio.wait_for(fut, 30)
        print("received", flush=True)
    except CommClosedError as e:
        print(f"receive failed: {e}", flush=True)
    print(f"MPI stopped: {mpi_startup.mpi_stopped()}", flush=True)


async def send_and_die(path):
    MPI = await mpi_startup.mpi_ready()
    while not os.path.exists(path):
        await asyncio.sleep(0.01)
    with open(path) as f:
        comm = mpi_opener.opener.meet(f.read(), accepts=False, timeout=60)
    comm.Send([b"x", MPI.BYTE], 0, 6)  # UCX connects the two
    data = np.ones(2**26, "u1")
    request = comm.Isend([data, MPI.BYTE], 0, 7)
    write(path + ".sender", f"{os.getpid()} {beacon()}")
    while not os.path.exists(path + ".die"):
        request.Test()
        await asyncio.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)


def write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


COMMANDS = {
    "serve": serve,
    "serve-late": serve_late,
    "serve-without-ports": serve_without_ports,
    "ping-without-ports": ping_without_ports,
    "stuck-join": stuck_join,
    "ping": ping,
    "flood": flood,
    "ask-device": ask_device,
    "port": port,
    "ping-after-timeout": ping_after_timeout,
    "ping-astray": ping_astray,
    "ping-without-greeting": ping_without_greeting,
    "stuck-connect": stuck_connect,
    "receive-from-the-dying": receive_from_the_dying,
    "send-and-die": send_and_die,
}

if __name__ == "__main__":
    # From the module by its name, not __main__: the OnDevice it sends must
    # unpickle at the other end
    from distributed.comm.tests import mpi_peer

    asyncio.run(mpi_peer.COMMANDS[sys.argv[1]](*sys.argv[2:]))
