"""Across simulated hosts with a bandwidth cap: tcp:// vs mpi://.

    python benchmarks/hosts.py [--quick] [--out benchmarks/results] [--capped-only]

Four hosts simulated on this machine (``distributed/comm/tests/
simulated_hosts.py``: a network, UTS, IPC and PID namespace and a /dev/shm
of its own each, ``eth0`` on one bridge; needs root), each host's ``eth0``
capped with ``tc qdisc add dev eth0 root tbf rate 1gbit burst 512kb latency
20ms`` (netem is not in this kernel: no latency is added), then, unless
``--capped-only``, uncapped. Every process runs on a host; for mpi:// each is
its own ``mpiexec -n 1`` there (separate MPI jobs, which meet by
accept/connect). The driver (this process) is on none of the hosts' networks.

- ping-pong between a process on host 1 and one on host 2 through
  distributed's comm API, a numpy payload in ``to_serialize`` of 1 B to 64 MiB
  (16 MiB with ``--quick``) echoed back, one-way latency (half the round
  trip), median over the rounds;
- Dask workloads of ``workloads.py`` (its functions, with smaller sizes): a
  scheduler and the client on host 1, a worker of one thread (no nanny) on
  each of hosts 2-4; ``data_heavy`` (arrays made on two workers, summed by the
  third) and ``transpose_sum``; one warm-up run, then ``--repeat`` timed runs
  per cluster, median over the rounds.

tcp:// and mpi:// alternate: in each round each protocol gets a fresh server or
cluster, tcp first in one round and mpi first in the next. The MPI path is
MPICH's UCX netmod: the hosts share no IPC namespace or /dev/shm, so UCX takes
TCP over ``eth0`` (``UCX_NET_DEVICES=eth0``); the ping-pong client on mpi://
runs with ``UCX_PROTO_INFO_DIR``, and the protocols and transports UCX picked
between hosts are recorded from the graphs it writes there. Checks (a failed
one makes the exit status non-zero): the transports are all ``tcp/eth0``; on
mpi:// the ping-pong's messages of 1 MiB or more and the workloads' data moved
over MPI channels (``moved_off_the_socket``, on the workers through ``client.run``);
``eth0`` carried the ping-pong's payloads. The exit status of every process is
recorded.

Writes ``hosts.json`` and ``hosts.png``; where hosts cannot be simulated, says
why and exits 0 without writing anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

try:  # the simulated hosts are the tests': this one runs from a checkout
    from distributed.comm.tests.mpi_processes import Job, _env, mpiexec_command
    from distributed.comm.tests.mpi_processes import wait_for_file
    from distributed.comm.tests.simulated_hosts import SimulatedHosts, skip_reason
except ImportError as e:
    sys.exit(
        f"{e}: benchmarks/hosts.py uses the tests' simulated hosts; run it with "
        "distributed installed from a checkout (pip install -e .)"
    )

HERE = os.path.abspath(__file__)
BENCHMARKS = os.path.dirname(HERE)
CAP = "tbf rate 1gbit burst 512kb latency 20ms"
# On the hosts: this checkout, and these scripts (workers unpickle the
# workloads' functions by reference, ``workloads._array``)
ENV = {"PYTHONPATH": os.pathsep.join([BENCHMARKS, os.path.dirname(BENCHMARKS)])}
NAMES = ["data_heavy", "transpose_sum"]


def sizes(quick: bool) -> list[int]:
    import pingpong

    return pingpong.sizes(quick, top=2**24 if quick else 2**26)


def workload_sizes(quick: bool) -> dict:
    if quick:
        return {
            "data_heavy": {"arrays": 8, "mib": 16},
            "transpose_sum": {"n": 2000, "chunk": 500},
        }
    return {
        "data_heavy": {"arrays": 16, "mib": 32},
        "transpose_sum": {"n": 3000, "chunk": 500},
    }


# -- what runs on the hosts ---------------------------------------------------


async def client(address: str, quick: bool) -> dict:
    """One-way times of each message size, all of them"""
    import numpy as np
    from pingpong import repetitions

    from distributed.comm import connect
    from distributed.protocol import to_serialize

    comm = await connect(address)
    results = {}

    async def timed(msg, n):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await comm.write(msg)
            await comm.read()
            times.append((time.perf_counter() - start) / 2)
        return times

    await timed({"op": "ping", "i": 1}, 20)  # warm up
    results["dict"] = await timed({"op": "ping", "i": 1, "key": "x-123"}, 100)
    for size in sizes(quick):
        msg = {"x": to_serialize(np.ones(size, dtype="u1"))}
        await timed(msg, 2)
        # half pingpong.py's: every size runs in two rounds
        results[size] = await timed(msg, repetitions(size, quick, budget=2**25))
    if address.startswith("mpi://"):
        from distributed.comm.tests.mpi_processes import moved_off_the_socket

        results["over_mpi_bytes"] = moved_off_the_socket()
    await comm.close()
    return results


def run_workloads(protocol: str, scheduler_file: str, workers: int, args) -> dict:
    """The client: ``workloads.measure`` of each workload; then the cluster
    is shut down"""
    import workloads

    from distributed import Client

    with Client(scheduler_file=scheduler_file, timeout=60) as client:
        client.wait_for_workers(workers, timeout=120)
        info = client.scheduler_info(n_workers=-1)["workers"]
        assert all(a.startswith(protocol + "://") for a in info), list(info)
        results = {"workers": {a: w["host"] for a, w in info.items()}}
        results["workloads"] = {
            name: workloads.measure(
                client,
                name,
                workload_sizes(args.quick)[name],
                args.repeat,
                protocol == "mpi",
            )
            for name in NAMES
        }
        if protocol == "mpi":
            from distributed.comm.tests.mpi_processes import moved_off_the_socket

            results["moved_over_mpi"] = client.run(moved_off_the_socket)
        print(json.dumps(results), flush=True)
        client.shutdown()
    return results


# -- the driver ---------------------------------------------------------------


@contextlib.contextmanager
def on_host(
    hosts: SimulatedHosts, name: str, argv: list[str], mpi: bool, env=ENV, **kwargs
):
    """``python <argv>`` on host ``name``, as its own one-rank MPI job when
    ``mpi``, in a session of its own; stopped with all it started on exit"""
    argv = [sys.executable, *argv]
    if mpi:
        argv = [mpiexec_command(), "-n", "1", *argv]
    job = Job(
        hosts.command(name, argv, env), env=_env(), start_new_session=True, **kwargs
    )
    with job:
        try:
            yield job
        finally:
            if job.poll() is None:
                job.stop()


def last_json(out: str, job: subprocess.Popen) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{job.args[-4:]} exited {job.returncode}:\n{out[-4000:]}")


def eth0_bytes(hosts: SimulatedHosts) -> int:
    return sum(hosts.interface_bytes(name) for name in hosts.names)


def set_cap(hosts: SimulatedHosts, capped: bool) -> None:
    for name in hosts.names:
        hosts.run(name, ["tc", "qdisc", "del", "dev", "eth0", "root"])  # if any
        if capped:
            cmd = ["tc", "qdisc", "add", "dev", "eth0", "root", *CAP.split()]
            done = hosts.run(name, cmd)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def pingpong_run(hosts: SimulatedHosts, protocol: str, quick: bool) -> dict:
    """A server on host 1, the client on host 2; the client's times"""
    a, b = hosts.names[:2]
    mpi = protocol == "mpi"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "address")
        pingpong = os.path.join(BENCHMARKS, "pingpong.py")  # its echo server
        server = [pingpong, "serve", protocol, path, hosts.address(a)]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        with on_host(hosts, a, server, mpi, **quiet) as job:
            address = wait_for_file(path, job)
            before = eth0_bytes(hosts)
            argv = [HERE, "client", address] + (["--quick"] if quick else [])
            # UCX writes which protocols and transports it picked
            ucx = os.path.join(tmp, "ucx")
            os.mkdir(ucx)
            env = {**ENV, "UCX_PROTO_INFO": "y", "UCX_PROTO_INFO_DIR": ucx}
            # A crash writes bytes that are not UTF-8 (issue 26)
            out = {"stdout": subprocess.PIPE, "text": True, "errors": "replace"}
            with on_host(hosts, b, argv, mpi, env if mpi else ENV, **out) as proc:
                stdout, _ = proc.communicate(timeout=600)
            result = last_json(stdout, proc)
            result["eth0_bytes"] = eth0_bytes(hosts) - before
            result["client_exit"] = proc.returncode
            if proc.returncode:  # after its result: at exit
                result["client_output"] = stdout[-2000:]
            if mpi:
                result["ucx_inter_node"] = ucx_protocols(ucx)
    return result


def ucx_protocols(directory: str) -> list[str]:
    """The protocols (and transports) UCX picked between hosts, from the
    graphs ``UCX_PROTO_INFO_DIR`` holds: ``"eager short: tcp/eth0"``"""
    found = set()
    for entry in os.listdir(directory):
        if "_inter_node_" in entry:
            with open(os.path.join(directory, entry)) as f:
                text = f.read()
            match = re.search(r'node0 \[label="([^"]*)"', text)
            if match:
                found.add(match.group(1).replace("\\n", ": "))
    return sorted(found)


def workloads_run(hosts: SimulatedHosts, protocol: str, args) -> dict:
    """A scheduler on host 1, a worker on each other host, the client on host 1"""
    mpi = protocol == "mpi"
    first, others = hosts.names[0], hosts.names[1:]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = os.path.join(tmp, "scheduler.json")
        scheduler = ["-m", "distributed.cli.dask_scheduler", "--protocol", protocol]
        scheduler += ["--scheduler-file", path, "--no-dashboard"]
        jobs = [stack.enter_context(on_host(hosts, first, scheduler, mpi, **quiet))]
        wait_for_file(path, jobs[0])
        worker = ["-m", "distributed.cli.dask_worker", "--scheduler-file", path]
        worker += ["--no-nanny", "--nthreads", "1", "--no-dashboard"]
        for name in others:
            jobs.append(stack.enter_context(on_host(hosts, name, worker, mpi, **quiet)))
        argv = [HERE, "workloads", protocol, path, str(len(others))]
        argv += ["--repeat", str(args.repeat)] + (["--quick"] if args.quick else [])
        before = eth0_bytes(hosts)
        with on_host(
            hosts,
            first,
            argv,
            False,
            stdout=subprocess.PIPE,
            text=True,
            errors="replace",
        ) as proc:
            stdout, _ = proc.communicate(timeout=600)
        result = last_json(stdout, proc)
        result["eth0_bytes"] = eth0_bytes(hosts) - before
        # The client shut the cluster down: how its processes (or mpiexec) ended
        result["exits"] = {"client": proc.returncode}
        for name, job in zip(["scheduler", *others], jobs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(10)
            result["exits"][name] = job.returncode
    result["seconds"] = time.perf_counter() - start
    return result


def summarize(results: dict) -> None:
    for setting, runs in results["runs"].items():
        pp = results["pingpong"][setting] = {}
        for protocol in ["tcp://", "mpi://"]:
            done = [r["pingpong"] for r in runs[protocol]]
            keys = [k for k in done[0] if k == "dict" or k.isdigit()]
            pp[protocol] = {
                k: statistics.median(t for d in done for t in d[k]) for k in keys
            }
        pp["mpi/tcp"] = {k: pp["mpi://"][k] / pp["tcp://"][k] for k in pp["tcp://"]}
        wl = results["workloads"][setting] = {}
        for name in NAMES:
            row = wl[name] = {}
            for protocol in ["tcp://", "mpi://"]:
                done = [r["cluster"]["workloads"][name] for r in runs[protocol]]
                times = [t for d in done for t in d["times"]]
                row[protocol] = {
                    "seconds": statistics.median(times),
                    "times": times,
                    "bytes_moved": statistics.median(d["bytes_moved"] for d in done),
                }
                over = [d["over_mpi_bytes"] for d in done if d["over_mpi_bytes"]]
                if over:
                    row[protocol]["over_mpi_bytes"] = statistics.median(over)
            row["mpi/tcp"] = row["mpi://"]["seconds"] / row["tcp://"]["seconds"]


def check(results: dict) -> list[str]:
    """What went wrong: data that should have gone over MPI (or eth0) did not"""
    problems = []
    for setting, runs in results["runs"].items():
        for run in runs["mpi://"]:
            pp, cluster = run["pingpong"], run["cluster"]
            # Each message of 1 MiB or more, both ways, over MPI
            big = sum(
                int(k) * (len(v) + 2) * 2
                for k, v in pp.items()
                if k.isdigit() and int(k) >= 2**20
            )
            if pp.get("over_mpi_bytes", 0) < 0.9 * big:  # the first go over TCP
                problems.append(
                    f"{setting} ping-pong: {pp.get('over_mpi_bytes')} bytes "
                    f"over MPI, {big} expected"
                )
            picked = pp.get("ucx_inter_node") or ["nothing"]
            if any(not p.endswith(": tcp/eth0") for p in picked):
                problems.append(f"{setting} ping-pong: UCX between hosts: {picked}")
            moved = sum(cluster["moved_over_mpi"].values()) / 2
            expected = sum(
                w["bytes_moved"] * len(w["times"])
                for w in cluster["workloads"].values()
            )
            if moved < 0.9 * expected:
                problems.append(
                    f"{setting} workloads: {moved:.0f} bytes over MPI, "
                    f"{expected} moved in the timed runs"
                )
        for protocol, rs in runs.items():
            for run in rs:
                pp = run["pingpong"]
                payload = sum(
                    int(k) * (len(v) + 2) * 2 for k, v in pp.items() if k.isdigit()
                )
                if pp["eth0_bytes"] < payload:  # rx + tx of two hosts: 2x this
                    problems.append(
                        f"{setting} {protocol} ping-pong: {pp['eth0_bytes']} bytes "
                        f"on eth0, {payload} expected"
                    )
    return problems


def print_table(results: dict) -> None:
    for setting, pp in results["pingpong"].items():
        print(f"ping-pong, {setting}, one-way (median)")
        print(f"{'size':>10s} {'tcp://':>12s} {'mpi://':>12s} {'mpi/tcp':>8s}")
        for key in pp["tcp://"]:
            tcp, mpi = pp["tcp://"][key], pp["mpi://"][key]
            print(
                f"{key:>10s} {tcp * 1e6:10.1f}us {mpi * 1e6:10.1f}us "
                f"{pp['mpi/tcp'][key]:8.2f}"
            )
    print(
        f"{'workload':14s} {'setting':9s} {'tcp s':>8s} {'mpi s':>8s} {'mpi/tcp':>8s}"
    )
    for setting, table in results["workloads"].items():
        for name, row in table.items():
            print(
                f"{name:14s} {setting:9s} {row['tcp://']['seconds']:8.3f} "
                f"{row['mpi://']['seconds']:8.3f} {row['mpi/tcp']:8.2f}"
            )


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (lat, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = {"tcp://": "tab:blue", "mpi://": "tab:orange"}
    styles = {"capped": "-", "uncapped": ":"}
    for setting, pp in results["pingpong"].items():
        for protocol in ["tcp://", "mpi://"]:
            xs = sorted(int(k) for k in pp[protocol] if k != "dict")
            ys = [pp[protocol][str(x)] * 1e6 for x in xs]
            lat.loglog(
                xs,
                ys,
                styles[setting],
                marker="o",
                color=colors[protocol],
                label=f"{protocol} {setting}",
            )
    lat.set(xlabel="message size (bytes)", ylabel="one-way latency (us, median)")
    lat.set_title("ping-pong between two hosts")
    lat.grid(True, which="both", alpha=0.3)
    lat.legend()
    groups = [
        (setting, name)
        for setting, table in results["workloads"].items()
        for name in table
    ]
    for i, protocol in enumerate(["tcp://", "mpi://"]):
        xs = [j + (i - 0.5) * 0.4 for j in range(len(groups))]
        ys = [results["workloads"][s][n][protocol]["seconds"] for s, n in groups]
        drawn = bars.bar(xs, ys, 0.4, color=colors[protocol], label=protocol)
        bars.bar_label(drawn, fmt="%.2f", fontsize=8)
    bars.set_xticks(
        range(len(groups)), [f"{n.replace('_', ' ')}\n{s}" for s, n in groups]
    )
    bars.set_ylabel("wall time (s, median)")
    bars.set_title("scheduler, client on host 1; a worker on each of hosts 2-4")
    bars.legend()
    fig.suptitle(
        f"Across simulated hosts, eth0 {CAP}" + (" (quick)" if results["quick"] else "")
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "hosts.png"), dpi=100)


def main() -> None:
    import pingpong

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(BENCHMARKS, "results"))
    parser.add_argument("--capped-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=None)
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return
    rounds = args.rounds or (1 if args.quick else 2)
    args.repeat = args.repeat or (1 if args.quick else 3)
    settings = ["capped"] + ([] if args.capped_only else ["uncapped"])
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": pingpong.versions(),
        "quick": args.quick,
        "settings": {
            "cap": f"tc qdisc add dev eth0 root {CAP}",
            "hosts": 4,
            "rounds": rounds,
            "repeat": args.repeat,
            "warm_up": 1,
            "sizes": sizes(args.quick),
            "workload_sizes": workload_sizes(args.quick),
            "mpi_path": "MPICH ch4:ucx; separate mpiexec -n 1 per process; "
            "UCX over TCP on eth0 (UCX_NET_DEVICES=eth0, no shared IPC or /dev/shm)",
        },
        "order": [],
        "runs": {s: {"tcp://": [], "mpi://": []} for s in settings},
        "pingpong": {},
        "workloads": {},
    }
    # SIGTERM unwinds as Ctrl-C does: every process stopped, the hosts removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.perf_counter()
    results["load_average"] = {"before": os.getloadavg()}  # others' work too
    with SimulatedHosts(4) as hosts:
        results["settings"]["names"] = hosts.names
        for setting in settings:
            set_cap(hosts, setting == "capped")
            for rnd in range(rounds):
                order = ["tcp", "mpi"] if rnd % 2 == 0 else ["mpi", "tcp"]
                for protocol in order:
                    print(
                        f"{setting}, round {rnd + 1}: {protocol}://",
                        file=sys.stderr,
                        flush=True,
                    )
                    run = {"round": rnd + 1}
                    run["pingpong"] = pingpong_run(hosts, protocol, args.quick)
                    run["cluster"] = workloads_run(hosts, protocol, args)
                    results["runs"][setting][f"{protocol}://"].append(run)
                    results["order"].append([setting, rnd + 1, f"{protocol}://"])
    results["seconds"] = time.perf_counter() - start
    results["load_average"]["after"] = os.getloadavg()
    summarize(results)
    results["problems"] = check(results)
    with open(os.path.join(args.out, "hosts.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    print_table(results)
    print(f"({results['seconds']:.0f} s in all)")
    if results["problems"]:
        sys.exit("\n".join(results["problems"]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        import pingpong

        pingpong.run_client(client)
    elif sys.argv[1:2] == ["workloads"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("what")
        parser.add_argument("protocol")
        parser.add_argument("scheduler_file")
        parser.add_argument("workers", type=int)
        parser.add_argument("--repeat", type=int, default=1)
        parser.add_argument("--quick", action="store_true")
        args = parser.parse_args()
        run_workloads(args.protocol, args.scheduler_file, args.workers, args)
    else:
        main()
