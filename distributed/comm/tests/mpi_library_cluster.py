"""A cluster on mpi:// started one way, with the MPI library of the Python
that runs this: ``python -m distributed.comm.tests.mpi_library_cluster WAY DIR``.

Every frame that leaves a worker takes MPI where the library allows it
(``local-copy: false``: no copy from the writer's memory).  The ways:

- ``job``: scheduler and two workers ranks of one ``mpiexec`` job
  (``--no-nanny``); ``job-nanny``: the same with nannies, whose worker
  processes are not ranks;
- ``apart``: the scheduler and the workers by two ``mpiexec`` commands;
- ``dask-mpi``: ``mpiexec -n 3 dask-mpi`` with plain workers;
- ``dask-mpi-script``: ``mpiexec -n 4`` of a script that calls dask-mpi's
  ``initialize``, whose rank 1 is the client;
- ``mpi-and-tcp``: as ``job``, the scheduler listening on ``mpi://`` for the
  workers and on ``tcp://`` for the client;
- ``local``: ``LocalCluster(protocol="mpi")``, without ``mpiexec``.

A client in this process (but for ``dask-mpi-script``) computes a graph
whose chunks move between the workers, then shuts the cluster down.  Each
process's output goes to a file in DIR; the last line printed is ``REPORT``
and JSON: whether the result was right, the bytes of frames that moved over
MPI, and every exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import dask

LOCAL_COPY = "DASK_DISTRIBUTED__COMM__MPI__LOCAL_COPY"
os.environ[LOCAL_COPY] = "false"
dask.config.refresh()

import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402

from distributed import Client, LocalCluster  # noqa: E402
from distributed.comm import get_address_host  # noqa: E402
from distributed.utils import open_port  # noqa: E402
from distributed.comm.tests.mpi_processes import (  # noqa: E402
    moved_off_the_socket,
    mpiexec,
    scheduler_address,
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


def jobs(way: str, scheduler_file: str, ports: tuple[int, int]) -> list[list[str]]:
    """The mpiexec commands that start the cluster ``way`` (``ports``: of
    ``mpi-and-tcp``'s scheduler)"""
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
    if way == "dask-mpi-script":
        return [["-n", "4", "-m", "distributed.comm.tests.mpi_library_cluster", "rank"]]
    if way == "mpi-and-tcp":
        scheduler = [*scheduler, "--protocol", "mpi,tcp", "--port", "%d,%d" % ports]
        return [["-n", "1", *scheduler, ":", "-n", "2", *worker, "--no-nanny"]]
    raise ValueError(f"no way {way!r}")


def rank() -> None:
    """A rank of ``dask-mpi-script``: dask-mpi's scheduler (rank 0), the
    client (rank 1, which reports) or a worker"""
    from dask_mpi import initialize

    initialize(protocol="mpi", nthreads=1, dashboard=False)
    with Client() as client:
        right, moved = compute(client)
    print("RANK REPORT", json.dumps({"right": right, "moved": moved}), flush=True)


def main(way: str, directory: str) -> dict:
    if way == "local":
        with LocalCluster(
            protocol="mpi", n_workers=2, threads_per_worker=1, dashboard_address=None
        ) as cluster, Client(cluster) as client:
            right, moved = compute(client)
        return {"right": right, "moved": moved, "codes": []}
    scheduler_file = os.path.join(directory, "scheduler.json")
    ports = (open_port(), open_port())
    if way == "dask-mpi-script":
        [args] = jobs(way, scheduler_file, ports)
        log = os.path.join(directory, "job0.log")
        with open(log, "w") as f, mpiexec(args, stdout=f, stderr=f, text=True) as job:
            code = job.wait(120)
        with open(log) as f:
            report = json.loads(f.read().split("RANK REPORT ", 1)[1].splitlines()[0])
        return {**report, "codes": [code]}
    with contextlib.ExitStack() as stack:
        started = []
        for i, args in enumerate(jobs(way, scheduler_file, ports)):
            log = stack.enter_context(open(os.path.join(directory, f"job{i}.log"), "w"))
            started.append(
                stack.enter_context(mpiexec(args, stdout=log, stderr=log, text=True))
            )
            if i == 0:
                address = scheduler_address(scheduler_file, started[0])
        if way == "mpi-and-tcp":  # the client comes over tcp://
            address = f"tcp://{get_address_host(address)}:{ports[1]}"
        with Client(address, timeout=60) as client:
            right, moved = compute(client)
            client.shutdown()
        codes = [job.wait(60) for job in started]
    return {"right": right, "moved": moved, "codes": codes}


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank()
        sys.exit()
    report = main(*sys.argv[1:3])
    print("REPORT", json.dumps(report), flush=True)
