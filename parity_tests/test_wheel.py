"""Installed as users install it (issue 40, item 5): a wheel built from the working tree, installed by pip
into a folder of its own and run from a folder outside the repository, with only that folder on the path,
runs each journey's first command (docs/journeys.md: the example model, a traced training run; the CLI's
help; a tiny model initialised and decoded) and the README's first Python snippet, reading the Multi30k
files the wheel carries. Offline: pip builds without isolation and installs with --no-index.

The GPU benchmarker's journey starts from the repository root (`python -m benchmarks...`): the benchmarks
are not part of the package, so it has no installed form to test here (parity_tests/test_journeys.py
runs it from a clone).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from parity_tests.test_data import PUBLIC_SHA256, digest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"rosetta", "numpy_ref", "torch_impl", "jax_impl", "peer_impl"}  # pyproject.toml's find.include


@dataclass(frozen=True)
class Installed:
    wheel: Path
    site: Path  # pip install --target: the packages, and bin/rosetta, the console script
    home: Path  # the user's working folder, outside the repository
    env: dict[str, str]


def run(args: list[str], installed: Installed, stdin: str = "", cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """ARGS run to exit status 0 (else the test fails showing stderr)."""
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=300,
                          cwd=cwd or installed.home, env=env or installed.env)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel, built once per session from a copy of the files git would commit (tracked, and new ones
    not ignored), so build/ and *.egg-info land in the copy and never in the checkout."""
    base = tmp_path_factory.mktemp("wheel")
    src, dist, site, home = (base / name for name in ("src", "dist", "site", "home"))
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():  # a tracked file deleted in the working tree is not built
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    offline = {**os.environ, "PIP_NO_INDEX": "1"}
    done = subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-w",
                           str(dist)], capture_output=True, text=True, timeout=300, env=offline)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = dist.glob("rosetta_transformer-*.whl")
    done = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300, env=offline)
    assert done.returncode == 0, done.stderr[-3000:]
    home.mkdir()
    assert REPO not in home.resolve().parents
    # Only the installed folder on the path, its script first on PATH; no data folder named, so the
    # default (the wheel's own copy) is what the commands read.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROSETTA_DATA_DIR")}
    env.update(PYTHONPATH=str(site), PATH=f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return Installed(wheel, site, home, env)


def test_the_wheel_holds_the_packages_the_script_and_the_data(installed):
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
        assert top == PACKAGES  # not the tests, not the benchmarks
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "rosetta = rosetta.cli:main" in wheel.read(entry_points).decode()
        data = sorted(n.removeprefix("rosetta/data/multi30k/") for n in names
                      if n.startswith("rosetta/data/multi30k/"))
        assert data == sorted(PUBLIC_SHA256)
        for name, expected in PUBLIC_SHA256.items():  # the untouched public files' hashes
            assert digest(wheel.read(f"rosetta/data/multi30k/{name}")) == expected, name


def test_what_runs_is_the_installed_package_and_its_data(installed):
    done = run([sys.executable, "-c", "import rosetta, rosetta.harness.data as d; "
                "print(rosetta.__file__); print(d.default_data_dir())"], installed)
    module, data_dir = map(Path, done.stdout.splitlines())
    # the venv's editable install of this checkout must not be what answers
    assert installed.site in module.parents and data_dir == installed.site / "rosetta" / "data" / "multi30k"
    assert shutil.which("rosetta", path=installed.env["PATH"]) == str(installed.site / "bin" / "rosetta")


def test_the_cli_a_tiny_model_and_its_generation(installed, tmp_path):
    assert run(["rosetta", "--help"], installed).stdout.startswith("usage: rosetta")
    assert run([sys.executable, "-m", "rosetta.cli", "--help"], installed).stdout.startswith("usage: rosetta")
    run(["rosetta", "init", "--preset", "tiny", "--out", "m.safetensors"], installed)
    got = run(["rosetta", "generate", "--checkpoint", "m.safetensors", "--backend", "numpy"], installed,
              stdin="5 6 7 2\n9 8 2\n").stdout
    # The checkout's own CLI, on the same arguments, is the expected answer: same weights, same tokens.
    checkout = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rosetta = [sys.executable, "-m", "rosetta.cli"]
    mine = str(tmp_path / "m.safetensors")
    run([*rosetta, "init", "--preset", "tiny", "--out", mine], installed, cwd=REPO, env=checkout)
    assert (installed.home / "m.safetensors").read_bytes() == Path(mine).read_bytes()
    expected = run([*rosetta, "generate", "--checkpoint", mine, "--backend", "numpy"], installed,
                   stdin="5 6 7 2\n9 8 2\n", cwd=REPO, env=checkout).stdout
    assert got == expected and len(got.splitlines()) == 2


def test_the_marian_porters_first_command_reads_the_bundled_data(installed):
    """docs/journeys.md journey 1 (at 1 step, not 40: the build is what is tested, not the training), then
    a translation of the directory it wrote."""
    done = run(["rosetta", "example", "opus-mt", "opus-mt-de-en/", "--steps", "1"], installed)
    assert "trained 1 steps on Multi30k de-en" in done.stdout
    out = installed.home / "opus-mt-de-en"
    assert {"source.spm", "target.spm", "vocab.json", "config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()}
    translated = run(["rosetta", "translate", "--checkpoint", "opus-mt-de-en/", "--backend", "numpy"],
                     installed, stdin="Ein Hund läuft.\n").stdout
    assert len(translated.splitlines()) == 1 and translated.strip()


def test_the_tutorial_porters_first_command(installed):
    """docs/journeys.md journey 2's first line, as written: a traced reference run."""
    run(["rosetta", "train", "--backend", "torch", "--task", "copy", "--preset", "tiny", "--steps", "3",
         "--trace", "3", "--set", "dropout=0", "--dtype", "float64", "--eval-every", "0",
         "--checkpoint-every", "0", "--no-progress", "--out", "runs/ref"], installed)
    assert (installed.home / "runs" / "ref" / "torch" / "result.json").is_file()


def test_the_readmes_first_python_snippet(installed):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet, "README.md has no Python snippet"
    (installed.home / "snippet.py").write_text(snippet.group(1), encoding="utf-8")
    run([sys.executable, "snippet.py"], installed)
    saved = re.findall(r'"([\w.-]+\.safetensors)"', snippet.group(1))
    assert saved and all((installed.home / name).is_file() for name in saved), saved
