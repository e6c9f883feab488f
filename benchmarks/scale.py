"""One scheduler and many workers: tasks per second and the scheduler's CPU.

    python benchmarks/scale.py [--quick] [--workers 200] [--rounds 2]
                               [--out benchmarks/results]

A scheduler process (``dask scheduler --protocol P``), ``--workers`` workers of
one thread each, spread over four processes (many ``Worker`` objects on one
event loop: 200 worker processes would not fit on a small machine), and a
client in this process. It measures, for tcp:// and mpi://, alternating over
``--rounds`` rounds (2), with a 95 % bootstrap interval of each mpi/tcp:

- idle: CPU seconds used by the scheduler and by the worker processes in 10 s
  with every worker connected and nothing to do;
- tiny tasks: ``client.map`` of ``--tasks`` no-op tasks, gathered; tasks per
  second and the scheduler's CPU seconds.

Writes ``scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import psutil

import processes
from stats import ratio_interval

HERE = os.path.abspath(__file__)
PROCESSES = 4


async def run_workers(address: str, n: int) -> None:
    from distributed import Worker

    workers = [
        Worker(address, nthreads=1, dashboard=False, silence_logs=40) for _ in range(n)
    ]
    await asyncio.gather(*workers)  # start them all
    await asyncio.Event().wait()  # until killed


def cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(protocol: str, n_workers: int, n_tasks: int) -> dict:
    from distributed import Client

    with tempfile.TemporaryDirectory() as tmp:
        scheduler_file = os.path.join(tmp, "scheduler.json")
        scheduler_argv = ["-m", "distributed.cli.dask_scheduler", "--protocol"]
        scheduler_argv += [protocol, "--port", "0", "--no-dashboard"]
        scheduler_argv += ["--scheduler-file", scheduler_file]
        log = open(os.path.join(tmp, "log"), "w")
        # Each process in a session of its own, as mpiexec starts its job:
        # Linux's autogroup shares the CPU between sessions, and a scheduler
        # alone in its session got 15 % more CPU than one sharing the
        # benchmark's (for mpi://, a job of its own, as dask-jobqueue's)
        procs = [
            processes.launch(
                scheduler_argv, mpi=protocol == "mpi", stdout=log, stderr=log
            )
        ]
        try:
            while not os.path.exists(scheduler_file):
                time.sleep(0.1)
            with open(scheduler_file) as f:
                address = json.load(f)["address"]
            per_process = n_workers // PROCESSES
            for _ in range(PROCESSES):
                argv = [HERE, "workers", address, str(per_process)]
                procs.append(processes.launch(argv, False, stdout=log, stderr=log))
            with Client(address, timeout=120) as client:
                client.wait_for_workers(per_process * PROCESSES, timeout=300)
                root = psutil.Process(procs[0].pid)
                python = os.path.realpath(sys.executable)
                (scheduler,) = [  # not mpiexec, nor Hydra's proxy
                    p
                    for p in [root, *root.children(recursive=True)]
                    if p.exe() == python
                ]
                workers = [psutil.Process(p.pid) for p in procs[1:]]
                time.sleep(2)  # settle after registering
                s0, w0 = cpu(scheduler), sum(map(cpu, workers))
                time.sleep(10)
                idle = {
                    "scheduler_cpu_s": cpu(scheduler) - s0,
                    "workers_cpu_s": sum(map(cpu, workers)) - w0,
                }
                client.gather(client.map(int, range(200), pure=False))  # warm up
                s0, start = cpu(scheduler), time.perf_counter()
                futures = client.map(int, range(n_tasks), pure=False)
                client.gather(futures)
                elapsed = time.perf_counter() - start
                tasks = {
                    "tasks_per_s": n_tasks / elapsed,
                    "scheduler_cpu_s": cpu(scheduler) - s0,
                }
                del futures
                client.shutdown()
        finally:
            for proc in procs:
                processes.stop(proc)
            log.close()
    return {"idle_10s": idle, "tiny_tasks": tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    n_workers = args.workers or (40 if args.quick else 200)
    n_tasks = 2000 if args.quick else 10000
    import pingpong

    rounds = {"tcp": [], "mpi": []}
    for i in range(args.rounds):
        for protocol in ["tcp", "mpi"][:: 1 if i % 2 == 0 else -1]:
            print(f"{protocol}:// with {n_workers} workers", flush=True)
            rounds[protocol].append(measure(protocol, n_workers, n_tasks))

    # Each figure of the summary: where a round holds it
    parts = {
        "tasks_per_s": ("tiny_tasks", "tasks_per_s"),
        "scheduler_cpu_s": ("tiny_tasks", "scheduler_cpu_s"),
        "idle_scheduler_cpu_s": ("idle_10s", "scheduler_cpu_s"),
        "idle_workers_cpu_s": ("idle_10s", "workers_cpu_s"),
    }

    def series(protocol, part, key):
        return [r[part][key] for r in rounds[protocol]]

    summary = {
        f"{p}://": {
            name: statistics.median(series(p, *part)) for name, part in parts.items()
        }
        for p in rounds
    }
    intervals = {
        name: ratio_interval(series("mpi", *part), series("tcp", *part))
        for name, part in parts.items()
    }
    results = {
        "machine": pingpong.versions(),
        "quick": args.quick,
        "workers": n_workers,
        "tasks": n_tasks,
        "rounds": rounds,
        "summary": summary,
        "intervals": intervals,  # of mpi/tcp
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump(results, f, indent=1)
    tcp, mpi = summary["tcp://"], summary["mpi://"]
    print(
        f"{n_workers} workers, {n_tasks} tiny tasks (medians of {args.rounds} rounds)"
    )
    print(f"{'':28}{'tcp://':>10}{'mpi://':>10}{'mpi/tcp':>9}  95 % interval")
    for key in tcp:
        low, high = intervals[key]
        print(
            f"{key:28}{tcp[key]:10.2f}{mpi[key]:10.2f}{mpi[key] / tcp[key]:9.2f}"
            f"  {low:.2f}-{high:.2f}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["workers"]:
        asyncio.run(run_workers(sys.argv[2], int(sys.argv[3])))
    else:
        main()
