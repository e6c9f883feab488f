"""Publish benchmark results as the project's docs:

    python benchmarks/publish.py [RESULTS]

copies the JSON files of a run in RESULTS (``benchmarks/results`` by default;
``docs/benchmarks`` to rewrite the pages from what is published) into
``docs/benchmarks/`` without their raw samples, with their plots, then writes
``docs/benchmarks.rst`` and the speed table of ``README.rst`` from
``docs/benchmarks/*.json``.  Neither page is edited by hand: what they say is
what the benchmarks last wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys

import report

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = os.path.join(ROOT, "docs", "benchmarks")
PAGE = os.path.join(ROOT, "docs", "benchmarks.rst")
README = os.path.join(ROOT, "README.rst")
NAMES = [
    "pingpong",
    "pauses",
    "workloads",
    "scale",
    "idle",
    "connect",
    "apps",
    "hosts",
    "soak",
    "gpu",
    "gpu-direct",
    "gpu_costs",
]
# Raw samples, which the pages and plots do not need: (key path, ...)
RAW = {
    "hosts": [("runs",)],
    "workloads": [("runs",)],
    "soak": [("protocols", "*", "cycles")],
}
# Of the soak's samples, what its plot shows
SOAK_PLOTTED = {"rss", "fds", "shm_maps", "mpi"}
README_START = ".. speed table: written by benchmarks/publish.py"
README_END = ".. end of the speed table"


def copy_run(results: str) -> None:
    """The run's JSON, without raw samples, and plots into docs/benchmarks"""
    for name in NAMES:
        source = os.path.join(results, f"{name}.json")
        if not os.path.exists(source):
            continue
        with open(source) as f:
            data = json.load(f)
        if name == "gpu" and data.get("gpu", "").startswith("none"):
            sys.exit(f"{source} is a rehearsal without a GPU: not published")
        for path in RAW.get(name, []):
            _drop(data, path)
        if name == "soak":
            for protocol in data["protocols"].values():
                protocol["samples"] = [_plotted(s) for s in protocol.get("samples", [])]
        with open(os.path.join(DOCS, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        plot, published = os.path.join(results, f"{name}.png"), figure_path(name)
        if os.path.abspath(plot) == published:
            continue
        if os.path.exists(plot):
            shutil.copyfile(plot, published)
        elif os.path.exists(published):  # an older run's: not of these figures
            os.unlink(published)


def _plotted(sample: dict) -> dict:
    """A soak sample, with what its plot shows"""
    kept = {"cycle": sample["cycle"], "shm": sample["shm"]}
    for role, value in sample.items():
        if isinstance(value, dict) and role != "shm":
            kept[role] = {k: v for k, v in value.items() if k in SOAK_PLOTTED}
            if isinstance(kept[role].get("mpi"), dict):
                kept[role]["mpi"] = {"by_id": kept[role]["mpi"].get("by_id")}
    return kept


def _drop(data: dict, path: tuple) -> None:
    key, rest = path[0], path[1:]
    targets = data.values() if key == "*" else [data] if not rest else [data.get(key)]
    if not rest:
        data.pop(key, None)
        return
    for target in targets:
        if isinstance(target, dict):
            _drop(target, rest)


def load(name: str) -> dict | None:
    return report.load(DOCS, name)


# --- reStructuredText ---


def rst_table(rows: list[list[str]]) -> list[str]:
    """A simple table; the first row is the header"""
    rows = [[cell.strip() or "\\ " for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rule = "  ".join("=" * w for w in widths)

    def line(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return [rule, line(rows[0]), rule, *map(line, rows[1:]), rule]


def from_markdown(lines: list[str]) -> list[str]:
    """report.py's markdown as reStructuredText: its pipe tables as simple
    tables, `code` as ``code``"""
    out: list[str] = []
    table: list[list[str]] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-:") for c in cells):  # the rule under the head
                table.append([_code(c) for c in cells])
            continue
        if table:
            out += rst_table(table) + [""]
            table = []
        out.append(_code(line))
    while out and not out[-1]:
        out.pop()
    return out


def _code(text: str) -> str:
    return re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", text)


def heading(title: str, mark: str = "-") -> list[str]:
    return [title, mark * len(title), ""]


def figure_path(name: str) -> str:
    return os.path.join(DOCS, f"{name}.png")


def figure(name: str) -> list[str]:
    if not os.path.exists(figure_path(name)):
        return []
    return [f".. image:: benchmarks/{name}.png", ""]


# --- sections the summary of report.py does not have ---


def frames_lines(wl: dict) -> list[str]:
    """MiB of the frames the workers wrote, by size (warm-up runs, tcp://)"""
    mode, table = next(iter(wl["workloads"].items()))
    bands = sorted(
        {
            int(b)
            for row in table.values()
            for b in row.get("tcp://", {}).get("frames", {})
        }
    )
    if not bands:
        return ["The frames were not counted in this run."]
    rows = [["workload", *(f"{_size(b)}+" for b in bands)]]
    for name, row in table.items():
        frames = row.get("tcp://", {}).get("frames", {})
        rows.append(
            [name, *(f"{frames.get(str(b), [0, 0])[1] / 2**20:.1f}" for b in bands)]
        )
    return [
        f"MiB the workers wrote in frames of each size, on ``tcp://`` ({mode}, "
        "the warm-up run of each workload):",
        "",
        *rst_table(rows),
    ]


def scale_lines(scale: dict) -> list[str]:
    s, i = scale["summary"], scale.get("intervals", {})
    rows = [["", "tcp://", "mpi://", "mpi/tcp", "95 % interval"]]
    for key, label in [
        ("tasks_per_s", "tiny tasks per second"),
        ("scheduler_cpu_s", "scheduler CPU s, tiny tasks"),
        ("idle_scheduler_cpu_s", "scheduler CPU s, idle 10 s"),
        ("idle_workers_cpu_s", "workers' CPU s, idle 10 s"),
    ]:
        tcp, mpi = s["tcp://"][key], s["mpi://"][key]
        interval = "{:.2f}-{:.2f}".format(*i[key]) if key in i else ""
        rows.append([label, f"{tcp:.1f}", f"{mpi:.1f}", f"{mpi / tcp:.2f}", interval])
    return [
        f"One scheduler and {scale['workers']} workers in four processes, "
        f"{scale['tasks']} tiny tasks; medians of {len(scale['rounds']['tcp'])} rounds.",
        "",
        *rst_table(rows),
    ]


def soak_lines(soak: dict) -> list[str]:
    s = soak["settings"]
    rows = [["", *soak["protocols"]]]
    summaries = [p["summary"] for p in soak["protocols"].values()]
    rows.append(["cycles right", *(str(x["cycles_ok"]) for x in summaries)])
    rows.append(
        ["seconds per cycle", *(f"{x['seconds_per_cycle']:.2f}" for x in summaries)]
    )
    for role in ["scheduler", "steady_worker", "client"]:
        rows.append(
            [
                f"RSS growth per cycle, {role.replace('_', ' ')}",
                *(
                    f"{x[role]['rss_growth_per_cycle'] / 1024:+.1f} KiB"
                    for x in summaries
                ),
            ]
        )
        rows.append(
            [
                f"open fds, {role.replace('_', ' ')}, first / last",
                *("{} / {}".format(*x[role]["fds"]) for x in summaries),
            ]
        )
    rows.append(
        ["mpich_shm files left", *(str(x["shm_files_left"]) for x in summaries)]
    )
    return [
        f"{s['cycles']} cycles of a worker joining, sending "
        f"{s['transfer'] // 2**20} MiB to a steady worker and leaving ("
        + ", ".join(s["modes"])
        + " in turn); RSS growth is a linear fit over the second half.",
        "",
        *rst_table(rows),
    ]


def gpu_lines(gpu: dict) -> list[str]:
    """The GPU run's tables: every transport, and each route of mpi://
    against tcp:// and ucx://, where they were measured"""
    pp, apps = gpu["pingpong"], gpu.get("apps", {})
    mine = [n for n in pp if n.startswith("mpi://")]
    pairs = [(m, b) for b in ("tcp://", "ucx://") if b in pp for m in mine]

    def table(figures: dict, first: str, value) -> list[str]:
        names = list(figures)
        rows = [[first, *names, *(f"{m} / {b}" for m, b in pairs)]]
        for key in dict.fromkeys(k for n in names for k in figures[n]):
            if key in ("gpu_path", "device_ipc"):
                continue
            cells = {n: value(figures[n][key]) for n in names if key in figures[n]}
            failed = {n for n, v in cells.items() if v is None}  # its error
            cells = {n: v for n, v in cells.items() if v is not None}
            label = _size(int(key)) if key.isdigit() else key
            row = [label]
            for n in names:
                row.append(
                    _seconds(cells[n])
                    if n in cells
                    else "failed" if n in failed else "-"
                )
            for m, b in pairs:
                both = m in cells and b in cells
                row.append(f"{cells[m] / cells[b]:.2f}" if both else "-")
            rows.append(row)
        return rst_table(rows)

    lines = [
        f"{gpu['gpu']}, CuPy {gpu['cupy']}, {gpu['machine']['mpi_library']}; "
        f"CUDA-aware: {gpu['cuda_aware']}. One-way time of a CuPy array "
        "echoed as device frames, median:",
        "",
        *table(pp, "size", float),
    ]
    if apps:
        workers = gpu.get("workers", "two")  # runs before the key had two
        lines += ["", f"Dask arrays of CuPy chunks on {workers} workers, median:"]
        lines += [""] + table(apps, "workload", lambda f: f.get("wall_time"))
    for name, row in apps.items():
        for workload, f in row.items():
            if "error" in f:
                lines += ["", f"{name} {workload}: {_one_line(f['error'])}"]
    failed = gpu.get("failed", {})
    for name, why in failed.items():
        lines += ["", f"{name}: {why}."]
    for name in gpu.get("variants", []):
        if name not in pp and not any(k.startswith(name + " ") for k in failed):
            lines += ["", f"{name}: not measured."]
    return lines


def gpu_costs_lines(costs: dict) -> list[str]:
    """What each step of a device frame's trip cost, where it was measured"""
    rows = [["step", "median"]]
    for part in ("steps", "opens"):
        figures = costs.get(part, {})
        if "error" in figures:  # the part failed as a whole
            figures = {part: figures}
        for step, us in figures.items():
            if isinstance(us, dict):
                rows.append([step, f"failed: {_one_line(us['error'])}"])
            else:
                rows.append([step, _seconds(us / 1e6)])
    lines = ["Each step of a device frame's trip (``benchmarks/gpu_costs.py``):", ""]
    lines += rst_table(rows)
    freed = costs.get("freed while mapped", {})
    if freed and "error" not in freed:
        lines += [
            "",
            "GiB in use on the GPU as one process allocates 1 GiB that another maps:",
            "",
        ]
        lines += rst_table([["", "GiB"], *([k, f"{v:.2f}"] for k, v in freed.items())])
    return lines


def _one_line(error: str) -> str:
    return " ".join(error.split()).rstrip(".") + "."


def _size(n: int) -> str:
    for unit, scale in [("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)]:
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.0f} us"


# --- the pages ---

INTRO = """\
Benchmarks: ``mpi://`` against ``tcp://``
=========================================

This page is written by ``python benchmarks/publish.py`` from the JSON files in
``docs/benchmarks/``, as each benchmark last wrote them: do not edit it by
hand. Runs from before, with what changed between them, are in
``docs/mpi-history.rst``.

Run every benchmark with one command from the repository root (the
``benchmarks`` extra brings pandas and matplotlib; ``distributed-ucxx-cu12``
adds ``ucx://``), then publish the run::

    pip install ".[mpi,benchmarks]"
    python -m benchmarks            # about 30 minutes on 2 cores; --quick: 5
    python benchmarks/publish.py benchmarks/results

Each benchmark measures every transport in the same run on the same machine,
taking turns: compare ratios within a run, not times between runs. The
benchmarks:

- ``workloads.py``: Dask workloads on a scheduler and four workers, as a
  ``LocalCluster`` and as one ``mpiexec`` job;
- ``pauses.py``: round trips of a small message after pauses of 0 to 100 ms,
  the receiver idle or busy in a task;
- ``pingpong.py``: a comm ping-pong of numpy payloads between two processes
  (``mpi://``: each started by its own ``mpiexec -n 1``; "one job": two ranks
  of one job), and raw mpi4py between two ranks as the ceiling;
- ``scale.py``: one scheduler and 200 workers; ``idle.py``: CPU of idle
  processes with open comms; ``connect.py``: connection set-up; ``apps.py``:
  transpose-sum, merge and dot on two workers;
- ``hosts.py``: across simulated hosts with a bandwidth cap (needs root and
  namespaces, and a checkout: it uses the tests' simulated hosts);
- ``soak.py`` (not part of ``python -m benchmarks``): workers that come and go;
- ``gpu.py``: device frames and CuPy (and cuDF) workloads, on a machine with a GPU
  (``--host-arrays`` rehearses it without one, on numpy and pandas);
- ``local_ways.py`` and ``connect_growth.py`` (not part of ``python -m
  benchmarks``; no Dask): the floor of each way a mid-size frame could go
  between processes of one host, and what a process keeps of each MPI job that
  connected to it (``docs/mpi-design.rst`` says what they found).
"""


def page() -> str:
    pp, apps, idle, conn, wl, pauses, hosts = (load(n) for n in report.SUMMARIZED)
    lines = INTRO.splitlines() + [""]
    first = report.first_with_machine(wl, pp, pauses)
    if first:
        m = first["machine"]
        lines += [
            f"CPU figures: {m['cpus']} cores, Python {m['python']}, "
            f"{' '.join(m['mpi_library'].split())}, distributed {m['distributed']}, "
            f"mpi4py {m['mpi4py']}.",
            "",
        ]
    lines += (
        heading("Targets")
        + from_markdown(report.targets(pp, apps, idle, wl, pauses))
        + [""]
    )
    if wl:
        lines += heading("Real workloads, wall time (median)")
        lines += from_markdown(report.workloads_lines(wl)) + [""] + figure("workloads")
    if wl:
        lines += heading("Where the workloads' bytes travel") + frames_lines(wl) + [""]
    if pauses:
        lines += heading("Round trips after a pause (median), receiver idle or busy")
        lines += from_markdown(report.pauses_lines(pauses)) + [""] + figure("pauses")
    if pp:
        lines += heading("Ping-pong, one-way time (median)")
        lines += from_markdown(report.pingpong_lines(pp)) + [""] + figure("pingpong")
    scale = load("scale")
    if scale:
        lines += heading("Scale") + scale_lines(scale) + [""]
    if conn:
        lines += heading("Connection set-up")
        rows = [["", "tcp://", "mpi://"]]
        for key in ["init", "first", "next", "many_comms", "many_processes"]:
            rows.append([key, _seconds(conn["tcp"][key]), _seconds(conn["mpi"][key])])
        lines += rst_table(rows) + [""]
    if apps:
        lines += heading("Applications on two workers (median)")
        p = apps["protocols"]
        rows = [["benchmark", "tcp://", "mpi://", "mpi/tcp"]]
        for name in p["tcp://"]:
            t, m = p["tcp://"][name]["wall_time"], p["mpi://"][name]["wall_time"]
            rows.append([name, f"{t:.2f} s", f"{m:.2f} s", f"{m / t:.2f}"])
        lines += rst_table(rows) + [""] + figure("apps")
    if hosts:
        lines += heading("Across simulated hosts (median)")
        lines += from_markdown(report.hosts_lines(hosts)) + [""] + figure("hosts")
    soak = load("soak")
    if soak:
        lines += heading("Soak") + soak_lines(soak) + [""] + figure("soak")
    for name, title in [
        ("gpu", "GPU"),
        ("gpu-direct", "GPU, CUDA-aware MPI (test rig)"),
    ]:
        gpu = load(name)
        if gpu:
            lines += heading(title) + gpu_lines(gpu) + [""] + figure(name)
    costs = load("gpu_costs")
    if costs:
        lines += heading("GPU, the costs of each step") + gpu_costs_lines(costs) + [""]
    while not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def readme_table() -> list[str]:
    """The README's speed table: ratios of ``mpi://`` to ``tcp://``'s time"""
    rows = [["what (2-core machine, MPICH from PyPI)", "mpi:// time / tcp://'s"]]
    wl, pauses, pp, gpu = (load(n) for n in ["workloads", "pauses", "pingpong", "gpu"])
    if wl:
        ratios = report.workload_ratios(wl)
        for mode in dict.fromkeys(mode for mode, _ in ratios):
            mine = [r for (m, _), r in ratios.items() if m == mode]
            rows.append([f"real workloads, {mode}", f"{min(mine):.2f}-{max(mine):.2f}"])
    if pauses:
        for key, who in [("round_trip", "idle"), ("round_trip_busy", "busy")]:
            r = report.pause_ratios(pauses, key).values()
            rows.append(
                [f"round trips after pauses, {who}", f"{min(r):.2f}-{max(r):.2f}"]
            )
    if pp:
        t = pp["transports"]
        small = [k for k in t["tcp://"] if k != "dict" and int(k) <= 1024]
        r = statistics.median(t["mpi://"][k] / t["tcp://"][k] for k in small)
        rows.append(["ping-pong, 1 B - 1 KiB", f"{r:.2f}"])
        for size in ["1048576", "4194304", "67108864"]:
            if size in t["tcp://"]:
                r = t["mpi://"][size] / t["tcp://"][size]
                rows.append([f"ping-pong, {_size(int(size))}", f"{r:.2f}"])
    if gpu:
        pp = gpu["pingpong"]
        ipc = pp.get("mpi:// ipc") or pp.get("mpi:// staged", {})
        for base in ("tcp://", "ucx://"):
            both = [k for k in ipc if k.isdigit() and k in pp.get(base, {})]
            if both:
                big = max(both, key=int)
                r = ipc[big] / pp[base][big]
                what = (
                    f"GPU ping-pong, {_size(int(big))}, against {base} ({gpu['gpu']})"
                )
                rows.append([what, f"{r:.2f}"])
    return rst_table(rows)


def write_readme() -> None:
    with open(README) as f:
        text = f.read()
    start, end = text.index(README_START), text.index(README_END)
    table = "\n".join(readme_table())
    text = f"{text[:start]}{README_START}\n\n{table}\n\n{text[end:]}"
    with open(README, "w") as f:
        f.write(text)


def main(results: str) -> None:
    copy_run(results)
    with open(PAGE, "w") as f:
        f.write(page())
    write_readme()
    print(f"wrote {PAGE} and README.rst's speed table")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results"))
