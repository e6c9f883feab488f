"""The MPI libraries that clusters run, each the way it can be launched, with
every frame between workers taking MPI where the library allows it
(``local-copy: false``): results right, every process exits 0, none dies of
a signal, and frames go over MPI where the library can carry them, else
over TCP, said in the log (see :mod:`mpi_library_cluster`).

MPICH is this environment's.  Intel MPI and Open MPI run in environments of
their own, which ``.ci/run`` makes: ``.venv-impi`` (``pip install mpi4py
impi-rt -e ".[test]"``, or $MPI4DASK_IMPI_PYTHON) and ``.venv-openmpi``
(see ``mpi_processes.ENVIRONMENTS``); without one, its cases skip, saying why.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

pytest.importorskip("mpi4py")

from distributed.comm import mpi_policy
from distributed.comm.tests.mpi_processes import (
    OPENMPI_ENV,
    _env,
    library_python_or_skip,
)

pytestmark = pytest.mark.timeout(200)


# Where frames between workers travel, by library and way; for TCP, what the
# log says of why
NO_PORTS = "comms between this process and processes of other mpiexec jobs"
OPEN_MPI_APART = "Open MPI cannot connect processes of different mpiexec jobs"
CASES = {
    "MPICH": {
        "job": "MPI",
        "job-nanny": "MPI",
        "apart": "MPI",
        "dask-mpi": "MPI",
        "dask-mpi-script": "MPI",
        "mpi-and-tcp": "MPI",
        "local": "MPI",
    },
    # Its shared-memory fabric for ranks of one job; no RDMA network here for
    # processes of different jobs (see distributed.comm.mpi_library)
    "Intel MPI": {
        "job": "MPI",
        "job-nanny": NO_PORTS,
        "apart": "MPI",  # the two workers are ranks of one job
        "dask-mpi": "MPI",
        "dask-mpi-script": "MPI",
        "mpi-and-tcp": "MPI",
        "local": NO_PORTS,
    },
    "Open MPI": {
        "job": "MPI",
        "job-nanny": OPEN_MPI_APART,
        "apart": "MPI",
        "dask-mpi": "MPI",
        "dask-mpi-script": "MPI",
        "mpi-and-tcp": "MPI",
        "local": OPEN_MPI_APART,
    },
}


def environment(library: str) -> tuple[str, dict]:
    """The Python of ``library``'s environment, and the variables it needs;
    the test skips without one"""
    python = library_python_or_skip(library)
    return python, OPENMPI_ENV if library == "Open MPI" else {}


@pytest.mark.parametrize("way", list(CASES["MPICH"]))
@pytest.mark.parametrize("library", list(CASES))
def test_library_and_way(library, way, tmp_path):
    if way.startswith("dask-mpi"):
        pytest.importorskip("dask_mpi")
    python, env = environment(library)
    proc = subprocess.run(
        [python, "-m", "distributed.comm.tests.mpi_library_cluster", way, tmp_path],
        env={**_env(python), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    logs = proc.stdout
    for path in sorted(glob.glob(f"{tmp_path}/*.log")):
        with open(path) as f:
            logs += f.read()
    assert "Segmentation fault" not in logs and "signal 11" not in logs, logs
    assert proc.returncode == 0, logs
    report = json.loads(proc.stdout.rsplit("REPORT ", 1)[1])
    assert report["right"], logs
    assert report["codes"] == [0] * len(report["codes"]), logs
    expected = CASES[library][way]
    if expected == "MPI":
        assert report["moved"] > 0, logs
    else:
        assert report["moved"] == 0, logs
        assert expected in logs, logs


def test_the_probe_says_why_intel_mpi_connects_no_jobs_here():
    """Without an RDMA network, Intel MPI processes of different jobs move
    their frames over TCP, and ``mpi_probe`` says why; a rank of a job on
    one host has Intel MPI's shared-memory fabric alone"""
    python, env = environment("Intel MPI")
    if mpi_policy.rdma():
        pytest.skip(f"this host has an RDMA network ({mpi_policy.rdma()})")

    def other_jobs(*launcher: str) -> str:
        out = subprocess.run(
            [*launcher, python, "-m", "distributed.comm.mpi_probe"],
            env={**_env(python), **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        return dict(line.split(":", 1) for line in out.splitlines())[
            "Frames to other jobs"
        ].strip()

    alone = other_jobs()
    assert alone.startswith("over TCP: Intel MPI's OFI fabric has no RDMA"), alone
    mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
    in_a_job = other_jobs(mpiexec, "-n", "2")
    assert "shared-memory fabric alone" in in_a_job, in_a_job


# Run by Intel MPI's Python: libfabric's tcp provider taken for an RDMA
# network, as a process started alone on a host with one would see it
_ALONE_WITH_PORTS = """
import os
from distributed.comm import mpi_library, mpi_startup
mpi_library._NO_CHANNEL_PROVIDERS = ()
MPI = mpi_startup.start_mpi().result()
assert mpi_library.no_ports() is None, mpi_library.no_ports()
assert "I_MPI_FABRICS" not in os.environ, "the fabric chosen for MPI_Init stayed"
MPI.Close_port(MPI.Open_port())
print("ports work over", mpi_library.network())
"""


def test_an_intel_mpi_process_alone_takes_the_ofi_fabric_where_ports_work():
    """A process started without mpiexec takes I_MPI_FABRICS=shm:ofi for its
    MPI_Init where a probe found a network that carries channels, opens
    ports there (on Intel MPI's default fabric, MPI_Open_port crashes), and
    gives the setting back: its children choose their own"""
    python, env = environment("Intel MPI")
    child_env = {**_env(python), **env}
    child_env.pop("I_MPI_FABRICS", None)
    proc = subprocess.run(
        [python, "-c", _ALONE_WITH_PORTS],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ports work over tcp" in proc.stdout, proc.stdout + proc.stderr
