"""GPU benchmarks: CuPy payloads over tcp://, every route of mpi:// the
machine allows, and ucx:// (where distributed-ucxx is installed), in one run,
on a machine with a GPU.

    python benchmarks/gpu.py [--quick] [--out benchmarks/results]
    python benchmarks/gpu.py --plot gpu.json
    python benchmarks/gpu.py --quick --host-arrays --out /tmp/rehearsal

- ping-pong: a CuPy array of 1 B to 1 GiB, echoed as device frames by a server
  process (``deserialize=False``), timed through distributed's comm API;
- apps: dask arrays of CuPy chunks on a scheduler and four workers sharing the
  GPU, each a process of its own (as ``benchmarks/apps.py``): transpose-sum,
  ``(a @ a.T).sum()``, a rechunk by tasks, and 8 arrays of 256 MiB made on the
  workers and summed on one; where cuDF is installed, a shuffle and a merge of
  dataframes of cuDF partitions.

The routes of mpi://: "ipc" (the default between processes of one host: the
reader copies from the writer's GPU memory, and says so on the comm's
socket), "ipc, channel" (``lend-on-socket`` off: the frames are named, and
their copy acknowledged, over an MPI channel), "staged" (``device-ipc`` off;
through pinned host memory), "direct" (``device-ipc`` off, MPI taken as
CUDA-aware; measured only where ``python -m distributed.comm.mpi_probe`` says
it is, or with ``--direct``).  Each transport is measured in a process of
its own, once for the ping-pong and once for the workloads, stopped after
``--limit`` seconds each; ``gpu.json`` (rewritten after each) says which did
not finish, and the run's output where each process of those was.  Writes
``gpu.json`` and ``gpu.png``.

``--host-arrays`` puts numpy and pandas in CuPy's and cuDF's place: a
rehearsal of the whole run on a machine without a GPU, whose figures say
nothing about GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import apps
import pingpong
import psutil
from processes import LOGS as BENCHMARK_LOGS
from processes import kill, kill_orphans, launch, take_orphans

HERE = os.path.abspath(__file__)
# Set by --host-arrays, for every process of the run
HOST_ARRAYS = "GPU_BENCHMARK_HOST_ARRAYS"
# Why ucx:// is not measured, where run.sh found it could not be
UCX_LEFT_OUT = "GPU_BENCHMARK_UCX_LEFT_OUT"
# Where the measuring process and its ping-pong client write the figures so
# far, so that a part that fails or hangs keeps those it had
FIGURES = "GPU_BENCHMARK_FIGURES"


def write_json(data: dict, path: str) -> None:
    """Whole or not at all: a reader never sees half a file"""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def say(*args) -> None:
    """Print to stderr, which may be a pipe whose reader (``tee``) has gone:
    the figures matter more than their echo"""
    with contextlib.suppress(OSError):
        print(*args, file=sys.stderr, flush=True)


def array_module():
    """CuPy, or numpy in a rehearsal (``--host-arrays``)"""
    if os.environ.get(HOST_ARRAYS):
        import numpy

        return numpy
    import cupy

    return cupy


def sizes(quick: bool) -> list[int]:
    return pingpong.sizes(quick, 2**28 if quick else 2**30)


def repetitions(size: int, quick: bool) -> int:
    return pingpong.repetitions(size, quick, 2**28)


async def client(address: str, quick: bool) -> dict:
    cupy = array_module()

    from distributed.comm import connect
    from distributed.protocol import to_serialize

    comm = await connect(address)
    results = {"gpu_path": getattr(comm, "gpu_path", None)}
    if address.startswith("mpi://"):  # whether the IPC route is taken
        from distributed.comm import mpi_policy

        results["device_ipc"] = mpi_policy.ipc_from(comm.peer)

    async def timed(msg, n):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await comm.write(msg)
            reply = await comm.read()
            times.append((time.perf_counter() - start) / 2)
        assert isinstance(reply["x"], cupy.ndarray), type(reply["x"])
        return statistics.median(times)

    for size in sizes(quick):
        say(f"{size} B")  # where a hang was
        msg = {"x": to_serialize(cupy.ones(size, dtype="u1"))}
        await timed(msg, 2)
        results[size] = await timed(msg, repetitions(size, quick))
        if os.environ.get(FIGURES):
            write_json(results, os.environ[FIGURES])
    await comm.close()
    return results


def transpose_sum(n: int, chunk: int):
    import dask.array as da

    cupy = array_module()

    rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    x = rs.random((n, n), chunks=chunk)
    return (x + x.T).sum()


def dot(n: int, chunk: int):
    import dask.array as da

    cupy = array_module()

    rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    a = rs.random((n, n), chunks=chunk)
    return (a @ a.T).sum()


def rechunk(n: int, pieces: int):
    import dask.array as da

    cupy = array_module()

    rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    x = rs.random((n, n), chunks=(n, n // pieces))
    return x.rechunk((n // pieces, n), method="tasks").sum()


def gather(arrays: int, mib: int):
    """``arrays`` arrays of ``mib`` MiB, made on the workers, summed on one"""
    import dask

    cupy = array_module()

    @dask.delayed(pure=False)
    def make(i):
        return cupy.full(mib * 2**20 // 8, i, dtype="f8")

    @dask.delayed
    def total(parts):
        return float(sum(float(part.sum()) for part in parts))

    return total([make(i) for i in range(arrays)])


def dataframe_module():
    """cuDF, pandas in a rehearsal (``--host-arrays``), or None where cuDF or
    dask_cudf (which teaches dask.dataframe cuDF) is missing or broken"""
    if os.environ.get(HOST_ARRAYS):
        if importlib.util.find_spec("pandas") is None:
            return None
        import pandas

        return pandas
    if not all(importlib.util.find_spec(m) for m in ("cudf", "dask_cudf")):
        return None
    try:
        import cudf
        import dask_cudf  # noqa: F401
    except Exception as e:
        say(f"no cuDF workloads: {e!r}")
        return None
    return cudf


def frame(rows: int, partitions: int, name: str, seed: int):
    """A dask dataframe of cuDF partitions: a random key and a column"""
    import dask.dataframe as dd

    def partition(seed: int):
        import numpy

        rng = numpy.random.default_rng(seed)
        part = rows // partitions
        columns = {"key": rng.integers(0, rows, part), name: rng.random(part)}
        return dataframe_module().DataFrame(columns)

    return dd.from_map(partition, range(seed, seed + partitions))


def shuffle(rows: int, partitions: int):
    """All-to-all: every partition to every worker (dask-cuda's
    ``local_cudf_shuffle``)"""
    return (
        frame(rows, partitions, "x", 0).shuffle("key", shuffle_method="tasks").x.sum()
    )


def merge(rows: int, partitions: int):
    """A hash join of two dataframes (dask-cuda's ``local_cudf_merge``)"""
    left, right = frame(rows, partitions, "x", 0), frame(rows, partitions, "y", 1000)
    return left.merge(right, on="key", shuffle_method="tasks").x.sum()


WORKERS = 4


def suite(quick: bool) -> dict:
    n = 8000 if quick else 16000
    workloads = {
        "transpose_sum": (transpose_sum, n, n // 8),
        "dot": (dot, n // 2, n // 8),
        "rechunk": (rechunk, n, 16),
        "gather": (gather, 8, 64 if quick else 256),
    }
    if dataframe_module() is not None:  # cuDF is installed
        rows = 4_000_000 if quick else 40_000_000
        workloads["shuffle"] = (shuffle, rows, 16)
        workloads["merge"] = (merge, rows, 16)
    return workloads


def cuda_aware() -> tuple[bool, str]:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "distributed.comm.mpi_probe"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    except subprocess.SubprocessError as e:
        return False, f"no: the probe failed ({e})"
    rows = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    line = rows.get("CUDA-aware MPI", " no: the probe failed").strip()
    return line.startswith("yes"), line


@contextlib.contextmanager
def environment(**settings):
    """``settings`` in the environment of every process started meanwhile"""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


MPI_SETTING = "DASK_DISTRIBUTED__COMM__MPI__"
NO_IPC = {MPI_SETTING + "DEVICE_IPC": "False"}


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (lat, bw, app) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, figures in results["pingpong"].items():
        xs = sorted(int(k) for k in figures if k.isdigit())
        ys = [figures[str(x)] for x in xs]
        lat.loglog(xs, [y * 1e6 for y in ys], marker="o", label=name)
        bw.semilogx(xs, [x / y / 1e9 for x, y in zip(xs, ys)], marker="o", label=name)
    lat.set(xlabel="CuPy array size (bytes)", ylabel="one-way latency (us, median)")
    bw.set(xlabel="CuPy array size (bytes)", ylabel="bandwidth (GB/s)")
    apps_ = results["apps"]
    names = list(apps_)
    benches = list(dict.fromkeys(b for n in names for b in apps_[n]))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        walls = [apps_[name].get(b, {}).get("wall_time", 0) for b in benches]
        app.bar([j + i * width for j in range(len(benches))], walls, width, label=name)
    app.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(benches))])
    app.set_xticklabels(benches)
    app.set_ylabel("wall time (s, median)")
    for ax in (lat, bw, app):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPU data, {results['gpu']}, {results['machine']['mpi_library']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gpu.png"), dpi=100)


PARTS = ("pingpong", "apps")


def measure(
    protocol: str, part: str, quick: bool, repeat: int, limit: float, stall: float, keep
) -> None:
    """Measure ``part`` on ``protocol`` in a child process (``gpu.py
    measure``), stopped after ``limit`` seconds, or once its figures have not
    grown for ``stall`` seconds; ``keep(figures, failure)`` gets those it
    wrote and why some are missing, if any are, whatever stopped it (this
    process too: a SIGTERM)"""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "figures.json")
        argv = [HERE, "measure", protocol, part, path, "--repeat", str(repeat)]
        argv += ["--limit", str(limit)]
        # A process that aborts prints where each of its threads was
        with environment(PYTHONFAULTHANDLER="1"):
            proc = launch(argv + (["--quick"] if quick else []), mpi=False)
        failure = "stopped by the run's deadline"  # unless it ends before
        try:
            failure = wait(proc, path, limit, stall)
            if failure:
                show_stacks(proc)
                proc.terminate()  # it stops its server and cluster
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(20)
            else:
                failure = proc.returncode and f"exit status {proc.returncode}"
        finally:
            kill(proc)
            kill_orphans()  # of a child that died hard, say
            figures = None
            if os.path.exists(path):
                with open(path) as f:
                    figures = json.load(f)
            keep(figures, failure or None)


def wait(proc: subprocess.Popen, path: str, limit: float, stall: float) -> str:
    """Wait for ``proc``; why it was stopped, if it was"""
    start = last = time.monotonic()
    grown = None
    while proc.poll() is None:
        now = time.monotonic()
        if now - start > limit:
            return f"unfinished after {limit:.0f} s"
        with contextlib.suppress(OSError):
            if (mtime := os.stat(path).st_mtime) != grown:
                grown, last = mtime, now
        if now - last > stall:
            return f"unfinished: no new figure for {stall:.0f} s"
        time.sleep(0.2)
    return ""


def show_stacks(proc: subprocess.Popen) -> None:
    """Print the Python stacks of a measuring process that hung and of the
    processes it started: itself only prints (SIGUSR1), they abort (SIGABRT;
    a cluster's print into its logs, if kept)"""
    say(f"where the processes of {proc.args[1:5]} were:")
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)  # for it to print before the others' errors
        for child in children:
            with contextlib.suppress(psutil.Error):
                if "python" in os.path.basename(child.exe()):
                    child.send_signal(signal.SIGABRT)
    time.sleep(1)


def measure_here(
    protocol: str, part: str, path: str, quick: bool, repeat: int, limit: float
):
    """``gpu.py measure``: write the figures to ``path``, as they come"""
    # SIGTERM from the parent unwinds, so that the server and cluster stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if part == "pingpong":
        os.environ[FIGURES] = path  # the client writes them, size by size
        figures = pingpong.run_protocol(protocol, quick, client_script=HERE)
    else:
        workloads = suite(quick)
        figures = apps.run_protocol(
            protocol,
            WORKERS,
            quick,
            repeat,
            workloads,
            warm_up=True,
            timeout=limit / len(workloads),
            done=lambda figures: write_json(figures, path),
        )
    write_json(figures, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    parser.add_argument("--plot", metavar="JSON", help="only plot a run's results")
    parser.add_argument(
        "--host-arrays",
        action="store_true",
        help="numpy in CuPy's place: rehearse the run without a GPU",
    )
    parser.add_argument(
        "--limit",
        type=float,
        default=100,
        help="seconds each transport may take for the ping-pong, and again for "
        "the workloads (default 100)",
    )
    parser.add_argument(
        "--stall",
        type=float,
        default=45,
        help="seconds after which a ping-pong or workloads with no new figure "
        "are stopped (default 45)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds the whole run may take: a part gets what is left if that "
        "is less than --limit, and none is started with under 45 s left",
    )
    parser.add_argument(
        "--logs",
        metavar="DIR",
        nargs="?",
        const="",
        help="keep the output of the workloads' scheduler and workers, in DIR "
        "(default: logs/ beside gpu.json)",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="measure mpi:// direct even where MPI says it is not CUDA-aware "
        "(MPICH from PyPI on a UCX built with CUDA, in LD_LIBRARY_PATH)",
    )
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.dirname(os.path.abspath(args.plot)))
        return
    # SIGTERM (a timeout) unwinds, so that the measuring process is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    deadline = time.monotonic() + (float("inf") if args.budget is None else args.budget)
    take_orphans()
    repeat = args.repeat or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    if args.host_arrays:
        os.environ[HOST_ARRAYS] = "1"
    cupy = array_module()

    aware, why = cuda_aware()
    if args.direct and not aware:
        why += "; mpi:// direct measured anyway (--direct)"
    results = {
        "machine": pingpong.versions(),
        "gpu": (
            "none: numpy arrays (--host-arrays)"
            if args.host_arrays
            else cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        ),
        "cupy": cupy.__version__,
        "cuda_aware": why,
        "quick": args.quick,
        "workers": WORKERS,
        "pingpong": {},
        "apps": {},
    }
    # What the targets compare comes first (ucx:// after mpi:// ipc: it hung
    # before), each transport is measured in a process of its own that is
    # stopped after --limit seconds, and the results are written after each:
    # a transport that hangs is recorded as such, and the run goes on
    variants = [("mpi:// ipc", "mpi", {})]
    if importlib.util.find_spec("distributed_ucxx"):
        # As dask-cuda does, so that UCX sees the GPU
        ucx = {"DASK_DISTRIBUTED_UCXX__CREATE_CUDA_CONTEXT": str(not args.host_arrays)}
        variants.append(("ucx://", "ucx", ucx))
    variants += [("tcp://", "tcp", {})]
    variants += [("mpi:// staged", "mpi", {**NO_IPC})]
    variants += [
        ("mpi:// ipc, channel", "mpi", {MPI_SETTING + "LEND_ON_SOCKET": "False"})
    ]
    if aware or args.direct:
        variants.append(
            ("mpi:// direct", "mpi", {**NO_IPC, MPI_SETTING + "CUDA_AWARE": "true"})
        )
    results["variants"] = [name for name, _, _ in variants]
    if args.logs is not None:
        os.environ[BENCHMARK_LOGS] = args.logs or os.path.join(args.out, "logs")
        os.makedirs(os.environ[BENCHMARK_LOGS], exist_ok=True)
    failed = results["failed"] = {}
    if os.environ.get(UCX_LEFT_OUT):
        failed["ucx://"] = os.environ[UCX_LEFT_OUT]
    unfinished = set()
    out = os.path.join(args.out, "gpu.json")
    try:
        for name, protocol, settings in variants:
            for part in PARTS:
                key = f"{name} {part}"
                # A part stopped at its limit takes up to 25 s more to stop
                limit = min(args.limit, deadline - time.monotonic() - 30)
                if limit < 15:
                    failed[key] = "not started: out of time (--budget)"
                elif name in unfinished:
                    failed[key] = f"not started: its {PARTS[0]} did not finish"
                else:
                    start = time.perf_counter()

                    def keep(figures, failure):
                        if figures is not None:
                            results[part][name] = figures
                        if failure and failure.startswith("unfinished"):
                            unfinished.add(name)
                        if failure:
                            took = time.perf_counter() - start
                            failed[key] = f"{failure}, {took:.0f} s"

                    with environment(**settings):
                        measure(
                            protocol, part, args.quick, repeat, limit, args.stall, keep
                        )
                write_json(results, out)
                say(f"{key}: {failed.get(key, 'done')}")
    finally:
        write_json(results, out)
        with contextlib.suppress(Exception):
            plot(results, args.out)
    with contextlib.suppress(OSError):  # stdout gone: the figures are written
        summarize(results)


def summarize(results: dict) -> None:
    """Each transport's figures, and ipc's against ucx:// (else tcp://)"""
    for part, cell in [("pingpong", "{:.6f}s"), ("apps", "{:.3f}s")]:
        figures = results[part]
        names = list(figures)
        base = next((n for n in ("ucx://", "tcp://") if n in figures), None)
        keys = dict.fromkeys(
            k for n in names for k in figures[n] if k not in ("gpu_path", "device_ipc")
        )
        print(part, *names, f"ipc/{base}", sep="  ")
        for key in keys:
            row, cells = [], []
            for name in names:
                figure = figures[name].get(key)  # a workload's: figures or error
                value = figure.get("wall_time") if isinstance(figure, dict) else figure
                row.append(value)
                failed = figure is not None and value is None
                cells.append(
                    "failed" if failed else "-" if value is None else cell.format(value)
                )
            ratio = ""
            if base and "mpi:// ipc" in names and None not in row:
                ratio = f"{row[names.index('mpi:// ipc')] / row[names.index(base)]:.2f}"
            print(key, *cells, ratio, sep="  ")
    for name, why in results.get("failed", {}).items():
        print(f"{name}: {why}")
    print("CUDA-aware MPI:", results["cuda_aware"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        pingpong.run_client(client)
    elif sys.argv[1:2] == ["measure"]:
        protocol, part, path, *rest = sys.argv[2:]
        repeat = int(rest[rest.index("--repeat") + 1])
        limit = float(rest[rest.index("--limit") + 1])
        measure_here(protocol, part, path, "--quick" in rest, repeat, limit)
    else:
        main()
