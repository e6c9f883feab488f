"""Soak: workers that come and go for a long time; nothing may grow with each one.

    python benchmarks/soak.py [--cycles 500] [--protocol tcp mpi] [--sample-every K]
                              [--out benchmarks/results]

For each protocol, one after the other in the same run: a scheduler and one
steady worker, each a process of its own (under its own ``mpiexec -n 1`` for
mpi://), and a client in this process, on the same protocol. Then N cycles:

- a new worker starts (its own process, ``--no-nanny``) and joins;
- it makes a 16 MiB array, which a task on the steady worker fetches and checks;
- on the long-lived comms: ``--small`` round trips of small messages, client
  to steady worker and client to scheduler, and ``--large`` messages of
  ``--large-size`` (half up to the steady worker, half down from it, through
  the scheduler); the defaults make 10^5 round trips and 10^3 large messages
  over 500 cycles;
- the new worker leaves, in turn: retired by the client, killed (SIGKILL to
  its process group), closed by the scheduler, killed.

Every ``--sample-every`` cycles it samples the scheduler, the steady worker
and this process (the client): RSS, open fds, threads, memory maps and the
maps of /dev/shm files, open pooled comms, and for mpi:// the sizes of the
channel registries (``distributed.comm.mpi_channel``); and /dev/shm: the
``mpich_shm_*`` files, their bytes, and how many no live process holds
(maps or has open). After the cluster has shut down it lists the files left
in /dev/shm since the start.

Writes ``soak.json`` (time series per protocol, each cycle's result and a
summary: RSS growth per cycle fitted over the second half, fds and threads
first and last, files left) and ``soak.png``. Not part of ``python -m
benchmarks``: 500 cycles take about half an hour per protocol on 2 cores.

MPICH 5.0.2 keeps a table of the MPI jobs a process has connected to, never
emptied, and aborts the process that meets its 1024th (each worker and client
started alone is a job): past 1000 jobs, mpi:// meets new ones over TCP
(``distributed.comm.mpi_channel.MAX_JOBS``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import psutil

from processes import kill, launch, wait_for_file

import distributed
from distributed import Client

MODES = ["retire", "kill", "close", "kill"]  # how the new worker of cycle i leaves
TRANSFER = 16 * 2**20  # bytes each new worker sends to the steady worker
STEP_TIMEOUT = 60  # seconds, for any one step of a cycle
SHM_PREFIX = "mpich_shm_"


# --- run on the cluster's processes (pickled by value: this is __main__) ---


def _registries():
    """Sizes of the mpi:// channel registries of this process; None if unused"""
    import sys

    mod = sys.modules.get("distributed.comm.mpi_channel")
    if mod is None:
        return None
    opener = sys.modules["distributed.comm.mpi_opener"].opener
    engines = sys.modules["distributed.comm.mpi_progress"].ProgressEngine
    sizes = {**mod.channels.sizes(), **opener.sizes()}
    # The progress engines' transfers in flight, and abandoned ones
    sizes.update({"engine_" + k: n for k, n in engines.sizes().items()})
    return sizes


def _pool(pool) -> dict:
    return {
        "pool_open": pool.open,
        "pool_addresses": len(set(pool.available) | set(pool.occupied)),
    }


def _scheduler_state(dask_scheduler):
    return {
        "mpi": _registries(),
        **_pool(dask_scheduler.rpc),
        "workers": len(dask_scheduler.workers),
        "tasks": len(dask_scheduler.tasks),
    }


def _worker_state(dask_worker):
    return {
        "mpi": _registries(),
        **_pool(dask_worker.rpc),
        "keys": len(dask_worker.data),
    }


def _worker_names(dask_scheduler):
    return {ws.name: addr for addr, ws in dask_scheduler.workers.items()}


def _close_worker(addr, dask_scheduler):
    dask_scheduler.close_worker(addr)


def _make(nbytes, value):
    import numpy as np

    return np.full(nbytes // 8, value, dtype="f8")


def _consume(x):
    return float(x.sum()), int(x.nbytes)


def _checksum(x):
    return float(x.sum())


# --- this process's view of the machine ---


def python_process(job: subprocess.Popen) -> psutil.Process:
    """The Python process of a job (under mpiexec: its descendant), found by
    executable: setproctitle renames dask's processes"""
    root = psutil.Process(job.pid)
    python = os.path.realpath(sys.executable)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if p.exe() == python:
                return p
    raise RuntimeError(f"no Python process under {job.args}")


def process_stats(p: psutil.Process) -> dict:
    with p.oneshot():
        stats = {
            "rss": p.memory_info().rss,
            "fds": p.num_fds(),
            "threads": p.num_threads(),
        }
    with open(f"/proc/{p.pid}/maps") as f:
        maps = f.readlines()
    stats["maps"] = len(maps)
    stats["shm_maps"] = sum("/dev/shm/" in line for line in maps)
    return stats


def shm_held() -> set[str]:
    """The /dev/shm/mpich_shm_* files that a live process maps or has open"""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" + SHM_PREFIX in line:
                        held.add(line.split(None, 5)[-1].strip())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/" + SHM_PREFIX):
                        held.add(target)
    return {path.removesuffix(" (deleted)") for path in held}


def shm_files() -> dict[str, int]:
    """The mpich_shm_* files in /dev/shm, with their sizes"""
    files = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(SHM_PREFIX):
                with contextlib.suppress(OSError):
                    files[entry.path] = entry.stat().st_size
    return files


def shm_state(start: dict[str, int]) -> dict:
    files, held = shm_files(), shm_held()
    new = set(files) - set(start)
    return {
        "files": len(files),
        "bytes": sum(files.values()),
        "unheld": sum(path not in held for path in files),
        "new": len(new),
        "new_unheld": sum(path not in held for path in new),
    }


# --- the soak ---


def log_tail(path: str, n: int = 3000) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()[-n:]
    return ""


class Soak:
    def __init__(self, protocol: str, args, tmp: str):
        self.protocol = protocol
        self.mpi = protocol == "mpi"
        self.args = args
        self.tmp = tmp
        self.jobs: list[subprocess.Popen] = []
        self.samples: list[dict] = []
        self.cycles: list[dict] = []
        self.client: Client | None = None
        self.stopped = ""  # why the cycles stopped early, if they did

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(os.path.join(self.tmp, f"{name}.log"), "w")
        job = launch(argv, self.mpi, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.jobs.append(job)
        return job

    def start_worker(self, name: str) -> subprocess.Popen:
        argv = ["-m", "distributed.cli.dask_worker", "--scheduler-file"]
        argv += [self.sched_file, "--no-nanny", "--nthreads", "1", "--no-dashboard"]
        # Killed workers leave their directories: in ``tmp``, removed after
        argv += ["--local-directory", self.tmp]
        return self.start(name, [*argv, "--name", name])

    def wait_joined(self, name: str, job: subprocess.Popen) -> str:
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            names = self.client.run_on_scheduler(_worker_names, callback_timeout=30)
            if name in names:
                return names[name]
            if job.poll() is not None:
                raise RuntimeError(f"worker {name} exited with {job.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"worker {name} did not join")

    def wait_gone(self, name: str) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT
        while name in self.client.run_on_scheduler(_worker_names, callback_timeout=30):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler still lists {name}")
            time.sleep(0.1)

    def run(self) -> dict:
        args = self.args
        self.shm_start = shm_files()
        self.sched_file = os.path.join(self.tmp, "scheduler.json")
        t0 = time.monotonic()
        scheduler = self.start(
            "scheduler",
            [
                "-m",
                "distributed.cli.dask_scheduler",
                "--protocol",
                self.protocol,
                "--port",
                "0",
                "--scheduler-file",
                self.sched_file,
                "--no-dashboard",
            ],
        )
        wait_for_file(self.sched_file, scheduler)
        steady_job = self.start_worker("steady")
        self.client = Client(scheduler_file=self.sched_file, timeout=STEP_TIMEOUT)
        self.steady = self.wait_joined("steady", steady_job)
        self.procs = {
            "scheduler": python_process(scheduler),
            "steady_worker": python_process(steady_job),
            "client": psutil.Process(),
        }
        self.started = time.monotonic() - t0
        self.sample(0)
        for i in range(1, args.cycles + 1):
            self.cycles.append(self.cycle(i))
            c = self.cycles[-1]
            print(
                f"{self.protocol}:// cycle {i}/{args.cycles} {c['mode']}: "
                f"{'ok' if c['ok'] else 'FAILED ' + c['error']} in {c['seconds']:.1f} s",
                flush=True,
            )
            if i % args.sample_every == 0 or i == args.cycles:
                self.sample(i)
            dead = [j.args for j in (scheduler, steady_job) if j.poll() is not None]
            failing = len(self.cycles) >= 5 and not any(
                c["ok"] for c in self.cycles[-5:]
            )
            if dead or failing:  # the rest would only time out, cycle after cycle
                self.stopped = f"exited: {dead}" if dead else "5 cycles failed in a row"
                print(f"{self.protocol}:// stopped: {self.stopped}", flush=True)
                if self.samples[-1]["cycle"] != i:
                    self.sample(i)
                break
        self.cluster_seconds = time.monotonic() - t0
        self.shutdown(scheduler, steady_job)
        return self.result()

    def cycle(self, i: int) -> dict:
        args, client = self.args, self.client
        mode = MODES[(i - 1) % len(MODES)]
        name = f"soak-{i}"
        record = {"cycle": i, "mode": mode, "ok": False, "error": ""}
        t0 = time.monotonic()
        job = None
        try:
            job = self.start_worker(name)
            addr = self.wait_joined(name, job)
            record["join_seconds"] = time.monotonic() - t0

            # 16 MiB from the new worker to the steady one
            t = time.monotonic()
            made = client.submit(
                _make,
                TRANSFER,
                i,
                workers=[addr],
                allow_other_workers=False,
                pure=False,
                key=f"make-{i}",
            )
            used = client.submit(
                _consume,
                made,
                workers=[self.steady],
                allow_other_workers=False,
                pure=False,
                key=f"consume-{i}",
            )
            total, nbytes = used.result(timeout=STEP_TIMEOUT)
            transfer_ok = nbytes == TRANSFER and total == i * (TRANSFER // 8)
            del made, used
            record["transfer_seconds"] = time.monotonic() - t

            # traffic on long-lived comms
            t = time.monotonic()
            client.sync(self.small, args.small, callback_timeout=STEP_TIMEOUT)
            record["small_seconds"] = time.monotonic() - t
            t = time.monotonic()
            large_ok = self.large(i, args.large, args.large_size)
            record["large_seconds"] = time.monotonic() - t

            # and leave
            t = time.monotonic()
            if mode == "retire":
                client.retire_workers([addr], close_workers=True, callback_timeout=60)
            elif mode == "close":
                client.run_on_scheduler(_close_worker, addr, callback_timeout=30)
            else:
                kill(job)
            self.wait_gone(name)
            try:
                job.wait(STEP_TIMEOUT)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
            record["leave_seconds"] = time.monotonic() - t
            record["ok"] = transfer_ok and large_ok and exited
            if not record["ok"]:
                record["error"] = (
                    f"transfer_ok={transfer_ok} large_ok={large_ok} exited={exited}"
                )
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc()[-3000:]
        finally:
            if job is not None:
                kill(job)
                self.jobs.remove(job)
                if not record["ok"]:
                    record["worker_log"] = log_tail(
                        os.path.join(self.tmp, f"{name}.log")
                    )
        record["seconds"] = time.monotonic() - t0
        return record

    async def small(self, n: int) -> None:
        """n round trips of small messages on pooled (long-lived) comms:
        half to the steady worker, half to the scheduler"""
        worker = self.client.rpc(self.steady)
        for k in range(n):
            if k % 2:
                await self.client.scheduler.identity()
            else:
                await worker.identity()

    def large(self, i: int, n: int, size: int) -> bool:
        """n messages of ``size`` bytes through the scheduler: half up to the
        steady worker, half down from it"""
        import numpy as np

        ok = True
        up = np.full(size // 8, float(i))
        for k in range(n):
            w = [self.steady]
            if k % 2 == 0:
                got = self.client.run(_checksum, up, workers=w, callback_timeout=60)
                ok &= got[self.steady] == float(i) * (size // 8)
            else:
                got = self.client.run(_make, size, i, workers=w, callback_timeout=60)
                arr = got[self.steady]
                ok &= arr.nbytes == size // 8 * 8 and bool((arr == i).all())
        return ok

    def sample(self, cycle: int) -> None:
        s = {"cycle": cycle, "time": time.time(), "shm": shm_state(self.shm_start)}
        for role, p in self.procs.items():
            try:
                s[role] = process_stats(p)
            except (psutil.Error, OSError) as e:
                s[role] = {"error": repr(e)}
        try:
            s["scheduler"].update(
                self.client.run_on_scheduler(_scheduler_state, callback_timeout=30)
            )
            got = self.client.run(
                _worker_state, workers=[self.steady], callback_timeout=30
            )
            s["steady_worker"].update(got[self.steady])
            s["client"]["mpi"] = _registries()
            s["client"].update(_pool(self.client.rpc))
        except Exception as e:
            s["error"] = f"{type(e).__name__}: {e}"
        self.samples.append(s)

    def shutdown(self, scheduler: subprocess.Popen, steady: subprocess.Popen) -> None:
        """Close the cluster gracefully (so that MPI finalizes), then make sure"""
        self.shutdown_clean = True
        try:
            self.client.retire_workers(
                [self.steady], close_workers=True, callback_timeout=60
            )
            self.client.sync(self.client._shutdown, callback_timeout=60)  # shutdown()
        except Exception as e:
            self.shutdown_clean = f"{type(e).__name__}: {e}"
        for job in [steady, scheduler]:
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                self.shutdown_clean = f"{job.args} did not exit"
        with contextlib.suppress(Exception):
            self.client.close(timeout=10)
        for job in self.jobs:
            kill(job)
        self.jobs.clear()

    def result(self) -> dict:
        end = shm_files()
        held = shm_held()
        new = sorted(set(end) - set(self.shm_start))
        shm = {
            "files_at_start": len(self.shm_start),
            "files_at_end": len(end),
            "new": len(new),
            "new_bytes": sum(end[p] for p in new),
            "new_unheld": [p for p in new if p not in held],
            "new_held": [p for p in new if p in held],  # by live processes
            "gone": len(set(self.shm_start) - set(end)),
        }
        ok = sum(c["ok"] for c in self.cycles)
        res = {
            "cycles": self.cycles,
            "samples": self.samples,
            "shm_left": shm,
            "startup_seconds": self.started,
            "seconds": self.cluster_seconds,
            "shutdown_clean": self.shutdown_clean,
            "stopped_early": self.stopped,
            "summary": summarize(self.samples, self.cycles, shm),
        }
        res["summary"]["cycles_ok"] = ok
        if ok < len(self.cycles) or self.shutdown_clean is not True:
            res["logs"] = {
                n: log_tail(os.path.join(self.tmp, f"{n}.log"))
                for n in ["scheduler", "steady"]
            }
        return res


def fit(samples: list[dict], role: str, key: str) -> float | None:
    """Growth of ``key`` per cycle, a least-squares line through the second
    half of the samples"""
    last = samples[-1]["cycle"] if samples else 0
    pts = [
        (s["cycle"], s[role][key])
        for s in samples
        if s["cycle"] >= last / 2 and isinstance(s.get(role, {}).get(key), int)
    ]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    return statistics.linear_regression(*zip(*pts)).slope


def summarize(samples: list[dict], cycles: list[dict], shm: dict) -> dict:
    out = {"cycles": len(cycles), "failed": [c["cycle"] for c in cycles if not c["ok"]]}
    if cycles:
        out["seconds_per_cycle"] = statistics.mean(c["seconds"] for c in cycles)
    first, last = samples[0], samples[-1]
    for role in ["scheduler", "steady_worker", "client"]:
        r = {"rss_growth_per_cycle": fit(samples, role, "rss")}
        r["maps_growth_per_cycle"] = fit(samples, role, "maps")
        for key in ["rss", "fds", "threads", "maps", "shm_maps", "pool_open"]:
            a, b = first.get(role, {}).get(key), last.get(role, {}).get(key)
            r[key] = [a, b]
        a = (first.get(role, {}).get("mpi") or {}).get("by_id")
        b = (last.get(role, {}).get("mpi") or {}).get("by_id")
        r["mpi_channels"] = [a, b]
        out[role] = r
    out["shm_files_left"] = len(shm["new_unheld"])
    out["shm_files_held_at_end"] = len(shm["new_held"])
    return out


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (rss, fds), (chan, shm) = axes
    colors = {"tcp": "tab:blue", "mpi": "tab:orange"}
    styles = {"scheduler": "-", "steady_worker": "--", "client": ":"}
    for protocol, r in results["protocols"].items():
        samples = r.get("samples") or []
        xs = [s["cycle"] for s in samples]
        c = colors.get(protocol)
        for role, ls in styles.items():

            def series(key, scale=1.0):
                return [s.get(role, {}).get(key, float("nan")) / scale for s in samples]

            label = f"{protocol} {role}"
            rss.plot(xs, series("rss", 2**20), ls, color=c, label=label)
            fds.plot(xs, series("fds"), ls, color=c, label=label)
            if protocol == "mpi":
                ch = [
                    (s.get(role, {}).get("mpi") or {}).get("by_id", float("nan"))
                    for s in samples
                ]
                chan.plot(xs, ch, ls, color=c, label=f"{label} channels")
            chan.plot(
                xs,
                series("shm_maps"),
                ls,
                color=c,
                alpha=0.4,
                label=f"{label} /dev/shm maps",
            )
        shm.plot(
            xs,
            [s["shm"]["new"] for s in samples],
            "-",
            color=c,
            label=f"{protocol}: new mpich_shm files",
        )
        shm.plot(
            xs,
            [s["shm"]["new_unheld"] for s in samples],
            "--",
            color=c,
            label=f"{protocol}: new, held by no process",
        )
    rss.set(xlabel="cycle", ylabel="RSS (MiB)", title="memory")
    fds.set(xlabel="cycle", ylabel="open fds", title="file descriptors")
    chan.set(xlabel="cycle", ylabel="count", title="MPI channels; /dev/shm maps")
    shm.set(xlabel="cycle", ylabel="files", title="/dev/shm/mpich_shm_* since start")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "soak.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--protocol", nargs="+", default=["tcp", "mpi"])
    parser.add_argument("--sample-every", type=int, default=None)
    parser.add_argument("--small", type=int, default=200, help="round trips a cycle")
    parser.add_argument("--large", type=int, default=2, help="large messages a cycle")
    parser.add_argument("--large-size", type=int, default=4 * 2**20)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results")
    )
    args = parser.parse_args()
    args.sample_every = args.sample_every or max(1, args.cycles // 100)
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "distributed": distributed.__version__,
        },
        "settings": {
            k: getattr(args, k)
            for k in ["cycles", "sample_every", "small", "large", "large_size"]
        }
        | {"transfer": TRANSFER, "modes": MODES},
        "protocols": {},
    }
    path = os.path.join(args.out, "soak.json")
    for protocol in args.protocol:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            soak = Soak(protocol, args, tmp)
            try:
                results["protocols"][protocol] = soak.run()
            except Exception as e:
                results["protocols"][protocol] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                    "cycles": soak.cycles,
                    "samples": soak.samples,
                }
                print(f"{protocol}:// soak failed: {e}", flush=True)
            finally:
                if soak.client is not None:
                    with contextlib.suppress(Exception):
                        soak.client.close(timeout=10)
                for job in soak.jobs:
                    kill(job)
        results["protocols"][protocol]["wall_seconds"] = time.monotonic() - t0
        with open(path, "w") as f:  # after each protocol, in case the next hangs
            json.dump(results, f, indent=1)
    if "mpi" in args.protocol:
        from distributed.comm import mpi_startup

        with contextlib.suppress(Exception):
            results["machine"]["mpi_library"] = mpi_startup.library()
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    print(f"wrote {path} (and soak.png when matplotlib is installed)")
    for protocol, r in results["protocols"].items():
        s = r.get("summary")
        if not s:
            print(f"{protocol}://: {r.get('error')}")
            continue
        print(
            f"{protocol}://: {s['cycles_ok']}/{s['cycles']} cycles ok in "
            f"{r['wall_seconds']:.0f} s; RSS growth per cycle (2nd half): "
            + ", ".join(
                f"{role} {g / 1024:+.1f} KiB" if g is not None else f"{role} -"
                for role in ["scheduler", "steady_worker", "client"]
                for g in [s[role]["rss_growth_per_cycle"]]
            )
            + f"; fds scheduler {s['scheduler']['fds']}, steady "
            f"{s['steady_worker']['fds']}; mpich_shm files left: {s['shm_files_left']}"
        )


if __name__ == "__main__":
    main()
