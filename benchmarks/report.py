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


def targets(pp: dict | None, apps: dict | None, idle: dict | None) -> list[str]:
    lines = ["| target | measured | met |", "|---|---|---|"]
    if pp:
        t = pp["transports"]
        small = [k for k in t["tcp://"] if k != "dict" and int(k) <= 1024]
        large = [k for k in t["tcp://"] if k != "dict" and int(k) >= 2**24]
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
            f"| idle: mpi CPU no more than tcp | mpi {mpi:.2f} s, tcp {tcp:.2f} s of CPU over {idle['mpi']['seconds']:g} s | {'yes' if mpi <= tcp * 1.2 else 'no'} |"
        )
    return lines


def main(out: str) -> None:
    pp, apps, idle, conn = (
        load(out, n) for n in ["pingpong", "apps", "idle", "connect"]
    )
    lines = ["# Benchmark summary", ""]
    if pp:
        m = pp["machine"]
        lines += [
            f"Machine: {m['cpus']} CPUs, Python {m['python']}, {m['mpi_library']}, "
            f"distributed {m['distributed']}, mpi4py {m['mpi4py']}"
            + (" (quick run)" if pp["quick"] else ""),
            "",
        ]
    lines += ["## Targets", ""] + targets(pp, apps, idle) + [""]
    if pp:
        lines += (
            ["## Ping-pong, one-way latency (median)", ""] + pingpong_lines(pp) + [""]
        )
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
