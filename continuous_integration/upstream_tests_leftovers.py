"""pytest plugin for upstream_tests.py: kill the processes a test left running.

A test that fails half-way may leave a process it started behind (a ``dask spec``
scheduler waiting for a signal that never came). Upstream's CI gives each partition
a fresh machine; here one run holds the machine for an hour, and such a process
holds its ports (8786, the dashboard's 8787) for every later test, which then fails
for that reason alone. So after each test, its processes are killed and named.
"""

from __future__ import annotations

import psutil
import pytest

# Helpers that multiprocessing starts once and keeps for the whole session
SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str) -> None:
    left = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            if not any(helper in cmdline for helper in SESSION_HELPERS):
                proc.kill()
                left.append(f"{proc.pid} ({cmdline[:100]})")
        except psutil.Error:
            pass
    if left:
        print(f"\n{nodeid} left processes running, killed: {', '.join(left)}")
