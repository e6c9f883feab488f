"""A whole cluster on protocol="mpi": scheduler and workers started by
separate ``mpiexec`` commands, this test process as the client."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")
da = pytest.importorskip("dask.array")

from distributed import Client
from distributed.comm.tests.mpi_processes import mpiexec, wait_for_file

pytestmark = pytest.mark.timeout(120)


def test_mpiexec_cluster_moves_data_between_workers(tmp_path):
    scheduler_file = str(tmp_path / "scheduler.json")
    scheduler_args = ["-m", "distributed.cli.dask_scheduler", "--protocol", "mpi"]
    scheduler_args += ["--port", "0"]
    scheduler_args += ["--scheduler-file", scheduler_file, "--no-dashboard"]
    worker_args = ["-m", "distributed.cli.dask_worker", "--scheduler-file"]
    worker_args += [scheduler_file, "--no-nanny", "--nthreads", "1", "--no-dashboard"]

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
