"""Run every benchmark, then summarize against the targets.

    python -m benchmarks [--quick] [--out benchmarks/results]

Each benchmark runs alone (they would disturb each other's timings); all of
them measure tcp:// and mpi:// (and ucx:// where installed) in the same run.
A benchmark that fails does not stop the others; the command then exits with
an error after the summary.
"""

import os
import subprocess
import sys

from benchmarks import report

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    args = sys.argv[1:]
    out = (
        args[args.index("--out") + 1]
        if "--out" in args
        else os.path.join(HERE, "results")
    )
    failed = []
    names = ["pingpong", "pauses", "connect", "idle", "apps", "workloads", "scale"]
    for name in names + ["hosts"]:  # hosts: skipped where it cannot simulate them
        print(f"== {name}", flush=True)
        done = subprocess.run([sys.executable, os.path.join(HERE, f"{name}.py"), *args])
        if done.returncode:
            failed.append(name)
    report.main(out)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
