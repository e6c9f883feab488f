"""Summarize the JSON files of a benchmark run against the project's targets:

    python -m benchmarks.report [results folder]

Writes ``summary.md`` beside the JSON files and prints it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def load(out: str, name: str) -> dict | None:
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def one_job(transports: dict) -> dict:
    """mpi:// between two ranks of one job, where raw mpi4py runs: the figures
    to compare with raw (plain mpi:// in runs from before they were measured)"""
    return transports.get("mpi:// one job", transports["mpi://"])


def pingpong_lines(pp: dict) -> list[str]:
    t = pp["transports"]
    names = list(t)
    job = one_job(t)
    lines = [
        "| size | " + " | ".join(names) + " | mpi/tcp | mpi one job/raw |",
        "|---:|" + "---:|" * (len(names) + 2),
    ]
    for key in t["tcp://"]:
        cells = [f"{t[n][key] * 1e6:.1f} us" if key in t[n] else "" for n in names]
        ratio = t["mpi://"][key] / t["tcp://"][key]
        raw = t["raw mpi4py"].get(key)
        cells += [f"{ratio:.2f}", f"{job[key] / raw:.1f}" if raw else ""]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def workload_ratios(wl: dict) -> dict[tuple[str, str], float]:
    """mpi/tcp of each (mode, workload) measured on both protocols"""
    return {
        (mode, name): row["mpi/tcp"]
        for mode, table in wl["workloads"].items()
        for name, row in table.items()
        if "mpi/tcp" in row
    }


def workload_intervals(wl: dict) -> dict[tuple[str, str], list[float]]:
    """The 95 % interval of each (mode, workload)'s mpi/tcp, where measured"""
    return {
        (mode, name): row["mpi/tcp 95%"]
        for mode, table in wl["workloads"].items()
        for name, row in table.items()
        if "mpi/tcp 95%" in row
    }


def pause_intervals(pauses: dict, key: str) -> dict[str, list[float]]:
    """The 95 % interval of mpi/tcp by gap, labelled as :func:`pause_ratios`"""
    intervals = pauses.get("intervals", {}).get(key, {})
    return {f"{float(g) * 1e3:g} ms": i for g, i in intervals.items()}


def pause_ratios(pauses: dict, key: str) -> dict[str, float]:
    """mpi/tcp by gap (ms) of ``round_trip`` or ``round_trip_busy``"""
    tcp, mpi = pauses[key]["tcp://"], pauses[key]["mpi://"]
    return {f"{float(g) * 1e3:g} ms": mpi[g] / tcp[g] for g in tcp}


def worst(ratios: dict, intervals: dict | None = None) -> str:
    """The highest ratio, and its 95 % interval where ``intervals`` has one"""
    key = max(ratios, key=ratios.get)
    name = " ".join(key) if isinstance(key, tuple) else key
    interval = (intervals or {}).get(key)
    if interval:
        name += ", 95 % interval {:.2f}-{:.2f}".format(*interval)
    return f"worst {ratios[key]:.2f} ({name})"


def targets(
    pp: dict | None,
    apps: dict | None,
    idle: dict | None,
    wl: dict | None = None,
    pauses: dict | None = None,
) -> list[str]:
    lines = ["| target | measured | met |", "|---|---|---|"]
    if wl:
        ratios = workload_ratios(wl)
        others = {k: r for k, r in ratios.items() if k[1] != "data_heavy"}
        heavy = {k: r for k, r in ratios.items() if k[1] == "data_heavy"}
        if others:
            met = all(r <= 0.9 for r in others.values())
            lines.append(
                f"| real workloads: mpi/tcp <= 0.9, LocalCluster and one mpiexec job | {worst(others, workload_intervals(wl))} | {'yes' if met else 'no'} |"
            )
        if heavy:
            met = all(r <= 0.6 for r in heavy.values())
            lines.append(
                f"| data-heavy workload: mpi/tcp <= 0.6 | {worst(heavy)} | {'yes' if met else 'no'} |"
            )
    if pauses:
        for key, who in [("round_trip", "idle"), ("round_trip_busy", "busy")]:
            if key in pauses:
                ratios = pause_ratios(pauses, key)
                met = all(r <= 1.0 for r in ratios.values())
                lines.append(
                    f"| pauses, receiver {who}: mpi/tcp <= 1.0 at every gap | {worst(ratios, pause_intervals(pauses, key))} | {'yes' if met else 'no'} |"
                )
    if pp:
        t = pp["transports"]
        small = [k for k in t["tcp://"] if k != "dict" and int(k) <= 1024]
        large = [k for k in t["tcp://"] if k != "dict" and int(k) >= 2**24]
        sizes = [k for k in t["tcp://"] if k != "dict"]
        slowest = max(sizes, key=lambda k: t["mpi://"][k] / t["tcp://"][k])
        ratio = t["mpi://"][slowest] / t["tcp://"][slowest]
        lines.append(
            f"| ping-pong: mpi no slower than tcp at any size | worst {ratio:.2f} ({int(slowest)} B) | {'yes' if ratio <= 1 else 'no'} |"
        )
        ratio = statistics.median(t["mpi://"][k] / t["tcp://"][k] for k in small)
        lines.append(
            f"| small messages: mpi latency <= 1/4 of tcp | {ratio:.2f} of tcp (median over 1 B - 1 KiB) | {'yes' if ratio <= 0.25 else 'no'} |"
        )
        job = one_job(t)
        raw = statistics.median(job[k] / t["raw mpi4py"][k] for k in small)
        lines.append(
            f"| small messages: mpi latency <= 3x raw mpi4py | {raw:.0f}x raw (one job) | {'yes' if raw <= 3 else 'no'} |"
        )
        if large:
            bw = statistics.median(t["tcp://"][k] / t["mpi://"][k] for k in large)
            lines.append(
                f"| large messages: mpi bandwidth >= 2x tcp | {bw:.2f}x tcp | {'yes' if bw >= 2 else 'no'} |"
            )
            raw_bw = statistics.median(t["raw mpi4py"][k] / job[k] for k in large)
            lines.append(
                f"| large messages: mpi bandwidth >= 80 % of raw | {100 * raw_bw:.0f} % of raw (one job) | {'yes' if raw_bw >= 0.8 else 'no'} |"
            )
        if "ucx://" in t:
            faster = all(t["mpi://"][k] < t["ucx://"][k] for k in t["ucx://"])
            lines.append(
                f"| mpi faster than ucx at every size | {'yes' if faster else 'no'} | {'yes' if faster else 'no'} |"
            )
        else:
            lines.append(
                "| mpi faster than ucx at every size | ucx not installed in this run | - |"
            )
    if apps:
        p = apps["protocols"]
        for name in ["transpose_sum", "merge", "dot"]:
            r = p["mpi://"][name]["wall_time"] / p["tcp://"][name]["wall_time"]
            goal = name != "dot"
            lines.append(
                f"| {name}: mpi wall time {'<= 0.8x tcp' if goal else '(no target)'} | {r:.2f}x tcp | {('yes' if r <= 0.8 else 'no') if goal else '-'} |"
            )
    if idle:
        tcp, mpi = idle["tcp"]["cpu_seconds"], idle["mpi"]["cpu_seconds"]
        lines.append(
            f"| idle: mpi CPU no more than tcp | mpi {mpi:.2f} s, tcp {tcp:.2f} s of CPU over {idle['mpi']['seconds']:g} s | {'yes' if mpi <= tcp else 'no'} |"
        )
    return lines


def workloads_lines(wl: dict) -> list[str]:
    s = wl["settings"]
    lines = [
        f"A scheduler and {s['workers']} workers of {s['threads']} thread(s); "
        f"{s['repeat']} pairs of timed runs (one tcp://, one mpi://, next to each "
        f"other) in each of {s['rounds']} round(s); mpi/tcp is the median of "
        "the pairs' ratios.",
        "",
        "The interval after mpi/tcp: 95 % of bootstrap resamplings of the pairs "
        "fall there.",
        "",
        "In transfers: seconds of the workers' transfers of task data (fetching "
        "a task's inputs, P2P's sends), summed over the workers and over "
        "transfers at once.",
        "",
        "| workload | launched by | tcp:// | mpi:// | mpi/tcp | moved between workers "
        "| over MPI | CPU s tcp:// | CPU s mpi:// | in transfers s tcp:// "
        "| in transfers s mpi:// |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, table in wl["workloads"].items():
        for name, row in table.items():
            t, m = row.get("tcp://", {}), row.get("mpi://", {})
            secs = lambda r: f"{r['seconds']:.3f} s" if r else "-"  # noqa: E731
            cpu = lambda r: f"{r['cpu_seconds']:.1f}" if r else "-"  # noqa: E731
            mib = lambda v: (
                f"{v / 2**20:.0f} MiB" if v is not None else "-"
            )  # noqa: E731
            ratio = f"{row['mpi/tcp']:.2f}" if "mpi/tcp" in row else "-"
            if "mpi/tcp 95%" in row:
                ratio += " ({:.2f}-{:.2f})".format(*row["mpi/tcp 95%"])
            in_transfers = lambda r: (  # noqa: E731
                f"{r['transfer_seconds']:.2f}" if "transfer_seconds" in r else "-"
            )
            lines.append(
                f"| {name} | {mode} | {secs(t)} | {secs(m)} | {ratio} | "
                f"{mib((m or t).get('bytes_moved'))} | {mib(m.get('over_mpi_bytes'))} | "
                f"{cpu(t)} | {cpu(m)} | {in_transfers(t)} | {in_transfers(m)} |"
            )
    return lines


def pauses_lines(pauses: dict) -> list[str]:
    series = [
        (k, w)
        for k, w in [("round_trip", "idle"), ("round_trip_busy", "busy")]
        if k in pauses
    ]
    control = pauses.get("round_trip_control")
    head = "| pause |"
    for _, who in series:
        head += f" tcp:// {who} | mpi:// {who} | mpi/tcp {who} |"
    if control:
        head += " tcp/tcp (control) |"
    columns = 3 * len(series) + bool(control)
    lines = [head, "|---:|" + "---:|" * columns]
    for gap in pauses["round_trip"]["tcp://"]:
        row = f"| {float(gap) * 1e3:g} ms |"
        for key, _ in series:
            tcp, mpi = pauses[key]["tcp://"][gap], pauses[key]["mpi://"][gap]
            row += f" {tcp * 1e6:.0f} us | {mpi * 1e6:.0f} us | {mpi / tcp:.2f} |"
        if control:
            a, b = (by_gap[gap] for by_gap in control.values())
            row += f" {b / a:.2f} |"
        lines.append(row)
    return lines


def hosts_lines(hosts: dict) -> list[str]:
    """``hosts.py``: ping-pong and workloads across simulated hosts"""
    s = hosts["settings"]
    lines = [
        f"eth0 of each host: `{s['cap']}` (capped); MPI: {s['mpi_path']}.",
        "",
        "| | "
        + " | ".join(
            f"tcp:// {k} | mpi:// {k} | mpi/tcp {k}" for k in hosts["pingpong"]
        )
        + " |",
        "|---|" + "---:|" * 3 * len(hosts["pingpong"]),
    ]
    first = next(iter(hosts["pingpong"].values()))
    for key in first["tcp://"]:
        row = f"| ping-pong {key} |"
        for pp in hosts["pingpong"].values():
            tcp, mpi = pp["tcp://"][key], pp["mpi://"][key]
            row += f" {tcp * 1e6:.0f} us | {mpi * 1e6:.0f} us | {mpi / tcp:.2f} |"
        lines.append(row)
    for name in next(iter(hosts["workloads"].values())):
        row = f"| {name} |"
        for table in hosts["workloads"].values():
            r = table[name]
            row += f" {r['tcp://']['seconds']:.3f} s | {r['mpi://']['seconds']:.3f} s | {r['mpi/tcp']:.2f} |"
        lines.append(row)
    if hosts.get("problems"):
        lines += ["", "Problems: " + "; ".join(hosts["problems"])]
    return lines


SUMMARIZED = ["pingpong", "apps", "idle", "connect", "workloads", "pauses", "hosts"]


def first_with_machine(*results: dict | None) -> dict | None:
    """The first of ``results`` that says which machine it ran on"""
    return next((r for r in results if r and "machine" in r), None)


def main(out: str) -> None:
    pp, apps, idle, conn, wl, pauses, hosts = (load(out, n) for n in SUMMARIZED)
    lines = ["# Benchmark summary", ""]
    first = first_with_machine(pp, wl, pauses)
    if first:
        m = first["machine"]
        lines += [
            f"Machine: {m['cpus']} CPUs, Python {m['python']}, {m['mpi_library']}, "
            f"distributed {m['distributed']}, mpi4py {m['mpi4py']}"
            + (" (quick run)" if first["quick"] else ""),
            "",
        ]
    lines += ["## Targets", ""] + targets(pp, apps, idle, wl, pauses) + [""]
    if wl:
        lines += (
            ["## Real workloads, wall time (median)", ""] + workloads_lines(wl) + [""]
        )
    if pauses:
        lines += (
            ["## Round trips after a pause (median), receiver idle or busy", ""]
            + pauses_lines(pauses)
            + [""]
        )
    if pp:
        lines += (
            ["## Ping-pong, one-way latency (median)", ""] + pingpong_lines(pp) + [""]
        )
    if hosts:
        lines += ["## Across simulated hosts (median)", ""] + hosts_lines(hosts) + [""]
    if apps:
        lines += [
            "## Applications",
            "",
            "| benchmark | tcp:// | mpi:// | mpi/tcp | moved between workers "
            "| CPU s tcp:// | CPU s mpi:// |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        p = apps["protocols"]
        for name in p["tcp://"]:
            t, m = p["tcp://"][name], p["mpi://"][name]
            lines.append(
                f"| {name} | {t['wall_time']:.2f} s | {m['wall_time']:.2f} s | "
                f"{m['wall_time'] / t['wall_time']:.2f} | {m['bytes_moved'] / 2**20:.0f} MiB | "
                f"{t.get('cpu_seconds', float('nan')):.1f} | {m.get('cpu_seconds', float('nan')):.1f} |"
            )
        lines.append("")
    if conn:
        lines += [
            "## Connection set-up",
            "",
            "| | tcp:// | mpi:// |",
            "|---|---:|---:|",
        ]
        for key, unit, scale in [
            ("init", "ms", 1e3),
            ("first", "ms", 1e3),
            ("next", "ms", 1e3),
            ("many_comms", "s", 1),
            ("many_processes", "s", 1),
        ]:
            lines.append(
                f"| {key} | {conn['tcp'][key] * scale:.2f} {unit} | {conn['mpi'][key] * scale:.2f} {unit} |"
            )
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(__file__), "results")
    )
