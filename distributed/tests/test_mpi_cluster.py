"""A whole cluster on protocol="mpi", this test process as the client: the
scheduler and the workers started by separate ``mpiexec`` commands, or as
ranks of one ``mpiexec`` job."""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")
da = pytest.importorskip("dask.array")

from distributed import Client
from distributed.comm.tests.mpi_processes import mpiexec, run_mpiexec, wait_for_file

pytestmark = pytest.mark.timeout(120)


def scheduler_and_workers(scheduler_file: str) -> tuple[list[str], list[str]]:
    scheduler = ["-m", "distributed.cli.dask_scheduler", "--protocol", "mpi"]
    scheduler += ["--port", "0", "--scheduler-file", scheduler_file, "--no-dashboard"]
    worker = ["-m", "distributed.cli.dask_worker", "--scheduler-file", scheduler_file]
    worker += ["--no-nanny", "--nthreads", "1", "--no-dashboard"]
    return scheduler, worker


def test_one_mpiexec_job(tmp_path):
    """The README's example: scheduler and workers are ranks of one job, and
    MPI_Init in each waits for all of them"""
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler, worker = scheduler_and_workers(scheduler_file)
    with mpiexec(["-n", "1", *scheduler, ":", "-n", "2", *worker]) as job:
        wait_for_file(scheduler_file, job)
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            x = da.random.RandomState(0).random((1000, 1000), chunks=(250, 250))
            expected = (x + x.T).sum().compute(scheduler="sync")
            assert np.isclose(client.compute((x + x.T).sum()).result(), expected)
            client.shutdown()
        assert job.wait(60) == 0


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

            x = da.random.RandomState(42).random((2000, 2000), chunks=(500, 500))
            expected = (x + x.T).sum().compute(scheduler="sync")
            assert np.isclose(client.compute((x + x.T).sum()).result(), expected)
            expected = x.dot(x.T)[:10, :10].compute(scheduler="sync")
            got = client.compute(x.dot(x.T)[:10, :10]).result()
            np.testing.assert_allclose(got, expected)

            incoming = client.run(
                lambda dask_worker: dask_worker.state.transfer_incoming_count_total
            )
            assert sum(incoming.values()) > 0, "no data moved between workers"

            client.shutdown()
            assert workers.wait(60) == 0
        assert scheduler.wait(60) == 0


def test_dask_mpi_script():
    pytest.importorskip("dask_mpi")
    script = os.path.join(os.path.dirname(__file__), "mpi_dask_mpi_script.py")
    out = run_mpiexec(["-n", "4", sys.executable, script], timeout=100)
    assert "dask-mpi result ok" in out


def test_killed_worker_does_not_take_the_cluster_down(tmp_path):
    """Each worker is a job of its own: SIGKILL one while data moves; its
    tasks are recomputed elsewhere and the result is right"""
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler, worker = scheduler_and_workers(scheduler_file)
    with (
        mpiexec(["-n", "1", *scheduler]) as sched,
        mpiexec(["-n", "1", *worker]) as victim,
        mpiexec(["-n", "1", *worker]),
        mpiexec(["-n", "1", *worker]),
    ):
        wait_for_file(scheduler_file, sched)
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            x = da.random.RandomState(3).random((3000, 3000), chunks=(300, 300))
            graph = (x + x.T).sum()
            expected = graph.compute(scheduler="sync")
            future = client.compute(graph)
            while client.run(
                lambda dask_worker: dask_worker.state.transfer_incoming_count_total
            ) == dict.fromkeys(client.scheduler_info()["workers"], 0):
                pass  # until data moves between workers
            victim.kill_all()
            assert np.isclose(future.result(timeout=60), expected)
            assert len(client.scheduler_info()["workers"]) == 2


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
                pid_after = lambda seconds: (time.sleep(seconds), os.getpid())[1]  # noqa: E731
                futures = client.map(pid_after, [0.05] * 60, pure=False)
                pids = set(client.gather(futures))
                assert len(pids) == 3, "the new workers were not used"
                later.terminate()  # SIGTERM: workers close and unregister
                assert later.wait(60) is not None
            deadline = time.monotonic() + 60
            while len(client.scheduler_info()["workers"]) != 1:
                assert time.monotonic() < deadline, "departed workers not forgotten"
                time.sleep(0.1)
            assert client.submit(sum, [3, 4]).result() == 7
