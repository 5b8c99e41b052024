"""Where the suite's time goes (issue 56): each test's wall and CPU seconds, and each module's totals,
written to a JSON file at the end of the run.

    make test                                   # writes .test-durations.json (DURATIONS= to move it)
    python -m pytest --durations-file out.json parity_tests/test_config.py
    python -m parity_tests.durations .test-durations.json [--top 20]   # the costliest modules, markdown

CPU seconds are the worker process's user + system time over a test's setup, call and teardown,
its finished subprocesses' included (getrusage RUSAGE_SELF + RUSAGE_CHILDREN): XLA's and PyTorch's
threads and every `rosetta` a test starts. A module-scoped fixture counts in the first test that
uses it. Under pytest-xdist the workers measure and the controller, which receives every report,
writes the file. A pytest plugin: pyproject.toml's addopts load it (`-p parity_tests.durations`).
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import pytest

from rosetta.cli_args import positive_int
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes, check_writable
from rosetta.json_input import read_json

CPU_AT = pytest.StashKey[float]()  # the worker's CPU seconds when the test's current phase began
FILE = pytest.StashKey[Path]()
# The recording process's tests: nodeid -> {"wall": s, "cpu": s, "outcome": ...}; None where nothing is
# recorded (no --durations-file, or an xdist worker). Module-level: pytest_runtest_logreport has no config.
_TIMES: dict | None = None


def cpu_seconds() -> float:
    """This process's user + system time and that of its children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write each test's and each module's wall and CPU seconds to PATH (JSON; "
                          "parity_tests/durations.py)")


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or a run without xdist) records."""
    global _TIMES
    path = config.getoption("--durations-file")
    if path and not hasattr(config, "workerinput"):
        try:  # a directory, a path under a file, an unwritable folder: one line before any test runs
            config.stash[FILE], _TIMES = check_writable(path), {}
        except RosettaError as e:
            raise pytest.UsageError(f"--durations-file: {e}") from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Each phase's report carries the CPU seconds spent since the previous phase ended."""
    now = cpu_seconds()
    report = (yield).get_result()
    report.user_properties.append(("cpu_seconds", now - item.stash.get(CPU_AT, now)))
    item.stash[CPU_AT] = cpu_seconds()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[CPU_AT] = cpu_seconds()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _TIMES is None:
        return
    entry = _TIMES.setdefault(report.nodeid, {"wall": 0.0, "cpu": 0.0, "outcome": "passed"})
    entry["wall"] += report.duration
    entry["cpu"] += dict(report.user_properties).get("cpu_seconds", 0.0)
    if report.outcome != "passed":
        entry["outcome"] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The tests and the modules' totals, the costliest first."""
    config = session.config
    if _TIMES is None or FILE not in config.stash:
        return
    modules: dict[str, dict] = {}
    for nodeid, t in _TIMES.items():
        m = modules.setdefault(nodeid.split("::")[0], {"wall": 0.0, "cpu": 0.0, "tests": 0})
        m["wall"] += t["wall"]
        m["cpu"] += t["cpu"]
        m["tests"] += 1
    order = sorted(modules, key=lambda name: -modules[name]["cpu"])
    payload = {"total": {"wall": sum(t["wall"] for t in _TIMES.values()),
                         "cpu": sum(t["cpu"] for t in _TIMES.values()), "tests": len(_TIMES)},
               "modules": {name: _rounded(modules[name]) for name in order},
               "tests": {k: _rounded(v) for k, v in sorted(_TIMES.items(), key=lambda kv: -kv[1]["cpu"])}}
    atomic_write_bytes(config.stash[FILE], (json.dumps(payload, indent=1) + "\n").encode())


def _rounded(entry: dict) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items()}


def table(payload: dict, top: int = 20) -> str:
    """The `top` costliest modules by CPU seconds, markdown, with their share of the suite's CPU."""
    total = payload["total"]
    lines = [f"{total['tests']} tests, {total['cpu']:.0f} CPU s, {total['wall']:.0f} test-wall s "
             "(summed over the workers)", "", "| module | tests | CPU s | share | wall s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in list(payload["modules"].items())[:top]:
        share = m["cpu"] / total["cpu"] if total["cpu"] else 0.0
        lines.append(f"| {Path(name).stem} | {m['tests']} | {m['cpu']:.0f} | {share:.0%} | {m['wall']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cli = argparse.ArgumentParser(description="The costliest test modules of a --durations-file run.")
    cli.add_argument("file", type=Path)
    cli.add_argument("--top", type=positive_int, default=20)
    args = cli.parse_args(argv)
    try:
        payload = read_json(args.file, "a durations file")
        text = table(payload, args.top)
    except RosettaError as e:
        cli.error(str(e))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        cli.error(f"{args.file}: not a --durations-file JSON (total, modules, tests): {type(e).__name__} {e}")
    print(text)


if __name__ == "__main__":
    main()
