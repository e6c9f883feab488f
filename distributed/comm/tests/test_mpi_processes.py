"""mpi:// between processes: peers started by ``mpiexec``, this test process
connecting to them as an MPI singleton, or separate ``mpiexec`` jobs talking
to each other."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")

import dask

from distributed import Client, Scheduler
from distributed.comm import (
    CommClosedError,
    connect,
    listen,
    mpi_channel,
    mpi_handshake,
    mpi_opener,
    mpi_policy,
    mpi_startup,
)
from distributed.comm.mpi import Head
from distributed.comm.mpi_routes import OverMPI
from distributed.comm.mpi_liveness import LocalPeer
from distributed.comm.mpi_progress import ProgressEngine
from distributed.comm.tests.mpi_peer import late_for_ports
from distributed.comm.tests.mpi_processes import (
    OUTPUT,
    known_mpi_crash,
    mpiexec,
    run_mpiexec,
    wait_for_file,
)
from distributed.protocol import to_serialize
from distributed.utils import _offload_executor
from distributed.utils_test import async_poll_for, captured_logger, gen_test

pytestmark = pytest.mark.timeout(180)

# One process of mpi_peer, under mpiexec: add its command
PEER = ["-n", "1", "-m", "distributed.comm.tests.mpi_peer"]


@pytest.fixture
def channel_for_host_frames(monkeypatch):
    """Large host frames between processes of one host take an MPI channel,
    as over TCP (lend-on-socket off, here and in the processes started
    meanwhile): for the tests of channels, and of MPI between processes"""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__LEND_ON_SOCKET", "False")
    with dask.config.set({"distributed.comm.mpi.lend-on-socket": False}):
        yield


@pytest.fixture
def server(tmp_path):
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path]) as proc:
        yield wait_for_file(path, proc), proc


@gen_test(timeout=120)
async def test_round_trips_with_an_mpiexec_process(server):
    address, _ = server
    comm = await connect(address)
    # A process of this host: the listener's Unix socket
    assert comm.stream.socket.family == socket.AF_UNIX
    for msg in [{"op": "ping"}, b"x" * 100_000, tuple(range(100))]:
        await comm.write(msg)
        assert await comm.read() == msg
    for size in [0, 1, 1000, 10_000_000, 10_000_000]:
        array = np.random.randint(0, 100, size)
        await comm.write({"x": to_serialize(array)})
        np.testing.assert_array_equal((await comm.read())["x"], array)
    # The large arrays were copied from the writers' memory, and their copies
    # acknowledged on the socket: no MPI channel opened
    assert comm.channel is None and not comm.lent
    await comm.close()


def test_a_comm_left_open_after_its_event_loop_closes_quietly(server):
    """A comm nobody closed, collected after its event loop closed (a test
    that failed half-way, say): its finalizer closes its socket, and raises
    nothing, though a callback waited for the socket to close"""

    async def open_a_comm():
        return await connect(server[0])

    comm = asyncio.run(open_a_comm())
    assert comm._lender.writer is not None  # it lends: it waits for the close
    socket_ = comm.stream.socket
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        del comm
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert socket_.fileno() == -1
    assert not unraisable, unraisable[0].exc_value


@pytest.fixture
def server_with_small_chunks(tmp_path, monkeypatch):
    """A peer whose chunk-size is 1 MiB"""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__CHUNK_SIZE", "1MiB")
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path]) as proc:
        yield wait_for_file(path, proc)


@gen_test(timeout=120)
async def test_ends_configured_with_different_chunk_sizes(
    channel_for_host_frames, server_with_small_chunks
):
    """Each end posts its receives in the chunks the other sends: they agree
    on one chunk-size at the handshake (MPI truncated the 4 MiB chunks into
    1 MiB receives before)"""
    with dask.config.set({"distributed.comm.mpi.chunk-size": "4MiB"}):
        comm = await connect(server_with_small_chunks)
    for _ in range(3):  # the first large frames ask for a channel
        array = np.random.randint(0, 100, 2_000_000)  # 16 MB
        await comm.write({"x": to_serialize(array)})
        np.testing.assert_array_equal((await comm.read())["x"], array)
    assert comm.channel is not None and comm.channel.nbytes >= 4 * array.nbytes
    await comm.close()


@gen_test(timeout=120)
async def test_concurrent_comms_between_two_processes_do_not_cross(server):
    address, _ = server
    comms = await asyncio.gather(*(connect(address) for _ in range(16)))

    async def talk(i, comm):
        for j in range(10):
            array = np.full(1000 * i + j, i)
            await comm.write({"i": i, "j": j, "x": to_serialize(array)})
            got = await comm.read()
            assert (got["i"], got["j"]) == (i, j)
            np.testing.assert_array_equal(got["x"], array)

    await asyncio.gather(*(talk(i, c) for i, c in enumerate(comms)))
    await asyncio.gather(*(c.close() for c in comms))


@gen_test(timeout=120)
async def test_killed_peer_fails_pending_read(server):
    address, proc = server
    comm = await connect(address)
    await comm.write("hello")
    assert await comm.read() == "hello"
    pending = asyncio.ensure_future(comm.read())
    proc.crash()
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(pending, 30)
    with pytest.raises(CommClosedError):
        await comm.write("anyone?")


@pytest.fixture
def copies(monkeypatch):
    """The bytes this process copies from the memory of writers on its host"""
    copied = []
    read = LocalPeer.read

    def counted(self, address, into, nbytes):
        read(self, address, into, nbytes)
        copied.append(nbytes)

    monkeypatch.setattr(LocalPeer, "read", counted)
    return copied


@pytest.mark.parametrize("local_copy", [True, False])
@gen_test(timeout=120)
async def test_large_frames_between_processes_of_one_host_are_copied(
    server, copies, local_copy
):
    """The reader copies them from the writer's memory, and says so on the
    socket: no MPI channel opens.  A reader that says not to (local-copy:
    false) is sent them through MPI, in that direction only."""
    address, _ = server
    with dask.config.set({"distributed.comm.mpi.local-copy": local_copy}):
        comm = await connect(address)
        for _ in range(3):  # the first large frames ask for a channel
            array = np.random.randint(0, 100, 2_000_000)  # 16 MB
            await comm.write({"op": "echo", "x": array})
            np.testing.assert_array_equal((await comm.read())["x"], array)
    assert (sum(copies) >= 3 * array.nbytes) is local_copy
    assert sum(copies) < 4 * array.nbytes  # this end copied what came back
    if local_copy:
        assert comm.channel is None
    else:
        # Once the channel that the first asked for is open (a round trip or
        # more), what comes back goes through MPI, and only that
        for _ in range(20):
            if comm.channel is not None:
                break
            await comm.write({"op": "echo", "x": array})
            await comm.read()
        before = comm.channel.nbytes
        await comm.write({"op": "echo", "x": array})
        np.testing.assert_array_equal((await comm.read())["x"], array)
        assert comm.channel.nbytes - before == array.nbytes
    assert not comm.lent  # the peer has what this end lent it
    await comm.close()


@gen_test(timeout=120)
async def test_lent_frames_go_when_their_reader_dies(server):
    """A reader killed with frames lent to it: the writer's comm closes at
    once and keeps nothing (it waits for a live reader that is slow)"""
    address, proc = server
    comm = await connect(address)
    await comm.write({"op": "stop-reading"})
    await comm.write({"x": np.ones(2_000_000)})  # lent, never read
    assert comm.lent == 1
    proc.crash()
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(comm.read(), 30)
    start = time.monotonic()
    await comm.close()
    assert time.monotonic() - start < 5
    assert not comm.lent


@gen_test(timeout=120)
async def test_a_closing_comm_stops_waiting_when_its_reader_dies(server):
    """A comm that closes with frames lent waits for its reader, and stops
    waiting as soon as the reader dies, not after ``LEND_AFTER_CLOSE``"""
    address, proc = server
    comm = await connect(address)
    await comm.write({"op": "stop-reading"})
    await comm.write({"x": np.ones(2_000_000)})  # lent, never read
    closing = asyncio.create_task(comm.close())
    await asyncio.sleep(0.5)
    assert not closing.done()  # it waits for the reader
    start = time.monotonic()
    proc.crash()
    await asyncio.wait_for(closing, 5)
    assert time.monotonic() - start < 2
    assert not comm.lent


@gen_test(timeout=120)
async def test_two_closes_of_a_comm_with_frames_lent_both_end_when_they_are_copied(
    server,
):
    """Both wait for the reader's copy, not the second alone (the first
    waited ``LEND_AFTER_CLOSE``)"""
    comm = await connect(server[0])
    await comm.write({"op": "sum", "x": np.ones(2_000_000)})  # lent
    start = time.monotonic()
    await asyncio.wait_for(asyncio.gather(comm.close(), comm.close()), 30)
    assert time.monotonic() - start < 5
    assert not comm.lent


@gen_test(timeout=120)
async def test_a_write_to_a_peer_that_hung_up_lends_nothing(server):
    """The frames of a write that fails are not kept for a reader"""
    comm = await connect(server[0])
    await comm.write({"op": "stop-reading", "close-after": 0})
    await asyncio.sleep(0.5)
    with pytest.raises(CommClosedError):
        await comm.write({"x": np.ones(2_000_000)})
    assert not comm.lent


@gen_test(timeout=120)
async def test_a_comm_closed_after_a_write_keeps_its_lent_frames_for_the_reader(
    server,
):
    """A writer that closes its comm right after writing keeps the frames it
    lent until the reader, reading late, has copied them"""
    await _read_a_message_written_before_close(await connect(server[0]))


@gen_test(timeout=120)
async def test_a_message_on_a_channel_written_just_before_close_arrives(
    channel_for_host_frames, server_copying_or_not
):
    """A writer that closes its comm right after writing: the reader, which
    sees the connection closed before it posts its receives (or copies),
    still gets the message, then the end, as on tcp://"""
    address, local_copy = server_copying_or_not
    with dask.config.set({"distributed.comm.mpi.local-copy": local_copy}):
        comm, _ = await _connect_with_channel(address)
        await _read_a_message_written_before_close(comm)


async def _read_a_message_written_before_close(comm):
    """Have the peer write a message and close ``comm`` at once; read it
    late, then the end"""
    await comm.write({"op": "write-and-close", "size": 8_000_000})
    await asyncio.sleep(1)  # the writer is closing meanwhile
    got = await comm.read()
    assert got["x"].sum() == 8_000_000
    with pytest.raises(CommClosedError):
        await comm.read()


@gen_test(timeout=120)
async def test_a_comm_whose_peer_hung_up_gives_its_sends_up(
    channel_for_host_frames, server
):
    """A comm that Dask leaves alone once the peer hung up (it never closes
    a comm already closed) keeps the frames of its writes no longer than
    the connect timeout, as a closed one does"""
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
        comm, _ = await _connect_with_channel(server[0])
        await comm.write({"op": "stop-reading", "close-after": 0.5})
        await comm.write({"x": to_serialize(np.ones(8_000_000, "u1"))})
        assert ProgressEngine.current().pending()
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()
        await async_poll_for(lambda: not ProgressEngine.current().pending(), 10)


@gen_test(timeout=120)
async def test_a_dial_for_a_process_that_listened_there_before_opens_nothing(
    channel_for_host_frames, server
):
    """A worker restarted on its port, dialled for its predecessor: it opened
    the channel, and waited in MPI for nobody for ``channel-timeout`` (its
    event loop blocked), then gave up on the dialler"""
    comm = await connect(server[0])
    assert mpi_policy.accepts(comm.peer)  # this process would wait in MPI
    async with listen("mpi://127.0.0.1:0", lambda comm: None) as listener:
        start = time.monotonic()
        await comm.write({"op": "dial-stale", "address": listener.contact_address})
        assert await comm.read() == {"dialled": True}
        assert time.monotonic() - start < 2
    assert mpi_channel.channels.reachable(comm.peer.process)
    await comm.close()
    comm, _ = await asyncio.wait_for(_connect_with_channel(server[0]), 30)
    await comm.close()


async def _connect_copying(address):
    """A comm to the peer at ``address`` that has copied a 16 MB array of
    this process's (and this one the peer's): the array"""
    comm = await connect(address)
    array = np.random.randint(0, 100, 2_000_000)
    await comm.write({"op": "echo", "x": array})
    await comm.read()
    return comm, array


async def _connect_with_channel(address):
    """A comm to the peer at ``address`` once the two have an MPI channel,
    and the array of 16 MB that opened it"""
    comm = await connect(address)
    array = np.random.randint(0, 100, 2_000_000)
    while comm.channel is None:
        await comm.write({"op": "echo", "x": array})
        await comm.read()
    return comm, array


@gen_test(timeout=120)
async def test_writer_that_dies_while_its_frame_is_copied_fails_the_read(
    server, tmp_path, monkeypatch
):
    """The reader gets an error, where MPI (UCX's CMA) would abort it, and
    goes on using MPI with others"""
    address, proc = server
    comm, array = await _connect_copying(address)
    read = LocalPeer.read

    def read_then_kill(self, address, into, nbytes):
        read(self, address, into, nbytes)
        if not self.died():
            proc.crash()  # half-way through the frame: 4 of its 16 MB

    monkeypatch.setattr(LocalPeer, "read", read_then_kill)
    await comm.write({"op": "echo", "x": array})
    with pytest.raises(CommClosedError, match="the peer process died"):
        await comm.read()
    monkeypatch.undo()
    assert mpi_startup.mpi_stopped() is None
    path = str(tmp_path / "other")
    with mpiexec([*PEER, "serve", path]) as other:
        comm = await connect(wait_for_file(path, other))
        for _ in range(3):
            await comm.write({"op": "sum", "x": array})
            assert (await comm.read())["sum"] == array.sum()
        await comm.close()


@gen_test(timeout=120)
async def test_frame_that_its_writer_gave_up_is_not_returned(server, copies):
    """A writer that aborted its comm frees the frames of the message it
    wrote: one that the reader copies then may be anything.  The writer
    marks the message given up, and the reader fails (here the frame's
    memory is still as it was)"""
    address, _ = server
    comm, _ = await _connect_copying(address)
    await comm.write({"op": "write-and-abort", "size": 8_000_000})
    await asyncio.sleep(1)  # the writer has given it up
    with pytest.raises(CommClosedError, match="the writer gave the message up"):
        await comm.read()
    assert sum(copies) >= 8_000_000  # it was copied, then refused


@gen_test(timeout=120)
async def test_large_copies_are_shared_with_the_offload_thread(server, monkeypatch):
    """The event loop and Dask's offload thread copy the pieces of a large
    frame between them"""
    address, _ = server
    comm, array = await _connect_copying(address)
    loop_thread, threads = threading.current_thread(), []
    read = LocalPeer.read

    def traced(self, address, into, nbytes):
        threads.append(threading.current_thread())
        if threading.current_thread() is loop_thread:
            time.sleep(0.002)  # however loaded the machine, the helper has time
        read(self, address, into, nbytes)

    monkeypatch.setattr(LocalPeer, "read", traced)
    await comm.write({"op": "echo", "x": array})
    np.testing.assert_array_equal((await comm.read())["x"], array)
    names = {thread.name.split("_")[0] for thread in threads}
    assert names == {loop_thread.name, "Dask-Offload"}
    await comm.close()


@gen_test(timeout=120)
async def test_a_copy_does_not_wait_for_a_busy_offload_thread(server):
    """The event loop copies every piece itself while the offload thread
    works on something else"""
    address, _ = server
    comm, array = await _connect_copying(address)
    # Dask would (de)serialize the message in that thread too, and the write
    # would wait for it: the copy only may use it
    comm.allow_offload = False
    release = threading.Event()
    busy = _offload_executor.submit(release.wait, 60)
    try:
        await comm.write({"op": "echo", "x": array})
        got = await asyncio.wait_for(comm.read(), 30)
    finally:
        release.set()
        busy.result()
    np.testing.assert_array_equal(got["x"], array)
    await comm.close()


@gen_test(timeout=120)
async def test_a_channel_released_at_one_end_is_released_at_the_other(
    channel_for_host_frames, server, monkeypatch
):
    """A channel that no comm uses any more at this end is freed here, while
    the peer still has a comm that used it, open but idle: the peer must not
    send over it after that (it did: in a run of the workloads benchmark,
    every transfer from one worker to another then failed with "message on an
    unknown MPI channel", and the computation hung)"""
    monkeypatch.setattr(mpi_channel, "FREE_AFTER", 0.5)
    address, _ = server
    idle, _ = await _connect_with_channel(address)
    channel = idle.channel
    await idle.write({"op": "stop-reading"})  # its end stays open there
    await idle.close()
    await async_poll_for(lambda: mpi_channel.channels.by_id(channel.id) is None, 5)
    comm = await connect(address)
    await comm.write({"op": "ones", "size": 8_000_000})
    assert (await comm.read())["x"].sum() == 8_000_000
    await comm.close()


async def echo(comm):
    """Send back every message, until the comm closes (a listener's)"""
    with contextlib.suppress(CommClosedError):
        while True:
            await comm.write(await comm.read())


@gen_test(timeout=120)
async def test_two_processes_dialling_each_other_at_once_keep_one_channel(
    channel_for_host_frames, tmp_path, monkeypatch
):
    """Two processes that write large frames to each other at once, each on
    a comm it dialled, open a channel each: both must keep the same one, and
    keep it.  On a busy machine the two ends may finish opening them in
    opposite orders (in the workloads benchmark, each then released the one
    the other kept, which left them none): here, this end finishes the
    first one late."""
    publish, late = mpi_channel.Channels.publish, set()

    def publish_the_first_late(self, channel):
        if channel.peer in late:
            publish(self, channel)
        else:
            late.add(channel.peer)
            asyncio.get_running_loop().call_later(0.3, publish, self, channel)

    monkeypatch.setattr(mpi_channel.Channels, "publish", publish_the_first_late)

    large = to_serialize(np.ones(8_000_000, "u1"))
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        for i in range(3):  # each pair crosses in its own way
            path = str(tmp_path / f"address-{i}")
            with mpiexec([*PEER, "serve", path]) as proc:
                comm = await connect(wait_for_file(path, proc))
                peer = comm.peer.process
                cross = {"op": "cross", "address": listener.contact_address}
                await comm.write({**cross, "size": 8_000_000, "x": large})
                assert await comm.read() == {"crossed": True}

                async def kept() -> int | None:
                    await comm.write({"op": "channel"})
                    theirs = (await comm.read())["channel"]
                    mine = mpi_channel.channels.get(peer)
                    return theirs if mine and mine.id == theirs else None

                for _ in range(100):
                    if (channel := await kept()) is not None:
                        break
                    await asyncio.sleep(0.05)
                assert channel is not None, "the two ends keep no channel alike"
                await asyncio.sleep(0.5)
                assert await kept() == channel
                await comm.close()


@gen_test(timeout=120)
async def test_a_process_answering_a_peers_dial_dials_it_for_no_second_channel(
    channel_for_host_frames, tmp_path, monkeypatch
):
    """The peer dials this process for a channel; while this process opens
    it, it writes large frames to the peer on a comm it dialled itself: that
    channel is opening already, and a second would cost another MPI connect
    (across hosts, each a chance for MPICH's bugs), one of the two kept"""
    open_channel, dial, dialled = mpi_opener.Opener.open, mpi_opener.Opener._dial, []

    async def open_late(self, stream, peer):
        await asyncio.sleep(1)
        return await open_channel(self, stream, peer)

    async def counted(self, address, peer):
        dialled.append(peer.process)
        await dial(self, address, peer)

    monkeypatch.setattr(mpi_opener.Opener, "open", open_late)
    monkeypatch.setattr(mpi_opener.Opener, "_dial", counted)

    large = to_serialize(np.ones(8_000_000, "u1"))
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        path = str(tmp_path / "address")
        with mpiexec([*PEER, "serve", path]) as proc:
            comm = await connect(wait_for_file(path, proc))
            peer = comm.peer.process
            # It dials back with large frames, and so dials for a channel
            cross = {"op": "cross", "address": listener.contact_address}
            await comm.write({**cross, "size": 8_000_000})
            await async_poll_for(lambda: mpi_opener.opener.sizes()["opening"], 30)
            await comm.write({"x": large})
            assert await comm.read() == {"crossed": True}
            assert (await comm.read())["x"].sum() == 8_000_000
            await async_poll_for(lambda: mpi_channel.channels.get(peer), 30)
            await comm.write({"op": "channel"})
            assert (await comm.read())["channel"] == mpi_channel.channels.get(peer).id
            assert dialled == []
            await comm.close()


def _can_unshare_pid() -> bool:
    try:
        return (
            subprocess.run(UNSHARE_PID + ["true"], capture_output=True).returncode == 0
        )
    except OSError:
        return False


def test_a_process_on_mpi_lets_its_siblings_read_its_memory():
    """Workers of a node are siblings, which Yama's ptrace_scope 1 (Ubuntu's
    default) forbids to read each other's memory unless the one read says any
    process of its user may (as UCX and Open MPI do): without that, no frame
    is copied between them"""
    named = (
        "import os; from distributed.comm.mpi_liveness import beacon; "
        "print(os.getpid(), beacon(), flush=True); input()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", named],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            pid, address = map(int, proc.stdout.readline().split())
            reads = (
                "import sys; from distributed.comm.mpi_liveness import LocalPeer; "
                f"sys.exit(not LocalPeer({pid}, {address}).readable())"
            )
            sibling = subprocess.run([sys.executable, "-c", reads], timeout=60)
            assert sibling.returncode == 0
        finally:
            proc.kill()


UNSHARE_PID = ["unshare", "--pid", "--fork", "--mount-proc"]


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs unshare --pid (root)")
def test_peer_on_this_host_in_another_pid_namespace(tmp_path):
    """Containers on one host that share its name (Docker's --network host,
    Apptainer with --pid): the peer's pid means nothing here, so the liveness
    check must not take it for dead; and MPICH 5.0 with UCX crashes opening a
    channel between them (segfault in MPI_Comm_accept), so they use TCP"""
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path], prefix=UNSHARE_PID) as proc:
        address = wait_for_file(path, proc)
        out = run_mpiexec([*PEER, "ping", address])
        assert "ping ok" in out
        assert "over MPI" not in out
        assert proc.poll() is None  # the server lives


def test_receiver_exits_cleanly_after_its_sender_died_with_frames_pending(
    channel_for_host_frames, tmp_path
):
    """A sender killed with frames still pending in MPI: at exit, the receiver
    must not copy from its memory (UCX would abort it) and exits with 0"""
    path, flooded = str(tmp_path / "address"), str(tmp_path / "flooded")
    with mpiexec([*PEER, "serve", path], **OUTPUT) as receiver:
        address = wait_for_file(path, receiver)
        with mpiexec([*PEER, "flood", address, flooded]) as sender:
            wait_for_file(flooded, sender)
            sender.crash()
        open(path + ".exit", "w").close()
        out, _ = receiver.communicate(timeout=60)
    assert receiver.returncode == 0, out
    assert "Fatal" not in out and "Abort" not in out, out
    assert "UCX" not in out, out


def test_receiver_survives_a_sender_that_died_while_mpi_copied_its_message(
    tmp_path,
):
    """A sender on this host dies while MPI copies its message, piece by
    piece, into the receiver: MPI had matched the receive, which UCX then
    cannot cancel, and its next call would copy from the dead process and
    abort the receiver.  The receiver calls MPI no more: the receive fails,
    and the process lives on, and exits with 0"""
    path = str(tmp_path / "port")
    pieces = ["-env", "UCX_CMA_SEG_SIZE", "65536"]  # one per call into MPI
    receiver = [*PEER[:2], *pieces, *PEER[2:], "receive-from-the-dying", path]
    with mpiexec(receiver, **OUTPUT) as proc:
        with mpiexec([*PEER, "send-and-die", path]):
            out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert "copying, done: False" in out, out
    assert "receive failed: the peer process died" in out, out
    assert "MPI stopped: MPI had begun to receive" in out, out
    assert "calls MPI no more" in out, out
    assert "Fatal" not in out and "process_vm_readv" not in out, out


def test_processes_exit_without_ucx_warnings_after_frames_left_unread(
    channel_for_host_frames, tmp_path
):
    """A reader that stopped reading with frames pending over MPI: at exit,
    the receiver receives and drops them, and the sender's sends complete.
    UCX warned at MPI_Finalize about each message left unmatched (receiver)
    and each request not complete (sender)"""
    path, flooded = str(tmp_path / "address"), str(tmp_path / "flooded")
    with mpiexec([*PEER, "serve", path], **OUTPUT) as receiver:
        address = wait_for_file(path, receiver)
        with mpiexec([*PEER, "flood", address, flooded], **OUTPUT) as sender:
            wait_for_file(flooded, sender)
            open(path + ".exit", "w").close()
            received, _ = receiver.communicate(timeout=60)
            open(flooded + ".exit", "w").close()
            sent, _ = sender.communicate(timeout=60)
    assert receiver.returncode == 0, received
    assert sender.returncode == 0, sent
    assert "UCX" not in received, received
    assert "UCX" not in sent, sent


def test_separate_mpiexec_jobs(channel_for_host_frames, server):
    address, _ = server
    out = run_mpiexec([*PEER, "ping", address])
    assert "ping ok" in out
    assert "over MPI" in out


@pytest.fixture
def idle_port(tmp_path):
    """The file of an MPI port that its process never accepts on"""
    path = str(tmp_path / "port")
    with mpiexec([*PEER, "port", path], **OUTPUT) as idle:
        wait_for_file(path, idle)
        yield path
        idle.stop()
        out = idle.stdout.read()
    # The connects it never matched
    assert "UCX" not in out, out


def test_connect_that_timed_out_does_not_break_the_next(server, idle_port):
    """MPICH with UCX leaves the receive of a timed-out connect posted; the
    next connect must not run into it, nor UCX warn of it at exit"""
    address, _ = server
    out = run_mpiexec([*PEER, "ping-after-timeout", idle_port, address])
    assert "connect timed out" in out
    assert "ping ok" in out
    assert "UCX" not in out, out


def test_an_mpi_connect_that_never_returns_is_reported_and_its_process_exits(
    idle_port,
):
    """MPICH with UCX once spun for good in a connect: a watchdog reports an
    accept or connect that outlives its timeout, and a process alone in its
    job exits instead of hanging (here the watchdog goes off while MPI waits)"""
    with mpiexec([*PEER, "stuck-connect", idle_port], **OUTPUT) as proc:
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    assert "MPI_Comm_connect has not returned" in out, out
    assert "This process exits" in out, out
    assert "connect returned" not in out, out
    assert "never returned" in known_mpi_crash(out)  # tests across hosts xfail


def test_comms_go_over_tcp_when_mpi_cannot_connect_two_processes(
    channel_for_host_frames, tmp_path, idle_port
):
    """A channel that MPI fails to open does not fail the comm: both ends
    fall back to TCP for it, and for every later comm of the pair, which
    then does not wait for MPI again"""
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path], **OUTPUT) as server:
        address = wait_for_file(path, server)
        out = run_mpiexec([*PEER, "ping-astray", idle_port, address])
        assert out.count("ping ok") == 2, out
        assert "over MPI" not in out
        assert out.count("over TCP from now on") == 1, out
        assert "UCX" not in out, out
        # The server goes on serving others over MPI
        out = run_mpiexec([*PEER, "ping", address])
        assert "ping ok" in out
        assert "over MPI" in out
        assert "over TCP" not in out
        server.stop()
        out = server.stdout.read()
    # Its accept that failed left a receive posted in MPICH
    assert "UCX" not in out, out


def test_a_process_that_cannot_open_mpi_ports_gives_mpi_up_with_its_peers(
    channel_for_host_frames, tmp_path
):
    """MPI_Open_port fails at the end that accepts (neither end has ports):
    both ends say so once and move their data over TCP, not asking for a
    channel again"""
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve-without-ports", path], **OUTPUT) as server:
        address = wait_for_file(path, server)
        out = run_mpiexec([*PEER, "ping-without-ports", address])
        assert "ping ok" in out, out
        assert "gave MPI up" in out, out
        assert out.count("over TCP from now on") == 1, out
        server.stop()
        out = server.stdout.read()
    assert out.count("over TCP from now on") == 1, out


@pytest.mark.timeout(60)
def test_a_join_whose_peer_never_joins_is_reported():
    """MPI_Comm_create_group, which makes the channel of two ranks of one
    job, has no timeout: a watchdog reports one whose peer never joins (a
    rank that died before it joined, where the job goes on)"""
    with mpiexec([*PEER[:1], "2", *PEER[2:], "stuck-join"], **OUTPUT) as job:
        out = ""
        for line in job.stdout:  # the process stays in MPI for good
            out += line
            if "go on" in line:
                break
        job.stop()
        out += job.stdout.read()
    assert "MPI_Comm_create_group has not returned" in out, out
    assert "This process cannot go on" in out, out
    assert "join returned" not in out, out


@gen_test(timeout=60)
async def test_a_connector_that_reads_the_port_after_the_accept_timed_out_stays_out_of_mpi(
    channel_for_host_frames, tmp_path, monkeypatch, capsys
):
    """A process whose event loop was busy when the port came, until after
    the acceptor's accept had timed out, does not connect: MPI would meet
    only the receive that accept left posted, and hold the process for its
    own timeout.  The two move their data over TCP.  Both ends are late
    here: which one connects depends on their ids"""
    # As they are now, after the test
    monkeypatch.setattr(mpi_handshake, "recv", mpi_handshake.recv)
    monkeypatch.setattr(mpi_opener.Opener, "meet", mpi_opener.Opener.meet)
    late_for_ports()
    path = str(tmp_path / "address")
    timeout = ["-env", "DASK_DISTRIBUTED__COMM__MPI__CHANNEL_TIMEOUT", "1s"]
    with dask.config.set({"distributed.comm.mpi.channel-timeout": "1s"}), mpiexec(
        [*PEER[:2], *timeout, *PEER[2:], "serve-late", path], **OUTPUT
    ) as server:
        comm = await connect(wait_for_file(path, server))
        peer = comm.peer.process
        array = np.arange(3_000_000)
        with captured_logger("distributed.comm.mpi_opener") as log:
            for _ in range(100):
                await comm.write({"op": "sum", "x": to_serialize(array)})
                assert (await comm.read())["sum"] == array.sum()
                if not mpi_channel.channels.reachable(peer):
                    break
                await asyncio.sleep(0.05)
        assert not mpi_channel.channels.reachable(peer)
        assert comm.channel is None
        await comm.close()
        server.stop()
        out = server.stdout.read() + capsys.readouterr().out
    assert "MPI_Comm_connect called" not in out, out
    assert "over TCP from now on" in out + log.getvalue(), out
    assert "the accept timed out before the connect" in out + log.getvalue(), out
    assert "UCX" not in out, out


def test_a_channel_whose_greeting_fails_at_one_end_is_dropped_at_both(
    channel_for_host_frames, tmp_path
):
    """A peer that never sends its greeting over a new channel: the other
    end gives up on it after ``channel-timeout``, both drop the channel, and
    their comms move their data over TCP"""
    path = str(tmp_path / "address")
    timeout = ["-env", "DASK_DISTRIBUTED__COMM__MPI__CHANNEL_TIMEOUT", "1s"]
    with mpiexec([*PEER[:2], *timeout, *PEER[2:], "serve", path], **OUTPUT) as server:
        address = wait_for_file(path, server)
        out = run_mpiexec([*PEER, "ping-without-greeting", address])
        assert "ping ok" in out
        assert "over MPI" not in out
        assert "it failed at the other end" in out, out
        assert "UCX" not in out, out
        # The server goes on serving others over MPI
        out = run_mpiexec([*PEER, "ping", address])
        assert "ping ok" in out
        assert "over MPI" in out
        server.stop()
        out = server.stdout.read()
    assert "no greeting from the peer in 1 s" in out, out
    assert "UCX" not in out, out


async def open_channel(comm) -> mpi_channel.Channel:
    """Write large frames until the comm's data moves over an MPI channel"""
    array = np.arange(600_000)
    for _ in range(100):
        await comm.write({"op": "sum", "x": to_serialize(array)})
        assert (await comm.read())["sum"] == array.sum()
        if comm.channel is not None:
            return comm.channel
        await asyncio.sleep(0.05)
    raise AssertionError("no MPI channel opened")


@gen_test(timeout=120)
async def test_stalled_receive_closes_the_comm_and_the_two_go_over_tcp(
    channel_for_host_frames, tmp_path, monkeypatch
):
    """A frame that MPI never delivers (as when a killed process left UCX's
    shared-memory queue of the receiver blocked) does not stall the receiver
    for good: after stall-timeout its comm closes, and the two processes move
    their data over TCP from then on"""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__STALL_TIMEOUT", "2s")
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path], **OUTPUT) as proc:
        address = wait_for_file(path, proc)
        comm = await connect(address)
        channel = await open_channel(comm)
        # A head that names a frame over MPI which is never sent
        head = Head(False, channel.id, channel.tag(), [(0, 4_800_000, OverMPI.code, 0)])
        comm.write_frames([head.pack()])
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(comm.read(), 30)
        # The next comm hears that the server gave up on MPI with this process
        new = await connect(address)
        array = np.arange(600_000)
        for _ in range(3):
            await new.write({"op": "sum", "x": to_serialize(array)})
            assert (await new.read())["sum"] == array.sum()
        assert new.channel is None
        await new.close()
        # The server goes on serving others over MPI
        out = run_mpiexec([*PEER, "ping", address])
        assert "ping ok" in out
        assert "over MPI" in out
        proc.stop()
        out = proc.stdout.read()
    assert out.count("MPI stopped delivering") == 1, out


@pytest.fixture(params=[True, False], ids=["copied", "through-mpi"])
def server_copying_or_not(request, tmp_path, monkeypatch):
    """A peer that copies large frames from this process, or has them sent
    through MPI (its local-copy)"""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__LOCAL_COPY", str(request.param))
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path]) as proc:
        yield wait_for_file(path, proc), request.param


@pytest.mark.slow
@gen_test(timeout=600)
async def test_frame_larger_than_2_gib(server_copying_or_not):
    """Copied, or through MPI in chunks (Open MPI 5 has no large counts)"""
    address, copies = server_copying_or_not
    if copies:  # lent on the socket
        comm, _ = await _connect_copying(address)
        assert comm.channel is None
    else:
        comm, _ = await _connect_with_channel(address)
        assert not comm.channel.peer_copies
    array = np.ones(2_500_000_000, dtype="u1")
    array[-1] = 7
    await comm.write({"op": "sum", "x": to_serialize(array)})
    got = await comm.read()
    assert got == {"sum": 2_500_000_006, "nbytes": 2_500_000_000}
    await comm.close()


def test_ranks_behind_a_wrapper_script_know_they_are_one_job():
    """``mpiexec -n 2 ./run.sh``: ranks of one job that are not the
    launcher's children still open channels as one job (MPI_Comm_create_group);
    accept/connect between them moved large messages 100x slower"""
    code = "from distributed.comm import mpi_startup as m; m.start_mpi().result(); print(m.world())"
    out = run_mpiexec(["-n", "2", "sh", "-c", f'{sys.executable} -c "{code}"; true'])
    # mpiexec may interleave the two ranks' lines
    worlds = sorted(re.findall(r"\('([^']*)', (\d)\)", out))
    assert [rank for _, rank in worlds] == ["0", "1"], out
    assert worlds[0][0] == worlds[1][0], worlds


_SLOW_RANK = """
import asyncio, os, sys, time
from distributed.comm import mpi_startup
if os.environ["PMI_RANK"] == "1":
    time.sleep(4)  # MPI_Init returns once every rank of the job called it
mpi_startup.INIT_WARNING_DELAY = 0.5  # then mpi_ready awaits MPI's future

async def main():
    try:  # rank 0 times out; rank 1, which came late, does not
        await asyncio.wait_for(mpi_startup.mpi_ready(), 1.5)
    except asyncio.TimeoutError:
        pass
    MPI = await asyncio.wait_for(mpi_startup.mpi_ready(), 30)
    with open(os.path.join(sys.argv[1], os.environ["PMI_RANK"]), "w") as f:
        f.write(str(MPI.COMM_WORLD.Get_size()))

asyncio.run(main())
"""


def test_a_handshake_that_times_out_while_mpi_starts_leaves_mpi_starting(tmp_path):
    """A comm's handshake that times out while MPI_Init waits for the other
    ranks (a connect timeout under mpiexec) must not cancel MPI's start:
    MPI was then unusable in that process for good"""
    out = run_mpiexec(["-n", "2", sys.executable, "-c", _SLOW_RANK, str(tmp_path)])
    sizes = [(tmp_path / rank).read_text() for rank in ["0", "1"]]
    assert sizes == ["2", "2"], out


def test_a_rank_whose_job_mates_never_start_mpi_can_exit(tmp_path):
    """Its MPI_Init never returns; the process still ends when its work
    does (a scheduler whose workers never came, say), not at walltime"""
    started = tmp_path / "started"
    code = (
        "import os, time; from distributed.comm import mpi_startup\n"
        "if os.environ['PMI_RANK'] == '1': time.sleep(120)\n"
        f"else: mpi_startup.start_mpi(); open({str(started)!r}, 'w').close()"
    )
    with mpiexec(["-n", "2", sys.executable, "-c", code], **OUTPUT) as job:
        wait_for_file(str(started), job)
        deadline = time.monotonic() + 20
        while len(job.ranks()) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(job.ranks()) <= 1, "rank 0 did not exit"


_EXIT_WITH_SENDS_PENDING = """if True:
    import atexit, time
    atexit.register(time.sleep, 0.5)  # the last exit hook: the process ends later
    import asyncio, sys, threading
    import numpy as np
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    async def main():
        comm = await connect(sys.argv[1])
        while comm.channel is None:
            await comm.write({"op": "echo", "x": np.ones(2_000_000)})
            await comm.read()
        await comm.write({"op": "stop-reading"})
        await comm.write({"x": to_serialize(np.ones(64_000_000, "u1"))})
        return comm

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    comm = asyncio.run_coroutine_threadsafe(main(), loop).result(60)
    print("exits", flush=True)
"""


def test_a_process_exits_cleanly_while_a_loop_in_another_thread_sends(
    channel_for_host_frames, tmp_path, monkeypatch
):
    """A script's event loop in a thread of its own (a user's, or a sync
    Client's), with sends in flight at exit: it polled MPI after
    MPI_Finalize, and the process crashed"""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__LOCAL_COPY", "False")
    path = str(tmp_path / "address")
    with mpiexec([*PEER, "serve", path]) as proc:
        address = wait_for_file(path, proc)
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_WITH_SENDS_PENDING, address],
            timeout=120,
            **OUTPUT,
        )
    assert done.returncode == 0, done.stdout
    assert "exits" in done.stdout


def held_by_mpi() -> tuple:
    """What this process holds for its peers: its channels, and its progress
    engine's transfers"""
    return len(mpi_channel.channels), ProgressEngine.current().pending()


@gen_test(timeout=240)
async def test_workers_that_come_and_go_leave_nothing_behind(channel_for_host_frames):
    """Workers, each an mpiexec job of its own, join a scheduler in this
    process, send it data, and leave, retired or killed: the scheduler frees
    what it held for them, and no shared-memory file of theirs is left"""
    shm_files = set(glob.glob("/dev/shm/mpich_shm_*"))
    worker = ["-n", "1", "-m", "distributed.cli.dask_worker", "--no-nanny"]
    worker += ["--nthreads", "1", "--no-dashboard"]
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}):
        async with Scheduler(protocol="mpi", port=0, dashboard_address=":0") as s:
            async with Client(s.address, asynchronous=True) as c:
                start = held_by_mpi()
                for leave in ["retire", "kill", "retire", "kill"]:
                    with mpiexec([*worker, s.address]) as job:
                        await c.wait_for_workers(1)
                        [address] = s.workers
                        future = c.submit(np.arange, 2**20, workers=[address])
                        assert (await future).sum() == np.arange(2**20).sum()
                        del future
                        while s.tasks:  # forgotten: none to move elsewhere
                            await asyncio.sleep(0.01)
                        if leave == "retire":
                            await c.retire_workers([address])
                            await asyncio.to_thread(job.wait, 60)
                        else:
                            await asyncio.to_thread(job.crash)
                    while s.workers or held_by_mpi() != start:
                        await asyncio.sleep(0.1)  # the test's timeout bounds it
    assert set(glob.glob("/dev/shm/mpich_shm_*")) <= shm_files


@gen_test(timeout=120)
async def test_new_jobs_go_over_tcp_once_mpich_would_take_no_more(
    channel_for_host_frames, server, monkeypatch
):
    """MPICH aborts a process that connects to its 1024th job: past
    MAX_JOBS, processes of new jobs are met over TCP, with one warning"""
    address, _ = server
    monkeypatch.setattr(mpi_channel, "MAX_JOBS", mpi_channel.channels.sizes()["jobs"])
    with captured_logger("distributed.comm.mpi_channel") as log:
        for _ in range(2):
            comm = await connect(address)
            array = np.arange(600_000)
            for _ in range(3):
                await comm.write({"op": "sum", "x": to_serialize(array)})
                assert (await comm.read())["sum"] == array.sum()
                await asyncio.sleep(0.1)
            assert comm.channel is None
            await comm.close()
    assert log.getvalue().count("the most that MPICH allows one process") == 1
