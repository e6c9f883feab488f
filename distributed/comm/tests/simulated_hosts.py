"""Several hosts simulated on this machine, for tests across hosts.

Each host is a network namespace with an ``eth0`` on a bridge of its own
(itself in a "switch" namespace), a hosts file naming every host, and its own
UTS (host name), IPC, PID and mount namespaces with a ``/dev/shm`` of its own:
UCX ignores network namespaces and would move data between two processes of
one kernel through shared memory otherwise, as between ranks of one host.
Needs root (see ``skip_reason``).

Everything an instance makes is named after the process that made it and a
counter; a state file in :data:`STATE` says what it made, so that an instance
sweeps what dead ones left (a test process killed with SIGKILL) before it
makes its own.  A host's processes die with its PID namespace, whose first
process exits when the process that made the instance closes it or dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

STATE = "/run/simulated-hosts"  # a state file per live instance, and a lock
PREFIX = "simhost-"  # of every network namespace an instance makes
# The setting that sends frames between hosts over MPI even without RDMA
ACROSS_HOSTS = "DASK_DISTRIBUTED__COMM__MPI__ACROSS_HOSTS"
_counter = itertools.count()


def skip_reason() -> str | None:
    """Why hosts cannot be simulated here, or None if they can"""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "simulating hosts needs root"
    for tool in ["ip", "unshare", "nsenter"]:
        if shutil.which(tool) is None:
            return f"simulating hosts needs {tool}"
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return "cannot read this process's capabilities"
    if not int(caps.split()[1], 16) & (1 << 21):
        return "simulating hosts needs CAP_SYS_ADMIN"
    try:
        test = ["unshare", "--net", "--uts", "--ipc", "--pid", "--mount", "--fork"]
        test += ["--mount-proc", "sh", "-c", "mount -t tmpfs x /dev/shm"]
        proc = subprocess.run(test, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if proc.returncode:
        return f"unshare failed: {proc.stderr.strip()}"
    return None


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


class SimulatedHosts:
    """``n`` hosts (2 to 4) on one bridge; a context manager.

    Host ``k`` is called ``names[k]`` and has ``eth0`` at
    10.250.X.(k+1)/24, where X differs between live instances; with
    ``interfaces=2``, also ``eth1`` at 10.251.X.(k+1)/24 on a second bridge.
    Host names resolve to ``eth0`` addresses, and the default route goes
    through ``eth0``.  Processes started on a host (:meth:`command`,
    :meth:`popen`, :attr:`fake_ssh`) run with :attr:`env`, which tells UCX
    and libfabric to use ``eth0`` (outside these namespaces they would pick
    the machine's own interfaces), and mpi:// to move data between hosts over
    MPI: these hosts have no RDMA network, where it would not by default.
    Each host's processes have a ``TMPDIR`` of their own, removed with the
    hosts, as real hosts have a ``/tmp`` each: Open MPI names its session
    directories there by process id alone, and ids repeat on every host.
    """

    def __init__(self, n: int = 2, interfaces: int = 1, names=None):
        if not 2 <= n <= 4:
            raise ValueError("2 to 4 hosts")
        reason = skip_reason()
        if reason:
            raise RuntimeError(reason)
        self.tag = f"{os.getpid()}-{next(_counter)}"
        self.interfaces = interfaces
        self.env = {
            "UCX_NET_DEVICES": "eth0",
            "FI_TCP_IFACE": "eth0",
            ACROSS_HOSTS: "mpi",
        }
        self._inits: dict[str, subprocess.Popen] = {}
        self._pids: dict[str, int] = {}  # of each host's first process
        self._namespaces: list[str] = []
        self._closed = False
        self._relay = None
        os.makedirs(STATE, exist_ok=True)
        with self._locked():
            sweep()
            self.octet = self._free_octet()
            self.names = list(names or [f"h{self.octet}n{k + 1}" for k in range(n)])
            self._switch = f"{PREFIX}{self.tag}-sw"
            self._hosts = {
                name: f"{PREFIX}{self.tag}-{k}" for k, name in enumerate(self.names)
            }
            self._write_state()  # before anything exists, so a sweep finds it
            os.mkdir(os.path.join(STATE, self.tag))
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # What a test uses

    def address(self, name: str, interface: int = 0) -> str:
        """The IP address of host ``name`` (on ``eth<interface>``)"""
        return f"10.{250 + interface}.{self.octet}.{self.names.index(name) + 1}"

    def command(self, name: str, argv: list[str], env: dict | None = None) -> list[str]:
        """An argv that runs ``argv`` on host ``name``, in this working
        directory, with :attr:`env` and ``env`` on top of the caller's"""
        variables = [f"{k}={v}" for k, v in {**self.env, **(env or {})}.items()]
        return [*self._enter(name), "env", *variables, *argv]

    def popen(self, name: str, argv: list[str], env: dict | None = None, **kwargs):
        """``subprocess.Popen`` of ``argv`` on host ``name``"""
        return subprocess.Popen(self.command(name, argv, env), **kwargs)

    def run(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` on host ``name``, its output as text"""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(name, argv), **kwargs)

    def interface_bytes(self, name: str, interface: str = "eth0") -> int:
        """Bytes received and sent on an interface of host ``name``"""
        out = _ip("-n", self._hosts[name], "-s", "-j", "link", "show", interface)
        stats = json.loads(out.stdout)[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]

    def processes(self, name: str) -> list[psutil.Process]:
        """The processes on host ``name`` but its first one"""
        ns = os.stat(self._path(name, "pid")).st_ino
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if process.pid != self._pids[name]:
                    if os.stat(f"/proc/{process.pid}/ns/pid").st_ino == ns:
                        found.append(process)
        return found

    @property
    def fake_ssh(self) -> str:
        """A script that stands for ssh (``mpiexec -launcher ssh
        -launcher-exec FAKESSH -hosts a:1,b:2``): runs its command line on
        the host it names, with :attr:`env`"""
        return os.path.join(STATE, self.tag, "ssh")

    def close(self) -> None:
        """Kill every process on the hosts; remove all the instance made"""
        if self._closed:
            return
        self._closed = True
        helpers = [*self._inits.values(), *([self._relay] if self._relay else [])]
        for helper in helpers:
            with contextlib.suppress(OSError):
                helper.stdin.close()  # it exits on EOF
        for helper in helpers:
            try:
                helper.wait(5)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
            helper.stdout.close()
        with self._locked():
            _teardown(
                self.tag, list(self._pids.values()), psutil.Process().create_time()
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # How

    def _enter(self, name: str) -> list[str]:
        """Enter the host's namespaces; in a mount namespace of its own (as
        ``ip netns exec`` does) mount the host's /proc, /sys, /dev/shm and
        hosts file; then run ``"$@"`` with :attr:`env`"""
        ns = self._hosts[name]
        enter = ["nsenter", f"--net=/run/netns/{ns}"]
        enter += [
            f"--{kind}={self._path(name, kind)}" for kind in ["uts", "ipc", "pid"]
        ]
        setup = (
            "mount -t proc proc /proc && mount -t sysfs sysfs /sys && "
            f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && "
            f"mount --bind {self._path(name, 'shm')} /dev/shm && "
            f"export TMPDIR={self._path(name, 'tmp')} && "
            'exec "$@"'
        )
        return [
            *enter,
            "unshare",
            "--mount",
            "--propagation=slave",
            "sh",
            "-c",
            setup,
            name,
        ]

    @contextlib.contextmanager
    def _locked(self):
        with open(os.path.join(STATE, "lock"), "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _free_octet(self) -> int:
        used = {state.get("octet") for state in _states().values()}
        return next(i for i in range(1, 255) if i not in used)

    def _write_state(self) -> None:
        state = {
            "owner": os.getpid(),
            "started": psutil.Process().create_time(),
            "octet": self.octet,
            "pids": list(self._pids.values()),
        }
        path = os.path.join(STATE, f"{self.tag}.json")
        with open(path + ".new", "w") as f:
            json.dump(state, f)
        os.replace(path + ".new", path)

    def _build(self) -> None:
        sw = self._switch
        _ip("netns", "add", sw)
        for i in range(self.interfaces):
            _ip("-n", sw, "link", "add", f"br{i}", "type", "bridge")
            _ip("-n", sw, "link", "set", f"br{i}", "up")
        hosts = ["127.0.0.1 localhost"]
        hosts += [f"{self.address(name)} {name}" for name in self.names]
        for k, name in enumerate(self.names):
            ns = self._hosts[name]
            _ip("netns", "add", ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("\n".join(hosts) + "\n")
            _ip("-n", ns, "link", "set", "lo", "up")
            for i in range(self.interfaces):
                # Made in the switch with its peer in the host: never named
                # outside the instance's namespaces
                port, eth = f"p{k}e{i}", f"eth{i}"
                _ip(
                    "-n",
                    sw,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    eth,
                    "netns",
                    ns,
                )
                _ip("-n", sw, "link", "set", port, "master", f"br{i}", "up")
                _ip(
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.address(name, i)}/24",
                    "dev",
                    f"eth{i}",
                )
                _ip("-n", ns, "link", "set", f"eth{i}", "up")
            # distributed finds its own address by routing to a public one
            _ip("-n", ns, "route", "add", "default", "dev", "eth0")
            self._start_host(name, ns)
        self._write_state()
        self._write_fake_ssh()

    def _start_host(self, name: str, ns: str) -> None:
        """The host's first process, which holds its namespaces and lives
        until its stdin closes (this process closed the instance, or died);
        handles on its namespaces, and its /dev/shm"""
        init = subprocess.Popen(
            ["unshare", "--uts", "--ipc", "--pid", "--fork", "--kill-child"]
            + ["sh", "-c", 'hostname "$0" && echo ready && read _', name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # no Ctrl-C from the terminal
        )
        self._inits[name] = init
        if init.stdout.readline() != b"ready\n":
            raise RuntimeError(f"host {name} did not start: {init.wait(10)}")
        [child] = psutil.Process(init.pid).children()
        self._pids[name] = child.pid
        # Files, not pids: a process on a host sees no pid outside it
        for kind in ["uts", "ipc", "pid"]:
            path = self._path(name, kind)
            open(path, "w").close()
            _mount("--bind", f"/proc/{child.pid}/ns/{kind}", path)
        os.mkdir(self._path(name, "shm"))
        os.mkdir(self._path(name, "tmp"))
        _mount("-t", "tmpfs", "-o", "size=4g", "shm", self._path(name, "shm"))

    def _path(self, name: str, what: str) -> str:
        return os.path.join(STATE, self.tag, f"{name}.{what}")

    def _write_fake_ssh(self) -> None:
        """A process on a host cannot enter another host's PID namespace (a
        sibling of its own), so the fake ssh asks a relay outside the hosts
        to run its command, over a Unix socket, handing over its stdin,
        stdout and stderr"""
        directory = os.path.dirname(self.fake_ssh)
        commands = {name: self.command(name, []) for name in self.names}
        commands.update({self.address(name): commands[name] for name in self.names})
        with open(os.path.join(directory, "hosts.json"), "w") as f:
            json.dump(commands, f)
        self._relay = subprocess.Popen(
            [sys.executable, __file__, "relay", directory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        if self._relay.stdout.readline() != b"ready\n":
            raise RuntimeError("the fake ssh's relay did not start")
        with open(self.fake_ssh, "w") as f:
            f.write(f"#!{sys.executable}\n")
            f.write(f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n")
            f.write("from simulated_hosts import ssh; ssh()\n")
        os.chmod(self.fake_ssh, 0o755)


def ssh() -> None:
    """The fake ssh: ``ssh [OPTIONS] HOST COMMAND...``"""
    args = sys.argv[1:]
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if len(option) == 2 and option[1] in "bcDEeFIiJLlmOopQRSWw":
            args.pop(0)  # its value
    if not args:
        sys.exit("usage: ssh [OPTIONS] HOST COMMAND...")
    host, command = args[0], " ".join(args[1:])
    directory = os.path.dirname(os.path.abspath(sys.argv[0]))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.path.join(directory, "relay.sock"))
    request = {"host": host, "command": command, "cwd": os.getcwd()}
    request["env"] = dict(os.environ)
    socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reply = sock.makefile().readline()
    sys.exit(int(reply) if reply.strip() else 255)


def relay(directory: str) -> None:
    """Run the commands of the fake ssh on their hosts, until stdin closes"""
    with open(os.path.join(directory, "hosts.json")) as f:
        commands = json.load(f)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.path.join(directory, "relay.sock"))
    server.listen(64)
    running: set[subprocess.Popen] = set()

    def serve(conn: socket.socket) -> None:
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            prefix = commands.get(request["host"])
            if prefix is None or len(fds) != 3:
                os.write(fds[2], f"fake ssh: no host {request['host']}\n".encode())
                conn.sendall(b"255\n")
                return
            proc = subprocess.Popen(
                [*prefix, "sh", "-c", request["command"]],
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                cwd=request["cwd"],
                env=request["env"],
                start_new_session=True,
            )
            for fd in fds:
                os.close(fd)
            running.add(proc)
            # ssh dies, its command too: wait for either
            threading.Thread(
                target=_kill_on_eof, args=(conn, proc), daemon=True
            ).start()
            code = proc.wait()
            running.discard(proc)
            with contextlib.suppress(OSError):
                conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()
    for proc in list(running):
        _killpg(proc)


def _kill_on_eof(conn: socket.socket, proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        conn.recv(1)
    _killpg(proc)


def _killpg(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _states() -> dict[str, dict]:
    """The state files of instances, by tag"""
    states = {}
    for entry in os.listdir(STATE):
        if entry.endswith(".json"):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(STATE, entry)) as f:
                    states[entry[: -len(".json")]] = json.load(f)
    return states


def _alive(owner: int, started: float | None) -> bool:
    try:
        process = psutil.Process(owner)
        return started is None or abs(process.create_time() - started) < 1
    except psutil.Error:
        return False


def sweep() -> None:
    """Remove what instances whose process died left (call under the lock)"""
    states = _states()
    live = set()
    for tag, state in states.items():
        if _alive(state.get("owner", -1), state.get("started")):
            live.add(tag)
        else:
            _teardown(tag, state.get("pids", []), state.get("started", 0))
    # Namespaces of instances that died before writing their state
    names = _ip("netns", "list", check=False).stdout.split()
    for ns in names:
        if ns.startswith(PREFIX):
            tag = "-".join(ns[len(PREFIX) :].split("-")[:2])
            if tag not in live:  # states are written before namespaces
                _teardown(tag, [], time.time())


def _teardown(tag: str, pids: list[int], started: float) -> None:
    """Remove instance ``tag``, whose owner started at ``started``"""
    # Not at the top: the fake ssh imports this module, and should not
    # import distributed
    from distributed.comm.tests.mpi_processes import remove_leaked_hwloc_files

    for pid in pids:  # a host's first process: its namespace dies with it
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.name() == "sh":
                process.kill()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for ns in _ip("netns", "list", check=False).stdout.split():
        if ns.startswith(f"{PREFIX}{tag}-"):
            _ip("netns", "delete", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    here = os.path.join(STATE, tag) + "/"
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    for path in reversed(mounts):
        if path.startswith(here):
            subprocess.run(["umount", "-l", path], capture_output=True)
    shutil.rmtree(here, ignore_errors=True)
    remove_leaked_hwloc_files(since=started)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(STATE, f"{tag}.json"))
    with contextlib.suppress(OSError):
        os.rmdir("/etc/netns")  # if no other instance uses it
    # ``ip netns add`` bind-mounts /run/netns on itself: undone once no
    # namespace is left (one of another instance would make umount fail)
    if "/run/netns" in mounts and not os.listdir("/run/netns"):
        subprocess.run(["umount", "/run/netns"], capture_output=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        relay(sys.argv[2])
