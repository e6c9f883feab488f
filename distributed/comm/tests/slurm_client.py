"""The client of the Slurm tests, run on the cluster's login node (with
simulated hosts, the test process is on none of their networks)::

    python -m distributed.comm.tests.slurm_client SCHEDULER_FILE NWORKERS
    python -m distributed.comm.tests.slurm_client jobqueue NJOBS [scancel]

The first connects to a running cluster; ``jobqueue`` starts one with
dask-jobqueue's ``SLURMCluster(protocol="mpi")``, scales it to NJOBS jobs,
and, with ``scancel``, cancels one worker's job while data moves.  Both move
16 MiB arrays between every two workers and print ``REPORT <json>``: whether
the results were right, and what each worker says of itself.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import numpy as np

from distributed import Client, wait
from distributed.comm.tests.mpi_hosts_client import SIZE, about, wait_for_channels


def move_between_all(client: Client) -> tuple[bool, list[str]]:
    """Move an array from every worker to every other, twice (the first
    round opens MPI channels: its arrays go over TCP while they open, and
    the second waits for them): whether the results were right, and what
    the scheduler says of those not done after 60 s (a worker restarted
    meanwhile never runs the tasks pinned to it)"""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    pairs = list(itertools.permutations(workers, 2))
    right = True
    deadline = time.monotonic() + 60
    for _ in range(2):
        futures = []
        for i, (a, b) in enumerate(pairs):
            x = client.submit(np.full, SIZE, i, workers=[a], pure=False)
            futures.append(
                client.submit(np.sum, x, workers=[b], allow_other_workers=False)
            )
        try:
            wait(futures, timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            missing = [f.key for f in futures if not f.done()]
            return False, client.run_on_scheduler(_tasks, keys=missing)
        right &= client.gather(futures) == [i * SIZE for i in range(len(pairs))]
        wait_for_channels(client)
    return bool(right), []


def report(client: Client, **extra) -> dict:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {
        **extra,
        "workers": {
            address: {**info, "host": workers[address]["host"]}
            for address, info in client.run(about).items()
        },
    }


def squeue() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
    return out.stdout.split()


def scancel_while_moving(client: Client, job_id: str) -> dict:
    """Move many arrays between workers, cancel a worker's job meanwhile;
    what became of the results, and whether the cluster goes on"""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    pairs = list(itertools.permutations(workers, 2)) * 4
    futures = []
    for i, (a, b) in enumerate(pairs):
        # Tasks meant for the cancelled worker run elsewhere
        where = {"allow_other_workers": True}
        x = client.submit(np.full, SIZE, i, workers=[a], pure=False, **where)
        futures.append(client.submit(np.sum, x, workers=[b], **where))
    wait(futures[:2])
    subprocess.run(["scancel", job_id], check=True)
    # A result held by the cancelled worker is lost, then computed again
    right, wrong, errors, stuck = 0, [], [], []
    deadline = time.monotonic() + 60  # within the test's own timeout
    for i, future in enumerate(futures):
        try:
            result = future.result(timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            stuck.append(future.key)
            continue
        except Exception as e:
            errors.append(repr(e))
            continue
        if result == i * SIZE:
            right += 1
        else:  # what came instead says where it went wrong
            wrong.append({"i": i, "got": int(result), "pair": pairs[i]})
    out = {
        "results": len(futures),
        "right_after_scancel": right,
        "wrong": wrong,
        "errors": errors,
        # What the scheduler says of the results not done after 60 s
        "stuck_after_scancel": stuck and client.run_on_scheduler(_tasks, keys=stuck),
    }
    if not stuck:
        x = client.submit(np.full, SIZE, 1.0, pure=False)
        out["after"] = bool(client.submit(np.sum, x).result(timeout=30) == SIZE)
    return out


def _tasks(dask_scheduler, keys: list) -> list[str]:
    """Where the scheduler has the tasks of ``keys`` and their inputs"""
    out = []
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            out.append(f"{key}: unknown")
            continue
        for t in [ts, *ts.dependencies]:
            where = t.processing_on or sorted(w.address for w in t.who_has or ())
            out.append(f"{t.key}: {t.state} {where}")
    return out


def jobqueue(njobs: int, cancel: bool) -> dict:
    from dask_jobqueue import SLURMCluster

    cluster = SLURMCluster(
        protocol="mpi",
        cores=1,
        processes=1,
        memory="1GB",
        queue="debug",
        walltime="00:10:00",
        scheduler_options={"dashboard_address": None, "port": 0},
        worker_extra_args=["--no-dashboard"],
    )
    with cluster, Client(cluster, timeout=60) as client:
        cluster.scale(jobs=njobs)
        client.wait_for_workers(njobs, timeout=120)
        jobs = sorted(squeue())
        right, stuck = move_between_all(client)
        out = report(client, right=right, stuck=stuck, jobs=jobs)
        if cancel and not stuck:
            victim = sorted(cluster.workers)[0]
            others = {
                address
                for address, worker in client.scheduler_info()["workers"].items()
                if worker["name"] != victim
            }
            out.update(scancel_while_moving(client, cluster.workers[victim].job_id))
            # The other workers, still the same processes (a worker restarted
            # by its nanny comes back at a new address); the scheduler may
            # take a moment to hear from one again
            deadline = time.monotonic() + 10
            while (
                not others <= set(client.scheduler_info()["workers"])
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            out["survivors"] = len(others & set(client.scheduler_info()["workers"]))
        cluster.scale(0)
        deadline = time.monotonic() + 60
        while squeue() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["left_after_scale_down"] = squeue()
    return out


def main(args: list[str]) -> None:
    if args[0] == "jobqueue":
        out = jobqueue(int(args[1]), args[2:3] == ["scancel"])
    else:
        with Client(scheduler_file=args[0], timeout=60) as client:
            client.wait_for_workers(int(args[1]), timeout=120)
            right, stuck = move_between_all(client)
            out = report(client, right=right, stuck=stuck)
            client.shutdown()
    print("REPORT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
