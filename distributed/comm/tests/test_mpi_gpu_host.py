"""The GPU path of mpi:// without a GPU: device frames in host memory
(``distributed.comm.mpi.device-backend: host``, see ``mpi_gpu.HostDevice``)
between this process and an mpi_peer process under mpiexec, staged through
pinned slots, direct to MPI (``cuda-aware: true``, which holds for host
memory with any MPI), or copied by the reader from the writer's memory as
CUDA IPC would (``device-ipc``: the host device maps the writer's buffers,
copies with ``process_vm_readv``, as late as a GPU might, and overwrites a
buffer it frees), over an MPI channel or lent on the comm's socket
(``lend-on-socket``).  Chunks are small, so that small frames take several
chunks and reuse the slots, yet larger than MPICH sends eagerly (copied at
once): a slot reused before its send completed shows (at 4 KiB, only under
load)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from typing import NamedTuple

import psutil
import pytest

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")

import dask

from distributed.comm import (
    CommClosedError,
    connect,
    mpi_channel,
    mpi_gpu,
    mpi_ipc,
    mpi_transfers,
)
from distributed.comm.mpi_channel import channels
from distributed.comm.mpi_progress import ProgressEngine
from distributed.comm.tests.mpi_peer import OnDevice, OnDeviceOrHost
from distributed.comm.tests.mpi_processes import OUTPUT, Job, mpiexec, wait_for_file
from distributed.protocol import to_serialize
from distributed.utils_test import async_poll_for, gen_test

pytestmark = pytest.mark.timeout(120)

CHUNK = 16384
PEER = ["-n", "1", "-m", "distributed.comm.tests.mpi_peer"]


class Peer(NamedTuple):
    address: str
    job: Job
    # How device frames travel between the two: staged, direct, ipc (over a
    # channel), lent (by IPC, on the socket)
    route: str
    gpu_path: str
    config: dict  # for this process (gen_test resets dask's config)


@contextlib.contextmanager
def serving(route: str, monkeypatch, tmp_path):
    """An echoing mpi_peer under mpiexec; both ends on host "GPUs", with
    small chunks, device frames taking ``route``"""
    config = {
        "device-backend": "host",
        "chunk-size": CHUNK,
        # Whatever the defaults, larger frames do not travel on the socket
        "inline-size": 1024,
        "local-inline-size": 1024,
        "lend-on-socket": route == "lent",
        "cuda-aware": route == "direct",
        "device-ipc": route in ("ipc", "lent"),
    }
    for key, value in config.items():
        name = "DASK_DISTRIBUTED__COMM__MPI__" + key.upper().replace("-", "_")
        monkeypatch.setenv(name, str(value))
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path]) as job:
        yield Peer(
            wait_for_file(path, job),
            job,
            route,
            "direct" if route == "direct" else "staged",
            {f"distributed.comm.mpi.{k}": v for k, v in config.items()},
        )


@pytest.fixture(params=["staged", "direct", "ipc", "lent"])
def peer(request, monkeypatch, tmp_path):
    with serving(request.param, monkeypatch, tmp_path) as peer:
        yield peer


@pytest.fixture(params=["staged", "direct", "ipc"])
def channel_peer(request, monkeypatch, tmp_path):
    with serving(request.param, monkeypatch, tmp_path) as peer:
        yield peer


@pytest.fixture(params=["ipc", "lent"])
def ipc_peer(request, monkeypatch, tmp_path):
    with serving(request.param, monkeypatch, tmp_path) as peer:
        yield peer


def check(reply: dict, x: list, make: list) -> None:
    """The reply to a "device" message, byte for byte"""
    sizes = [item.frame.nbytes for item in x if isinstance(item, OnDevice)]
    assert list(reply["digests"]) == [
        item.digest() if isinstance(item, OnDevice) else None for item in x
    ], f"device frames of {sizes} bytes reached the peer changed"
    assert len(reply["x"]) == len(x)
    for got, sent in zip(reply["x"], x):
        assert type(got) is type(sent)
        if isinstance(sent, OnDevice):
            # in a device frame that the backend allocated
            assert isinstance(got.frame, mpi_gpu.HostBuffer)
            assert got.digest() == sent.digest()
        elif isinstance(sent, np.ndarray):
            np.testing.assert_array_equal(got, sent)
        else:
            assert got == sent
    assert [got.digest() for got in reply["made"]] == [
        OnDevice.random(size, seed).digest() for size, seed in make
    ], f"device frames of {[size for size, _ in make]} bytes arrived changed"


async def connect_over_mpi(address: str):
    """A comm whose large frames travel over MPI: a channel opens the first
    time a frame needs one, and until then frames travel over TCP.  Between
    two ends that lend device frames on the socket, a comm once the peer
    said so: no channel opens"""
    comm = await connect(address)
    if dask.config.get("distributed.comm.mpi.lend-on-socket"):
        await async_poll_for(lambda: comm._lender.peer_ipc, timeout=5)
        return comm
    for _ in range(100):
        await comm.write({"op": "echo", "x": to_serialize(np.zeros(CHUNK))})
        await comm.read()  # over MPI too, if the channel is open at both ends
        if comm.channel and comm.channel is channels.get(comm.peer.process):
            return comm
        await asyncio.sleep(0.05)
    raise AssertionError(f"{comm} opened no MPI channel")


async def exchange(comm, x: list, make: list) -> None:
    """Send ``x``, and get frames of the sizes and seeds ``make``"""
    await comm.write({"op": "device", "x": to_serialize(x), "make": make})
    check(await comm.read(), x, make)


@contextlib.contextmanager
def on_call(method: str, count: int, action):
    """Call ``action()`` as this process's device ``method`` is called for
    the ``count``-th time from now"""
    device = mpi_gpu.device()
    original = getattr(device, method)
    calls = 0

    def call(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == count:
            action()
        return original(*args, **kwargs)

    setattr(device, method, call)
    try:
        yield
    finally:
        delattr(device, method)


@gen_test(timeout=60)
async def test_device_frames_of_every_size(peer):
    sizes = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, mpi_gpu.DEPTH * CHUNK + 1]
    sizes += [11 * CHUNK + 333, 3 * 2**20 + 7]
    with dask.config.set(peer.config):
        comm = await connect_over_mpi(peer.address)
        assert comm.gpu_path == peer.gpu_path
        for size in sizes:
            await exchange(comm, [OnDevice.random(size, size)], [(size, size + 1)])
        await comm.close()


@gen_test(timeout=60)
async def test_device_and_host_frames_in_one_message(peer):
    with dask.config.set(peer.config):
        x = [
            OnDevice.random(5 * CHUNK + 1, 1),
            np.arange(50_000),  # a host frame over MPI
            b"bytes",
            OnDevice.random(0, 2),
            OnDevice.random(3 * CHUNK, 3),
        ]
        comm = await connect_over_mpi(peer.address)
        await exchange(comm, x, [(CHUNK + 7, 4), (0, 5), (2 * CHUNK, 6)])
        await comm.close()


@gen_test(timeout=90)
async def test_many_messages_in_flight_both_ways(peer):
    """Comms that each write while they read the replies: both processes
    stage frames towards each other at once, on several comms"""

    async def talk(i, comm):
        sizes = [(i * 3 * CHUNK + j * 777, 100 * i + j) for j in range(8)]
        sent = [[j, OnDevice.random(*size)] for j, size in enumerate(sizes)]

        async def write():
            for x, make in zip(sent, sizes):
                await comm.write({"op": "device", "x": to_serialize(x), "make": [make]})

        async def read():
            for x, make in zip(sent, sizes):
                check(await comm.read(), x, [make])

        await asyncio.gather(write(), read())

    with dask.config.set(peer.config):
        comms = [await connect_over_mpi(peer.address) for _ in range(4)]
        await asyncio.gather(*(talk(i, comm) for i, comm in enumerate(comms)))
        await asyncio.gather(*(comm.close() for comm in comms))


async def assert_serves(address):
    """The peer lives, and serves a new comm"""
    comm = await connect_over_mpi(address)
    await exchange(comm, [OnDevice.random(3 * CHUNK + 5, 7)], [(CHUNK + 1, 8)])
    await comm.close()


async def poll_for_the_peers_sends_to_complete(address, timeout=10):
    comm = await connect(address)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await comm.write({"op": "pending"})
        if (await comm.read())["pending"] == 0:
            break
        assert asyncio.get_running_loop().time() < deadline, "its sends hang"
        await asyncio.sleep(0.05)
    await comm.close()


LARGE = 40 * CHUNK + 1  # a frame that takes a while


@gen_test(timeout=60)
async def test_comm_closed_mid_frame_by_the_reader(peer):
    """Direct, as host frames: the writer posted all the chunks, and the
    reader's receives complete nonetheless, so the writer's sends complete
    and nothing stays queued in MPI (UCX warned of each chunk at exit).
    Staged, the writer posts a chunk once a slot is free, and stops when the
    comm breaks.  By IPC, the reader copies, and still says it has the frame,
    so that the writer lets it go"""
    with dask.config.set(peer.config):
        comm = await connect_over_mpi(peer.address)
        await comm.write({"op": "device", "x": [], "make": [(LARGE, 0)]})
        # The next copy is not made at once: the close comes in meanwhile
        mpi_gpu.device().copies = 0
        # Once the frame's head arrived, while its chunks are on their way
        with on_call("buffer", 1, lambda: asyncio.ensure_future(comm.close())):
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.read(), 20)
        assert comm.closed()
        if peer.route != "staged":
            await poll_for_the_peers_sends_to_complete(peer.address)
        await assert_serves(peer.address)


@gen_test(timeout=60)
async def test_peer_leaves_the_channel_once_it_reads_that_the_comm_closed(
    channel_peer, monkeypatch
):
    """This end frees the channel ``FREE_AFTER`` after its last comm closed;
    the peer must not name it in a message of a later comm"""
    monkeypatch.setattr(mpi_channel, "FREE_AFTER", 0.5)
    with dask.config.set(channel_peer.config):
        comm = await connect_over_mpi(channel_peer.address)
        channel = comm.channel
        await comm.close()
        await async_poll_for(lambda: channels.by_id(channel.id) is None, timeout=5)
        await assert_serves(channel_peer.address)


@gen_test(timeout=60)
async def test_comm_closed_mid_frame_by_the_writer(peer):
    with dask.config.set(peer.config):
        # Unanswered: an answer over MPI to the closed comm would stay queued
        msg = {"op": "drop", "x": to_serialize([OnDevice.random(LARGE, 0)])}
        comm = await connect_over_mpi(peer.address)
        if peer.route == "staged":  # once the third chunk is being copied
            closing = []

            def close():
                closing.append(asyncio.ensure_future(comm.close()))

            with on_call("copy", 3, close):
                with pytest.raises(CommClosedError):
                    await asyncio.wait_for(comm.write(msg), 20)
            await closing[0]
        else:  # all chunks are posted at once
            await comm.write(msg)
            await comm.close()
        assert comm.closed()
        await assert_serves(peer.address)


@gen_test(timeout=60)
async def test_a_staged_message_pins_one_set_of_slots(monkeypatch, tmp_path):
    """Its frames share ``DEPTH`` pinned slots, at each end (fewer for fewer
    chunks): a writer took ``DEPTH`` for each frame, however small, and
    moved to the next without waiting, so one message of many frames (a
    cuDF partition's columns) pinned several times its size"""
    with serving("staged", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config):
            comm = await connect_over_mpi(peer.address)
            mpi_gpu._stager.cache_clear()  # an empty pool of slots
            device, pinned = mpi_gpu.device(), []
            monkeypatch.setattr(
                device,
                "pinned",
                lambda size, pin=device.pinned: pinned.append(size) or pin(size),
            )
            x = [OnDevice.random(CHUNK // 2 + i, i) for i in range(32)]
            await exchange(comm, x, [(CHUNK // 2, 99)])
            assert len(pinned) <= mpi_gpu.DEPTH, len(pinned)
            await comm.close()


@pytest.mark.parametrize("route", ["staged", "ipc", "lent"])
@gen_test(timeout=60)
async def test_a_device_error_while_reading_is_a_closed_comm(
    route, monkeypatch, tmp_path
):
    """A CUDA error while reading device frames (no pinned memory left, a
    failed copy) fails the read as a network failure does, so that Dask
    fetches the data again, where another exception marked the tasks that
    need it failed"""

    def fail(*args, **kwargs):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")

    with serving(route, monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config):
            comm = await connect_over_mpi(peer.address)
            mpi_gpu._stager.cache_clear()  # no pinned slot to reuse
            with monkeypatch.context() as patch:
                patch.setattr(mpi_gpu.device(), "pinned", fail)  # staged
                patch.setattr(mpi_gpu._HostMapping, "copy_to", fail)  # by IPC
                await comm.write({"op": "device", "x": [], "make": [(4 * CHUNK, 1)]})
                with pytest.raises(CommClosedError, match="cudaErrorMemoryAllocation"):
                    await comm.read()
            assert comm.closed()
            await assert_serves(peer.address)


@gen_test(timeout=60)
async def test_a_staged_write_waits_for_its_frames_producers_before_the_head(
    monkeypatch, tmp_path
):
    """A long kernel on the frames' stream, waited for after the head went:
    the reader's receives saw nothing for ``stall-timeout``, and the two
    gave MPI up for good"""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__STALL_TIMEOUT", "1s")
    with serving("staged", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config):
            comm = await connect_over_mpi(peer.address)
            device = mpi_gpu.device()
            monkeypatch.setattr(
                device,
                "synchronize",
                lambda frames, wait=device.synchronize: (
                    time.sleep(1.5) if frames else None,
                    wait(frames),
                ),
            )
            await exchange(comm, [OnDevice.random(4 * CHUNK, 1)], [])
            assert channels.reachable(comm.peer.process)
            await comm.close()


class _Frame:
    """A device frame of these ``shape``, ``typestr`` and ``strides``"""

    def __init__(self, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "data": (0, False),
            "version": 3,
        }


def test_the_size_of_a_device_frame():
    """Every byte of a frame with no gaps; a strided one is refused, where
    its first bytes in a row went, silently"""
    assert mpi_gpu.nbytes(_Frame((3, 4), "<f8")) == 96
    assert mpi_gpu.nbytes(_Frame((3, 4), "<f8", (32, 8))) == 96
    assert mpi_gpu.nbytes(_Frame((1, 4), "<f8", (0, 8))) == 32
    assert mpi_gpu.nbytes(_Frame((5,), "<M8[ns]")) == 40
    assert mpi_gpu.nbytes(_Frame((0,), "|u1")) == 0
    with pytest.raises(ValueError, match="strided"):
        mpi_gpu.nbytes(_Frame((3, 4), "<f8", (64, 8)))
    with pytest.raises(ValueError, match="strided"):
        mpi_gpu.nbytes(_Frame((4,), "|u1", (2,)))


@gen_test(timeout=60)
async def test_a_staged_write_whose_reader_hung_up_fails(monkeypatch, tmp_path):
    """The reader stops reading, then closes the comm, before a staged frame
    is sent: the write, which waits for the frame's first chunks to be sent
    to reuse their slots, fails instead of waiting for good"""
    monkeypatch.setattr(mpi_transfers, "HANG_UP_CHECK", 0.1)
    with serving("staged", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config):
            comm = await connect_over_mpi(peer.address)
            await comm.write({"op": "stop-reading", "close-after": 1})
            x = to_serialize(OnDevice.random(4 * mpi_gpu.DEPTH * CHUNK, 1))
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.write({"op": "echo", "x": x}), 20)
            assert comm.closed()


@gen_test(timeout=60)
async def test_a_staged_frame_that_its_writer_gave_up_half_way(monkeypatch, tmp_path):
    """The writer aborts the comm in the middle of a staged frame: the read
    fails once MPI delivers no more for ``HUNG_UP_STALL``, not
    ``stall-timeout``, since the peer closed the connection, which says why;
    and MPI is not given up on between the two"""
    with serving("staged", monkeypatch, tmp_path) as peer:
        config = {**peer.config, "distributed.comm.mpi.stall-timeout": "60s"}
        with dask.config.set(config):
            comm = await connect_over_mpi(peer.address)
            size = 2000 * CHUNK
            await comm.write({"op": "device-and-abort", "size": size, "after": 0.2})
            with pytest.raises(CommClosedError, match="closed mid-message"):
                await asyncio.wait_for(comm.read(), 15)
            assert channels.reachable(comm.peer.process)


@gen_test(timeout=60)
async def test_peer_killed_mid_frame(peer):
    def kill():
        ranks = peer.job.ranks()
        for rank in ranks:
            rank.kill()
        psutil.wait_procs(ranks, timeout=10)

    with dask.config.set(peer.config):
        comm = await connect_over_mpi(peer.address)
        await comm.write({"op": "device", "x": [], "make": [(LARGE, 0)]})
        # Once the frame's head arrived, before any chunk is received
        with on_call("buffer", 1, kill):
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.read(), 20)
        assert comm.closed()


def test_no_ucx_error_at_exit_after_the_peer_died_mid_frame(channel_peer, tmp_path):
    """A process whose frames its peer on this host only copied, and which
    asked it for a device frame over MPI, outlives the peer, killed while
    sending it: it exits with 0, without a word from UCX.  UCX wires up what
    the peer's messages need when it first meets one (``Channel.greet``):
    here in the exit drain, after the peer died, which logged errors"""
    path = str(tmp_path / "asked")
    with mpiexec(
        [*PEER, "ask-device", channel_peer.address, path, str(LARGE)], **OUTPUT
    ) as job:
        wait_for_file(path, job)
        time.sleep(0.5)  # the peer posts its sends
        channel_peer.job.crash()
        open(path + ".exit", "w").close()
        out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    assert "UCX" not in out, out


# Copied from the writer's memory (device-ipc)


def mapped_of(comm) -> list:
    """What this process's device maps of the peer of ``comm``"""
    return [key for key in mpi_gpu.device().mapped if key[0] == comm.peer.pid]


async def mappings(address) -> dict:
    """The peer's device: how many IPC handles it opened, and maps now"""
    comm = await connect(address)
    await comm.write({"op": "mappings"})
    reply = await comm.read()
    await comm.close()
    return reply


def staging(monkeypatch) -> list:
    """The copies through pinned slots that this process makes from now"""
    device = mpi_gpu.device()
    staged: list = []
    stage = device.copy
    monkeypatch.setattr(device, "copy", lambda *a: staged.append(a) or stage(*a))
    return staged


async def host_frames_until_the_channel(comm, x: list, make: list, staged: list):
    """Exchange ``x`` and ``make`` until a message takes the MPI channel: as
    host frames, nothing staged, until then"""
    for _ in range(100):
        await exchange(comm, x, make)
        if comm.channel is not None:  # this message took it
            return
        assert not staged
        await asyncio.sleep(0.05)
    raise AssertionError(f"{comm} opened no MPI channel")


@contextlib.contextmanager
def no_staging():
    """Fail on a copy through pinned slots in this process"""

    def copy(*args, **kwargs):
        raise AssertionError("a device frame was staged, not copied by IPC")

    with on_call("copy", 1, copy):
        yield


@gen_test(timeout=60)
async def test_ipc_maps_an_allocation_once(ipc_peer):
    """The reader keeps its mapping of an allocation for the next frames in
    it: opening one costs far more than a copy"""
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        before = await mappings(ipc_peer.address)
        x = OnDevice.random(3 * CHUNK + 5, 1)
        for _ in range(5):
            await exchange(comm, [x], [(CHUNK + 1, 2)])
        after = await mappings(ipc_peer.address)
        assert after["opened"] == before["opened"] + 1, (before, after)
        assert after["mapped"] == before["mapped"] + 1, (before, after)
        await comm.close()


@gen_test(timeout=60)
async def test_ipc_maps_an_allocation_once_whatever_the_comms(ipc_peer):
    """Two comms between the same two processes share the reader's mappings:
    a second mapping of one allocation would fail (CUDA: "already mapped")"""
    with dask.config.set(ipc_peer.config), no_staging():
        comms = [await connect_over_mpi(ipc_peer.address) for _ in range(2)]
        before = await mappings(ipc_peer.address)
        x = OnDevice.random(3 * CHUNK + 5, 1)
        for comm in comms * 2:
            await exchange(comm, [x], [])
        after = await mappings(ipc_peer.address)
        assert after["opened"] == before["opened"] + 1, (before, after)
        await asyncio.gather(*(comm.close() for comm in comms))


@gen_test(timeout=60)
async def test_device_frames_lent_on_the_socket_open_no_channel(monkeypatch, tmp_path):
    """Lent, device frames need no MPI channel; this end's mappings of the
    peer's frames close with the last comm to it"""
    with serving("lent", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config), no_staging():
            comm = await connect_over_mpi(peer.address)
            x = [OnDevice.random(3 * CHUNK, 1), np.arange(5000)]
            await exchange(comm, x, [(CHUNK + 1, 2), (2 * CHUNK, 3)])
            assert mapped_of(comm)
            assert comm.channel is None and channels.get(comm.peer.process) is None
            await comm.write({"op": "channel"})
            assert (await comm.read())["channel"] is None
            await comm.close()
            assert not mapped_of(comm)


@gen_test(timeout=60)
async def test_frames_copied_over_a_channel_outlive_an_abort(monkeypatch, tmp_path):
    """By IPC over a channel the reader checks no lease: frames whose comm
    aborts stay until the reader has them, or dies"""
    with serving("ipc", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config), no_staging():
            comm = await connect_over_mpi(peer.address)
            await comm.write({"op": "stop-reading"})
            x = OnDevice.random(3 * CHUNK, 1)
            frame = weakref.ref(x.frame)
            await comm.write({"op": "drop", "x": to_serialize([x])})
            del x
            comm.abort()
            await asyncio.sleep(1)
            assert frame() is not None  # the peer may read it yet
            peer.job.crash()
            await async_poll_for(lambda: frame() is None, timeout=20)


@gen_test(timeout=60)
async def test_lent_mappings_close_when_the_peer_dies_unread(monkeypatch, tmp_path):
    """The peer dies while nothing reads its comm (one idle in a pool): the
    mappings of its frames close with the socket, not at the next read"""
    with serving("lent", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config), no_staging():
            comm = await connect_over_mpi(peer.address)
            await exchange(comm, [], [(3 * CHUNK, 1)])
            assert mapped_of(comm)
            peer.job.crash()
            await async_poll_for(lambda: not mapped_of(comm), timeout=20)
            assert comm.closed()
            comm.abort()


@gen_test(timeout=60)
async def test_device_frames_that_cannot_be_exported_are_not_lent(
    monkeypatch, tmp_path
):
    """Memory that has no IPC handle (a stream-ordered pool's): as host
    frames while no channel is open, then staged over the channel"""
    with serving("lent", monkeypatch, tmp_path) as peer:
        with dask.config.set(peer.config):
            comm = await connect_over_mpi(peer.address)
            device = mpi_gpu.device()
            monkeypatch.setattr(device, "export", lambda frame: None)
            staged = staging(monkeypatch)
            x = OnDeviceOrHost.random(3 * CHUNK + 5, 1)
            await host_frames_until_the_channel(comm, [x], [(CHUNK + 1, 2)], staged)
            assert staged
            await comm.close()


@gen_test(timeout=60)
async def test_device_frames_between_gpus_that_cannot_map_each_other_are_staged(
    monkeypatch, tmp_path
):
    """Each process sees its own GPU alone (Slurm's ``--gpus-per-task``):
    device frames are not copied by IPC, but staged over the channel that
    the first of them asks for, as host frames until it is open"""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the peer's
    with serving("lent", monkeypatch, tmp_path) as peer:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # this process's
        with dask.config.set(peer.config):
            comm = await connect(peer.address)
            device = mpi_gpu.device()
            opened = device.opened
            staged = staging(monkeypatch)
            x = OnDeviceOrHost.random(3 * CHUNK + 5, 1)
            await host_frames_until_the_channel(comm, [x], [], staged)
            await exchange(comm, [x], [(CHUNK + 1, 2)])
            assert staged
            assert device.opened == opened and not mapped_of(comm)
            await comm.close()


@gen_test(timeout=60)
async def test_device_frames_between_gpus_that_see_each_other_go_by_ipc(
    monkeypatch, tmp_path
):
    """Each process sees every GPU of the node, its own first (dask-cuda's
    CUDA_VISIBLE_DEVICES): the reader copies from the writer's GPU, whose
    number differs in the two processes"""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # the peer's
    with serving("lent", monkeypatch, tmp_path) as peer:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # this process's
        with dask.config.set(peer.config), no_staging():
            comm = await connect(peer.address)
            device = mpi_gpu.device()
            opened = device.opened
            x = OnDeviceOrHost.random(3 * CHUNK + 5, 1)
            await exchange(comm, [x], [(CHUNK + 1, 2)])
            assert device.opened > opened and mapped_of(comm)
            await comm.close()


@gen_test(timeout=90)
async def test_a_writer_whose_memory_cannot_be_mapped_is_staged_from(
    ipc_peer, monkeypatch
):
    """Mapping the peer's GPU memory fails (MIG, a container): that read
    fails clearly, and the next comms' device frames from the peer are
    staged over a channel that does not copy by IPC"""
    with dask.config.set(ipc_peer.config):
        # Two comms, which keep a channel in use as the first fails
        other = await connect_over_mpi(ipc_peer.address)
        comm = await connect_over_mpi(ipc_peer.address)
        device = mpi_gpu.device()

        def refuse(*args):
            raise RuntimeError("operation not supported")

        monkeypatch.setattr(device, "open", refuse)
        staged = staging(monkeypatch)
        x = OnDeviceOrHost.random(3 * CHUNK + 5, 1)
        await comm.write({"op": "device", "x": to_serialize([x]), "make": []})
        with pytest.raises(CommClosedError, match="cannot map"):
            await comm.read()
        for _ in range(100):
            comm = await connect(ipc_peer.address)
            await exchange(comm, [x], [])
            await comm.close()
            if staged:
                break
            await asyncio.sleep(0.05)
        assert staged
        other.abort()


@gen_test(timeout=90)
async def test_ipc_maps_a_reallocated_address_afresh(ipc_peer):
    """A frame freed by the writer and another allocated at its address: the
    reader drops its mapping of the old one (CUDA: "already mapped")"""
    size = 5 * CHUNK
    seen: set[int] = set()
    reused = False
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        for i in range(30):
            x = OnDevice.random(size, i)
            reused |= x.frame.array.ctypes.data in seen
            seen.add(x.frame.array.ctypes.data)
            await exchange(comm, [x], [])
            del x
        await comm.close()
    assert reused, "no address was reused: the test did not test"


def allocated_at(arena: np.ndarray, start: int, size: int, seed: int) -> OnDevice:
    """Random bytes in a device frame of the host backend that stands for an
    allocation at ``start`` of ``arena``: where the test says, not malloc"""
    frame = mpi_gpu.HostBuffer(0)
    frame.array = arena[start : start + size]
    frame.array[:] = np.random.default_rng(seed).integers(0, 256, size, "u1")
    frame.nbytes = size
    frame.__cuda_array_interface__ = {
        **frame.__cuda_array_interface__,
        "data": (frame.array.ctypes.data, False),
        "shape": (size,),
    }
    return OnDevice(frame)


@gen_test(timeout=60)
async def test_ipc_maps_an_allocation_over_freed_ones_afresh(ipc_peer):
    """Frames freed by the writer, and another allocated across their
    addresses: the reader drops its mappings of every old one that the new
    overlaps (CUDA: "already mapped"), not only of one at the same address"""
    arena = np.empty(16 * CHUNK, "u1")
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        for i, (start, size) in enumerate(
            [(4, 2), (8, 2), (3, 8), (0, 4), (2, 12)]  # in chunks
        ):
            x = allocated_at(arena, start * CHUNK, size * CHUNK, i)
            await exchange(comm, [x], [])
            freed = weakref.ref(x.frame)
            del x
            # Once the writer let it go: an allocator reuses no memory sooner
            await async_poll_for(lambda: freed() is None, timeout=5)
        await comm.close()


@gen_test(timeout=60)
async def test_ipc_mappings_of_one_frame_allocations_are_bounded(ipc_peer, monkeypatch):
    """Allocations that each hold one frame, which their writer soon frees
    and a mapping would keep: past MAPPED_BYTES of them, the least recently
    used mappings close"""
    size = 3 * CHUNK
    monkeypatch.setattr(mpi_ipc.Mappings, "MAPPED_BYTES", 4 * size)
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        for i in range(10):
            make = [(size, i)]
            await comm.write({"op": "device", "x": [], "make": make, "keep": True})
            check(await comm.read(), [], make)
            assert len(mapped_of(comm)) <= 4
        await comm.close()


@gen_test(timeout=60)
async def test_ipc_maps_a_pool_once_for_its_pieces(ipc_peer, monkeypatch):
    """Frames that are pieces of one larger allocation (CuPy's and RMM's
    pools) are copied from their offsets through one mapping, which stays
    past MAPPED_BYTES: the writer frees not the pool but its pieces"""
    monkeypatch.setattr(mpi_ipc.Mappings, "MAPPED_BYTES", 1)
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        opened = mpi_gpu.device().opened
        for i in range(6):
            make = [(3 * CHUNK, i), (CHUNK + 1, i + 10)]
            await comm.write({"op": "device", "x": [], "make": make, "pool": True})
            check(await comm.read(), [], make)
            # and one frame in an allocation of its own, now and then
            make = [(CHUNK, i + 20)]
            await comm.write({"op": "device", "x": [], "make": make, "keep": True})
            check(await comm.read(), [], make)
        # The pool, and the latest of the others
        assert mpi_gpu.device().opened - opened == 1 + 6
        assert len(mapped_of(comm)) == 2
        await comm.close()


@gen_test(timeout=60)
async def test_ipc_mappings_copied_from_stay_open(ipc_peer, monkeypatch):
    """Comms read frames of one writer at once, each in an allocation
    of its own, past MAPPED_BYTES: no mapping closes while a copy from it
    is under way"""
    monkeypatch.setattr(mpi_ipc.Mappings, "MAPPED_BYTES", 1)
    with dask.config.set(ipc_peer.config), no_staging():
        comms = [await connect_over_mpi(ipc_peer.address) for _ in range(3)]

        async def read_frames(comm, seed: int):
            for i in range(30):
                make = [(3 * CHUNK, seed + i), (CHUNK, seed + i + 1)]
                await comm.write({"op": "device", "x": [], "make": make})
                check(await comm.read(), [], make)

        await asyncio.gather(*(read_frames(c, 100 * i) for i, c in enumerate(comms)))
        await asyncio.gather(*(comm.close() for comm in comms))


def copies_held(monkeypatch) -> tuple[asyncio.Event, asyncio.Event]:
    """The first copy by IPC from now is under way (the first event is set)
    until the second event is set: a GPU copying"""
    under_way, go_on = asyncio.Event(), asyncio.Event()
    wait = mpi_gpu.wait

    async def first_held(events):
        if not under_way.is_set():
            under_way.set()
            await go_on.wait()
        await wait(events)

    monkeypatch.setattr(mpi_gpu, "wait", first_held)
    return under_way, go_on


@gen_test(timeout=60)
async def test_a_read_cancelled_mid_copy_waits_for_the_copy(ipc_peer, monkeypatch):
    """A read cancelled while the GPU copies its frames (a worker closing,
    say): no mapping may close, nor buffer go, before the copy is done"""
    monkeypatch.setattr(mpi_channel, "FREE_AFTER", 0.5)
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        device = mpi_gpu.device()
        closed_under_copies = device.closed_under_copies
        under_way, _ = copies_held(monkeypatch)
        await comm.write({"op": "device", "x": [], "make": [(3 * CHUNK, 1)]})
        read = asyncio.create_task(comm.read())
        await under_way.wait()
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        comm.abort()
        await async_poll_for(lambda: not mapped_of(comm), timeout=20)
        assert device.closed_under_copies == closed_under_copies


@gen_test(timeout=60)
async def test_a_new_comm_shares_the_mappings_of_one_closed_mid_copy(
    ipc_peer, monkeypatch
):
    """A comm closed while the GPU copies frames for it, and a new comm to
    the same writer, whose frames are in the same allocation: the two
    comms' reads go through the same mappings, where a second mapping of the
    allocation would fail (CUDA: "already mapped")"""
    make = [(3 * CHUNK, 1)]
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        under_way, go_on = copies_held(monkeypatch)
        await comm.write({"op": "device", "x": [], "make": make, "pool": "shared"})
        read = asyncio.create_task(comm.read())
        await under_way.wait()
        comm.abort()
        again = await connect_over_mpi(ipc_peer.address)
        await again.write({"op": "device", "x": [], "make": make, "pool": "shared"})
        check(await again.read(), [], make)
        go_on.set()
        with contextlib.suppress(CommClosedError):
            await read
        assert again.peer.process not in mpi_ipc.unmappable
        await again.close()


@gen_test(timeout=60)
async def test_ipc_mappings_close_when_the_peer_goes(ipc_peer, monkeypatch):
    """The peer's frames mapped here, it is killed: once the channel is
    freed, this process maps nothing of it"""
    monkeypatch.setattr(mpi_channel, "FREE_AFTER", 0.5)
    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        await exchange(comm, [], [(3 * CHUNK, 1), (CHUNK + 1, 2)])
        assert mapped_of(comm)
        ipc_peer.job.crash()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(comm.read(), 20)
        await async_poll_for(lambda: not mapped_of(comm), timeout=30)


@gen_test(timeout=60)
async def test_writer_killed_while_its_frame_is_copied_by_ipc(ipc_peer):
    """The copy fails (the writer's memory is gone), the comm closes, and
    nothing stays mapped of the dead writer"""

    def kill():
        ipc_peer.job.crash()
        psutil.wait_procs(ipc_peer.job.ranks(), timeout=10)

    with dask.config.set(ipc_peer.config), no_staging():
        comm = await connect_over_mpi(ipc_peer.address)
        await comm.write({"op": "device", "x": [], "make": [(LARGE, 0)]})
        # Once the frame's head arrived and the buffer to copy into exists
        with on_call("buffer", 1, kill):
            with pytest.raises(CommClosedError, match="peer process died"):
                await asyncio.wait_for(comm.read(), 20)
        assert comm.closed()
        assert not mapped_of(comm)


@gen_test(timeout=60)
async def test_reader_killed_while_it_maps_the_writers_frames(ipc_peer):
    """This process writes device frames that the peer maps; the peer is
    killed: the frames are given up, and nothing here waits for it"""
    with dask.config.set(ipc_peer.config):
        comm = await connect_over_mpi(ipc_peer.address)
        await exchange(comm, [OnDevice.random(3 * CHUNK, 1)], [])
        assert (await mappings(ipc_peer.address))["mapped"]
        # Unanswered, so that the peer holds its mapping when it is killed
        await comm.write({"op": "drop", "x": to_serialize([OnDevice.random(LARGE, 2)])})
        ipc_peer.job.crash()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(comm.read(), 20)
        engine = ProgressEngine.current()
        await async_poll_for(lambda: engine.pending() == 0, timeout=30)


@gen_test(timeout=60)
async def test_one_device_frame_twice_in_a_message(peer):
    """The same buffer in two places of one message"""
    with dask.config.set(peer.config):
        comm = await connect_over_mpi(peer.address)
        x = OnDevice.random(3 * CHUNK + 5, 1)
        await exchange(comm, [x, 7, x], [])
        await comm.close()
