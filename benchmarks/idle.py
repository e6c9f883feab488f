"""Idle cost: CPU used by a scheduler and two workers sitting idle with open comms.

    python benchmarks/idle.py [--quick] [--seconds 20] [--rounds 3]
                              [--out benchmarks/results]

For each protocol, starts a scheduler and two workers (each in its own
``mpiexec -n 1`` for mpi://, plain processes for tcp://), connects a client,
runs one small computation so that all comms are open, then measures the CPU
seconds (user + system) the three processes use over the idle period.
``--rounds`` rounds, tcp:// and mpi:// alternating (one cluster differs from
the next by 5-45 %); the figures are the medians, with a 95 % bootstrap
interval of mpi/tcp. Writes ``idle.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psutil

from processes import cluster
from stats import ratio_interval

from distributed import Client


def python_processes(job: subprocess.Popen) -> list[psutil.Process]:
    """By executable, not by name: setproctitle renames dask's processes"""
    root = psutil.Process(job.pid)
    procs = [root, *root.children(recursive=True)]
    python = os.path.realpath(sys.executable)
    return [p for p in procs if p.exe() == python]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def measure(protocol: str, seconds: float) -> dict:
    with cluster(protocol, 2) as (sched_file, jobs):
        with Client(scheduler_file=sched_file, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            assert client.submit(sum, [1, 2]).result() == 3
            procs = [p for job in jobs for p in python_processes(job)]
            time.sleep(2)  # let start-up settle
            before = cpu_seconds(procs)
            time.sleep(seconds)
            used = cpu_seconds(procs) - before
    return {
        "cpu_seconds": used,
        "seconds": seconds,
        "processes": len(procs),
        "cpu_percent_per_process": 100 * used / seconds / len(procs),
    }


def median(runs: list[dict]) -> float:
    return statistics.median(r["cpu_seconds"] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results")
    )
    args = parser.parse_args()
    seconds = args.seconds or (5 if args.quick else 20)
    os.makedirs(args.out, exist_ok=True)
    rounds = {"tcp": [], "mpi": []}
    for i in range(args.rounds or (1 if args.quick else 3)):
        for protocol in ["tcp", "mpi"] if i % 2 == 0 else ["mpi", "tcp"]:
            rounds[protocol].append(measure(protocol, seconds))
    results = {
        protocol: {
            **min(runs, key=lambda r: abs(r["cpu_seconds"] - median(runs))),
            "rounds": [r["cpu_seconds"] for r in runs],
        }
        for protocol, runs in rounds.items()
    }
    results["mpi"]["mpi/tcp 95%"] = ratio_interval(
        results["mpi"]["rounds"], results["tcp"]["rounds"]
    )
    with open(os.path.join(args.out, "idle.json"), "w") as f:
        json.dump(results, f, indent=1)
    for protocol, r in results.items():
        print(
            f"{protocol}://: {r['cpu_seconds']:.3f} CPU s in {seconds:g} s "
            f"({r['cpu_percent_per_process']:.2f} % of a core per process)"
        )
    low, high = results["mpi"]["mpi/tcp 95%"]
    tcp, mpi = results["tcp"]["cpu_seconds"], results["mpi"]["cpu_seconds"]
    print(f"mpi/tcp {mpi / tcp:.2f} (95 % interval {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
