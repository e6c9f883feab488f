"""A real Slurm cluster for tests, on this machine, always cleaned up.

Each :class:`SlurmCluster` has a scratch directory of its own with its
slurm.conf, a munged of its own (its own key and socket: nothing is shared
with a system munge or with a second cluster), a slurmctld, and one slurmd per
node, all in the foreground as our children.  Nodes are either several slurmd
on this machine (Debian builds Slurm with ``MULTIPLE_SLURMD``), which MPI sees
as one host, or one slurmd in each host of a ``SimulatedHosts``, which MPI
sees as separate hosts.

Every process of a cluster, jobs included, carries ``DASK_SLURM_CLUSTER=<its
directory>`` in its environment: the daemons get it from us, jobs from the
client commands, which must run with :attr:`SlurmCluster.env`.  That is how
clean-up finds slurmstepd and job processes, which Slurm starts as daemons,
and how a later cluster sweeps up after one whose test process was killed.
"""

from __future__ import annotations

import contextlib
import getpass
import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

from distributed.comm.tests.mpi_processes import _env, remove_leaked_hwloc_files
from distributed.comm.tests.simulated_hosts import ACROSS_HOSTS

MARKER = "DASK_SLURM_CLUSTER"
PREFIX = "dask-slurm-"
DAEMONS = ["munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel"]


def skip_reason() -> str | None:
    """Why no Slurm cluster can run here, or None"""
    if not sys.platform.startswith("linux"):
        return "Slurm tests run on Linux only"
    if os.geteuid() != 0:
        return "Slurm tests need root (slurmd runs jobs as their users)"
    missing = [d for d in DAEMONS if not shutil.which(d, path=_sbin_path())]
    if missing:
        return (
            f"Slurm tests need {', '.join(missing)}: apt-get install "
            "slurmctld slurmd slurm-client munge"
        )
    return None


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _which(name: str) -> str:
    return shutil.which(name, path=_sbin_path()) or name


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free now, away from the ephemeral range"""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 30000)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _mount_cgroups() -> list[str]:
    """Shell commands that mount the cgroup file systems of this machine
    again, as they are here, in a mount namespace with a /sys of its own"""
    commands = []
    with open("/proc/self/mounts") as f:
        for line in f:
            kind, path, fs, options = line.split()[:4]
            if path == "/sys/fs/cgroup" or path.startswith("/sys/fs/cgroup/"):
                commands.append(
                    f"mkdir -p {path} && mount -t {fs} -o {options} {kind} {path}"
                )
    return commands


class SlurmCluster:
    """A Slurm cluster of ``nodes`` nodes of ``cpus`` CPUs each, with one
    partition, ``debug``.  Use as a context manager; :meth:`close` always
    tears down every daemon, job and file.

    ``hosts``, a ``SimulatedHosts``: one node per host, slurmd running on
    it, and slurmctld and every client command (:meth:`command`) on the
    first one, so that all of them reach each other.
    """

    def __init__(self, nodes: int = 2, cpus: int = 4, hosts=None, timeout: float = 30):
        self.hosts = hosts
        self.nodes = list(hosts.names) if hosts else [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.timeout = timeout
        self.processes: dict[str, subprocess.Popen] = {}
        self.dir = ""
        self.env: dict[str, str] = {}

    # Starting

    def __enter__(self) -> SlurmCluster:
        sweep()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self.started = time.time()
        self.dir = tempfile.mkdtemp(prefix=PREFIX)
        # munged wants every directory above its socket open to everyone
        os.chmod(self.dir, 0o755)
        with open(self.path("owner"), "w") as f:
            me = psutil.Process()
            f.write(f"{me.pid} {me.create_time()}")
        for sub in ["state", "spool", "jobs", "tmp"]:
            os.mkdir(self.path(sub))
        self.env = {
            **_env(),
            MARKER: self.dir,
            "SLURM_CONF": self.path("slurm.conf"),
            # Workers' scratch space, Hydra's files and the like stay inside
            "DASK_TEMPORARY_DIRECTORY": self.path("tmp"),
            "TMPDIR": self.path("tmp"),
            # Nodes without RDMA: move data between them over MPI anyway
            ACROSS_HOSTS: "mpi",
        }
        self.env["PATH"] = _sbin_path() + os.pathsep + self.env["PATH"]
        self._write_config()
        self._start_munge()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i"], self.controller)
        for node in self.nodes:
            os.mkdir(self.path("spool", node))
            argv = [_which("slurmd"), "-D", "-N", node]
            if self.hosts:
                # slurmd wants cgroups, and a host has a /sys of its own
                mount = " && ".join([*_mount_cgroups(), 'exec "$@"'])
                argv = ["sh", "-c", mount, "sh", *argv]
            self._spawn(f"slurmd-{node}", argv, node if self.hosts else None)
        self._wait_until_idle()

    @property
    def controller(self) -> str | None:
        """The host that runs slurmctld and the client commands"""
        return self.hosts.names[0] if self.hosts else None

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def _write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        if self.hosts:
            ctld = f"{self.controller}({self.hosts.address(self.controller)})"
            addresses = [self.hosts.address(node) for node in self.nodes]
            hostnames = list(self.nodes)
        else:
            ctld = "localhost(127.0.0.1)"
            addresses = ["127.0.0.1"] * len(self.nodes)
            hostnames = ["localhost"] * len(self.nodes)
        user = getpass.getuser()
        lines = [
            f"ClusterName=dask{os.getpid()}",
            f"SlurmctldHost={ctld}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.path('munge.socket')}",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}",
            f"SlurmctldLogFile={self.path('slurmctld.log')}",
            f"SlurmdSpoolDir={self.path('spool', '%n')}",
            f"SlurmdPidFile={self.path('slurmd-%n.pid')}",
            f"SlurmdLogFile={self.path('slurmd-%n.log')}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            # Jobs go to the least loaded node: separate jobs on separate
            # nodes, as on a busy cluster
            "SelectTypeParameters=CR_Core,CR_LLN",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            # Nodes have more CPUs than this machine: believe the config
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            # Ended jobs leave squeue within seconds; a step gets 2 s
            # between SIGTERM and SIGKILL
            "MinJobAge=2",
            "KillWait=2",
            "InactiveLimit=0",
            "MessageTimeout=10",
            "MailProg=/bin/true",
        ]
        for node, host, addr, port in zip(self.nodes, hostnames, addresses, node_ports):
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr={addr} Port={port} "
                f"CPUs={self.cpus} Boards=1 SocketsPerBoard=1 "
                f"CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory=4000"
            )
        lines.append(
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        )
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        key = self.path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        socket_path = self.path("munge.socket")
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={self.path('munged.pid')}",
                f"--log-file={self.path('munged.log')}",
                f"--seed-file={self.path('munged.seed')}",
            ],
            None,
        )
        self._wait(lambda: os.path.exists(socket_path), "munged to create its socket")

    def _spawn(self, name: str, argv: list[str], host: str | None) -> None:
        if host is not None:
            argv = self.hosts.command(host, argv)
        with open(self.path(f"{name}.out"), "wb") as out:
            self.processes[name] = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not condition():
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for "
                        f"{what}:\n{self.logs()}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.1)

    def _wait_until_idle(self) -> None:
        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return all(states.get(node) == "idle" for node in self.nodes)

        self._wait(idle, f"nodes {', '.join(self.nodes)} to be idle")

    # Using

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on the cluster's login node; run it with
        :attr:`env`"""
        if self.hosts:
            return self.hosts.command(self.controller, argv)
        return list(argv)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("cwd", self.dir)
        return subprocess.Popen(self.command(argv), env=self.env, **kwargs)

    def run(self, argv: list[str], check: bool = True, timeout: float = 60) -> str:
        """Run a client command (``srun``, ``sbatch``, ``squeue`` ...) to its
        end; its standard output, and error too on failure"""
        proc = subprocess.run(
            self.command(argv),
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode:
            raise RuntimeError(
                f"{' '.join(argv)} exited with {proc.returncode}:\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout

    def jobs(self) -> list[str]:
        """Ids of the jobs in squeue"""
        return self.run(["squeue", "-h", "-o", "%i"]).split()

    def wait_for_no_jobs(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.jobs():
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs left in squeue: {self.jobs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        """The daemons' logs, for error messages"""
        out = []
        for path in sorted(
            glob.glob(self.path("*.log")) + glob.glob(self.path("*.out"))
        ):
            with open(path, errors="replace") as f:
                out.append(f"--- {os.path.basename(path)}\n{f.read()[-20000:]}")
        return "\n".join(out)

    # Stopping

    def close(self) -> None:
        """Cancel every job, stop every daemon, kill whatever is left of
        them and of the jobs, and remove the directory"""
        if not self.dir:
            return
        ctld = self.processes.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--user", getpass.getuser()], timeout=15)
                self.wait_for_no_jobs(timeout=10)
        # slurmd before slurmctld, munged, which they need, last
        order = sorted(self.processes, key=lambda n: (n == "munged", n == "slurmctld"))
        for name in order:
            _stop(self.processes[name])
        kill_marked(self.dir)
        remove_leaked_hwloc_files(since=self.started)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = ""


def _stop(proc: subprocess.Popen, timeout: float = 5) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def marked(directory: str) -> list[psutil.Process]:
    """The processes of the cluster in ``directory``: by their environment,
    or, for slurmstepd, which has none, by their working directory"""
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in me:
            continue
        with contextlib.suppress(psutil.Error):
            cwd = proc.cwd()
            if cwd == directory or cwd.startswith(directory + os.sep):
                found.append(proc)
            elif proc.environ().get(MARKER) == directory:
                found.append(proc)
    return found


def kill_marked(directory: str, timeout: float = 10) -> None:
    """SIGKILL every process of the cluster in ``directory``, and wait"""
    procs = marked(directory)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=timeout)


def sweep() -> None:
    """Remove what clusters whose test process died left behind"""
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(directory, "owner")) as f:
                pid, created = f.read().split()
        except (OSError, ValueError):
            # A cluster that is starting may not have written it yet
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(directory) < 60:
                    continue
            pid, created = "-1", "0"
        try:
            alive = psutil.Process(int(pid)).create_time() == float(created)
        except (ValueError, psutil.Error):
            alive = False
        if not alive:
            kill_marked(directory)
            shutil.rmtree(directory, ignore_errors=True)
