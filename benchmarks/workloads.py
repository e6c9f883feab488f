"""Real Dask workloads on a scheduler and four workers: tcp:// vs mpi://.

    python benchmarks/workloads.py [--quick] [--out benchmarks/results]
        [--rounds 2] [--repeat 5] [--threads 1] [--modes LocalCluster,mpiexec]
        [--only transpose_sum,...] [--control]

Each workload computes while its processes communicate:

- ``control_plane``: 4000 tiny tasks through ``client.map`` and ``gather``
- ``request_response``: 150 tasks submitted one at a time, each awaited
- ``transpose_sum``: ``(x + x.T).sum()`` of a 3000x3000 array, 500x500 chunks
- ``p2p_rechunk``: a 4000x4000 array rechunked from (100, 4000) to
  (4000, 100) chunks with the P2P method, then summed
- ``p2p_shuffle``: a 2-million-row dataframe (16 partitions) shuffled on its
  key with the P2P method, then reduced (a function of every column of every
  partition, so that nothing can be optimised away)
- ``data_heavy``: 16 arrays of 64 MiB made on three workers, then summed by
  the fourth (``client.submit(f, *arrays, workers=[one])``): 1 GiB moved; only
  that step is timed
- ``join``: two dataframes of 1 million rows (8 partitions each) merged on a
  key with the P2P hash join, then reduced
- ``sort``: a dataframe of 2 million rows sorted by a column, then reduced
- ``climatology``: the mean by month of a (days, 100, 100) array chunked by
  30 days (a year of daily fields, four years long): each month's days picked
  from every chunk, as ``xarray``'s ``groupby("time.month")`` does
- ``tree_reduction``: the Gram matrix ``x.T @ x`` of a (40000, 400) array in
  chunks of 2500 rows, partial products summed in a tree
- ``fancy_indexing``: 4000 random rows of a (32000, 500) array taken from
  every chunk, then summed by column

in two launch modes:

- ``LocalCluster``: ``LocalCluster(protocol=P, n_workers=4, processes=True)``,
  each worker in a process of its own under a nanny; the scheduler runs in the
  process of the client, as LocalCluster always has it
- ``mpiexec``: one ``mpiexec`` job of the dask CLI, a scheduler rank and four
  worker ranks without nannies (``--protocol tcp`` for tcp://, also under
  mpiexec); the client is a plain process outside the job

Workers have ``--threads`` threads each (default 1: this benchmark was written
on a 2-core machine, where four workers of one thread and a scheduler already
ask for more than there is), and the default memory limits.

tcp:// and mpi:// alternate: in each round, each mode starts a cluster for
each protocol (tcp first in one round and mpi first in the next, the two modes
in opposite orders) and keeps the two side by side, the one idle while the
other computes. Each cluster runs each workload once to warm up; then the
two take turns, one timed run each, ``--repeat`` pairs (default 5; 1 with
``--quick``, which also makes the sizes smaller: a check that everything works,
not figures), the first of a pair alternating. A workload's mpi/tcp is the
median of the ratios of its pairs over all rounds: two runs next to each other
in time see the same machine, where runs a minute apart differ by up to 10 %
here (the CPU time of a run drifts with its wall time: the machine's speed
changes, not the transport). Also recorded per
workload: bytes moved between workers (data fetched by workers from others,
from their transfer counters, plus the bytes P2P sent through its comms,
including each worker's share to itself), CPU seconds of the scheduler (and
the client, in LocalCluster) and the workers, and on mpi:// the bytes of frames
that went over MPI channels between workers (sent through MPI, or, between
processes of one host, copied from the writer's memory; the others went on the
comms' TCP connections), and the seconds of the workers' transfers of task
data (``transfer_seconds``: fetching a task's inputs, and P2P's sends of
shards, as Dask's own performance metrics count them, summed over the
workers and over transfers at once).

``--control`` runs ``tcp://`` in ``mpi://``'s place as well, the same way: its
ratios show how far two runs of one transport land apart on this machine, the
noise against which the ratios of a real run are read.

Every cluster runs in a child process of its own (``workloads.py serve MODE
PROTOCOL``), which runs a workload when the driver asks and must answer within
a timeout, so that MPI started in one cluster cannot touch another; the whole
process group is killed after each cluster, and processes left over are
reported. The warm-up run of each workload also counts the frames the
workers wrote, by size (``frames``: count and bytes per band of sizes), which
says where a workload's bytes travel; the timed runs do not count them.
Writes ``workloads.json`` (``workloads[mode][name]``: per protocol the median
``seconds``, all ``times``, ``bytes_moved``, ``cpu_seconds``,
``over_mpi_bytes``, ``frames``; ``pairs``, the ratios mpi/tcp of the pairs of runs;
``mpi/tcp``, their median, and ``mpi/tcp 95%``, a bootstrap interval of it;
``runs``: each cluster's own figures, start-up time, mpiexec's exit status,
leftovers) and ``workloads.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from stats import paired_ratio_interval

HERE = os.path.abspath(__file__)
MODES = ["LocalCluster", "mpiexec"]
LABELS = {
    "LocalCluster": "LocalCluster, nanny workers",
    "mpiexec": "one mpiexec job (dask CLI)",
}
WORKERS = 4
NAMES = [
    "control_plane",
    "request_response",
    "transpose_sum",
    "p2p_rechunk",
    "p2p_shuffle",
    "data_heavy",
    "join",
    "sort",
    "climatology",
    "tree_reduction",
    "fancy_indexing",
]
# Frame sizes counted: the lower bound of each band
BANDS = [0, 2**10, 2**16, 2**18, 2**20, 2**22, 2**23, 2**24]


def sizes(quick: bool) -> dict:
    if quick:
        return {
            "control_plane": {"tasks": 1000},
            "request_response": {"tasks": 50},
            "transpose_sum": {"n": 2000, "chunk": 500},
            "p2p_rechunk": {"n": 2000, "strip": 100},
            "p2p_shuffle": {"rows": 500_000, "partitions": 8},
            "data_heavy": {"arrays": 16, "mib": 16},
            "join": {"rows": 250_000, "partitions": 4},
            "sort": {"rows": 500_000, "partitions": 8},
            "climatology": {"years": 1, "side": 50},
            "tree_reduction": {"rows": 10_000, "columns": 200, "chunk": 1000},
            "fancy_indexing": {"rows": 8000, "columns": 250, "take": 1000},
        }
    return {
        "control_plane": {"tasks": 4000},
        "request_response": {"tasks": 150},
        "transpose_sum": {"n": 3000, "chunk": 500},
        "p2p_rechunk": {"n": 4000, "strip": 100},
        "p2p_shuffle": {"rows": 2_000_000, "partitions": 16},
        "data_heavy": {"arrays": 16, "mib": 64},
        "join": {"rows": 1_000_000, "partitions": 8},
        "sort": {"rows": 2_000_000, "partitions": 16},
        "climatology": {"years": 4, "side": 100},
        "tree_reduction": {"rows": 40_000, "columns": 400, "chunk": 2500},
        "fancy_indexing": {"rows": 32_000, "columns": 500, "take": 4000},
    }


# -- the workloads: each returns the seconds of its timed part ---------------


def inc(x):
    return x + 1


def control_plane(client, tasks: int) -> float:
    start = time.perf_counter()
    futures = client.map(inc, range(tasks), pure=False)
    client.gather(futures)
    return time.perf_counter() - start


def request_response(client, tasks: int) -> float:
    start = time.perf_counter()
    for i in range(tasks):
        client.submit(inc, i, pure=False).result()
    return time.perf_counter() - start


def transpose_sum(client, n: int, chunk: int) -> float:
    import dask.array as da

    x = da.random.random((n, n), chunks=chunk)
    start = time.perf_counter()
    client.compute((x + x.T).sum()).result()
    return time.perf_counter() - start


def p2p_rechunk(client, n: int, strip: int) -> float:
    import dask
    import dask.array as da

    with dask.config.set({"array.rechunk.method": "p2p"}):
        x = da.random.random((n, n), chunks=(strip, n))
        y = x.rechunk((n, strip)).sum()
    start = time.perf_counter()
    client.compute(y).result()
    return time.perf_counter() - start


def _partition(seed: int, rows: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "key": rng.integers(0, rows, rows),
            "x": rng.random(rows),
            "y": rng.random(rows),
        }
    )


def _summary(part):
    """Uses every column (the shuffle must move them all) and the partitioning
    (keys unique to a partition: the shuffle cannot be skipped)"""
    import pandas as pd

    return pd.Series([part["key"].nunique() + part["x"].sum() - part["y"].sum()])


def p2p_shuffle(client, rows: int, partitions: int) -> float:
    import random

    import dask
    import dask.dataframe as dd
    import pandas as pd

    seed = random.randrange(2**31)  # new keys every time
    seeds = range(seed, seed + partitions)
    with dask.config.set({"dataframe.shuffle.method": "p2p"}):
        df = dd.from_map(_partition, seeds, rows=rows // partitions)
        result = (
            df.shuffle("key").map_partitions(_summary, meta=pd.Series(dtype="f8")).sum()
        )
    start = time.perf_counter()
    client.compute(result).result()
    return time.perf_counter() - start


def _array(mib: int, value: int):
    import numpy as np

    return np.full(mib * 2**20 // 8, value, dtype="f8")


def _sum_all(*arrays) -> float:
    return float(sum(a.sum() for a in arrays))


def data_heavy(client, arrays: int, mib: int) -> float:
    from distributed import wait

    workers = sorted(client.scheduler_info()["workers"])
    target, others = workers[0], workers[1:]
    futures = [
        client.submit(_array, mib, i, workers=[others[i % len(others)]], pure=False)
        for i in range(arrays)
    ]
    wait(futures)
    start = time.perf_counter()
    total = client.submit(_sum_all, *futures, workers=[target], pure=False).result()
    elapsed = time.perf_counter() - start
    assert total == mib * 2**20 // 8 * sum(range(arrays)), total
    return elapsed


def _keyed(seed: int, rows: int, keys: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame({"key": rng.integers(0, keys, rows), "v": rng.random(rows)})


def join(client, rows: int, partitions: int) -> float:
    import random

    import dask
    import dask.dataframe as dd

    seed = random.randrange(2**31)
    per = rows // partitions
    left = dd.from_map(_keyed, range(seed, seed + partitions), rows=per, keys=rows)
    right = dd.from_map(
        _keyed, range(seed + partitions, seed + 2 * partitions), rows=per, keys=rows
    )
    with dask.config.set({"dataframe.shuffle.method": "p2p"}):
        merged = left.merge(right, on="key", how="inner")
        result = merged["v_x"].sum() + merged["v_y"].sum()
    start = time.perf_counter()
    client.compute(result).result()
    return time.perf_counter() - start


def _first_and_last(part):
    import pandas as pd

    if not len(part):
        return pd.Series([0.0])
    return pd.Series([part["x"].iloc[0] - part["x"].iloc[-1] + part["y"].sum()])


def sort(client, rows: int, partitions: int) -> float:
    import random

    import dask
    import dask.dataframe as dd
    import pandas as pd

    seed = random.randrange(2**31)
    df = dd.from_map(
        _partition, range(seed, seed + partitions), rows=rows // partitions
    )
    with dask.config.set({"dataframe.shuffle.method": "p2p"}):
        ordered = df.sort_values("x")
        result = ordered.map_partitions(
            _first_and_last, meta=pd.Series(dtype="f8")
        ).sum()
    start = time.perf_counter()
    client.compute(result).result()
    return time.perf_counter() - start


def climatology(client, years: int, side: int) -> float:
    import dask.array as da
    import numpy as np

    days = 365 * years
    month = (np.arange(days) % 365) * 12 // 365  # a 365-day calendar
    x = da.random.random((days, side, side), chunks=(30, side, side))
    means = da.stack([x[month == m].mean(axis=0) for m in range(12)])
    start = time.perf_counter()
    client.compute(means.sum()).result()
    return time.perf_counter() - start


def tree_reduction(client, rows: int, columns: int, chunk: int) -> float:
    import dask.array as da

    x = da.random.random((rows, columns), chunks=(chunk, columns))
    gram = da.einsum("ij,ik->jk", x, x, split_every=2)
    start = time.perf_counter()
    client.compute(gram.sum()).result()
    return time.perf_counter() - start


def fancy_indexing(client, rows: int, columns: int, take: int) -> float:
    import dask.array as da
    import numpy as np

    x = da.random.random((rows, columns), chunks=(rows // 8, columns))
    index = np.sort(np.random.default_rng().choice(rows, take, replace=False))
    result = x[index[::-1]].sum(axis=0)  # descending: gathered across chunks
    start = time.perf_counter()
    client.compute(result.sum()).result()
    return time.perf_counter() - start


WORKLOADS = {name: globals()[name] for name in NAMES}


# -- frame sizes, counted on the workers -------------------------------------


def _count_frames(dask_worker=None, start: bool = True):
    """Count the frames this process writes on tcp:// and mpi:// comms, by
    band of size (start), or stop and return the counts"""
    import bisect
    import sys

    modules = [
        sys.modules[name]
        for name in ["distributed.comm.tcp", "distributed.comm.mpi"]
        if name in sys.modules
    ]
    if not start:
        counts = {}
        for module in modules:
            wrapper = module.to_frames
            module.to_frames = getattr(wrapper, "original", wrapper)
            counts = getattr(wrapper, "counts", counts)
        return counts
    counts: dict[int, list[int]] = {}

    def counting(original):
        async def to_frames(*args, **kwargs):
            frames = await original(*args, **kwargs)
            for frame in frames:
                try:
                    size = memoryview(frame).nbytes
                except TypeError:  # a device buffer
                    size = getattr(frame, "nbytes", 0)
                band = BANDS[bisect.bisect_right(BANDS, size) - 1]
                entry = counts.setdefault(band, [0, 0])
                entry[0] += 1
                entry[1] += size
            return frames

        to_frames.original = original
        to_frames.counts = counts
        return to_frames

    for module in modules:
        module.to_frames = counting(module.to_frames)
    return None


def frames_written(client, run) -> dict:
    """Frames the workers wrote while ``run()`` ran: {band: [count, bytes]}"""
    client.run(_count_frames)
    try:
        run()
    finally:
        per_worker = client.run(_count_frames, start=False)
    total: dict[str, list[int]] = {}
    for counts in per_worker.values():
        for band, (n, nbytes) in counts.items():
            entry = total.setdefault(str(band), [0, 0])
            entry[0] += n
            entry[1] += nbytes
    return dict(sorted(total.items(), key=lambda item: int(item[0])))


# -- counters read on the workers --------------------------------------------


def _counters(dask_worker) -> dict:
    """This worker's cumulative counters"""
    p2p = sum(
        v
        for k, v in dask_worker.digests_total.items()
        if isinstance(k, tuple)
        and k[0] == "p2p"
        and "comms" in str(k[2])
        and k[-2:] == ("process", "bytes")
    )
    # Seconds of transfers of task data: fetching a task's inputs, and P2P's
    # sends of shards (Dask's own fine performance metrics)
    transfers = sum(
        v
        for k, v in dask_worker.digests_total.items()
        if isinstance(k, tuple)
        and k[-1] == "seconds"
        and (
            k == ("gather-dep", "network", "seconds")
            or (k[0] == "p2p" and "comms" in str(k[2]) and k[-2] == "send")
        )
    )
    mpi = None  # bytes moved off the comms' sockets: over MPI, or copied
    channel = sys.modules.get("distributed.comm.mpi_channel")  # never imports it
    lending = sys.modules.get("distributed.comm.mpi_lending")
    if channel is not None:
        with contextlib.suppress(Exception):
            mpi = channel.channels.moved() + (lending.Lender.moved if lending else 0)
    return {
        "fetched": dask_worker.transfer_outgoing_bytes_total,
        "p2p": p2p,
        "mpi": mpi,
        "transfers": transfers,
        "cpu": _cpu(),
    }


def _cpu() -> float:
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def counters(client) -> dict:
    per_worker = client.run(_counters).values()
    total = {
        key: (
            sum(c[key] for c in per_worker)
            if all(c[key] is not None for c in per_worker)
            else None
        )
        for key in ["fetched", "p2p", "mpi", "transfers", "cpu"]
    }
    total["cpu"] += client.run_on_scheduler(_cpu)
    if total["mpi"] is not None:
        total["mpi"] /= 2  # each end of a channel counts a frame
    return total


def settle(client, timeout: float = 30) -> None:
    """Until the scheduler holds no task (the last run's are released)"""
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
        if time.monotonic() > deadline:
            raise TimeoutError("the scheduler still holds tasks")
        time.sleep(0.05)


def run_once(client, name: str, params: dict, on_mpi: bool) -> dict:
    """One timed run of a workload, and what it moved and cost"""
    before = counters(client)
    seconds = WORKLOADS[name](client, **params)
    settle(client)
    after = counters(client)
    mpi = None
    if on_mpi and after["mpi"] is not None and before["mpi"] is not None:
        mpi = after["mpi"] - before["mpi"]
    return {
        "seconds": seconds,
        "moved": after["fetched"] - before["fetched"] + after["p2p"] - before["p2p"],
        "p2p": after["p2p"] - before["p2p"],
        "mpi": mpi,
        "transfers": after["transfers"] - before["transfers"],
        "cpu": after["cpu"] - before["cpu"],
    }


def warm_up(client, name: str, params: dict) -> None:
    WORKLOADS[name](client, **params)
    settle(client)


def figures(runs: list[dict]) -> dict:
    """A cluster's figures for one workload, from its timed runs"""
    mpi = [r["mpi"] for r in runs if r["mpi"] is not None]
    return {
        "times": [r["seconds"] for r in runs],
        "bytes_moved": statistics.median(r["moved"] for r in runs),
        "p2p_bytes": statistics.median(r["p2p"] for r in runs),
        "over_mpi_bytes": statistics.median(mpi) if mpi else None,
        "cpu_seconds": statistics.median(r["cpu"] for r in runs),
        "transfer_seconds": statistics.median(r["transfers"] for r in runs),
    }


def measure(client, name: str, params: dict, repeat: int, on_mpi: bool) -> dict:
    """A warm-up and ``repeat`` timed runs of a workload"""
    warm_up(client, name, params)
    return figures([run_once(client, name, params, on_mpi) for _ in range(repeat)])


# -- one cluster, in a child process -----------------------------------------


@contextlib.contextmanager
def local_cluster(protocol: str, threads: int, info: dict):
    from distributed import Client, LocalCluster

    with LocalCluster(
        protocol=protocol,
        n_workers=WORKERS,
        threads_per_worker=threads,
        processes=True,
        dashboard_address=None,
    ) as cluster, Client(cluster) as client:
        client.wait_for_workers(WORKERS, timeout=120)
        yield client


@contextlib.contextmanager
def mpiexec_job(protocol: str, threads: int, info: dict):
    """``mpiexec -n 1 scheduler : -n 4 worker``, in this process's group (the
    driver kills that group); shut down through the client, then whatever is
    left of the job killed. ``info["job_exit"]``: mpiexec's exit status after
    the shutdown (None: it had not ended 30 s later)"""
    import psutil

    from processes import MPIEXEC, remove_leaked_hwloc_files

    from distributed import Client

    with tempfile.TemporaryDirectory() as tmp:
        sched_file = os.path.join(tmp, "scheduler.json")
        python = [sys.executable, "-m"]
        cmd = [MPIEXEC, "-n", "1", *python, "distributed.cli.dask_scheduler"]
        cmd += ["--protocol", protocol, "--port", "0", "--no-dashboard"]
        cmd += ["--scheduler-file", sched_file, ":", "-n", str(WORKERS)]
        cmd += [*python, "distributed.cli.dask_worker", "--scheduler-file", sched_file]
        cmd += ["--no-nanny", "--nthreads", str(threads), "--no-dashboard"]
        log = open(os.path.join(tmp, "job.log"), "w+")
        started = time.time()
        # Not this process's stdin, which mpiexec would forward to rank 0
        job = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(sched_file):
                if job.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no scheduler file; {cmd}")
                time.sleep(0.05)
            with Client(scheduler_file=sched_file, timeout=60) as client:
                client.wait_for_workers(WORKERS, timeout=120)
                yield client
                processes = psutil.Process(job.pid).children(recursive=True)
                client.shutdown()
            try:
                info["job_exit"] = job.wait(30)
            except subprocess.TimeoutExpired:
                print(
                    "mpiexec job did not end after client.shutdown()", file=sys.stderr
                )
            for p in processes:
                with contextlib.suppress(psutil.Error):
                    if p.is_running():
                        print(f"left after shutdown, killed: {p}", file=sys.stderr)
                        p.kill()
        except BaseException:
            log.seek(0)
            sys.stderr.write("mpiexec job's output (tail):\n" + log.read()[-4000:])
            raise
        finally:
            if job.poll() is None:
                ranks = psutil.Process(job.pid).children(recursive=True)
                job.terminate()  # mpiexec ends its ranks, removes its /tmp files
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.wait(5)
                for p in ranks:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                job.kill()
                job.wait()
                remove_leaked_hwloc_files(since=started)  # of its killed proxy
            log.close()


def serve(mode: str, protocol: str, quick: bool, threads: int) -> None:
    """Start a cluster, and run the workloads that the driver names on its
    stdin, one run each, one reply line each"""
    start = time.perf_counter()
    cluster = local_cluster if mode == "LocalCluster" else mpiexec_job
    info = {}
    with cluster(protocol, threads, info) as client:
        addresses = list(client.scheduler_info()["workers"])
        assert all(a.startswith(protocol + "://") for a in addresses), addresses
        reply({"startup_seconds": time.perf_counter() - start})
        for line in sys.stdin:
            ask = json.loads(line)
            if ask["op"] == "stop":
                break
            name, params = ask["name"], sizes(quick)[ask["name"]]
            print(f"  {mode} {protocol}:// {ask['op']} {name}", file=sys.stderr)
            if ask["op"] == "warm_up":
                frames = frames_written(client, lambda: warm_up(client, name, params))
                reply({"frames": frames})
            else:
                reply(run_once(client, name, params, protocol == "mpi"))
    reply(info)


REPLY = "@workloads@ "  # marks the driver's lines among whatever else is printed


def reply(obj: dict) -> None:
    print(REPLY + json.dumps(obj), flush=True)


# -- the driver ---------------------------------------------------------------


def leftovers(pgid: int, grace: float = 10) -> list[str]:
    """Processes still running in the process group or session ``pgid`` after
    ``grace`` seconds (zombies, which only wait for init to reap them, aside)"""
    import psutil

    deadline = time.monotonic() + grace
    while True:
        found = []
        for p in psutil.process_iter(["pid", "name", "status", "cmdline"]):
            with contextlib.suppress(OSError, psutil.Error):
                if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                    continue
                if pgid in (os.getpgid(p.pid), os.getsid(p.pid)):
                    cmd = " ".join(p.info["cmdline"] or [])[:100]
                    found.append(f"{p.pid} {p.info['name']} {cmd}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


class Cluster:
    """A cluster in a child process (``workloads.py serve MODE PROTOCOL``),
    run by the driver one workload run at a time; each reply within
    ``timeout`` seconds.  ``stop()`` returns its figures, and its error if
    it failed."""

    def __init__(self, mode: str, protocol: str, args, timeout: float):
        self.name = f"{mode} {protocol}://"
        self.timeout = timeout
        cmd = [sys.executable, HERE, "serve", mode, protocol]
        cmd += ["--threads", str(args.threads)] + (["--quick"] if args.quick else [])
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            start_new_session=True,
        )
        self._pending = b""
        self.runs: dict[str, list] = {}
        self.frames: dict[str, dict] = {}  # of each workload's warm-up
        self.result = {"workloads": {}}

    def start(self) -> None:
        """Once the cluster is up"""
        self.result.update(self._ask(None))

    def warm_up(self, name: str) -> None:
        self.frames[name] = self._ask({"op": "warm_up", "name": name})["frames"]

    def time(self, name: str) -> None:
        self.runs.setdefault(name, []).append(self._ask({"op": "run", "name": name}))

    def _ask(self, ask: dict | None) -> dict:
        try:
            if ask is not None:
                self.proc.stdin.write(json.dumps(ask).encode() + b"\n")
                self.proc.stdin.flush()
            return self._reply()
        except (OSError, TimeoutError, RuntimeError) as e:
            self._failed(e)
            raise RuntimeError(f"{self.name} failed") from e

    def _reply(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(REPLY):
                    return json.loads(text[len(REPLY) :])
            ready, _, _ = select.select(
                [self.proc.stdout], [], [], max(0, deadline - time.monotonic())
            )
            if not ready:
                raise TimeoutError("timed out")
            data = os.read(self.proc.stdout.fileno(), 2**16)
            if not data:
                raise RuntimeError(f"exit {self.proc.wait()}")
            self._pending += data

    def _failed(self, error: Exception) -> None:
        if "error" in self.result:
            return
        self.result["error"] = str(error.__cause__ or error) or type(error).__name__
        self.err.seek(0)
        log = self.err.read()
        print(
            f"{self.name} FAILED ({self.result['error']}):\n{log[-6000:]}",
            file=sys.stderr,
        )

    def stop(self) -> dict:
        """Shut the cluster down; kill whatever is left of its processes"""
        if "error" not in self.result:
            with contextlib.suppress(RuntimeError):
                self.result.update(self._ask({"op": "stop"}))
        left = leftovers(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.err.close()
        if left:
            print(f"{self.name}: left behind, killed: {left}", file=sys.stderr)
        self.result["left_behind"] = left
        for name, runs in self.runs.items():
            self.result["workloads"][name] = figures(runs)
            self.result["workloads"][name]["frames"] = self.frames.get(name, {})
        return self.result


def one_round(mode: str, order: list[str], args, timeout: float) -> dict:
    """Both clusters of a mode, started one after the other and kept side by
    side; each workload's timed runs alternate between them in pairs, the
    first of a pair taking turns (ABBA), so that the machine's drift
    weighs on both alike"""
    clusters = {}
    try:
        for protocol in order:
            ran = "tcp" if args.control else protocol
            clusters[protocol] = Cluster(mode, ran, args, timeout)
            clusters[protocol].start()
        for name in args.only:
            for protocol in order:
                clusters[protocol].warm_up(name)
            for i in range(args.repeat):
                for protocol in order if i % 2 == 0 else order[::-1]:
                    clusters[protocol].time(name)
    except RuntimeError:
        pass  # the failed cluster said why; the other one stops too
    finally:
        results = {protocol: c.stop() for protocol, c in clusters.items()}
    return results


def summarize(results: dict, names: list[str]) -> None:
    """Medians over the rounds; mpi/tcp, the median of the ratios of the
    pairs of timed runs"""
    for mode, runs in results["runs"].items():
        table = results["workloads"].setdefault(mode, {})
        for name in names:
            row, by_round = {}, {}
            for protocol in ["tcp://", "mpi://"]:
                done = by_round[protocol] = {
                    r["round"]: r["workloads"][name]
                    for r in runs[protocol]
                    if name in r.get("workloads", {})
                }
                if not done:
                    continue
                times = [t for d in done.values() for t in d["times"]]
                row[protocol] = {
                    "seconds": statistics.median(times),
                    "times": times,
                    "bytes_moved": statistics.median(
                        d["bytes_moved"] for d in done.values()
                    ),
                    "cpu_seconds": statistics.median(
                        d["cpu_seconds"] for d in done.values()
                    ),
                }
                transfers = [d.get("transfer_seconds") for d in done.values()]
                if None not in transfers:  # results of an older run lack it
                    row[protocol]["transfer_seconds"] = statistics.median(transfers)
                mpi = [
                    d["over_mpi_bytes"]
                    for d in done.values()
                    if d["over_mpi_bytes"] is not None
                ]
                if mpi:
                    row[protocol]["over_mpi_bytes"] = statistics.median(mpi)
                # Of the first round's warm-up
                row[protocol]["frames"] = next(iter(done.values())).get("frames", {})
            # A pair: the two runs of one round made next to each other
            pairs = [
                m / t
                for rnd, tcp in by_round["tcp://"].items()
                if rnd in by_round["mpi://"]
                for t, m in zip(tcp["times"], by_round["mpi://"][rnd]["times"])
            ]
            if pairs:
                row["pairs"] = pairs
                row["mpi/tcp"] = statistics.median(pairs)
                row["mpi/tcp 95%"] = paired_ratio_interval(pairs)
            table[name] = row


def print_table(results: dict) -> None:
    print(
        f"{'workload':17s} {'mode':12s} {'tcp s':>8s} {'mpi s':>8s} {'mpi/tcp':>8s}"
        f" {'95 % interval':>13s} {'moved MiB':>10s} {'over MPI MiB':>13s}"
    )
    for mode, table in results["workloads"].items():
        for name, row in table.items():
            tcp, mpi = row.get("tcp://"), row.get("mpi://")
            cell = lambda r: f"{r['seconds']:8.3f}" if r else f"{'-':>8s}"  # noqa: E731
            ratio = f"{row['mpi/tcp']:8.2f}" if "mpi/tcp" in row else f"{'-':>8s}"
            if "mpi/tcp 95%" in row:
                ratio += "{:>14s}".format("%.2f-%.2f" % tuple(row["mpi/tcp 95%"]))
            else:
                ratio += f"{'-':>14s}"
            moved = (mpi or tcp or {}).get("bytes_moved")
            moved = f"{moved / 2**20:10.1f}" if moved is not None else f"{'-':>10s}"
            over = (mpi or {}).get("over_mpi_bytes")
            over = f"{over / 2**20:13.1f}" if over is not None else f"{'-':>13s}"
            print(
                f"{name:17s} {mode:12s} {cell(tcp)} {cell(mpi)} {ratio} {moved} {over}"
            )


def band_name(band: int) -> str:
    """A band of frame sizes by its lower bound, as "64K+" """
    for unit, scale in [("M", 2**20), ("K", 2**10)]:
        if band >= scale:
            return f"{band // scale}{unit}+"
    return f"{band}+"


def print_frames(results: dict) -> None:
    """Bytes the workers wrote in frames of each band of sizes (warm-up runs,
    tcp://, the first mode)"""
    table = next(iter(results["workloads"].values()), {})
    print("MiB written by the workers, by frame size (tcp://):")
    print(f"{'workload':17s}" + "".join(f"{band_name(b):>8s}" for b in BANDS))
    for name, row in table.items():
        frames = (row.get("tcp://") or {}).get("frames", {})
        cells = [frames.get(str(b), [0, 0])[1] / 2**20 for b in BANDS]
        print(f"{name:17s}" + "".join(f"{c:8.1f}" for c in cells))


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modes = list(results["workloads"])
    names = [n for n in NAMES if any(n in results["workloads"][m] for m in modes)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(names))]
        ratios = [
            results["workloads"][mode].get(n, {}).get("mpi/tcp", float("nan"))
            for n in names
        ]
        bars = ax.bar(xs, ratios, width, label=LABELS.get(mode, mode))
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=1)
    if "data_heavy" in names:  # its target
        j = names.index("data_heavy")
        ax.hlines(0.8, j - 0.45, j + 0.45, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names])
    ax.set_ylabel("wall time mpi:// / tcp:// (median)")
    m = results["machine"]
    ax.set_title(
        f"Dask workloads, scheduler + {WORKERS} workers x {results['settings']['threads']}"
        f" thread(s), {m['cpus']} CPUs" + (" (quick)" if results["quick"] else "")
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "workloads.png"), dpi=100)


def main() -> None:
    import pingpong

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--only", default=",".join(NAMES))
    parser.add_argument(
        "--control",
        action="store_true",
        help="run tcp:// in mpi://'s place too: the ratios then show how much "
        "two runs of one transport differ on this machine",
    )
    args = parser.parse_args()
    args.only = args.only.split(",")
    if set(args.only) - set(NAMES) or set(args.modes.split(",")) - set(MODES):
        parser.error(f"workloads are {NAMES}, modes {MODES}")
    rounds = args.rounds or 2
    args.repeat = args.repeat or (1 if args.quick else 5)
    timeout = 240 if args.quick else 600
    modes = args.modes.split(",")
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": pingpong.versions(),
        "quick": args.quick,
        "control": args.control,
        "settings": {
            "workers": WORKERS,
            "threads": args.threads,
            "rounds": rounds,
            "repeat": args.repeat,
            "warm_up": 1,
            "sizes": {n: s for n, s in sizes(args.quick).items() if n in args.only},
        },
        "order": [],
        "runs": {m: {"tcp://": [], "mpi://": []} for m in modes},
        "workloads": {},
    }
    start = time.perf_counter()
    for rnd in range(rounds):
        # each mode: tcp first in one round, mpi first in the next
        for i, mode in enumerate(modes):
            order = ["tcp", "mpi"] if (rnd + i) % 2 == 0 else ["mpi", "tcp"]
            print(f"round {rnd + 1}: {mode}", file=sys.stderr, flush=True)
            for protocol, result in one_round(mode, order, args, timeout).items():
                result["round"] = rnd + 1
                results["runs"][mode][f"{protocol}://"].append(result)
                results["order"].append([rnd + 1, mode, f"{protocol}://"])
    results["seconds"] = time.perf_counter() - start
    summarize(results, args.only)
    with open(os.path.join(args.out, "workloads.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    print_table(results)
    print_frames(results)
    if args.control:
        print("control: tcp:// ran in mpi://'s place")
    print(f"({results['seconds']:.0f} s in all)")
    failed = [
        (m, p)
        for m, runs in results["runs"].items()
        for p, rs in runs.items()
        for r in rs
        if "error" in r
    ]
    if failed:
        sys.exit(f"failed runs: {failed}")


def child() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("serve")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("protocol")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    serve(args.mode, args.protocol, args.quick, args.threads)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        child()
    else:
        main()
