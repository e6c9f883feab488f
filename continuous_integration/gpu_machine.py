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
``benchmarks/gpu.py`` and ``benchmarks/gpu_costs.py``; logs, ``probe.txt``,
test output, ``gpu.json``, ``gpu.png`` and ``gpu_costs.json`` go to ``$OUT``.

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
machine has it.  On an H200 (2026-11-26) ``all`` took under three
minutes: the set-up 20 s, the tests 15-40 s, the full benchmark
(``GPU_BENCH_ARGS=" "``) 70 s.  On an H100 (2026-11-28) the tests took 80 s
and mpi:// by IPC 22 s, but ucx:// hung twice: the benchmark gives each
transport 100 s for the ping-pong and 100 s for the workloads (``--limit``),
records a part that did not finish, prints where its processes were (their
output, the workers' too, is in ``$OUT``), and goes on.  The device tool
lends 15 minutes a session, machine starts included: one ``all`` call, and a
second only if the first is short.
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
# ucx:// for CUDA 13 (libucxx 0.52 wants UCX below 1.22), for bundle --ucxx
UCXX = ["distributed-ucxx-cu13", "ucxx-cu13", "libucxx-cu13", "libucx-cu13<1.22"]
UCXX += ["rmm-cu13", "librmm-cu13", "rapids-logger"]
# What MPICH needs of UCX, for bundle --ucx-cuda
UCX_LIBRARIES = {f"lib{n}.so.0" for n in ["ucp", "ucs", "uct", "ucm", "ucs_signal"]}
UCX_MODULES = {"libuct_cuda.so.0", "libucm_cuda.so.0", "libuct_cma.so.0"}

RUN = r"""#!/usr/bin/env bash
# Written by continuous_integration/gpu_machine.py: see there.
# bash run.sh test: set up, probe, GPU tests; bash run.sh bench: the benchmark;
# bash run.sh all: both; bash run.sh direct: both, on the direct path.
# Each fits in one device call (10 minutes); set MPI4DASK_GPU_LARGE=0 to leave
# out the 2.5 GB array, GPU_BENCH_ARGS (default --quick) for the benchmark.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/run-${1:-test}.log") 2>&1
cd "$HERE"
if [ ! -e .venv/ready ]; then
    nvidia-smi || true
    # A virtual environment that sees the machine's packages (CuPy, Numba, its
    # mpi4py) after its own: what the machine lacks comes from the wheels
    MACHINE_SITE="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    python3 -m venv .venv
    . .venv/bin/activate
    echo "$MACHINE_SITE" > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine.pth"
    pip install -q --no-index --find-links wheels wheels/distributed-*.whl mpich \
        pytest pytest-timeout
    if ls wheels/dask_cuda-*.whl >/dev/null 2>&1; then
        pip install -q --no-index --no-deps wheels/dask_cuda-*.whl
    fi
    python -c "import mpi4py; print('mpi4py', mpi4py.__version__, mpi4py.__file__)"
    if ! timeout 60 python -c "from mpi4py import MPI; print(MPI.Get_library_version())"; then
        echo "the machine's mpi4py does not start with MPICH: mpi4py from the wheels"
        pip install -q --no-index --find-links wheels --force-reinstall --no-deps mpi4py
    fi
    touch .venv/ready
fi
. .venv/bin/activate
# The package under test is the bundle's copy (with its tests), not the wheel's
export PYTHONPATH="$HERE"
if [ -d "$HERE/ucxx" ]; then  # bundle --ucxx: ucx:// and RMM
    export PYTHONPATH="$HERE:$HERE/ucxx" DASK_DISTRIBUTED_UCXX__CREATE_CUDA_CONTEXT=True
fi
which mpiexec
status=0
# The GPU tests, and whether workers may read each other's memory there (Yama)
tests=(distributed/comm/tests/test_mpi_gpu.py
    distributed/comm/tests/test_mpi_processes.py::test_a_process_on_mpi_lets_its_siblings_read_its_memory)
if [ "${1:-test}" = direct ]; then
    export LD_LIBRARY_PATH="$HERE/ucx-cuda" DASK_DISTRIBUTED__COMM__MPI__CUDA_AWARE=true
    tests+=(-k "between_two_processes or on_a_cluster or without_gpu")
fi
if [ "${1:-test}" != bench ]; then
    timeout 120 python -m distributed.comm.mpi_probe | tee "$OUT/probe.txt"
    timeout 300 python -m pytest -v -rs -p no:cacheprovider "${tests[@]}" 2>&1 \
        | tee "$OUT/test_mpi_gpu.txt"
    status=$?
fi
if [ "${1:-test}" != test ]; then
    direct=()
    if [ "${1:-test}" = direct ]; then
        unset DASK_DISTRIBUTED__COMM__MPI__CUDA_AWARE  # staged, then direct
        direct=(--direct)
    fi
    (cd benchmarks && timeout 420 python gpu.py "${direct[@]}" ${GPU_BENCH_ARGS:---quick} --logs --out "$OUT") || status=$?
    (cd benchmarks && timeout 90 python gpu_costs.py --out "$OUT") || status=$?
fi
exit $status
"""


def bundle(ucx_cuda: bool = False, ucxx: bool = False) -> None:
    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    wheels = BUNDLE / "wheels"
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    # This project, as the machine's pip would install it: a pure-Python wheel
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", wheels, ROOT], check=True)
    (wheel,) = wheels.glob("distributed-*.whl")
    # Its dependencies and the tests', for the machine's Python
    platforms = ["manylinux2014_x86_64", "manylinux_2_17_x86_64"]
    platforms += ["manylinux_2_28_x86_64"]
    subprocess.run(
        [
            *pip,
            "download",
            "-q",
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            "--implementation",
            "cp",
            *[arg for p in platforms for arg in ("--platform", p)],
            "-d",
            wheels,
            wheel,
            *EXTRA,
        ],
        check=True,
    )
    if ucxx:
        for numpy in wheels.glob("numpy-*.whl"):  # the machine has it
            numpy.unlink()
        download(wheels, "dask-cuda")
    # The materialized package with its tests, and the benchmarks
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "distributed", BUNDLE / "distributed", ignore=ignore)
    shutil.copytree(ROOT / "benchmarks", BUNDLE / "benchmarks", ignore=ignore)
    for name in ["conftest.py", "setup.cfg"]:
        shutil.copy(ROOT / name, BUNDLE / name)
    (BUNDLE / "run.sh").write_text(RUN)
    if ucx_cuda:
        add_ucx_cuda()
    if ucxx:
        add_ucxx()
    files = [p for p in BUNDLE.rglob("*") if p.is_file() and not p.is_symlink()]
    size = sum(p.stat().st_size for p in files)
    print(f"{BUNDLE}: {size / 2**20:.1f} MiB")
    if size > 60 * 2**20:
        sys.exit("too large for the device tool, which carries 64 MiB in all")


def download(into: Path, *requirements: str) -> None:
    """Wheels of ``requirements`` alone, for the machine's Python"""
    platforms = ["manylinux2014_x86_64", "manylinux_2_17_x86_64"]
    platforms += ["manylinux_2_28_x86_64"]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        + ["--only-binary=:all:", "--python-version", PYTHON, "--implementation"]
        + ["cp", *[arg for p in platforms for arg in ("--platform", p)]]
        + ["-d", into, *requirements],
        check=True,
    )


def add_ucxx() -> None:
    """distributed-ucxx and what it needs, unzipped into ``ucxx/`` and pruned
    to what runs: no static libraries, headers, CMake files, programs or
    perftest, and one copy of each shared library (the wheels hold three,
    which the others now link to).  Not stripped: auditwheel patched them,
    and stripped they fail to load."""
    target = BUNDLE / "ucxx"
    with tempfile.TemporaryDirectory() as tmp:
        download(Path(tmp), *UCXX)
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
    args = parser.parse_args()
    bundle(args.ucx_cuda, args.ucxx)
