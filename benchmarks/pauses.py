"""Round trips with pauses between them, receiver idle or busy: tcp:// vs mpi://.

    python benchmarks/pauses.py [--quick] [--rounds 2] [--out benchmarks/results]

Ping-pong sends the next message as soon as the last one is back; Dask's
scheduler and workers mostly talk now and then, while their task threads
compute. Here a client process sleeps ``gap`` (0 to 100 ms) before each round
trip of a small message to an echoing server and times the round trip
(median per gap), in two series:

- ``idle``: the server does nothing else;
- ``busy``: the server runs a task thread all along, as a worker computing
  does: a loop of pure-Python work (about 1 ms; it holds the GIL, so the event
  loop's thread waits for it up to the switch interval, 5 ms) and a NumPy
  ufunc over 1 MiB (which releases the GIL while it runs).

The two transports are measured in the same two processes, each started by
``mpiexec -n 1``: the server listens on tcp:// and on mpi://, the client holds
a comm to each and alternates between them, round trip by round trip (tcp
first, then mpi first), each after its own pause. Separate processes per
transport differ by up to 30 % from one start to the next at long pauses (the
VM's wake-up latency), which no number of samples removes. A third series,
``control``, measures tcp:// against tcp:// the same way (receiver idle): how
far from 1.0 the method itself lands. The figure per gap is the median of all
round trips of all rounds (``per_round`` holds each round's median). Writes
``pauses.json`` (``round_trip``: receiver idle, ``round_trip_busy``: receiver
busy, ``round_trip_control``: tcp:// twice; seconds, by gap in seconds;
``intervals``: a 95 % bootstrap interval of each ratio) and ``pauses.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import pingpong
from processes import launch, stop, wait_for_file
from stats import ratio_interval

HERE = os.path.abspath(__file__)
GAPS = [0, 0.0005, 0.002, 0.005, 0.03, 0.1]  # seconds
SERIES = {
    "idle": "round_trip",
    "busy": "round_trip_busy",
    "control": "round_trip_control",
}
# What each series measures against what
SERIES_PROTOCOLS = {
    "idle": (["tcp", "mpi"], ["tcp://", "mpi://"]),
    "busy": (["tcp", "mpi"], ["tcp://", "mpi://"]),
    "control": (["tcp", "tcp"], ["tcp://", "tcp:// again"]),
}


def repetitions(gap: float, quick: bool) -> int:
    """Round trips per gap and transport: 200 (50 quick), fewer where the
    gaps add up to more than 20 s (2 s quick)"""
    most, seconds = (50, 2) if quick else (200, 20)
    return most if gap == 0 else max(20, min(most, int(seconds / gap)))


async def client(addresses: str, quick: bool) -> dict:
    """Round trips over a comm to each of ``addresses`` (space-separated),
    alternating: ``{transport: {gap: [seconds, ...]}}``"""
    from distributed.comm import connect

    comms = [await connect(address) for address in addresses.split()]
    for comm in comms:
        for _ in range(20):  # warm up
            await comm.write({"op": "ping"})
            await comm.read()
    times: list[dict] = [{} for _ in comms]
    for gap in GAPS:
        for t in times:
            t[str(gap)] = []
        for i in range(repetitions(gap, quick)):
            for k in range(len(comms)) if i % 2 == 0 else reversed(range(len(comms))):
                await asyncio.sleep(gap)
                start = time.perf_counter()
                await comms[k].write({"op": "ping"})
                await comms[k].read()
                times[k][str(gap)].append(time.perf_counter() - start)
    for comm in comms:
        await comm.close()
    return {f"{i}": t for i, t in enumerate(times)}


def busy_task() -> None:
    """A task thread that never ends: pure Python, then NumPy, again and again"""
    import numpy as np

    a = np.random.random(2**17)  # 1 MiB
    while True:
        total = 0
        for i in range(10_000):  # about 1 ms of pure Python
            total += i * i
        np.sqrt(a, out=a)  # releases the GIL
        a += 1.0


def serve(protocols: str, path: str, busy: bool) -> None:
    if busy:
        threading.Thread(target=busy_task, daemon=True, name="task").start()
    asyncio.run(pingpong.serve(protocols, path))


def run_series(protocols: list[str], quick: bool, busy: bool) -> list[dict]:
    """The client's round trips to a server on ``protocols``, by protocol"""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "address")
        server_args = [HERE, "serve", ",".join(protocols), path]
        server = launch(
            server_args + (["--busy"] if busy else []),
            True,
            stdout=subprocess.DEVNULL,  # mpiexec's banner when it is stopped
        )
        try:
            addresses = wait_for_file(path, server)
            args = [HERE, "client", addresses] + (["--quick"] if quick else [])
            client_proc = launch(args, True, stdout=subprocess.PIPE, text=True)
            stdout, _ = client_proc.communicate(timeout=1800)
            result = json.loads(stdout.strip().splitlines()[-1])
        finally:
            stop(server)
    return [result[f"{i}"] for i in range(len(protocols))]


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (rt, ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    gaps = list(results["round_trip"]["tcp://"])  # evenly spaced, labelled
    xs = range(len(gaps))
    for series, key in SERIES.items():
        style = {"idle": "-", "busy": "--", "control": ":"}[series]
        figures = results[key]
        if series != "control":
            for protocol, by_gap in figures.items():
                rt.plot(
                    xs,
                    [by_gap[g] * 1e3 for g in gaps],
                    style,
                    marker="o",
                    label=f"{protocol} receiver {series}",
                )
        a, b = figures.values()
        ratio.plot(
            xs,
            [b[g] / a[g] for g in gaps],
            style,
            marker="o",
            label=(
                "tcp:// / tcp:// (control)"
                if series == "control"
                else f"receiver {series}"
            ),
        )
    ratio.axhline(1.0, color="black", linewidth=1)
    rt.set(ylabel="round trip (ms, median)", ylim=(0, None))
    ratio.set(ylabel="round trip mpi:// / tcp://", ylim=(0, None))
    for ax in (rt, ratio):
        ax.set(xlabel="pause before each round trip (ms)")
        ax.set_xticks(xs, [f"{float(g) * 1e3:g}" for g in gaps])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        "round trips of a small message after a pause"
        + (" (quick)" if results["quick"] else "")
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pauses.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": pingpong.versions(),
        "quick": args.quick,
        "gaps_ms": [g * 1e3 for g in GAPS],
        "repetitions": {str(g): repetitions(g, args.quick) for g in GAPS},
        "rounds": args.rounds,
        "busy_task": busy_task.__doc__,
    }
    per_round: dict = {s: {} for s in SERIES}
    for rnd in range(args.rounds):
        for series, (protocols, labels) in SERIES_PROTOCOLS.items():
            print(f"round {rnd + 1}: {series}", file=sys.stderr)
            times = run_series(protocols, args.quick, busy=series == "busy")
            for label, t in zip(labels, times):
                per_round[series].setdefault(label, []).append(t)
    results["intervals"] = {}
    for series, key in SERIES.items():
        # Every round trip of every round, by protocol and gap
        pooled = {
            protocol: {str(g): [t for r in rounds for t in r[str(g)]] for g in GAPS}
            for protocol, rounds in per_round[series].items()
        }
        results[key] = {
            protocol: {g: statistics.median(t) for g, t in by_gap.items()}
            for protocol, by_gap in pooled.items()
        }
        a, b = pooled.values()  # tcp://, then mpi:// (control: tcp://)
        results["intervals"][key] = {g: ratio_interval(b[g], a[g]) for g in a}
    results["per_round"] = {
        series: {
            protocol: [{g: statistics.median(t) for g, t in r.items()} for r in rounds]
            for protocol, rounds in by_protocol.items()
        }
        for series, by_protocol in per_round.items()
    }
    with open(os.path.join(args.out, "pauses.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    summarize(results)


def summarize(results: dict) -> None:
    print("series    gap (ms)     a (us)     b (us)       b/a  95 % interval")
    for series, key in SERIES.items():
        a, b = results[key].values()  # tcp://, then mpi:// (control: tcp://)
        for gap in a:
            low, high = results["intervals"][key][gap]
            print(
                f"{series:8s} {float(gap) * 1e3:9g} {a[gap] * 1e6:10.0f}"
                f" {b[gap] * 1e6:10.0f} {b[gap] / a[gap]:9.2f}"
                f"      {low:.2f}-{high:.2f}"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        pingpong.run_client(client)
    elif sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], sys.argv[3], "--busy" in sys.argv[4:])
    else:
        main()
