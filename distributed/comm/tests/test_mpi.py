"""The mpi:// transport held to what upstream's comm tests ask of tcp://,
with both ends in this process (they talk over a duplicate of MPI_COMM_SELF).
Tests with peers in other processes are in test_mpi_processes.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import socket
import struct
import select
import subprocess
import sys
import time
import weakref

import pytest
from tornado.iostream import StreamClosedError

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")

import dask

from distributed import Client, Scheduler, Worker
from distributed.comm import (
    CommClosedError,
    connect,
    get_address_host,
    get_address_host_port,
    get_local_address_for,
    listen,
    parse_address,
    resolve_address,
)
from distributed.comm import mpi_buffers, mpi_handshake, mpi_policy, mpi_startup
from distributed.comm import mpi_stream
from distributed.comm.core import FatalCommClosedError
from distributed.comm.mpi_head import Head
from distributed.comm.mpi_handshake import HEADER, MAGIC
from distributed.comm.mpi_hello import PROTOCOL, Peer
from distributed.comm.mpi_liveness import LocalPeer, hung_up
from distributed.comm.registry import backends
from distributed.comm.utils import to_frames
from distributed.core import Server, rpc
from distributed.protocol import Serialized, deserialize, to_serialize
from distributed.utils_test import (
    async_poll_for,
    captured_logger,
    gen_cluster,
    gen_test,
    inc,
    popen,
)


def parse_peer(hello: dict) -> Peer:
    return Peer.parse(hello, mpi_startup.library())


async def echo(comm):
    """Send back every message, until the comm closes"""
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass


@contextlib.asynccontextmanager
async def echoing(address="mpi://127.0.0.1:0"):
    """A comm to a listener that sends back every message; closed after"""
    async with listen(address, echo) as listener:
        comm = await connect(listener.contact_address)
        yield comm
        await comm.close()


@contextlib.asynccontextmanager
async def comm_pair():
    """Both ends of a new comm: the connector's and the listener's"""
    accepted = asyncio.get_running_loop().create_future()

    async def accept(comm):
        accepted.set_result(comm)

    async with listen("mpi://127.0.0.1:0", accept) as listener:
        comm = await connect(listener.contact_address)
        yield comm, await accepted


async def assert_serves(listener):
    comm = await connect(listener.contact_address)
    await comm.write("still serving")
    assert await comm.read() == "still serving"
    await comm.close()


def python_output(code: str, env: dict | None = None) -> str:
    """What ``python -c code`` prints, in a process of its own"""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout


def env_alone() -> dict:
    """This process's environment without the variables of its process
    manager (its own, once it started MPI): a child's MPI starts alone"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "MPI_"))}
    env.pop("DASK_MPI_PMI_USER", None)
    return env


def test_registered():
    assert "mpi" in backends
    backend = backends["mpi"]
    assert backend.get_address_host("127.0.0.1:1234") == "127.0.0.1"
    assert backend.get_address_host_port("127.0.0.1:1234") == ("127.0.0.1", 1234)


def test_import_does_not_start_mpi():
    code = (
        "import sys, distributed, distributed.comm.mpi; "
        "assert 'mpi4py' not in sys.modules, sorted(m for m in sys.modules if 'mpi' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_process_that_gave_up_on_many_still_connects():
    """Each process MPI failed with (workers killed mid-message, say) is named
    in the handshake; past some 900 of them it outgrew 64 KiB, and every
    connection of the process failed"""
    code = """if True:
        import asyncio, uuid
        from distributed.comm import connect, listen
        from distributed.comm.mpi_channel import channels

        async def echo(comm):
            await comm.write(await comm.read())

        async def main():
            for i in range(3000):
                channels.give_up_on(f"elsewhere/{i}/{uuid.uuid4().hex}")
            async with listen("mpi://127.0.0.1:0", echo) as listener:
                comm = await connect(listener.contact_address, timeout=10)
                await comm.write("hello")
                print(await comm.read(), len(channels.unreachable()))
                await comm.close()

        asyncio.run(main())
    """
    assert python_output(code).split() == ["hello", "512"]


def test_a_process_that_started_mpi_alone_leaves_no_pmi_variables():
    """Its children (a job it submits, and theirs) would take them for their
    own process manager's"""
    code = (
        "import os; from distributed.comm import mpi_startup; "
        "mpi_startup.start_mpi().result(); "
        "print(sorted(k for k in os.environ if k.startswith('PMI')))"
    )
    out = python_output(code, env_alone())
    assert out.strip() == "[]", out


@pytest.mark.parametrize("stale", ["pipe", "socketpair"])
def test_a_process_alone_ignores_a_stale_pmi_fd(stale):
    """``PMI_FD`` from an ancestor's environment (under a forkserver, say)
    may name any file of this process: a pipe failed MPI's start, and a
    socket pair of its own (asyncio's self-pipe) was taken for a process
    manager, and MPI_Init waited for good"""
    make = "os.pipe()[0]" if stale == "pipe" else "socket.socketpair()[0].detach()"
    code = (
        f"import os, socket; os.environ['PMI_FD'] = str({make}); "
        "from distributed.comm import mpi_startup; "
        "print(mpi_startup.start_mpi().result(timeout=30).COMM_WORLD.Get_size())"
    )
    assert python_output(code, env_alone()).strip() == "1"


def test_a_process_alone_starts_mpi_with_a_thousand_files_open():
    """Its own process manager (``mpi_pmi``) answers MPI_Init on a socket
    whose number may be 1024 or more, which select() refused: MPI_Init
    then waited for good"""
    code = (
        "import os; files = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]; "
        "from distributed.comm import mpi_startup; "
        "print(mpi_startup.start_mpi().result(timeout=30).COMM_WORLD.Get_size())"
    )
    assert python_output(code, env_alone()).strip() == "1"


@pytest.mark.skipif(sys.platform != "linux", reason="UCX copies from peers on Linux")
def test_local_peer_knows_when_its_process_died():
    """What the progress engine asks before each call into MPI (see
    ``distributed.comm.mpi_liveness``): the process was killed"""
    code = (
        "import time; from distributed.comm.mpi_liveness import beacon; "
        "print(beacon(), flush=True); time.sleep(60)"
    )
    with popen([sys.executable, "-c", code], capture_output=True) as proc:
        mpi_startup.start_mpi().result()
        hello = {
            **mpi_handshake.hello(),
            "process": f"{socket.gethostname()}/{proc.pid}/x",
            "beacon": int(proc.stdout.readline()),
        }
        peer = LocalPeer.find(parse_peer(hello))
        assert not peer.died()
        proc.kill()
        deadline = time.monotonic() + 10
        while not peer.died():  # dead, not yet reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        elsewhere = {**hello, "process": f"elsewhere/{proc.pid}/x"}
        assert LocalPeer.find(parse_peer(elsewhere)) is None
        # A container on this host: its pids are not ours
        assert LocalPeer.find(parse_peer({**hello, "pid_namespace": -1})) is None


def test_rdma_networks_on_a_fake_sysfs_tree(tmp_path):
    """``across-hosts: auto`` takes MPI between hosts with an InfiniBand
    (RoCE, Omni-Path, EFA) port up, or a Slingshot NIC, and names it"""
    ports = tmp_path / "class" / "infiniband" / "mlx5_1" / "ports"
    for port, state in [(1, "1: DOWN"), (2, "4: ACTIVE")]:
        (ports / str(port)).mkdir(parents=True)
        (ports / str(port) / "state").write_text(state)
    assert mpi_policy.rdma(str(tmp_path)) == "infiniband mlx5_1"
    (ports / "2" / "state").write_text("1: DOWN")
    mpi_policy.rdma.cache_clear()
    assert mpi_policy.rdma(str(tmp_path)) is None
    (tmp_path / "class" / "cxi" / "cxi0").mkdir(parents=True)
    mpi_policy.rdma.cache_clear()
    assert mpi_policy.rdma(str(tmp_path)) == "slingshot cxi0"
    mpi_policy.rdma.cache_clear()


@gen_test()
async def test_across_hosts_setting():
    await mpi_startup.mpi_ready()
    here = mpi_handshake.hello()
    there = {**here, "process": "elsewhere/1/x"}

    def tcp_between_hosts(hello):
        return mpi_policy.tcp_between_hosts(parse_peer(hello))

    assert tcp_between_hosts(there) is not bool(here["rdma"] and there["rdma"])
    assert not tcp_between_hosts(here)  # this host: always MPI
    with dask.config.set({"distributed.comm.mpi.across-hosts": "mpi"}):
        assert not tcp_between_hosts({**there, "rdma": None})
    with dask.config.set({"distributed.comm.mpi.across-hosts": "tcp"}):
        assert tcp_between_hosts({**there, "rdma": "infiniband mlx5_0"})
        assert not tcp_between_hosts(here)
    with dask.config.set({"distributed.comm.mpi.across-hosts": "sometimes"}):
        with pytest.raises(ValueError, match="auto, mpi or tcp, not 'sometimes'"):
            mpi_handshake.hello()


@pytest.mark.parametrize("size", ["0.5", "-4MiB"])
@gen_test()
async def test_a_chunk_size_below_one_byte_fails_the_handshake(size):
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        with dask.config.set({"distributed.comm.mpi.chunk-size": size}):
            with pytest.raises(ValueError, match=f"at least 1 byte, not '{size}'"):
                await connect(listener.contact_address)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"process": "nobody"}, "host/pid/nonce"),
        ({"process": 7}, "did not say which process"),
        ({"world": "job"}, "mpiexec job"),
        ({"library": "another MPI"}, "must use the same MPI library"),
        ({"protocol": 1}, "use the same version of distributed"),
    ],
)
@gen_test()
async def test_a_hello_is_parsed_once_and_garbage_refused(change, why):
    await mpi_startup.mpi_ready()
    hello = mpi_handshake.hello()
    peer = parse_peer(hello)
    assert (peer.process, peer.library, peer.gpu) == (
        hello["process"],
        hello["library"],
        hello["gpu"],
    )
    assert peer.world == (tuple(hello["world"]) if hello["world"] else None)
    assert peer.job == (hello["world"][0] if hello["world"] else hello["process"])
    assert peer.host == socket.gethostname() and peer.pid == os.getpid()
    with pytest.raises(ValueError, match=why):
        parse_peer({**hello, **change})


def test_address_helpers():
    assert parse_address("mpi://127.0.0.1:8786") == ("mpi", "127.0.0.1:8786")
    assert get_address_host("mpi://127.0.0.1:8786") == "127.0.0.1"
    assert get_address_host_port("mpi://127.0.0.1:8786") == ("127.0.0.1", 8786)
    assert resolve_address("mpi://localhost:8786") == "mpi://127.0.0.1:8786"
    assert get_local_address_for("mpi://127.0.0.1:8786") == "mpi://127.0.0.1"


@gen_test()
async def test_no_message_starts_as_a_head_does():
    """A message whose frames all travel on TCP goes as tcp:// writes it,
    without a head: its first frame is msgpack, which never starts with the
    byte that a head starts with"""
    messages = [
        {"op": "ping"},
        b"",
        "x",
        0,
        -1,
        None,
        True,
        2.5,
        [],
        tuple(range(1000)),
        {"f": inc, "x": to_serialize(np.arange(10))},
        Serialized({"serializer": "pickle"}, [b"abc"]),
    ]
    for msg in messages:
        frames = await to_frames(msg)
        assert frames[0][0] != Head.MARK, (msg, frames[0][:1])
    assert Head(True, 0, 0, []).pack()[0] == Head.MARK
    assert Head(False, 1, 2, [(0, 10, 1, 0)]).pack()[0] == Head.MARK


def test_message_head_comes_back_as_it_was_packed():
    heads = [
        Head(True, 0, 0, []),
        Head(False, 2**63 - 1, 2**31 - 1, [(0, 10, 1, 0), (3, 2**40, 4, 0)]),
        Head(False, 7, 8, [(1, 5, 3, 0), (0, 2**20, 2, 2**47)], (2**47, 2**64 - 1)),
    ]
    for head in heads:
        assert Head.unpack(head.pack()) == head


@gen_test()
async def test_client_server_round_trips():
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        addr = listener.contact_address
        assert addr.startswith("mpi://127.0.0.1:")
        assert listener.listen_address == addr
        comm = await connect(addr)
        assert comm.peer_address == addr
        assert comm.local_address.startswith("mpi://127.0.0.1:")
        assert repr(comm).startswith("<MPI")
        assert comm.same_host

        messages = [
            {"op": "ping"},
            b"",
            "x" * 100,
            tuple(range(1000)),  # msgpack gives lists back as tuples
            {"data": b"y" * 70_000},
            {"nested": ({"a": (1, 2.5)}, None, True)},
        ]
        for msg in messages:
            assert await comm.write(msg) > 0
            assert await comm.read() == msg
        for array in [np.arange(10), np.random.random(1_000_000), np.empty(0)]:
            await comm.write({"x": to_serialize(array), "y": 1})
            got = await comm.read()
            assert got["y"] == 1
            np.testing.assert_array_equal(got["x"], array)
        await comm.write({"x": to_serialize(np.arange(2_000_000))})
        got = await comm.read()
        np.testing.assert_array_equal(got["x"], np.arange(2_000_000))

        await comm.close()
        assert comm.closed()


@gen_test()
async def test_comms_on_one_host_use_the_listeners_unix_socket():
    accepted = []

    async def accept(comm):
        accepted.append(comm)
        await echo(comm)

    with captured_logger("distributed.comm.tcp") as log:
        async with listen("mpi://127.0.0.1:0", accept) as listener:
            host, port = get_address_host_port(listener.contact_address)
            local = await connect(listener.contact_address)
            # Another name of the listener: no Unix socket has it, so TCP
            other = await connect(f"mpi://localhost:{port}")
            for comm, family in [(local, socket.AF_UNIX), (other, socket.AF_INET)]:
                assert comm.stream.socket.family == family
                assert comm.same_host
                assert comm.peer_address.startswith("mpi://")
                for msg in [{"op": "ping"}, {"x": to_serialize(np.arange(600_000))}]:
                    await comm.write(msg)
                    got = await comm.read()
                    assert got.keys() == msg.keys()
                assert (got["x"] == np.arange(600_000)).all()
                assert comm.channel is not None  # the array went over MPI
            assert accepted[0].stream.socket.family == socket.AF_UNIX
            # Room for as much as TCP holds, as far as Linux allows
            with open("/proc/sys/net/core/wmem_max") as f:
                room = 2 * min(int(f.read()), 4 * 2**20)  # Linux doubles it
            for sock in [local.stream.socket, accepted[0].stream.socket]:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == room
            assert accepted[0].local_address == listener.contact_address
            assert accepted[0].peer_address == f"mpi://{host}:0"
            assert local.local_address == f"mpi://{host}:0"
            await local.close()
            await other.close()
        # Its Unix socket closed with the listener
        with socket.socket(socket.AF_UNIX) as sock, pytest.raises(OSError):
            sock.connect(f"\0distributed-mpi:{host}:{port}")
    assert not log.getvalue()  # no keepalive asked of a Unix socket


@gen_test()
async def test_host_frames_below_local_inline_size_stay_on_a_unix_socket():
    """On a Unix socket, host frames below local-inline-size travel with
    their message, larger ones take the channel; on TCP, from inline-size"""
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        _, port = get_address_host_port(listener.contact_address)
        unix, tcp = listener.contact_address, f"mpi://localhost:{port}"
        for address, size, routed, config in [
            (unix, 2**21, False, {}),  # the defaults: 4 MiB, inline-size 1 MiB
            (unix, 2**22 - 1, False, {}),
            (unix, 2**22, True, {}),
            (tcp, 2**20, True, {}),
            (unix, 2**21, True, {"distributed.comm.mpi.local-inline-size": "1MiB"}),
        ]:
            with dask.config.set(config):  # read by the handshake
                comm = await connect(address)
            sent = np.arange(size, dtype="u1")
            await comm.write({"x": to_serialize(sent)})
            np.testing.assert_array_equal((await comm.read())["x"], sent)
            assert (comm.channel is not None) == routed, (address, size)
            await comm.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run as another user")
@gen_test()
async def test_a_unix_socket_of_another_user_is_not_used():
    """Another user's process holds the Unix socket's name first: the listener
    takes TCP only, and connectors do not talk to that process"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    squatter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, socket, sys, time; os.setuid(65534); "
            "s = socket.socket(socket.AF_UNIX); s.bind('\\0' + sys.argv[1]); s.listen(); "
            "print('listening', flush=True); time.sleep(60)",
            f"distributed-mpi:127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert squatter.stdout.readline() == b"listening\n"
        async with echoing(f"mpi://127.0.0.1:{port}") as comm:
            assert comm.stream.socket.family == socket.AF_INET
            await comm.write({"op": "ping"})
            assert await comm.read() == {"op": "ping"}
    finally:
        squatter.kill()
        squatter.wait()
        squatter.stdout.close()


@gen_test()
async def test_many_messages_in_flight_keep_order():
    async with echoing("mpi://") as comm:
        for i in range(200):
            await comm.write({"i": i, "pad": b"z" * (i * 1000)})
        for i in range(200):
            assert (await comm.read())["i"] == i


@gen_test()
async def test_comms_to_one_listener_are_isolated():
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        comms = [await connect(listener.contact_address) for _ in range(20)]

        async def talk(i, comm):
            for j in range(20):
                await comm.write(
                    {"comm": i, "j": j, "payload": to_serialize(np.full(i * 997, j))}
                )
                got = await comm.read()
                assert (got["comm"], got["j"]) == (i, j)
                assert (got["payload"] == j).all() and got["payload"].size == i * 997

        await asyncio.gather(*(talk(i, c) for i, c in enumerate(comms)))
        await asyncio.gather(*(c.close() for c in comms))


@gen_test()
async def test_comm_closed_implicit():
    async def handle(comm):
        await comm.close()

    async with listen("mpi://127.0.0.1:0", handle) as listener:
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()
        with pytest.raises(CommClosedError):
            await comm.write("x")


@gen_test()
async def test_comm_closed_explicit_and_peer_sees_it():
    async with comm_pair() as (comm, peer):
        pending = asyncio.ensure_future(peer.read())
        await comm.write({"last": "message"})
        await comm.close()
        assert comm.closed()
        with pytest.raises(CommClosedError):
            await comm.read()
        with pytest.raises(CommClosedError):
            await comm.write("x")
        # Messages written before close() arrive, then the end of the stream
        assert await pending == {"last": "message"}
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(peer.read(), 5)


@gen_test()
async def test_no_frame_is_sent_over_mpi_to_a_peer_that_hung_up():
    """A write to a peer that closed its end fails before MPI sends to it:
    nobody would receive, and MPICH's UCX can crash sending to a process
    that died (on another host, a closed connection is the only sign)"""
    async with comm_pair() as (comm, peer):
        await peer.close()
        with pytest.raises(CommClosedError, match="closed the connection"):
            await comm.write(to_serialize(np.ones(2**22, "u1")))  # over MPI
        assert comm.closed()


def test_hung_up_tells_whether_the_peer_closed_the_connection():
    """Asked before every send over MPI: not while the peer is connected,
    with data waiting or not; yes once it closed its end, or this end did"""
    with socket.create_server(("127.0.0.1", 0)) as server:
        here = socket.create_connection(server.getsockname())
        there, _ = server.accept()
        with here, there:
            assert not hung_up(here)
            there.sendall(b"x")
            assert select.select([here], [], [], 5)[0]
            assert not hung_up(here)
            assert here.recv(1) == b"x"
            there.close()
            assert select.select([here], [], [], 5)[0]
            assert hung_up(here)
        assert hung_up(here)


@gen_test()
async def test_receive_that_gets_fewer_bytes_than_its_size_fails():
    """MPI fills a larger receive from a smaller send without an error: the
    progress engine checks what each receive got, so that a frame cannot
    come out with stale bytes, whatever mismatch the two ends have"""
    from distributed.comm.mpi_progress import ProgressEngine
    from distributed.comm.mpi_startup import mpi_ready

    MPI = await mpi_ready()
    comm = MPI.COMM_SELF.Dup()
    try:
        engine = ProgressEngine.current()
        sent, received = np.ones(10, "u1"), np.zeros(100, "u1")
        # Sent before the receive is handed to the engine, or after
        for sizes, fails, send_first in [
            ([10], False, True),
            ([100], True, True),
            ([100], True, False),
        ]:
            receive = comm.Irecv([received, MPI.BYTE], 0, 3)
            if send_first:
                send = engine.transfer([comm.Isend([sent, MPI.BYTE], 0, 3)], sent)
            done = engine.receive([receive], received, None, sizes)
            if not send_first:
                send = engine.transfer([comm.Isend([sent, MPI.BYTE], 0, 3)], sent)
            if fails:
                with pytest.raises(
                    CommClosedError, match="10 bytes to a receive of 100"
                ):
                    await done
            else:
                await done
            await send
    finally:
        comm.Free()


@gen_test()
async def test_transfers_in_flight_together_each_complete_with_their_own_bytes():
    """The engine tests all transfers in flight in one call into MPI: each
    one completes when its own requests have, whatever order their sends
    come in, and a receive that gets the wrong size fails alone"""
    from distributed.comm.mpi_progress import ProgressEngine
    from distributed.comm.mpi_startup import mpi_ready

    MPI = await mpi_ready()
    comm = MPI.COMM_SELF.Dup()
    try:
        engine = ProgressEngine.current()
        # Each message in two chunks, so that a transfer has several requests
        received = [np.zeros(200 * (i + 1), "u1") for i in range(6)]
        receives = []
        for i, frame in enumerate(received):
            halves = np.split(frame, 2)
            requests = [
                comm.Irecv([h, MPI.BYTE], 0, 2 * i + k) for k, h in enumerate(halves)
            ]
            sizes = [h.nbytes for h in halves]
            receives.append(engine.receive(requests, halves, None, sizes))
        sends = []
        for i in reversed(range(len(received))):  # one per loop iteration
            await asyncio.sleep(0)
            sent = np.full(received[i].nbytes, i + 1, "u1")
            if i == 3:
                sent = sent[:-1]  # its second chunk is a byte short
            halves = np.array_split(sent, [received[i].nbytes // 2])
            requests = [
                comm.Isend([h, MPI.BYTE], 0, 2 * i + k) for k, h in enumerate(halves)
            ]
            sends.append(engine.transfer(requests, halves))
        results = await asyncio.gather(*receives, return_exceptions=True)
        await asyncio.gather(*sends)
        assert isinstance(results[3], CommClosedError)
        assert "delivered 399 bytes to a receive of 400" in str(results[3])
        for i, (result, frame) in enumerate(zip(results, received)):
            if i != 3:
                assert result is None
                assert (frame == i + 1).all()
        assert engine.pending() == 0
    finally:
        comm.Free()


@gen_test()
async def test_abandoned_receive_half_done_is_cancelled_after_its_deadline():
    """A transfer abandoned after some of its chunks arrived: past the
    connect timeout the engine cancels the chunks still waiting (not the
    completed ones, which MPI no longer knows), so that no later message
    lands in a buffer it dropped"""
    from distributed.comm.mpi_progress import ProgressEngine
    from distributed.comm.mpi_startup import mpi_ready

    MPI = await mpi_ready()
    comm = MPI.COMM_SELF.Dup()
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": "100ms"}):
            engine = ProgressEngine.current()
        halves = [np.zeros(100, "u1"), np.zeros(100, "u1")]
        requests = [comm.Irecv([h, MPI.BYTE], 0, 1 + k) for k, h in enumerate(halves)]
        comm.Send([np.ones(100, "u1"), MPI.BYTE], 0, 1)  # the first half only
        fut = engine.receive(requests, halves, None, [100, 100])
        await async_poll_for(lambda: not requests[0], timeout=5)
        engine.abandon(fut)
        await async_poll_for(lambda: engine.pending() == 0, timeout=5)
        # The second half's receive is gone: a new one gets its message
        late = np.zeros(100, "u1")
        fresh = comm.Irecv([late, MPI.BYTE], 0, 2)
        comm.Send([np.full(100, 7, "u1"), MPI.BYTE], 0, 2)
        await async_poll_for(fresh.Test, timeout=5)
        assert (late == 7).all() and (halves[1] == 0).all()
    finally:
        comm.Free()


@gen_test()
async def test_a_receive_cancelled_with_its_reader_is_abandoned():
    """A task that awaits a receive is cancelled (a read, say), which
    cancels the receive's future: the engine lets it complete in its own
    time, then cancels it past the connect timeout, as one abandoned"""
    from distributed.comm.mpi_progress import ProgressEngine
    from distributed.comm.mpi_startup import mpi_ready

    MPI = await mpi_ready()
    comm = MPI.COMM_SELF.Dup()
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": "100ms"}):
            engine = ProgressEngine.current()
        buffer = np.zeros(100, "u1")
        request = comm.Irecv([buffer, MPI.BYTE], 0, 1)  # sent nothing

        async def read():
            await engine.receive([request], buffer, None, [100])

        reading = asyncio.create_task(read())
        await asyncio.sleep(0.01)
        reading.cancel()
        await async_poll_for(lambda: engine.pending() == 0, timeout=5)
        assert not request  # cancelled, not waited for on and on
    finally:
        comm.Free()


@gen_test()
async def test_abort_fails_pending_read():
    async with echoing() as comm:
        pending = asyncio.ensure_future(comm.read())
        await asyncio.sleep(0.05)
        comm.abort()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(pending, 5)
        assert comm.closed()


@gen_test()
async def test_connect_timeout():
    # A port nobody listens on: fail within the timeout, never hang
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = asyncio.get_running_loop().time()
    with pytest.raises(OSError, match="Timed out"):
        await connect(f"mpi://127.0.0.1:{port}", timeout=0.15)
    assert asyncio.get_running_loop().time() - start < 1


@gen_test()
async def test_many_listeners():
    listeners = [await listen("mpi://127.0.0.1:0", echo) for _ in range(100)]
    assert len({l.contact_address for l in listeners}) == 100
    comm = await connect(listeners[-1].contact_address)
    await comm.write("hello")
    assert await comm.read() == "hello"
    await comm.close()
    for l in listeners:
        l.stop()


@pytest.mark.parametrize("deserialize_on_read", [True, False])
@gen_test()
async def test_deserialize(deserialize_on_read):
    got = asyncio.get_running_loop().create_future()

    async def handle(comm):
        got.set_result(await comm.read())
        await comm.close()

    async with listen(
        "mpi://127.0.0.1:0", handle, deserialize=deserialize_on_read
    ) as listener:
        comm = await connect(listener.contact_address)
        array = np.arange(100)
        await comm.write({"x": to_serialize(array), "n": 1})
        msg = await got
        assert msg["n"] == 1
        if deserialize_on_read:
            np.testing.assert_array_equal(msg["x"], array)
        else:
            assert isinstance(msg["x"], Serialized)
            np.testing.assert_array_equal(
                deserialize(msg["x"].header, msg["x"].frames), array
            )
        await comm.close()


@gen_test()
async def test_garbage_handshake_does_not_stop_listener():
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        host, port = get_address_host_port(listener.contact_address)
        with captured_logger("distributed.comm.mpi") as log:
            for garbage in [b"GET / HTTP/1.1\r\n\r\n", MAGIC + b"\xff" * 8, b""]:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(garbage)
                await writer.drain()
                writer.close()
            await assert_serves(listener)
        # The listener says what was wrong, and dialled nobody
        assert "did not answer with an mpi:// handshake" in log.getvalue()
        assert "Cannot connect" not in log.getvalue()


def handshake(message: dict) -> bytes:
    """A handshake message as mpi:// sends it: magic, length, JSON"""
    body = json.dumps(message).encode()
    return HEADER.pack(MAGIC, len(body)) + body


async def say_hello(address, hello: dict) -> dict:
    """Send a handshake to an mpi:// listener; its reply"""
    host, port = get_address_host_port(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(handshake(hello))
    magic, size = HEADER.unpack(await reader.readexactly(HEADER.size))
    reply = json.loads(await reader.readexactly(size))
    assert await reader.read() == b""  # and the connection is closed
    writer.close()
    return reply


@gen_test()
async def test_peer_with_another_mpi_library_is_refused():
    hello = {
        "protocol": PROTOCOL,
        "process": "elsewhere/1/x",
        "library": "Other MPI 9.9",
    }
    async with listen("mpi://127.0.0.1:0", echo) as listener:
        with captured_logger("distributed.comm.mpi_handshake") as log:
            for _ in range(3):  # a refused worker retries for good
                reply = await say_hello(listener.contact_address, hello)
                assert "Other MPI 9.9" in reply["error"]
                assert "same MPI library" in reply["error"]
        # Said once, with the reason
        assert log.getvalue().count("refuses connections from 127.0.0.1") == 1
        assert "same MPI library" in log.getvalue()

        await assert_serves(listener)


@gen_test()
async def test_refused_connector_says_why_once():
    """The refused end logs the reason too: a worker that cannot register
    retries for good, and itself only says that it waits"""

    async def refuse(reader, writer):
        await reader.readexactly(HEADER.size)
        writer.write(handshake({"error": "no MPI for you"}))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with captured_logger("distributed.comm.mpi_handshake") as log:
            for _ in range(3):
                with pytest.raises(FatalCommClosedError, match="no MPI for you"):
                    await connect(f"mpi://127.0.0.1:{port}", timeout=5)
        assert log.getvalue().count("no MPI for you") == 1
    finally:
        server.close()


@gen_test()
async def test_rpc_server():
    server = Server({"ping": lambda: "pong", "add": lambda x, y: x + y})
    await server.listen("mpi://127.0.0.1:0")
    assert server.address.startswith("mpi://")
    assert server.port > 0
    async with rpc(server.address) as remote:
        assert await remote.ping() == "pong"
        results = await asyncio.gather(*(remote.add(x=i, y=i) for i in range(50)))
        assert results == [2 * i for i in range(50)]
        data = b"q" * 20_000_000
        assert await remote.add(x=data, y=b"!") == data + b"!"
    server.stop()


@gen_test()
async def test_scheduler_port_and_worker_protocol():
    async with Scheduler(protocol="mpi", port=0, dashboard_address=":0") as s:
        assert s.address.startswith("mpi://")
        async with Worker(s.address) as w:
            assert w.address.startswith("mpi://")  # protocol taken from the scheduler
            async with Client(s.address, asynchronous=True) as c:
                assert await c.submit(inc, 1) == 2


@gen_test()
async def test_scheduler_on_mpi_and_tcp():
    """Workers on mpi://, a client from outside the MPI job on tcp://"""
    async with Scheduler(
        protocol=["mpi", "tcp"], port=[0, 0], dashboard_address=":0"
    ) as s:
        mpi_address, tcp_address = s.listen_address, s.listeners[1].contact_address
        assert mpi_address.startswith("mpi://") and tcp_address.startswith("tcp://")
        async with Worker(mpi_address) as w:
            assert w.address.startswith("mpi://")
            async with Client(tcp_address, asynchronous=True) as c:
                assert await c.submit(inc, 41) == 42


@gen_cluster(client=True, scheduler_kwargs={"protocol": "mpi"})
async def test_cluster_in_one_process_moves_data_between_workers(c, s, a, b):
    da = pytest.importorskip("dask.array")
    assert s.address.startswith("mpi://") and a.address.startswith("mpi://")
    x = da.random.RandomState(0).random((400, 400), chunks=(100, 100))
    expected = (x + x.T).sum().compute(scheduler="sync")
    got = await c.compute((x + x.T).sum())
    assert np.isclose(got, expected)
    transfers = a.state.transfer_incoming_count_total
    assert transfers + b.state.transfer_incoming_count_total > 0


@gen_test()
async def test_config_bounds_used():
    with dask.config.set(
        {
            "distributed.comm.mpi.inline-size": "16B",
            "distributed.comm.mpi.local-inline-size": "16B",
            "distributed.comm.mpi.chunk-size": "1kiB",
        }
    ):
        async with echoing() as comm:
            payload = to_serialize(np.arange(10_000))
            await comm.write({"x": payload})
            np.testing.assert_array_equal((await comm.read())["x"], np.arange(10_000))
            assert comm.channel is not None  # in 1 KiB pieces


def address_of(buffer) -> int:
    return np.frombuffer(buffer, "u1").ctypes.data


@gen_test()
async def test_receive_buffers_start_on_2_MiB_and_serve_again_once_freed():
    mib = 2**20
    first, other = mpi_buffers.host_buffer(3 * mib), mpi_buffers.host_buffer(3 * mib)
    assert (first.nbytes, other.nbytes) == (3 * mib, 3 * mib)
    assert address_of(first) % (2 * mib) == 0 and address_of(other) % (2 * mib) == 0
    assert address_of(first) != address_of(other)

    old = address_of(first)
    del first
    # Of the same capacity (rounded to 2 MiB), taken again; not by a larger frame
    assert address_of(mpi_buffers.host_buffer(6 * mib)) != old
    again = mpi_buffers.host_buffer(4 * mib)
    assert address_of(again) == old

    # A view of a frame keeps its memory from the next frames
    view = memoryview(again)[10:20]
    array = np.frombuffer(view, "u1")
    del again, view
    assert address_of(mpi_buffers.host_buffer(4 * mib)) != old
    del array
    assert address_of(mpi_buffers.host_buffer(4 * mib)) == old


@gen_test()
async def test_freed_receive_buffers_are_given_back():
    mib = 2**20
    keep_for = mpi_buffers.KEEP_FOR
    mpi_buffers.KEEP_FOR = 0.2
    mpi_buffers.freed.clear()  # what earlier tests freed
    try:
        with dask.config.set({"distributed.comm.mpi.keep-freed": "8MiB"}):
            buffers = [mpi_buffers.host_buffer(2 * mib) for _ in range(6)]
        del buffers
        assert mpi_buffers.freed.nbytes() == 8 * mib
        await async_poll_for(lambda: not mpi_buffers.freed.nbytes(), timeout=5)

        with dask.config.set({"distributed.comm.mpi.keep-freed": 0}):
            buffer = mpi_buffers.host_buffer(2 * mib)
        del buffer
        assert not mpi_buffers.freed.nbytes()
    finally:
        mpi_buffers.KEEP_FOR = keep_for


def test_receive_buffers_freed_after_their_loop_stopped_are_given_back():
    """Nothing would give them back later: a Client's loop stops when it
    closes, and its results are often freed after that"""

    async def receive():
        return mpi_buffers.host_buffer(2 * 2**20)

    loop = asyncio.new_event_loop()
    try:
        buffer = loop.run_until_complete(receive())
    finally:
        loop.close()
    mpi_buffers.freed.clear()  # what earlier tests freed
    del buffer
    assert not mpi_buffers.freed.nbytes()


@gen_test()
async def test_frames_received_into_freed_memory_keep_their_values():
    """Received arrays that are kept hold their memory; those dropped lend
    theirs to the next messages"""
    size = 3 * 2**20
    async with echoing() as comm:
        kept = []
        for i in range(8):
            sent = np.full(size, i, "u1")
            await comm.write({"x": to_serialize(sent), "i": i})
            got = await comm.read()
            np.testing.assert_array_equal(got["x"], sent)
            if i % 2:
                kept.append(got["x"])
            del got
        assert [int(x[0]) for x in kept] == [1, 3, 5, 7]
        assert all((x == x[0]).all() for x in kept)


@gen_test()
async def test_messages_keep_their_frames_whatever_their_sizes_on_the_socket():
    """Frames below, at and above what one read of the socket asks for, and
    empty ones, come whole, in order, and writable (numpy arrays made on
    them must be)"""
    a, b = socket.socketpair()
    writer, reader = mpi_stream.SocketStream(a), mpi_stream.SocketStream(b)
    try:
        step = mpi_stream.READ_SIZE
        sizes = [0, 1, step - 1, step, step + 1, 5 * 2**20 + 3, 0, 100]
        sent = [np.random.randint(0, 256, n, "u1").data for n in sizes]
        for _ in range(3):
            writer.write_message(sent)
        for _ in range(3):
            got = await reader.read_message(mpi_buffers.socket_buffer)
            assert [bytes(f) for f in got] == [bytes(f) for f in sent]
            assert not any(memoryview(f).readonly for f in got)
        writer.close()
        with pytest.raises(StreamClosedError):
            await reader.read_message(mpi_buffers.socket_buffer)
    finally:
        writer.close()
        reader.close()


@gen_test()
async def test_messages_nobody_reads_leave_the_socket_unread():
    """A comm reads a few messages ahead at most (and what one read of the
    socket brought): the rest wait in the kernel and the writer, as on
    tcp://, and come in order when read"""
    async with comm_pair() as (a, b):
        for i in range(40):
            await a.write({"i": i, "pad": b"x" * 100_000})
        await asyncio.sleep(0.2)
        assert b.stream.unread()  # the rest waits in the kernel
        assert [(await b.read())["i"] for _ in range(40)] == list(range(40))
        await a.close()
        await b.close()


@gen_test()
async def test_garbage_instead_of_a_message_closes_the_comm():
    """A frame size no memory can hold: the read fails, the comm closes"""
    async with comm_pair() as (a, b):
        await a.stream.write(struct.pack("Q", 2**62) + b"garbage")
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(b.read(), 5)
        assert b.closed()
        await a.close()


@gen_test()
async def test_frames_on_the_socket_are_received_into_recycled_memory():
    """Not only those over MPI, where glibc would map each afresh: under a
    nanny (``MALLOC_TRIM_THRESHOLD_``), every one of 128 KiB or more"""
    mpi_buffers.freed.clear()  # what earlier tests freed
    threshold = mpi_buffers.GLIBC_MMAP_THRESHOLD
    frame = np.arange(2**17, dtype="u4")  # 512 KiB: below inline-size
    try:
        async with comm_pair() as (a, b):
            mpi_buffers.GLIBC_MMAP_THRESHOLD = 128 * 2**10  # as under a nanny
            await a.write({"x": to_serialize(frame)})
            got = (await b.read())["x"]
            assert b.channel is None  # it came on the socket
            del got
            assert mpi_buffers.freed.nbytes() == 2 * 2**20  # one 2 MiB mapping
            await a.write({"x": to_serialize(frame)})
            got = (await b.read())["x"]
            assert not mpi_buffers.freed.nbytes()  # taken again
            np.testing.assert_array_equal(got, frame)
            del got

            # Where glibc serves it from its heap, so does the comm
            mpi_buffers.GLIBC_MMAP_THRESHOLD = 32 * 2**20
            await a.write({"x": to_serialize(frame)})
            got = (await b.read())["x"]
            np.testing.assert_array_equal(got, frame)
            assert address_of(got) % (2 * 2**20) != 0  # not in a mapping of ours
            del got
            assert mpi_buffers.freed.nbytes() == 2 * 2**20  # the one freed above
    finally:
        mpi_buffers.GLIBC_MMAP_THRESHOLD = threshold


@pytest.mark.parametrize(
    "env, threshold",
    [
        ({}, 32 * 2**20),
        ({"MALLOC_TRIM_THRESHOLD_": "65536"}, 128 * 2**10),  # a nanny's
        ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, 2**20),
    ],
)
def test_glibc_mmap_threshold_is_read_from_the_environment(env, threshold):
    code = (
        "from distributed.comm import mpi_buffers; "
        "print(mpi_buffers.GLIBC_MMAP_THRESHOLD)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = python_output(code, env)
    assert int(out) == threshold


def test_receive_buffer_comes_from_the_heap_when_no_mapping_can_be_made():
    """A process out of mappings (each frame it keeps holds one) or of
    address space still receives: glibc's heap may have room"""
    code = """if True:
        import asyncio, resource
        import numpy as np
        from distributed.comm import mpi_buffers

        async def receive():
            with open("/proc/self/status") as status:
                vm = next(int(l.split()[1]) for l in status if l.startswith("VmSize"))
            # Room for the frame (1.5 MiB), not for its 2 MiB-aligned mapping (4 MiB)
            limit = vm * 1024 + 3 * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            frame = np.frombuffer(mpi_buffers.host_buffer(3 * 2**19), "u1")
            frame[:] = 7
            print(frame.nbytes, frame.ctypes.data % (2 * 2**20) != 0, frame.sum())

        asyncio.run(receive())
    """
    out = python_output(code)
    assert out.split() == [str(3 * 2**19), "True", str(7 * 3 * 2**19)], out


@gen_test()
async def test_worker_without_host_listens_where_it_reaches_the_scheduler():
    """As a tcp:// worker does, not on the host's default-route address, which
    peers on another network (InfiniBand) may not reach"""
    async with Scheduler(
        protocol="mpi", host="127.0.0.1", port=0, dashboard_address=":0"
    ) as s:
        async with Worker(s.address) as w:
            assert w.address.startswith("mpi://127.0.0.1:")


@gen_test()
async def test_connect_to_a_tcp_listener_fails_at_once():
    async with listen("tcp://127.0.0.1:0", echo) as listener:
        port = get_address_host_port(listener.contact_address)[1]
        start = time.monotonic()
        with pytest.raises(FatalCommClosedError, match="not answer with an mpi://"):
            await connect(f"mpi://127.0.0.1:{port}", timeout=10)
        assert time.monotonic() - start < 5  # not retried until the timeout


@gen_test()
async def test_comm_dropped_without_close_is_collected():
    """Like a tcp:// comm: collected, its connection closed, its peer told
    (not with comm_pair(), which holds the comm)"""
    accepted = asyncio.get_running_loop().create_future()

    async def accept(comm):
        accepted.set_result(comm)

    async with listen("mpi://127.0.0.1:0", accept) as listener:
        comm = await connect(listener.contact_address)
        await comm.write("last words")
        peer = await accepted
        assert await peer.read() == "last words"
        dropped = weakref.ref(comm)
        del comm
        gc.collect()
        assert dropped() is None
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(peer.read(), 5)


def test_mpi_started_in_a_test_leaks_no_thread():
    """MPI starts on first use, inside a user's test: upstream's leak check
    must not find a thread it left running (here a fresh process, started
    without mpiexec, where MPICH needs a process manager thread in MPI_Init)"""
    code = """if True:
        import asyncio
        from distributed.comm import connect, listen
        from distributed.utils_test import check_thread_leak

        async def main():
            async with listen("mpi://127.0.0.1:0", lambda comm: comm.close()) as l:
                comm = await connect(l.contact_address)
                await comm.close()

        with check_thread_leak():
            asyncio.run(main())
        print("no thread leaked")
    """
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no thread leaked" in out.stdout
    # ... and MPI_Finalize, at exit, said nothing: Python 3.12 and later
    # start no thread there, where MPICH asks its process manager again
    assert out.stderr == ""


def test_the_older_of_two_processes_of_a_host_sorts_first():
    """Which of two processes accepts their channel: by host, then the one
    named first (an older process), whatever their pids, which wrap around"""
    me = mpi_startup.process_id()
    script = "from distributed.comm import mpi_startup; print(mpi_startup.process_id())"
    child = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert mpi_startup.sorts_first(me, child)
    assert not mpi_startup.sorts_first(child, me)
    host, _, nonce = child.split("/")
    assert mpi_startup.sorts_first(me, f"{host}/1/{nonce}")  # a wrapped pid
    _, pid, my_nonce = me.split("/")
    assert mpi_startup.sorts_first(f"a/{pid}/{nonce}", f"b/1/{my_nonce}")
