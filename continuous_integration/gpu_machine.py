"""Run the GPU tests and benchmarks on a machine with a GPU and no network.

Such a machine (the device tool's) has Python 3.12, CuPy, Numba and mpi4py,
but not dask, this project, or perhaps an MPI library. Here, with network:

    python continuous_integration/gpu_machine.py bundle

puts into ``build/gpu-bundle/`` (about 25 MB) the materialized package with its
tests, the benchmarks, and wheels for Python 3.12 of everything else, MPICH
and mpi4py included. There, from the repository root, with ``build/gpu-bundle``
carried:

    bash build/gpu-bundle/run.sh test     # $OUT: a folder to fill
    bash build/gpu-bundle/run.sh bench
    bash build/gpu-bundle/run.sh all      # both, in one device call
    bash build/gpu-bundle/run.sh direct   # both, on the direct path (below)

installs the wheels (once) into a virtual environment that sees the machine's
own packages (CuPy, Numba) after its own, then prints the probe
(``distributed.comm.mpi_probe``) and runs the GPU tests, or runs
``benchmarks/gpu.py`` and ``benchmarks/gpu_costs.py``; ``run-MODE.log``,
``probe.txt``, the tests' output, ``gpu.json``, ``gpu.png``,
``gpu_costs.json`` and the workers' logs (``logs.tgz``) go to ``$OUT``: the
device tool brings back 8 files.

MPICH from PyPI is not CUDA-aware, so GPU frames go staged.  For the direct
path, ``bundle --ucx-cuda`` adds UCX built with CUDA (from the libucx-cu12
wheel, 4 MB of it), and ``run.sh direct`` puts it under MPICH
(``LD_LIBRARY_PATH``) and tells mpi:// that MPI is CUDA-aware
(``cuda-aware: true``): MPICH hands device pointers to UCX, which moves them,
between processes of different jobs (those of one job on one host would go
through MPICH's own shared memory, which cannot).  A test rig, not a
configuration for users.

``bundle --ucxx`` adds ``ucx://`` (distributed-ucxx with UCX and RMM for CUDA
13, about 27 MB once pruned, in ``ucxx/``, put on ``PYTHONPATH``), so that
``benchmarks/gpu.py`` measures it beside mpi://, and dask-cuda (without its
dependencies, which the machine has), for its test; numpy is left out, the
machine has it; ``run.sh`` leaves ucx:// and RMM out where RMM cannot
allocate.  On an H200 (2026-11-26) ``all`` took under three minutes: the
set-up 20 s, the tests 15-40 s, the full benchmark (``GPU_BENCH_ARGS=" "``)
70 s.  On an H100 (2026-11-28) the tests took 80 s and mpi:// by IPC 22 s,
but ucx:// hung twice.  So ``run.sh`` keeps to one deadline (``RUN_BUDGET``,
530 s), the benchmark to what is left of it (``--budget``) and gives each
transport at most 100 s for the ping-pong and 100 s for the workloads
(``--limit``), or 45 s without a new figure (``--stall``), keeps what a part
measured before it failed or hung, prints
where its processes were (their output, the workers' too, is in ``$OUT``),
and goes on.  The device tool lends 15 minutes a session, machine starts
included: one ``all`` call (``timeout_s`` 570), and a second only if the
first is short.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "build" / "gpu-bundle"
PYTHON = "3.12"
# Beside distributed's own dependencies (read from the built wheel)
EXTRA = ["mpich", "mpi4py", "numpy", "pytest", "pytest-timeout"]
# ucx:// for CUDA 13, for bundle --ucxx: the versions that ran on the GPU
# machines (libucxx 0.52 wants UCX below 1.22)
UCXX = ["distributed-ucxx-cu13==0.52.*", "ucxx-cu13==0.52.*", "libucxx-cu13==0.52.*"]
UCXX += ["libucx-cu13==1.21.*", "rmm-cu13==26.10.*", "librmm-cu13==26.10.*"]
UCXX += ["rapids-logger==0.3.*"]
DASK_CUDA = "dask-cuda==26.10.*"
# What MPICH needs of UCX, for bundle --ucx-cuda
UCX_LIBRARIES = {f"lib{n}.so.0" for n in ["ucp", "ucs", "uct", "ucm", "ucs_signal"]}
UCX_MODULES = {"libuct_cuda.so.0", "libucm_cuda.so.0", "libuct_cma.so.0"}

RUN = r"""#!/usr/bin/env bash
# Written by continuous_integration/gpu_machine.py: see there.
# bash run.sh test: set up, probe, GPU tests; bash run.sh bench: the benchmark;
# bash run.sh all: both; bash run.sh direct: both, on the direct path.
# One deadline for the whole run, RUN_BUDGET seconds (default 530: a device
# call of 570 s with a margin): each step gets at most what is left of it, so
# that nothing outlives the call and its output.  MPI4DASK_GPU_LARGE=0 leaves
# out the 2.5 GB array, GPU_BENCH_ARGS (default --quick) goes to gpu.py.
set -uo pipefail
ulimit -c 0  # a hang's stacks come from aborts: no core files
mode="${1:-test}"
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/run-$mode.log") 2>&1
tee_pid=$!
cd "$HERE"
END=$((SECONDS + ${RUN_BUDGET:-530}))

# step LIMIT KEEP COMMAND...: COMMAND for at most LIMIT seconds, ending KEEP
# seconds before the deadline at the latest (for the steps after it); then
# SIGINT, on which Python unwinds (pytest's fixtures stop their processes)
step() {
    local limit=$1 left=$((END - SECONDS - $2))
    shift 2
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        echo "not run, out of time: $*"
        return 124
    fi
    timeout -s INT -k 20 "$limit" "$@"
}

# The wheels are for Python @PYTHON@
PY=
for candidate in python3 python@PYTHON@; do
    if command -v "$candidate" >/dev/null && "$candidate" -c \
        'import sys; sys.exit("%d.%d" % sys.version_info[:2] != sys.argv[1])' @PYTHON@; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "no Python @PYTHON@ here (python3 is $(python3 --version 2>&1)): the wheels are for @PYTHON@"
    exit 2
fi
if [ ! -e .venv/ready ]; then
    (  # stops at the first step that fails (set -e holds only outside an if)
        set -e
        nvidia-smi || true
        # A virtual environment that sees the machine's packages (CuPy, Numba,
        # its mpi4py), wherever they are, after its own: what the machine
        # lacks comes from the wheels
        sites="$("$PY" -c 'import site, sysconfig
p = sysconfig.get_paths()
print("\n".join(dict.fromkeys([p["purelib"], p["platlib"], site.getusersitepackages()])))')"
        "$PY" -m venv .venv
        . .venv/bin/activate
        echo "$sites" > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine.pth"
        pip install -q --no-index --find-links wheels wheels/distributed-*.whl mpich \
            pytest pytest-timeout
        if ls wheels/dask_cuda-*.whl >/dev/null 2>&1; then
            pip install -q --no-index --no-deps wheels/dask_cuda-*.whl
        fi
        for rehearsal in numpy pandas pyarrow; do  # the GPU machine has them
            if ls wheels/"$rehearsal"-*.whl >/dev/null 2>&1; then
                pip install -q --no-index --find-links wheels "$rehearsal"
            fi
        done
        python -c "import mpi4py; print('mpi4py', mpi4py.__version__, mpi4py.__file__)" ||
            echo "no mpi4py on the machine"
        # mpiexec is MPICH's (the wheel's): mpi4py must load MPICH too
        mpich='from mpi4py import MPI; v = MPI.Get_library_version(); print(v); assert "MPICH" in v'
        if ! timeout 60 python -c "$mpich"; then
            echo "the machine's mpi4py does not start with MPICH: mpi4py from the wheels"
            pip install -q --no-index --find-links wheels --force-reinstall --no-deps mpi4py
            timeout 60 python -c "$mpich"
        fi
        python -c "import cupy; print('CuPy', cupy.__version__, 'sees', cupy.cuda.runtime.getDeviceCount(), 'GPU(s)')" ||
            echo "CuPy sees no GPU here: the GPU tests skip"
        touch .venv/ready
    )
    if [ ! -e .venv/ready ]; then
        echo "set-up failed"
        exit 2
    fi
fi
. .venv/bin/activate
# The package under test is the bundle's copy (with its tests), not the wheel's
export PYTHONPATH="$HERE"
if [ -d "$HERE/ucxx" ]; then  # bundle --ucxx: ucx:// and RMM, where RMM works
    if PYTHONPATH="$HERE:$HERE/ucxx" step 120 300 python -c \
        'import distributed_ucxx, rmm; rmm.DeviceBuffer(size=1); print("RMM", rmm.__version__)'; then
        export PYTHONPATH="$HERE:$HERE/ucxx" DASK_DISTRIBUTED_UCXX__CREATE_CUDA_CONTEXT=True
    else
        export GPU_BENCHMARK_UCX_LEFT_OUT="not measured: RMM or distributed-ucxx does not load or allocate here (run-$mode.log)"
        echo "$GPU_BENCHMARK_UCX_LEFT_OUT"
    fi
fi
which mpiexec
status=0
# The GPU tests, and whether workers may read each other's memory there (Yama)
tests=(distributed/comm/tests/test_mpi_gpu.py
    distributed/comm/tests/test_mpi_processes.py::test_a_process_on_mpi_lets_its_siblings_read_its_memory)
if [ "$mode" = direct ]; then
    export LD_LIBRARY_PATH="$HERE/ucx-cuda" DASK_DISTRIBUTED__COMM__MPI__CUDA_AWARE=true
    tests+=(-k "between_two_processes or on_a_cluster or without_gpu")
fi
keep=0  # seconds the benchmark needs after the tests
if [ "$mode" != test ]; then keep=300; fi
if [ "$mode" != bench ]; then
    step 120 "$keep" python -m distributed.comm.mpi_probe | tee "$OUT/probe.txt"
    step 300 "$keep" python -m pytest -v -rs -p no:cacheprovider "${tests[@]}" 2>&1 \
        | tee "$OUT/test_mpi_gpu.txt"
    status=$?
fi
if [ "$mode" != test ]; then
    direct=()
    if [ "$mode" = direct ]; then
        unset DASK_DISTRIBUTED__COMM__MPI__CUDA_AWARE  # staged, then direct
        direct=(--direct)
    fi
    # gpu.py keeps to its budget (a part it cannot finish is recorded as
    # such), and leaves gpu_costs.py 80 s
    budget=$((END - SECONDS - 80))
    (cd benchmarks && step $((budget + 20)) 60 python gpu.py "${direct[@]}" \
        ${GPU_BENCH_ARGS:---quick} --budget "$budget" --logs "$HERE/logs" --out "$OUT") || status=$?
    (cd benchmarks && step 90 0 python gpu_costs.py --out "$OUT") || status=$?
fi
echo "processes left:"
ps -eo pid,etime,args | grep -E "[m]piexec|[h]ydra|[d]istributed\.cli|[g]pu(_costs)?\.py|[p]ingpong" ||
    echo none
# The device tool brings back 8 files of $OUT: the workers' logs as one
if [ -d logs ]; then tar czf "$OUT/logs.tgz" logs && rm -r logs; fi
rm -f "$OUT"/*.tmp
exec >&- 2>&-
for _ in $(seq 50); do  # the log whole, unless a process left holds it open
    kill -0 "$tee_pid" 2>/dev/null || break
    sleep 0.1
done
exit $status
"""


def bundle(ucx_cuda: bool = False, ucxx: bool = False, python: str = PYTHON) -> None:
    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    wheels = BUNDLE / "wheels"
    wheels.mkdir(parents=True)
    # This project, as the machine's pip would install it: a pure-Python wheel
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
    subprocess.run([*pip_wheel, "-w", wheels, ROOT], check=True)
    (wheel,) = wheels.glob("distributed-*.whl")
    # Its dependencies and the tests', for the machine's Python
    rehearsal = [] if python == PYTHON else ["pandas", "pyarrow"]
    download(wheels, python, wheel, *EXTRA, *rehearsal, deps=True)
    if ucxx:
        if python == PYTHON:
            for numpy in wheels.glob("numpy-*.whl"):  # the GPU machine has it
                numpy.unlink()
        download(wheels, python, DASK_CUDA)
    # The materialized package with its tests, and the benchmarks
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "distributed", BUNDLE / "distributed", ignore=ignore)
    shutil.copytree(ROOT / "benchmarks", BUNDLE / "benchmarks", ignore=ignore)
    for name in ["conftest.py", "setup.cfg"]:
        shutil.copy(ROOT / name, BUNDLE / name)
    (BUNDLE / "run.sh").write_text(RUN.replace("@PYTHON@", python))
    if ucx_cuda:
        add_ucx_cuda()
    if ucxx:
        add_ucxx(python)
    files = [p for p in BUNDLE.rglob("*") if p.is_file() and not p.is_symlink()]
    size = sum(p.stat().st_size for p in files)
    print(f"{BUNDLE}: {size / 2**20:.1f} MiB")
    if size > 60 * 2**20 and python == PYTHON:
        sys.exit("too large for the device tool, which carries 64 MiB in all")


def download(into: Path, python: str, *requirements, deps: bool = False) -> None:
    """Wheels of ``requirements`` (and their dependencies, if ``deps``), for
    the machine's Python"""
    platforms = ["manylinux2014_x86_64", "manylinux_2_17_x86_64"]
    platforms += ["manylinux_2_28_x86_64"]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q"]
        + ([] if deps else ["--no-deps"])
        + ["--only-binary=:all:", "--python-version", python, "--implementation"]
        + ["cp", *[arg for p in platforms for arg in ("--platform", p)]]
        + ["-d", into, *requirements],
        check=True,
    )


def add_ucxx(python: str) -> None:
    """distributed-ucxx and what it needs, unzipped into ``ucxx/`` and pruned
    to what runs: no static libraries, headers, CMake files, programs or
    perftest, and one copy of each shared library (the wheels hold three,
    which the others now link to).  Not stripped: auditwheel patched them,
    and stripped they fail to load."""
    target = BUNDLE / "ucxx"
    with tempfile.TemporaryDirectory() as tmp:
        download(Path(tmp), python, *UCXX)
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
    for path in sorted(target.rglob("*"), reverse=True):
        junk = path.suffix in (".a", ".la") or "perftest" in path.name
        junk |= path.is_dir() and path.name in ("bin", "include", "cmake")
        if junk and path.is_dir():
            shutil.rmtree(path)
        elif junk:
            path.unlink()
    for library in target.rglob("*.so.*.*.*"):  # libucp.so.0.0.0: the real one
        stem = library.name.split(".so.")[0] + ".so"
        for copy in (library.with_name(stem), library.with_name(stem + ".0")):
            if copy.exists() and not copy.is_symlink():
                copy.unlink()
                copy.symlink_to(library.name)


def add_ucx_cuda() -> None:
    """UCX built with CUDA, from the libucx-cu12 wheel: the libraries MPICH
    loads, and the transport modules for GPU memory and for copies between
    processes of one host"""
    target = BUNDLE / "ucx-cuda"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
            + ["-d", tmp, "libucx-cu12"],
            check=True,
        )
        (wheel,) = Path(tmp).glob("libucx_cu12-*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                file = Path(name).name
                if file in UCX_LIBRARIES or file.startswith("libcudart-"):
                    into = target
                elif file in UCX_MODULES:
                    into = target / "ucx"
                else:
                    continue
                into.mkdir(parents=True, exist_ok=True)
                (into / file).write_bytes(z.read(name))
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-unneeded", *target.rglob("*.so*")])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["bundle"])
    parser.add_argument(
        "--ucx-cuda", action="store_true", help="add UCX with CUDA, for run.sh direct"
    )
    parser.add_argument(
        "--ucxx", action="store_true", help="add ucx:// and dask-cuda, to compare"
    )
    parser.add_argument(
        "--python",
        default=PYTHON,
        help=f"the Python of the wheels (default {PYTHON}, the GPU machine's; "
        "this machine's to rehearse run.sh here, with GPU_BENCH_ARGS=--host-arrays)",
    )
    args = parser.parse_args()
    bundle(args.ucx_cuda, args.ucxx, args.python)
