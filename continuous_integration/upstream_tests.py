"""Run upstream distributed's own test suite against this fork.

Upstream keeps its tests in its repository, not in the sdist that the fork is built
from. This command lays the fork's materialized package and an upstream checkout's
tests, root ``conftest.py``, pytest configuration and ``pytest_resourceleaks.py``
side by side in ``build/upstream-tests-SCHEME/`` (ignored by git), runs pytest there the way
upstream's CI does (``DISABLE_IPV6=1``, timeouts by signal), and prints a summary in
which every failure is matched against ``upstream_tests_expected.toml``.

    python continuous_integration/upstream_tests.py --upstream PATH [--scheme mpi]
        [-- PYTEST ARGS]

PATH is a checkout of dask/distributed at the pinned release's tag, or any git
repository with ``--ref``; without ``--upstream`` the tag is cloned from GitHub into
``~/.cache/mpi4dask``. ``--scheme mpi`` sets ``DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME``,
so that every address without a scheme (nearly every ``gen_cluster`` test) is
``mpi://``. PYTEST ARGS (default: ``distributed``) select tests as usual. Exits 1 if
a test failed that the expected list does not name.

A run of the whole suite writes its figures to ``build/upstream-tests-SCHEME/
record.json``; ``--record`` also puts them in ``docs/upstream-tests/SCHEME.json``
and rewrites ``docs/upstream-tests.rst`` from those files (``--publish`` rewrites
the page alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream  # noqa: E402

ROOT = upstream.ROOT
PACKAGE = upstream.PACKAGE
EXPECTED = Path(__file__).resolve().parent / "upstream_tests_expected.toml"
REPOSITORY = "https://github.com/dask/distributed"
LEFTOVERS = "upstream_tests_leftovers"  # a pytest plugin
MPI_COMMS = "upstream_tests_mpi_comms.py"  # upstream's comm checks on mpi://
RECORDS = ROOT / "docs" / "upstream-tests"
PAGE = ROOT / "docs" / "upstream-tests.rst"


def checkout(path: Path | None, ref: str | None, version: str, dest: Path) -> None:
    """Write the upstream tree (``ref`` of the repository at ``path``, or the work
    tree at ``path``, or the release tag cloned from GitHub) into ``dest``."""
    if path is None:
        path = Path.home() / ".cache" / "mpi4dask" / f"{PACKAGE}-{version}-git"
        if not path.exists():
            subprocess.run(
                ["git", "clone", "--depth=1", f"--branch={version}", REPOSITORY, path],
                check=True,
            )
    if ref is None:
        shutil.copytree(path, dest, ignore=shutil.ignore_patterns(".git"))
        return
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", path, "archive", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def is_test_path(path: Path) -> bool:
    return "tests" in path.parts


def prepare(args: argparse.Namespace, run_dir: Path) -> None:
    """Upstream's checkout with its package replaced by the fork's, tests kept."""
    config = upstream.read_config(ROOT)
    upstream.materialize(ROOT)
    shutil.rmtree(run_dir, ignore_errors=True)
    checkout(args.upstream, args.ref, config.upstream_version, run_dir)
    package = run_dir / PACKAGE
    # pytest_resourceleaks.py is in upstream's wheel but not in its sdist.
    keep = {package / "pytest_resourceleaks.py"}
    for path in package.rglob("*"):
        if (
            path.is_file()
            and path not in keep
            and not is_test_path(path.relative_to(package))
        ):
            path.unlink()
    ignored = {".gitignore", upstream.STAMP, "__pycache__"}
    for path in (ROOT / PACKAGE).rglob("*"):
        rel = path.relative_to(ROOT)
        if not path.is_file() or is_test_path(rel) or ignored & set(rel.parts):
            continue
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, run_dir / rel)
    shutil.copy2(Path(__file__).with_name(f"{LEFTOVERS}.py"), run_dir)
    if args.scheme == "mpi":  # upstream's comm checks, on mpi:// too
        tests = run_dir / PACKAGE / "comm" / "tests"
        shutil.copy2(Path(__file__).with_name(MPI_COMMS), tests / "test_comms_mpi.py")


def expected_failures() -> dict[str, dict[str, str]]:
    """{section: {test id or prefix: reason}} from upstream_tests_expected.toml."""
    with open(EXPECTED, "rb") as f:
        return tomllib.load(f)


def node_id(case: ET.Element) -> str:
    """pytest's node id of a junit (xunit1) test case."""
    file, name = case.get("file", ""), case.get("name", "")
    module = file.removesuffix(".py").replace("/", ".")
    classname = case.get("classname", "")
    cls = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
    return "::".join([file, *(cls.split(".") if cls else []), name])


def outcomes(junit: Path) -> dict[str, str]:
    """{node id: passed | failed | error | skipped | xfailed} from a junit file."""
    result = {}
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                break
            if child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome = "xfailed" if xfail else "skipped"
        # A test that failed and then errored in teardown has two entries.
        if result.get(node_id(case), "passed") == "passed":
            result[node_id(case)] = outcome
    return result


def reason(test: str, known: dict[str, str]) -> str | None:
    for prefix, why in known.items():
        if (
            test == prefix
            or test.startswith(prefix + "::")
            or test.startswith(prefix + "[")
        ):
            return why
    return None


def summarize(
    results: dict[str, str], known: dict, scheme: str, seconds: float
) -> dict:
    """Print counts and every failure with its expected reason; the record of
    the run: its counts, and each failure's section (None: unexpected)"""
    counts: dict[str, int] = {}
    for outcome in results.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(f"\nupstream's suite on {scheme}://, {seconds / 60:.0f} min: ", end="")
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    sections = (["mpi"] if scheme == "mpi" else []) + ["stock"]
    failed = sorted(t for t, o in results.items() if o in ("failed", "error"))
    failures: dict[str, str | None] = {}
    for test in failed:
        failures[test] = None
        for section in sections:
            if why := reason(test, known.get(section, {})):
                print(f"  expected ({section}): {test}\n      {why}")
                failures[test] = section
                break
    unexpected = [test for test, section in failures.items() if section is None]
    for test in unexpected:
        print(f"  UNEXPECTED: {test}")
    print(
        f"{len(failed)} failed: {len(failed) - len(unexpected)} expected, "
        f"{len(unexpected)} unexpected"
    )
    return {
        "scheme": scheme,
        "date": datetime.date.today().isoformat(),
        "minutes": round(seconds / 60),
        "fork": upstream.read_config(ROOT).version,
        "counts": counts,
        "failures": failures,
    }


def publish() -> None:
    """Write docs/upstream-tests.rst from the records in docs/upstream-tests/"""
    known = expected_failures()
    lines = PAGE_INTRO.splitlines() + [""]
    for scheme in ["mpi", "tcp"]:
        path = RECORDS / f"{scheme}.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        title = f"The whole suite on ``{scheme}://``"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(record["counts"].items()))
        lines += [title, "-" * len(title), ""]
        lines += [
            f"{record['date']}, fork {record['fork']}, {record['minutes']} minutes: "
            f"{counts}.",
            "",
        ]
        failures = record.get("failures")
        if failures is None:  # a run from before the records
            lines += [record["note"].capitalize() + ".", ""]
            continue
        unexpected = [t for t, section in failures.items() if section is None]
        lines += [
            f"{len(failures)} failed: {len(failures) - len(unexpected)} expected, "
            f"{len(unexpected)} unexpected.",
            "",
        ]
        for test, section in sorted(failures.items(), key=lambda x: (str(x[1]), x[0])):
            why = reason(test, known.get(section, {})) if section else None
            lines.append(f"- ``{test}`` ({section or 'UNEXPECTED'})")
            if why:
                lines.append(f"  {why}")
        lines.append("")
    PAGE.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {PAGE}")


PAGE_INTRO = """\
Upstream's test suite on ``mpi://``
===================================

This page is written by ``python continuous_integration/upstream_tests.py
--publish`` from the records of the last whole runs (``docs/upstream-tests/``):
do not edit it by hand. Earlier runs, with what changed between them, are in
``docs/mpi-history.rst``.

distributed's own tests are not in the release the fork is built from;
``continuous_integration/upstream_tests.py`` (see ``README.rst``) lays a
checkout's tests around the fork and runs them as upstream's CI does: upstream's
pytest configuration (warnings are errors, leaked threads, processes, file
descriptors and comms fail a test), ``DISABLE_IPV6=1``, timeouts by signal. With
``--scheme mpi`` every address without a scheme, hence nearly every
``gen_cluster`` and ``gen_test`` cluster, is ``mpi://``; seven of upstream's comm
checks (``distributed/comm/tests/test_comms.py``) run on ``mpi://`` too.
``listen()`` of an address without a scheme still uses ``tcp://`` (upstream's
``comm/core.py``), and some tests rely on that.

Every failure is matched against
``continuous_integration/upstream_tests_expected.toml``, which gives, for each
test that fails here for a reason that is not a defect of the fork, that reason:

- ``[stock]``: fails on stock upstream distributed on these machines, on every
  transport (no sshd, running as root, too slow on 2 cores);
- ``[mpi]``: fails only on ``mpi://``, because the test assumes ``tcp://``: the
  line that does, and why that is not a defect of ``mpi://``;
- ``[deselect]``: not run at all (it would write to ``/`` or dial the internet).

A failure not in that file is reported as unexpected, and the command exits 1.
"""


def run(args: argparse.Namespace, run_dir: Path) -> bool:
    junit = run_dir / "results.xml"
    env = dict(os.environ, DISABLE_IPV6="1")
    env.pop("DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME", None)
    if args.scheme == "mpi":
        env["DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME"] = "mpi"
    known = expected_failures()
    deselect = [f"--deselect={t}" for t in known.get("deselect", {})]
    cmd = [sys.executable, "-m", "pytest", "-c", "pyproject.toml", "-p", LEFTOVERS]
    cmd += ["-o", "timeout_method=signal", "-o", "junit_family=xunit1"]
    cmd += [f"--junitxml={junit}", "--color=no", *deselect]
    cmd += args.pytest_args or [PACKAGE]
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    # Its own session, so that processes the tests leave behind can be killed.
    proc = subprocess.Popen(cmd, cwd=run_dir, env=env, start_new_session=True)
    try:
        proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not junit.exists():
        sys.exit(f"pytest wrote no results (exit code {proc.returncode})")
    record = summarize(outcomes(junit), known, args.scheme, time.monotonic() - start)
    if proc.returncode not in (0, 1):  # 1: tests failed
        print(f"pytest did not finish its run: exit code {proc.returncode}")
        return False
    if not args.pytest_args:  # the whole suite
        (run_dir / "record.json").write_text(json.dumps(record, indent=1))
        if args.record:
            RECORDS.mkdir(exist_ok=True)
            (RECORDS / f"{args.scheme}.json").write_text(json.dumps(record, indent=1))
            publish()
    return None not in record["failures"].values()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--upstream", type=Path, help="dask/distributed checkout (or git repository)"
    )
    parser.add_argument("--ref", help="with --upstream: the commit or tag to run")
    parser.add_argument("--scheme", choices=["tcp", "mpi"], default="tcp")
    parser.add_argument(
        "--record", action="store_true", help="publish a whole run's figures"
    )
    parser.add_argument(
        "--publish", action="store_true", help="rewrite the page, run nothing"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    if args.publish:
        publish()
        return
    # Tests SIGINT the processes they start, which would inherit an ignored
    # SIGINT from a shell's background job (``... &``): exec resets a handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_dir = ROOT / "build" / f"upstream-tests-{args.scheme}"
    prepare(args, run_dir)
    sys.exit(0 if run(args, run_dir) else 1)


if __name__ == "__main__":
    main()
