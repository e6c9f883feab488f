"""Run every benchmark, then summarize against the targets.

    python -m benchmarks [--quick] [--out benchmarks/results]

Each benchmark runs alone (they would disturb each other's timings); all of
them measure tcp:// and mpi:// (and ucx:// where installed) in the same run.
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
    for name in ["pingpong", "pauses", "connect", "idle", "apps"]:
        print(f"== {name}", flush=True)
        subprocess.run(
            [sys.executable, os.path.join(HERE, f"{name}.py"), *args], check=True
        )
    report.main(out)
