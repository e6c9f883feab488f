"""What this process's MPI library can do, found out before it is asked to.

Processes of different jobs, or started without ``mpiexec``, meet with
``MPI_Open_port``, ``MPI_Comm_accept`` and ``MPI_Comm_connect``; ranks of one
job need none of these (see ``mpi_opener``).  MPICH connects any two; Open
MPI cannot without its ``ompi-server`` (``mpi_policy.open_mpi_apart``).
Intel MPI (2021) connects them over its OFI fabric, but takes its
shared-memory fabric alone for a job whose ranks share one host, and for a
process started without ``mpiexec``; there ``MPI_Open_port`` dies of a
segmentation fault.  A call that may crash a worker is not made on a guess:

- a process started without a launcher (a nanny's worker, a LocalCluster's,
  a client) is a job of its own, whose fabric nobody else shares: unless the
  user chose one (``I_MPI_FABRICS``), it takes ``shm:ofi`` before MPI_Init,
  where a child process showed that ports work with it;
- a rank of an ``mpiexec`` job keeps the fabric of its job: it may have
  ports where ``I_MPI_FABRICS`` names ``ofi``, or where the job spans hosts,
  and a child process showed that ports work with that fabric.

Either way, only over an RDMA network: over libfabric's ``tcp`` and ``shm``
providers Intel MPI moved the frames of two such processes slowly or not at
all.  The child runs once per host and user for a library and its settings;
its answer is kept in a file.  A process without ports talks over TCP with
the processes of other jobs (``mpi_policy.mpi_refusal``), which says why,
once.  See docs/mpi-design.rst, "Intel MPI".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

# Intel MPI's own settings that choose its fabric and the OFI provider
_FABRIC_SETTINGS = (
    "I_MPI_FABRICS",
    "I_MPI_OFI_PROVIDER",
    "I_MPI_OFI_LIBRARY",
    "I_MPI_OFI_LIBRARY_INTERNAL",
    "FI_PROVIDER",
    "FI_PROVIDER_PATH",
)
# A launcher's variables: the probe runs as a process started without one
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "I_MPI_HYDRA_", "MPI_LOCAL", "OMPI_")
_PROBE = (
    "from mpi4py import MPI; MPI.Close_port(MPI.Open_port()); print('ports work')"
)
PROBE_TIMEOUT = 60
# libfabric providers that Intel MPI (2021.18) does not move the frames of
# two processes of different jobs over, measured here: over TCP at a few
# MB/s, stalling while the sender does not call MPI (tcp; sockets and udp
# are no faster than the comm's own connection), or not at all for as long
# as the reader waits (shm).  Those of RDMA networks (mlx, verbs, psm3, efa,
# cxi...) it may use; a channel that stops delivering is given up on
_NO_CHANNEL_PROVIDERS = ("tcp", "sockets", "udp", "shm")

_chosen: str | None = None  # the fabric this process chose for its MPI_Init
_no_ports: str | None = None  # why this process may not open MPI ports
_network: str | None = None  # the OFI provider of Intel MPI's fabric


def prepare(MPI, launched: bool) -> None:
    """Call before MPI_Init (``launched``: under a process manager): choose
    Intel MPI's fabric where it is this process's alone, and find out whether
    this process may open MPI ports"""
    global _no_ports, _network, _chosen
    if not MPI.Get_library_version().startswith("Intel(R) MPI"):
        return
    env = os.environ
    fabric = env.get("I_MPI_FABRICS")
    if launched:
        if fabric is None and _job_spans_hosts():
            fabric = "shm:ofi"  # what Intel MPI takes for such a job
        if fabric is None or "ofi" not in fabric:
            _no_ports = (
                "Intel MPI runs this job on its shared-memory fabric alone "
                f"(I_MPI_FABRICS={fabric or 'unset, and the job is on one host'}), "
                "where MPI_Open_port crashes (set I_MPI_FABRICS=shm:ofi for "
                "jobs on hosts with an RDMA network)"
            )
            return
    probe = _probe(fabric or "shm:ofi", MPI.Get_library_version())
    _network = probe.get("provider")
    if not probe["ports"]:
        _no_ports = f"{probe['why']} (I_MPI_FABRICS={fabric or 'shm:ofi'})"
    elif _network is None or _network.startswith(_NO_CHANNEL_PROVIDERS):
        _no_ports = (
            f"Intel MPI's OFI fabric has no RDMA network here (libfabric "
            f"provider {_network}), and moves the frames of processes of "
            "different jobs slowly or not at all"
        )
    elif not launched and fabric is None:
        # For this process's MPI_Init alone (see initialized): its children
        # (a job a task starts) choose their own
        env["I_MPI_FABRICS"] = _chosen = "shm:ofi"


def initialized() -> None:
    """Call once MPI_Init returned: take back the fabric chosen for it"""
    global _chosen
    if _chosen is not None and os.environ.get("I_MPI_FABRICS") == _chosen:
        del os.environ["I_MPI_FABRICS"]
    _chosen = None


def no_ports() -> str | None:
    """Why this process may not open MPI ports (nor accept or connect);
    None if it may"""
    return _no_ports


def network() -> str | None:
    """The network of Intel MPI's OFI fabric (its libfabric provider), where
    a probe found it out"""
    return _network


def _job_spans_hosts() -> bool:
    """Whether the ranks of this process's job run on more than one host, as
    its launcher says (Hydra: ranks here and in all; Slurm: nodes)"""
    env = os.environ
    here, everywhere = env.get("MPI_LOCALNRANKS"), env.get("PMI_SIZE")
    if here and everywhere:
        return int(here) < int(everywhere)
    return int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1) > 1


def _probe(fabric: str, library: str) -> dict:
    """What a process started without a launcher, on ``fabric``, does here:
    whether it opens an MPI port (``ports``; ``why`` not), and its libfabric
    provider.  Once per host, user, MPI ``library`` (its version) and
    setting: the answer is kept in a file"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(I_MPI_FABRICS=fabric, I_MPI_DEBUG="1")
    settings = {k: env.get(k) for k in _FABRIC_SETTINGS}
    # The host too: $TMPDIR may be shared by hosts that differ
    host = socket.gethostname()
    key = json.dumps([host, sys.executable, library, settings], sort_keys=True)
    path = os.path.join(
        tempfile.gettempdir(),
        f"dask-mpi-ports-{os.getuid()}-{hashlib.sha1(key.encode()).hexdigest()[:16]}",
    )
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    try:
        child = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        answer = {"ports": False, "why": f"MPI_Open_port hung for {PROBE_TIMEOUT} s"}
    else:
        provider = re.search(r"libfabric provider: (\S+)", child.stdout)
        answer = {
            "ports": "ports work" in child.stdout,
            "provider": provider and provider.group(1),
            "why": _failure(child),
        }
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(answer, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return answer


def _failure(child: subprocess.CompletedProcess) -> str:
    """What a probe that did not open a port ended with"""
    if child.returncode < 0:
        return f"MPI_Open_port ended a process with signal {-child.returncode}"
    last = child.stdout.strip().splitlines()[-1:] or ["no output"]
    return f"a process trying MPI_Open_port exited with {child.returncode}: {last[0]}"
