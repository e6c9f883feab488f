"""A cluster on mpi:// started one way, with the MPI library of the Python
that runs this: ``python -m distributed.comm.tests.mpi_library_cluster WAY DIR``.

Every frame that leaves a worker takes MPI where the library allows it
(``local-copy: false``: no copy from the writer's memory).  The ways:

- ``job``: scheduler and two workers ranks of one ``mpiexec`` job
  (``--no-nanny``); ``job-nanny``: the same with nannies, whose worker
  processes are not ranks;
- ``apart``: the scheduler and the workers by two ``mpiexec`` commands;
- ``dask-mpi``: ``mpiexec -n 3 dask-mpi`` with plain workers;
- ``local``: ``LocalCluster(protocol="mpi")``, without ``mpiexec``.

A client in this process computes a graph whose chunks move between the
workers, then shuts the cluster down.  Each process's output goes to a file
in DIR; the last line printed is ``REPORT`` and JSON: whether the result was
right, the bytes of frames that moved over MPI, and every exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import dask

LOCAL_COPY = "DASK_DISTRIBUTED__COMM__MPI__LOCAL_COPY"
os.environ[LOCAL_COPY] = "false"
dask.config.refresh()

import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402

from distributed import Client, LocalCluster  # noqa: E402
from distributed.comm.tests.mpi_processes import (  # noqa: E402
    moved_off_the_socket,
    mpiexec,
    wait_for_file,
)

SCHEDULER = ["-m", "distributed.cli.dask_scheduler", "--protocol", "mpi", "--port"]
SCHEDULER += ["0", "--no-dashboard"]
WORKER = ["-m", "distributed.cli.dask_worker", "--nthreads", "1", "--no-dashboard"]


def compute(client) -> tuple[bool, int]:
    """Whether a graph that moves chunks of 8 MB between workers computed
    right; the bytes of frames that moved over MPI"""
    client.wait_for_workers(2, timeout=60)
    x = da.random.RandomState(7).random((4000, 4000), chunks=(1000, 1000))
    expected = (x + x.T).sum().compute(scheduler="sync")
    right = all(
        np.isclose(client.compute((x + x.T).sum()).result(), expected) for _ in range(3)
    )
    return bool(right), sum(client.run(moved_off_the_socket).values())


def jobs(way: str, directory: str, scheduler_file: str) -> list[list[str]]:
    """The mpiexec commands that start the cluster ``way``"""
    scheduler = [*SCHEDULER, "--scheduler-file", scheduler_file]
    worker = [*WORKER, "--scheduler-file", scheduler_file]
    if way == "job":
        return [["-n", "1", *scheduler, ":", "-n", "2", *worker, "--no-nanny"]]
    if way == "job-nanny":
        return [["-n", "1", *scheduler, ":", "-n", "2", *worker, "--nanny"]]
    if way == "apart":
        return [["-n", "1", *scheduler], ["-n", "2", *worker, "--no-nanny"]]
    if way == "dask-mpi":
        dask_mpi = ["-m", "dask_mpi.cli", "--protocol", "mpi", "--no-dashboard"]
        dask_mpi += ["--scheduler-file", scheduler_file, "--nthreads", "1"]
        return [["-n", "3", *dask_mpi, "--worker-class", "distributed.Worker"]]
    raise ValueError(f"no way {way!r}")


def main(way: str, directory: str) -> dict:
    if way == "local":
        with LocalCluster(
            protocol="mpi", n_workers=2, threads_per_worker=1, dashboard_address=None
        ) as cluster, Client(cluster) as client:
            right, moved = compute(client)
        return {"right": right, "moved": moved, "codes": []}
    scheduler_file = os.path.join(directory, "scheduler.json")
    with contextlib.ExitStack() as stack:
        started = []
        for i, args in enumerate(jobs(way, directory, scheduler_file)):
            log = stack.enter_context(open(os.path.join(directory, f"job{i}.log"), "w"))
            started.append(
                stack.enter_context(mpiexec(args, stdout=log, stderr=log, text=True))
            )
            if i == 0:
                wait_for_file(scheduler_file, started[0])
                time.sleep(0.5)  # the file is written a moment after it exists
        with Client(scheduler_file=scheduler_file, timeout=60) as client:
            right, moved = compute(client)
            client.shutdown()
        codes = [job.wait(60) for job in started]
    return {"right": right, "moved": moved, "codes": codes}


if __name__ == "__main__":
    report = main(*sys.argv[1:3])
    print("REPORT", json.dumps(report), flush=True)
