"""Application benchmarks per protocol: transpose-sum, dataframe merge, matrix dot.

    python benchmarks/apps.py [--quick] [--workers 2] [--out benchmarks/results]

CPU versions of dask-cuda's ``local_cupy_transpose_sum`` and
``local_cudf_merge``, and a matrix product, on a cluster of N workers (each
worker and the scheduler in its own process: ``mpiexec -n 1`` for mpi://).
Reports the median wall time, the bytes moved between workers and the
throughput for each protocol. Writes ``apps.json`` and ``apps.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from processes import cluster

from distributed import Client


def transpose_sum(n: int, chunk: int):
    import dask.array as da

    x = da.random.random((n, n), chunks=chunk)
    return (x + x.T).sum()


def dot(n: int, chunk: int):
    import dask.array as da

    a = da.random.random((n, n), chunks=chunk)
    b = da.random.random((n, n), chunks=chunk)
    return a.dot(b).sum()


def _partition(seed: int, rows: int, name: str):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame({"key": rng.integers(0, rows, rows), name: rng.random(rows)})


def merge(rows: int, partitions: int):
    import dask.dataframe as dd

    def frame(name, seed):
        part_rows = rows // partitions
        seeds = range(seed, seed + partitions)
        return dd.from_map(_partition, seeds, rows=part_rows, name=name)

    joined = dd.merge(frame("x", 0), frame("y", 1000), on="key", shuffle_method="tasks")
    return joined["x"].sum()


def benchmarks(quick: bool) -> dict:
    if quick:
        return {
            "transpose_sum": (transpose_sum, 4000, 500),
            "dot": (dot, 2000, 500),
            "merge": (merge, 1_000_000, 8),
        }
    return {
        "transpose_sum": (transpose_sum, 10000, 1000),
        "dot": (dot, 4000, 1000),
        "merge": (merge, 5_000_000, 16),
    }


def transferred(client: Client) -> tuple[int, int]:
    """Bytes and transfers that workers have sent to other workers so far
    (counters, unlike the incoming log, which keeps its last 1000 entries)"""

    def total(dask_worker):
        return (
            dask_worker.transfer_outgoing_bytes_total,
            dask_worker.transfer_outgoing_count_total,
        )

    totals = client.run(total).values()
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def cpu_seconds(client: Client) -> float:
    """CPU time used so far by the scheduler and the workers"""

    def used():
        import psutil

        times = psutil.Process().cpu_times()
        return times.user + times.system

    return sum(client.run(used).values()) + client.run_on_scheduler(used)


def run_protocol(
    protocol: str,
    workers: int,
    quick: bool,
    repeat: int,
    suite: dict | None = None,
    warm_up: bool = False,
    timeout: float | None = None,
    done=None,
) -> dict:
    """Median figures of each of ``suite`` (default: :func:`benchmarks`).  A
    workload that fails, or takes over ``timeout`` seconds, is recorded as
    ``{"error": ...}`` and the next one runs; ``done(results)`` is called
    after each workload"""
    results = {}
    with cluster(protocol, workers, "--memory-limit", "0") as (sched_file, _):
        with Client(scheduler_file=sched_file, timeout=60) as client:
            client.wait_for_workers(workers, timeout=60)
            for name, (make, *args) in (suite or benchmarks(quick)).items():
                try:
                    results[name] = measure(
                        client, make, args, repeat, warm_up, timeout
                    )
                except Exception as e:
                    results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                if done:
                    done(results)
    return results


def measure(client: Client, make, args, repeat: int, warm_up: bool, timeout) -> dict:
    """Figures of ``make(*args)``, a new graph each time (the same keys could
    be found still in memory)"""
    times, moved, count, cpu = [], [], [], []
    for i in range(repeat + warm_up):
        graph = make(*args)
        before, cpu_before = transferred(client), cpu_seconds(client)
        start = time.perf_counter()
        client.compute(graph).result(timeout=timeout)
        client.cancel(graph)
        if i < warm_up:
            continue
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds(client) - cpu_before)
        after = transferred(client)
        moved.append(after[0] - before[0])
        count.append(after[1] - before[1])
    wall = statistics.median(times)
    nbytes = statistics.median(moved)
    return {
        "wall_time": wall,
        "times": times,
        "cpu_seconds": statistics.median(cpu),
        "transfers": statistics.median(count),
        "bytes_moved": nbytes,
        "throughput": nbytes / wall,
    }


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    protocols = list(results["protocols"])
    names = list(results["protocols"][protocols[0]])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(protocols)
    for i, p in enumerate(protocols):
        walls = [results["protocols"][p][n].get("wall_time", 0) for n in names]
        ax.bar([j + i * width for j in range(len(names))], walls, width, label=p)
    ax.set_xticks(
        [j + width * (len(protocols) - 1) / 2 for j in range(len(names))], names
    )
    ax.set_ylabel("wall time (s, median)")
    ax.set_title(f"{results['workers']} workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "apps.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results")
    )
    args = parser.parse_args()
    repeat = args.repeat or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    results = {"workers": args.workers, "quick": args.quick, "protocols": {}}
    for protocol in ["tcp", "mpi"]:
        print(f"{protocol}://", file=sys.stderr)
        results["protocols"][f"{protocol}://"] = run_protocol(
            protocol, args.workers, args.quick, repeat
        )
    with open(os.path.join(args.out, "apps.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    tcp, mpi = results["protocols"]["tcp://"], results["protocols"]["mpi://"]
    for name in tcp:
        if "error" in tcp[name] or "error" in mpi[name]:
            print(f"{name:15s} tcp {tcp[name]}  mpi {mpi[name]}")
            continue
        print(
            f"{name:15s} tcp {tcp[name]['wall_time']:7.2f}s  mpi {mpi[name]['wall_time']:7.2f}s"
            f"  mpi/tcp {mpi[name]['wall_time'] / tcp[name]['wall_time']:.2f}"
            f"  CPU s tcp {tcp[name]['cpu_seconds']:.2f} mpi {mpi[name]['cpu_seconds']:.2f}"
            f"  moved {mpi[name]['bytes_moved'] / 2**20:.0f} MiB in {mpi[name]['transfers']:.0f} transfers"
        )


if __name__ == "__main__":
    main()
