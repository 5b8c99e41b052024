"""What every benchmark records: the machine, the commit, the versions; one timer; and the one
way a benchmark times training: the trainers' own `Trainer.step`, built through the registry with
the settings `rosetta train` passes (rosetta/harness/loop.py), stepped by the harness's own Stepper
(rosetta/harness/stepping.py) exactly as a training run steps it."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rosetta.backends import get_trainer
from rosetta.cli_args import machine_memory, nonempty_path
from rosetta.config import ModelConfig
from rosetta.device import cache_dir, collect_less
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes, check_writable
from rosetta.harness.stepping import Stepper, cycle
from rosetta.json_input import field, read_json
from rosetta.machine import ISA_NAMES, cpu_facts, describe, isa_cap, isa_environment
from rosetta.training import Batch, TrainConfig

RESULTS = Path(__file__).parent / "results"
# Where a run's files go without --out-dir (issue 57). RESULTS is the project's record: the tables the
# docs render and the figures they quote, written by the benchmarks that measure and committed by
# whoever ran them. gpu_check and profile_step check and take apart a step on the user's own machine:
# their files are that user's, not a figure of the project's, so they go to USER_RESULTS, beside the
# runs of `rosetta train` (runs/, which git ignores), under the folder the command runs in.
USER_RESULTS = Path("runs") / "benchmarks"


class Parser(argparse.ArgumentParser):
    """A benchmark's command line. Every refusal is one line, `benchmarks.NAME: error: ...`, exit
    status 2, as `rosetta`'s are; and each benchmark makes them before its first measurement: its
    flags through rosetta/cli_args.py's types, its output files through `check_out_dir`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.removeprefix('python -m ')}: error: {message}\n")

    def check_out_dir(self, out_dir: Path, names: Iterable[str], flag: str | None = "--out-dir") -> Path:
        """`out_dir`, once each file the benchmark will write there can be written (rosetta.files:
        check_writable: not a file or a directory in the way, a folder a file can be created in);
        else one line naming `flag` (None: a folder no flag names, such as docs/)."""
        for name in names:
            try:
                check_writable(out_dir / name)
            except RosettaError as e:
                self.error(f"argument {flag}: {e}" if flag else str(e))
        return out_dir

    def add_out_dir(self, default: Path) -> None:
        """`--out-dir`, defaulting to RESULTS (a measurement for the record) or USER_RESULTS (a user's
        check of their own machine); checked before any work by `check_out_dir`."""
        where = "benchmarks/results, the project's record" if default == RESULTS else \
            f"{default}/ in the current folder (git ignores it); benchmarks/results is the project's record"
        self.add_argument("--out-dir", type=given_path, default=default,
                          help=f"where the results files go (default: {where})")

    def add_isa(self, both: bool = False) -> None:
        """`--isa`: the benchmark run with every library capped at an ISA (rosetta/machine.py); `both`:
        also `--isa both`, each of ISA_NAMES in a process of its own (run_isas), one results file."""
        self.add_argument("--isa", choices=(*ISA_NAMES, "both") if both else ISA_NAMES, default=None,
                          help="run with every library (oneDNN, ATen, MKL, XLA, CTranslate2) capped at this "
                               "ISA: avx2 measures what an AVX2-only CPU runs; native takes every cap away"
                               + ("; both: native, then avx2, in one results file" if both else "")
                               + " (default: the environment as it is; docs/benchmarks.md)")
        if both:  # where a process of `--isa both` leaves its part (run_isas)
            self.add_argument("--part", type=Path, default=None, help=argparse.SUPPRESS)

    def run_isas(self, argv: Sequence[str] | None) -> dict[str, dict]:
        """`--isa both`: the same command once per ISA of ISA_NAMES, each in a process started with that
        ISA's environment and writing its payload to a `--part` file; {isa: payload}. A part that fails
        ends this process with its exit status."""
        module = self.prog.removeprefix("python -m ")
        given = list(sys.argv[1:] if argv is None else argv)
        rest = [a for i, a in enumerate(given) if a not in ("--isa", "--isa=both")
                and not (i > 0 and given[i - 1] == "--isa")]
        parts = {}
        with tempfile.TemporaryDirectory(prefix="rosetta-isa-") as tmp:
            for isa in ISA_NAMES:
                part = Path(tmp) / f"{isa}.json"
                command = [sys.executable, "-m", module, *rest, "--isa", isa, "--part", str(part)]
                done = subprocess.run(command, env=isa_environment(isa))
                if done.returncode != 0:
                    raise SystemExit(done.returncode)
                parts[isa] = json.loads(part.read_text())  # our own child's file
        return parts

    def apply_isa(self, args: argparse.Namespace, argv: Sequence[str] | None) -> None:
        """Under `--isa X` with another cap in force, the same command again in a process started with X's
        environment (each library reads its cap when it starts), then exit with its status."""
        if args.isa is None or isa_cap() == args.isa:
            return
        module = self.prog.removeprefix("python -m ")
        argv = sys.argv[1:] if argv is None else list(argv)
        done = subprocess.run([sys.executable, "-m", module, *argv], env=isa_environment(args.isa))
        raise SystemExit(done.returncode)

    def bound(self, flag: str, value: int, maximum: int, why: str) -> int:
        """`value` of `flag` once it is at most `maximum`, a bound that depends on other flags or on the
        machine (a preset's max_len, what its memory holds); else one line naming the flag, the bound
        and `why`, before any work. Bounds known when parsing are integer_type's `maximum` instead."""
        if value > maximum:
            self.error(f"argument {flag}: must be <= {maximum:,} ({why}), got {value:,}")
        return value

    def fits_memory(self, flag: str, value: int, bytes_each: int, what: str) -> int:
        """`value` of `flag`, a number of `what` (rows, tokens, sentences) each needing `bytes_each` bytes
        at the least, once that many fit in this machine's memory (rosetta.cli_args.machine_memory: a
        bound it certainly cannot pass, e.g. the 36 TiB of `profile_step --batch 10**12`)."""
        memory = machine_memory()
        return self.bound(flag, value, max(1, memory // bytes_each),
                          f"{what} of {bytes_each:,} bytes at the least: this machine's memory is "
                          f"{memory / 2**30:.1f} GiB")

    @contextlib.contextmanager
    def refusing(self, flag: str | None = None) -> Iterator[None]:
        """Bad input found while setting up (a data directory, a suite's presets): one line, exit 2."""
        try:
            yield
        except RosettaError as e:
            self.error(f"argument {flag}: {e}" if flag else str(e))


def given_path(text: str) -> Path:
    """A path flag's value (--out-dir, a results file): "" is refused, not read as the current directory."""
    return Path(nonempty_path(text))


def parser(script: str, description: str | None) -> Parser:
    """The Parser of benchmarks/<script>.py (`script`: its __file__), named as it is run. Every
    benchmark's main builds it first: its process collects Python's garbage as `rosetta`'s does
    (rosetta/device.py: collect_less), so a step is timed as `rosetta train` runs it."""
    collect_less()
    return Parser(prog=f"python -m benchmarks.{Path(script).stem}", description=description,
                  formatter_class=argparse.RawDescriptionHelpFormatter)


def environment() -> dict:
    """Machine, commit and library versions, stored in every results file; "machine_block" is the block
    of `python -m benchmarks.machine` (vector ISA, each library's dispatch, the cap, the calibration;
    "machine" stays the host's name, as files before issue 55 have it)."""
    from benchmarks.machine import full_block

    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "platform": platform.platform(),
        "processor": cpu_facts()["model"],  # /proc/cpuinfo's model name, else platform's
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine_block": full_block(),
    }
    if os.environ.get("ROSETTA_COMMIT"):  # a machine whose checkout has no (or a stale) .git
        info["commit"] = os.environ["ROSETTA_COMMIT"] + " (from ROSETTA_COMMIT)"
        return _versions(info)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        info["commit"] += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = "unknown"
    return _versions(info)


def _versions(info: dict) -> dict:
    """Add the library versions (and the devices they see) to `info`."""
    import numpy
    info["numpy"] = numpy.__version__
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import flax
        import jax
        info["jax"], info["flax"] = jax.__version__, flax.__version__
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except ImportError:
        pass
    return info


def machine_line(env: dict) -> str:
    """The line every results table prints under its title: the CPU, its vector ISA, the cap and the
    matmul calibration (rosetta.machine.describe); files from before issue 55 say they have no block."""
    block = env.get("machine_block")
    return f"Machine: {describe(block)}" if block else "Machine: not recorded (a file from before issue 55)"


def with_machine(markdown: str, env: dict) -> str:
    """`markdown` with machine_line(env) under its title (its first line), once: what a benchmark prints
    is what write_results writes."""
    line = machine_line(env)
    if line in markdown:
        return markdown
    title, _, rest = markdown.partition("\n")
    return f"{title}\n\n{line}\n{rest}"


def isa_sections(parts: dict[str, dict], render: Callable[[dict], str]) -> str:
    """One markdown of `--isa both`'s parts (Parser.run_isas): each part's table, `render(part)`, under a
    "## ISA: its title" heading and its own machine line, after one title naming the ISAs."""
    sections = []
    for isa, part in parts.items():
        title, _, rest = with_machine(render(part), part["environment"]).partition("\n")
        sections.append(f"## {isa}: {title.lstrip('# ')}\n{rest}")
    first = render(next(iter(parts.values()))).partition("\n")[0].lstrip("# ")
    return f"# At each ISA ({', '.join(parts)}): {first}\n\n" + "\n".join(sections)


def time_it(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> dict:
    """Median and spread of wall-clock seconds over `repeats` calls, after `warmup` calls
    (compilation stays out of the numbers). `fn` must block until its result is ready."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "repeats": repeats}


# The training implementations a benchmark can time: name -> (backend, the Trainer's settings), each
# what `rosetta train --backend B [--loss chunked] [--compile]` builds.
TRAINERS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch": ("torch", {}),
    "torch (chunked loss)": ("torch", {"loss": "chunked"}),
    "torch.compile": ("torch", {"compile": True}),
    "jax": ("jax", {}),
    "jax (chunked loss)": ("jax", {"loss": "chunked"}),
    "peer": ("peer", {}),
}
HARNESS = " (rosetta train)"  # the name suffix of a row timed through the training loop itself
# The order of implementations in every table: the training loop's row after the one it runs.
IMPL_ORDER = ("numpy", *(name for impl in TRAINERS for name in (impl, impl + HARNESS)))
# What a benchmark's trainers train with: the paper's schedule and recipe (SPEC §4).
TRAIN_CONFIG = TrainConfig(warmup_steps=4000)


def build_trainer(impl: str, cfg: ModelConfig, params: dict, dtype: str, device: str | None = None) -> Any:
    """The trainer `rosetta train` would build for TRAINERS[impl], through the registry
    (rosetta.backends: get_trainer), on `device` (None: the framework's default), with its default
    cache of compiled programs (a benchmark row after a loop row of the same program compiles nothing:
    the warm-up is excluded from every number either way)."""
    backend, settings = TRAINERS[impl]
    return get_trainer(backend)(cfg, params, TRAIN_CONFIG, device=device, dtype=dtype,
                                compile_cache=cache_dir(), **settings)


def time_training(trainer: Any, batches: Sequence[Batch], warmup: int, repeats: int, steps: int) -> dict:
    """The median seconds of one `trainer.step`, over `repeats` stretches of `steps` steps cycling
    through `batches`, after `warmup` steps (at least one per batch shape: each compiles then);
    `warmup_s` is what the warm-up took (mostly compilation), `peak_memory_bytes` the trainer's."""
    stepper = Stepper(trainer, cycle(list(batches)))
    start = time.perf_counter()
    stepper.run(max(warmup, len({b.shape for b in batches})))
    warmup_s = time.perf_counter() - start
    times = [stepper.run(steps).step_seconds for _ in range(repeats)]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "repeats": repeats, "inner": steps, "warmup_s": warmup_s,
            "peak_memory_bytes": trainer.peak_memory_bytes()}


def release() -> None:
    """Hand back what the last trainer held before the next is built: its Python objects, and the
    blocks PyTorch's CUDA allocator caches (a no-op without CUDA), so that each trainer's peak
    memory is its own."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    torch.cuda.empty_cache()


def attempt(title: str, run: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """(`run(*args)`, None), or where it raised, (None, its error in one line: the type and the
    message's first line), printed under `title`, with what it held released: one failing part of a
    benchmark costs its own rows, not the run's (on an H200, 2026-11-30, the compiled training step's
    failure lost a whole profile_step run). The benchmark still exits 1 after writing what it measured."""
    try:
        return run(*args), None
    except Exception as error:  # noqa: BLE001 - any part's failure is its own, written beside the rest
        line = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        print(f"  {title}: failed: {line}", flush=True)
        release()
        return None, line


def write_results(name: str, payload: dict, markdown: str, out_dir: Path | None = None,
                  replace: bool = False) -> tuple[Path, Path]:
    """<out_dir or benchmarks/results>/<name>.json and .md, written atomically; the markdown's title
    (its first line) is followed by the machine line of the payload's environment (issue 55: every
    table names the ISA and calibration it ran at). A file already at the name is kept (_keep_earlier)
    unless `replace` (benchmarks.run's --overwrite)."""
    out_dir = out_dir or RESULTS
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    if not replace:
        _keep_earlier(json_path, md_path, payload.get("environment", {}).get("commit"))
    markdown = with_machine(markdown, payload.get("environment", {}))
    atomic_write_bytes(json_path, (json.dumps(payload, indent=2) + "\n").encode())
    atomic_write_bytes(md_path, markdown.encode())
    return json_path, md_path


def _keep_earlier(json_path: Path, md_path: Path, commit: str | None) -> None:
    """A results file already at this name from another commit (a second run the same day) is kept,
    renamed `<name>-<its commit>` (.json and .md), before this run's takes the name: nothing written is
    lost. The same clean commit's file is replaced (the same code run again)."""
    if not (json_path.is_file() or md_path.is_file()):  # a folder in the way: the write refuses it
        return
    try:
        earlier = str(read_json(json_path, "a results file").get("environment", {}).get("commit", ""))
    except (RosettaError, AttributeError):  # unreadable, or only the .md there
        earlier = ""
    if earlier == commit and not commit.endswith("dirty"):
        return
    tag = re.sub(r"[^0-9A-Za-z]+", "-", earlier.split(" ")[0]).strip("-") or "earlier"
    stem, n = f"{json_path.stem}-{tag}", 1
    while json_path.with_name(f"{stem}.json").exists() or md_path.with_name(f"{stem}.md").exists():
        n += 1
        stem = f"{json_path.stem}-{tag}-{n}"
    for path in (json_path, md_path):
        if path.is_file():
            path.rename(path.with_name(stem + path.suffix))


def newest_results(prefix: str, results: Path = RESULTS) -> Path | None:
    """The newest complete `<prefix>_<ISO date>.json` of `results` (a partial or narrowed run is named
    otherwise and not taken)."""
    files = [p for p in results.glob(f"{prefix}_*.json") if re.search(r"_\d{4}-\d\d-\d\d\.json$", p.name)]
    return max(files, key=lambda p: (p.stem[-10:], p.name), default=None)


def load_results(path: Path, module: str, keys: Iterable[str], schema: dict | None = None) -> dict:
    """A results file of benchmarks/`module` read by the one JSON reader (rosetta/json_input.py), with
    its top-level `keys` (and rows, non-empty); anything else exits naming the file and what is wrong."""
    try:
        result = read_json(path, f"a {module} results file", nonfinite=True,
                           schema={"rows": field("array"), **(schema or {})})
    except RosettaError as e:
        raise SystemExit(str(e)) from None
    missing = [k for k in keys if k not in result] or ([] if result.get("rows") else ["rows (empty)"])
    if missing:
        raise SystemExit(f"{path}: not a {module} results file (missing {', '.join(missing)})")
    return result


def results_block(prefix: str, results: Path, begin: str, end: str, body: Callable[[Path], str],
                  command: str) -> str:
    """A docs page's generated block: `body` of the newest `<prefix>_<date>.json` of `results`, which
    it links, between the markers; no such file exits naming the command that writes one."""
    path = newest_results(prefix, results)
    if path is None:
        raise SystemExit(f"no {prefix}_<date>.json in {results}: run `{command}`")
    source = f"From [`benchmarks/results/{path.name}`](../benchmarks/results/{path.name}). "
    return f"{begin}\n{source}{body(path)}{end}"


def replace_block(page: Path, begin: str, end: str, block: str) -> None:
    """Rewrite the part of `page` from marker `begin` to marker `end` (both kept in `block`)."""
    text = page.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{page} has no {begin} ... {end} block")
    start, stop = text.index(begin), text.index(end) + len(end)
    atomic_write_bytes(page, (text[:start] + block + text[stop:]).encode())
