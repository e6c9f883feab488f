"""A whole cluster on protocol="mpi", started in each of the ways people
start Dask on an MPI machine, this test process as the client: the scheduler
and the workers started by separate ``mpiexec`` commands, or as ranks of one
``mpiexec`` job, by dask-mpi, or by a LocalCluster without ``mpiexec``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")
da = pytest.importorskip("dask.array")

from distributed import Client, LocalCluster, Scheduler
from distributed.comm import get_address_host, mpi_buffers, mpi_channel
from distributed.utils import open_port
from distributed.utils_test import gen_test
from distributed.comm.tests.mpi_processes import (
    known_mpi_crash,
    moved_off_the_socket,
    mpiexec,
    run_mpiexec,
    scheduler_address,
    wait_for_file,
)

pytestmark = pytest.mark.timeout(120)


def scheduler_and_workers(
    scheduler_file: str, nanny: bool = False
) -> tuple[list[str], list[str]]:
    scheduler = ["-m", "distributed.cli.dask_scheduler", "--protocol", "mpi"]
    scheduler += ["--port", "0", "--scheduler-file", scheduler_file, "--no-dashboard"]
    worker = ["-m", "distributed.cli.dask_worker", "--scheduler-file", scheduler_file]
    worker += ["--nanny" if nanny else "--no-nanny", "--nthreads", "1"]
    return scheduler, [*worker, "--no-dashboard"]


def assert_moves_data(client) -> None:
    """Compute something that needs data from other workers; check the result,
    and that large frames moved as mpi:// moves them (copied from the
    writer's memory between processes of one host, else over MPI)"""
    x = da.random.RandomState(42).random((4000, 4000), chunks=(1000, 1000))
    expected = (x + x.T).sum().compute(scheduler="sync")
    for _ in range(10):
        assert np.isclose(client.compute((x + x.T).sum()).result(), expected)
        if sum(client.run(moved_off_the_socket).values()) > 0:
            break
    else:
        raise AssertionError("no large frame moved between workers")
    assert sum(transfers(client).values()) > 0, "no data moved between workers"


def transfers(client) -> dict[str, int]:
    """How many transfers each worker received from other workers"""
    return client.run(
        lambda dask_worker: dask_worker.state.transfer_incoming_count_total
    )


def compute_while_large_frames_move(client, timeout: float = 60):
    """Start a graph whose chunks (8 MB) are copied from the writers' memory
    (or go over MPI); return once its frames move: its future and the right
    result"""
    x = da.random.RandomState(3).random((3000, 3000), chunks=(1000, 1000))
    graph = (x + x.T).sum()
    expected = graph.compute(scheduler="sync")
    before = sum(client.run(moved_off_the_socket).values())
    future = client.compute(graph)
    deadline = time.monotonic() + timeout
    while sum(client.run(moved_off_the_socket).values()) == before:
        assert time.monotonic() < deadline, "no large frame moved"
        time.sleep(0.01)
    return future, expected


def wait_for_worker_count(client, n: int, why: str) -> None:
    """Until the scheduler knows ``n`` workers: fewer ones are gone"""
    deadline = time.monotonic() + 60
    while len(client.scheduler_info()["workers"]) != n:
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


@contextlib.contextmanager
def one_job_with_nannies(tmp_path, n_workers: int):
    """A scheduler and ``n_workers`` workers with nannies, ranks of one
    mpiexec job; the job and its scheduler file, once written"""
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler, worker = scheduler_and_workers(scheduler_file, nanny=True)
    with mpiexec(["-n", "1", *scheduler, ":", "-n", str(n_workers), *worker]) as job:
        wait_for_file(scheduler_file, job)
        yield job, scheduler_file


def use_nanny_workers_and_shut_down(job, scheduler_file: str, n_workers: int) -> int:
    """Workers with nannies move data; client.shutdown() ends every process
    of the job; its exit code"""
    with Client(scheduler_file=scheduler_file, timeout=60) as client:
        client.wait_for_workers(n_workers, timeout=60)
        workers = client.scheduler_info()["workers"].values()
        assert all(w["nanny"].startswith("mpi://") for w in workers)
        assert_moves_data(client)
        processes = processes_of(job)
        client.shutdown()
    code = job.wait(60)
    assert_gone(processes)
    return code


def processes_of(job) -> list[psutil.Process]:
    """The processes a job started (mpiexec's proxies, ranks, their children)"""
    return psutil.Process(job.pid).children(recursive=True)


def assert_gone(processes: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"processes left behind: {alive}"


def test_one_mpiexec_job(tmp_path):
    """The README's example: scheduler and workers (with nannies) are ranks of
    one job, and MPI_Init in each waits for all of them; client.shutdown()
    ends every process"""
    with one_job_with_nannies(tmp_path, 2) as (job, scheduler_file):
        assert use_nanny_workers_and_shut_down(job, scheduler_file, 2) == 0


def test_ctrl_c_stops_every_process(tmp_path):
    """Ctrl-C in the terminal of ``mpiexec``: SIGINT to its process group"""
    with one_job_with_nannies(tmp_path, 2) as (job, scheduler_file):
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            assert client.submit(sum, [1, 2]).result() == 3
            processes = processes_of(job)
            assert len(processes) >= 5  # scheduler, 2 nannies, 2 workers
            os.killpg(job.pid, signal.SIGINT)
            assert job.wait(60) is not None
            assert_gone(processes)


def test_mpiexec_cluster_moves_data_between_workers(tmp_path):
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler_args, worker_args = scheduler_and_workers(scheduler_file)
    with mpiexec(["-n", "1", *scheduler_args]) as scheduler:
        wait_for_file(scheduler_file, scheduler)
        with (
            mpiexec(["-n", "2", *worker_args]) as workers,
            Client(scheduler_file=scheduler_file, timeout=60) as client,
        ):
            assert client.scheduler.address.startswith("mpi://")
            client.wait_for_workers(2, timeout=60)
            info = client.scheduler_info()["workers"]
            assert all(addr.startswith("mpi://") for addr in info)
            pids = set(client.run(os.getpid).values())
            pids |= {client.run_on_scheduler(os.getpid), os.getpid()}
            assert len(pids) == 4

            assert_moves_data(client)
            x = da.random.RandomState(42).random((4000, 4000), chunks=(1000, 1000))
            expected = x.dot(x.T)[:10, :10].compute(scheduler="sync")
            got = client.compute(x.dot(x.T)[:10, :10]).result()
            np.testing.assert_allclose(got, expected)

            client.shutdown()
            assert workers.wait(60) == 0
        assert scheduler.wait(60) == 0


@pytest.mark.parametrize("ranks,args", [(4, []), (5, ["subcomm"])])
def test_dask_mpi_script(ranks, args):
    """``initialize(protocol="mpi")``, on COMM_WORLD or on a communicator
    of some of the ranks; the job ends when the client code does"""
    pytest.importorskip("dask_mpi")
    script = os.path.join(os.path.dirname(__file__), "mpi_dask_mpi_script.py")
    out = run_mpiexec(["-n", str(ranks), sys.executable, script, *args], timeout=100)
    assert "dask-mpi result ok" in out
    assert ("outside the cluster" in out) == bool(args)


def test_dask_mpi_command(tmp_path):
    """``mpiexec -n 4 dask-mpi --protocol mpi``: its workers have nannies,
    whose worker processes are not MPI ranks; a client from elsewhere"""
    pytest.importorskip("dask_mpi")
    scheduler_file = str(tmp_path / "scheduler.json")
    dask_mpi = ["-m", "dask_mpi.cli", "--protocol", "mpi"]
    dask_mpi += ["--scheduler-file", scheduler_file, "--no-dashboard"]
    with mpiexec(["-n", "4", *dask_mpi, "--nthreads", "1"]) as job:
        wait_for_file(scheduler_file, job)
        use_nanny_workers_and_shut_down(job, scheduler_file, 3)


@pytest.mark.parametrize("start", ["LocalCluster", "Client"])
def test_local_cluster(start):
    """No mpiexec: worker processes spawned by the cluster (through nannies);
    the cluster scales up and down"""
    kwargs = dict(protocol="mpi", n_workers=2, threads_per_worker=1)
    kwargs.update(dashboard_address=":0")
    with contextlib.ExitStack() as stack:
        if start == "LocalCluster":
            cluster = stack.enter_context(LocalCluster(**kwargs))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(**kwargs))
            cluster = client.cluster
        assert client.scheduler.address.startswith("mpi://")
        client.wait_for_workers(2, timeout=60)
        assert_moves_data(client)
        # A nanny's MALLOC_TRIM_THRESHOLD_ has glibc map each buffer from
        # 128 KiB: its worker reads such frames into recycled memory
        thresholds = client.run(lambda: mpi_buffers.GLIBC_MMAP_THRESHOLD)
        assert set(thresholds.values()) == {128 * 2**10}

        cluster.scale(3)
        client.wait_for_workers(3, timeout=60)
        pids = set(client.run(os.getpid).values())
        assert len(pids) == 3
        processes = [psutil.Process(pid) for pid in pids]
        assert_moves_data(client)
        cluster.scale(1)
        wait_for_worker_count(client, 1, "workers not retired")
        assert client.submit(sum, [1, 2]).result() == 3
    assert_gone(processes)


def test_killed_worker_does_not_take_the_cluster_down(tmp_path):
    """Each worker is a job of its own: SIGKILL one while data moves; its
    tasks are recomputed elsewhere and the result is right"""
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler, worker = scheduler_and_workers(scheduler_file)
    logs = [tmp_path / f"survivor-{i}.log" for i in range(2)]
    with contextlib.ExitStack() as stack:
        sched = stack.enter_context(mpiexec(["-n", "1", *scheduler]))
        victim = stack.enter_context(mpiexec(["-n", "1", *worker]))
        for log in logs:
            out = stack.enter_context(open(log, "w"))
            stack.enter_context(
                mpiexec(["-n", "1", *worker], stdout=out, stderr=subprocess.STDOUT)
            )
        wait_for_file(scheduler_file, sched)
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            future, expected = compute_while_large_frames_move(client)
            victim.crash()
            assert np.isclose(future.result(timeout=60), expected)
            survivors = len(client.scheduler_info()["workers"])
            assert sched.poll() is None
    if survivors < 2:
        crashes = {known_mpi_crash(log.read_text()) for log in logs}
        crashes.discard(None)
        if crashes:
            pytest.xfail(
                "Known MPICH/UCX limit (docs/mpi-design.rst): " + "; ".join(crashes)
            )
    assert survivors == 2


def test_killed_worker_process_in_one_job(tmp_path):
    """In one mpiexec job a rank that dies ends the job, but a nanny's worker
    process is no rank: SIGKILL one while data moves; the nanny starts a new
    one, its tasks are recomputed and the result is right"""
    with one_job_with_nannies(tmp_path, 3) as (job, scheduler_file):
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            victim = next(iter(client.run(os.getpid).values()))
            future, expected = compute_while_large_frames_move(client)
            os.kill(victim, signal.SIGKILL)
            assert np.isclose(future.result(timeout=60), expected)
            client.wait_for_workers(3, timeout=60)
            assert victim not in client.run(os.getpid).values()
            assert job.poll() is None


def test_scheduler_on_mpi_and_tcp(tmp_path):
    """Workers on mpi://, a client from outside the MPI job on tcp://"""
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler, worker = scheduler_and_workers(scheduler_file)
    scheduler[scheduler.index("--protocol") + 1] = "mpi,tcp"
    scheduler[scheduler.index("--port") + 1] = f"{open_port()},{(tcp := open_port())}"
    with mpiexec(["-n", "1", *scheduler, ":", "-n", "2", *worker]) as job:
        host = get_address_host(scheduler_address(scheduler_file, job))
        with Client(f"tcp://{host}:{tcp}", timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            assert all(
                a.startswith("mpi://") for a in client.scheduler_info()["workers"]
            )
            assert_moves_data(client)
            client.shutdown()
        assert job.wait(60) == 0


def test_workers_join_and_leave(tmp_path):
    """Workers started later by other mpiexec commands are used; one that
    stops is forgotten; no restart of the scheduler"""
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler, worker = scheduler_and_workers(scheduler_file)
    with mpiexec(["-n", "1", *scheduler]) as sched, mpiexec(["-n", "1", *worker]):
        wait_for_file(scheduler_file, sched)
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            assert client.submit(sum, [1, 2]).result() == 3
            with mpiexec(["-n", "2", *worker]) as later:
                client.wait_for_workers(3, timeout=60)
                # A lambda travels by value: workers cannot import this module
                pid_after = lambda s: (time.sleep(s), os.getpid())[1]  # noqa: E731
                futures = client.map(pid_after, [0.05] * 60, pure=False)
                pids = set(client.gather(futures))
                assert len(pids) == 3, "the new workers were not used"
                later.terminate()  # SIGTERM: workers close and unregister
                assert later.wait(60) is not None
            wait_for_worker_count(client, 1, "departed workers not forgotten")
            assert client.submit(sum, [3, 4]).result() == 7


@pytest.mark.parametrize("worker_class", ["Nanny", "Worker"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@gen_test(timeout=60)
async def test_signalled_worker_exits_quietly(worker_class, sig):
    """Nothing on stdout, where UCX prints: peers' last messages to a worker
    that closes its comms arrive while it exits, and MPI_Finalize used to
    warn about each one it had not received"""
    spec = {"cls": f"distributed.{worker_class}", "opts": {"nthreads": 1}}
    async with Scheduler(protocol="mpi", port=0, dashboard_address=":0") as s:
        spec["opts"]["scheduler_ip"] = s.address
        async with Client(s.address, asynchronous=True) as c:
            worker = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "dask", "spec", "--spec", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            try:
                await c.wait_for_workers(1)
                worker.send_signal(sig)
                stdout, stderr = await asyncio.wait_for(worker.communicate(), 30)
            finally:
                if worker.returncode is None:
                    worker.kill()
                await worker.wait()
    assert worker.returncode == 0, stderr.decode()
    assert stdout == b""


@gen_test(timeout=120)
async def test_scheduler_exchanging_only_control_messages_holds_no_channel():
    """Workers move data between them; the scheduler and the client,
    which only exchange small messages with them, open no MPI channel, so
    MPICH's per-connection memory and its limit of jobs do not apply to them"""
    worker = ["-m", "distributed.cli.dask_worker", "--no-nanny", "--nthreads", "1"]
    async with Scheduler(protocol="mpi", port=0, dashboard_address=":0") as s:
        with mpiexec(["-n", "2", *worker, "--no-dashboard", s.address]):
            async with Client(s.address, asynchronous=True) as c:
                await c.wait_for_workers(2)
                a, b = s.workers
                for i in range(5):
                    x = c.submit(np.full, 2**20, i, workers=[a], pure=False)
                    y = c.submit(np.sum, x, workers=[b])
                    assert await y == i * 2**20
                moved = await c.run(moved_off_the_socket)
                assert moved[a] > 0 and moved[b] > 0
                assert mpi_channel.channels.to_others() == []
                await c.shutdown()
