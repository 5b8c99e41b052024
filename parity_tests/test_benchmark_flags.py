"""Issue 39: every benchmark refuses a bad flag, an output folder it cannot write and a data folder
that is not there BEFORE its first measurement: one line `benchmarks.NAME: error: ...` naming the
flag (or the file), exit status 2, nothing written. Each case runs the benchmark's `main` in this
process with its measurement replaced by a failure, so a refusal that comes too late fails the test
at once instead of measuring for minutes; and each must return in seconds.

The expected reasons are rosetta.files.check_writable's rule written out (a file where a folder
should be; a folder in which creating a file fails, as Linux's /proc and /sys) and the argparse
types' ranges (rosetta/cli_args.py: finite, and within the flag's range)."""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

import pytest

from parity_tests.test_output_paths import snapshot
from rosetta.cli_args import MAX_COUNT, machine_cores

# What each benchmark measures (or trains, or renders) first: replaced by a failure in every case.
MEASURES = {
    "run": ["run"], "batches": ["run"], "decode_ct2": ["run"],
    "profile_cpu": ["train_cases", "decode_cases"], "decode_speed": ["run"],
    "gpu_check": ["parity_checks", "training_checks", "attention_checks", "decoding_checks",
                  "harness_checks"],
    "scaling": ["run", "measure"], "time_to_quality": ["train_and_evaluate", "table"], "pitfalls": ["run"],
    "report": ["load"], "profile_step": ["profile_impl", "loss_timings"], "loop_overhead": ["run"],
}
REFUSED_WITHIN_S = 10.0  # argparse and a probe; the measurements take minutes (docs/benchmarks.md)
PROC = Path("/proc/self").is_dir()  # Linux: a folder in which no file can be created, even by root
FILE = "{tmp}/a_file"  # a regular file where an output folder should be
NOT_A_FOLDER = "{tmp}/a_file/{name}: {tmp}/a_file is a file, not a directory"
PROC_REASON = "/proc/x/{name}: a file cannot be created in /proc (No such file or directory)"

CORES = machine_cores()
COUNT = "argument {flag}: must be an integer >= 1 and <= " + str(MAX_COUNT) + ", got '{got}'"
MEMORY = "{{any}} ({what} of {{any}} bytes at the least: this machine's memory is {{any}} GiB), got {got}"

# (benchmark, arguments, what the one line holds after `error: `; {tmp} the test's folder, {name}
# the first file the benchmark would write there, up to its date).
CASES = [
    # Output folders (issue 39: a traceback, or a refusal after minutes of measuring).
    ("run", ["--suite", "smoke", "--out-dir", FILE], "argument --out-dir: cannot write " + NOT_A_FOLDER),
    ("run", ["--suite", "smoke", "--out-dir", "/proc/x"], "argument --out-dir: cannot write " + PROC_REASON),
    ("run", ["--suite", "smoke", "--out-dir", "/sys/x"],
     "argument --out-dir: cannot write /sys/x/{name}: a file cannot be created in /sys ({any})"),
    ("run", ["--suite", "smoke", "--out-dir", ""],
     "argument --out-dir: must name a file or directory, got ''"),
    ("batches", ["--preset", "tiny", "--out-dir", FILE], "argument --out-dir: cannot write " + NOT_A_FOLDER),
    ("decode_ct2", ["--out-dir", "/proc/x"], "argument --out-dir: cannot write " + PROC_REASON),
    ("loop_overhead", ["--out-dir", FILE], "argument --out-dir: cannot write " + NOT_A_FOLDER),
    ("decode_ct2", ["--out-dir", FILE], "argument --out-dir: cannot write " + NOT_A_FOLDER),
    ("profile_cpu", ["--out-dir", "/proc/x"], "argument --out-dir: cannot write " + PROC_REASON),
    ("gpu_check", ["--preset", "tiny", "--device", "cpu", "--out-dir", FILE],
     "argument --out-dir: cannot write " + NOT_A_FOLDER),
    ("scaling", ["--preset", "tiny", "--buckets", "48", "--out-dir", "/proc/x"],
     "argument --out-dir: cannot write " + PROC_REASON),
    ("time_to_quality", ["--out", "{tmp}/run", "--results-dir", FILE],
     "argument --results-dir: cannot write " + NOT_A_FOLDER),
    ("time_to_quality", ["--out", FILE, "--train"],
     "argument --out: cannot write {tmp}/a_file/torch/run.json: {tmp}/a_file is a file, not a directory"),
    ("report", ["{tmp}/a_file/x.json"],
     "argument results: cannot write {tmp}/a_file/x.md: {tmp}/a_file is a file, not a directory"),
    # Data folders (issue 39: batches --data-dir /nonexistent, an uncaught DataError).
    ("batches", ["--preset", "tiny", "--no-write", "--data-dir", "{tmp}/none"],
     "argument --data-dir: Multi30k data directory '{tmp}/none' (given directory) does not exist; {any}"),
    ("batches", ["--data-dir", ""], "argument --data-dir: must name a file or directory, got ''"),
    ("time_to_quality", ["--out", "{tmp}/run", "--train", "--data-dir", "{tmp}/none"],
     "argument --data-dir: Multi30k data directory '{tmp}/none' (given directory) does not exist; {any}"),
    # Numbers: finite and in range (issue 39: scaling --timeout nan, a traceback).
    ("scaling", ["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got 'nan'"),
    ("scaling", ["--timeout", "inf"], "argument --timeout: must be a finite number > 0, got 'inf'"),
    ("scaling", ["--timeout", "-1"], "argument --timeout: must be a finite number > 0, got '-1'"),
    ("scaling", ["--timeout", "0"], "argument --timeout: must be a finite number > 0, got '0'"),
    ("scaling", ["--steps", "0"], COUNT.format(flag="--steps", got="0")),
    ("scaling", ["--warmup-steps", "-1"],
     f"argument --warmup-steps: must be an integer >= 0 and <= {MAX_COUNT}, got '-1'"),
    ("scaling", ["--workers", "2", "2"], "argument --workers: takes distinct integers >= 1"),
    ("scaling", ["--max-tokens", "1e9"], "argument --max-tokens: must be an integer >= 1, got '1e9'"),
    ("run", ["--suite", "smoke", "--peak-tflops", "nan"],
     "argument --peak-tflops: must be a finite number > 0, got 'nan'"),
    ("run", ["--suite", "smoke", "--presets", "huge"], "argument --presets: huge: suite smoke has tiny"),
    ("gpu_check", ["--peak-tflops", "-1"], "argument --peak-tflops: must be a finite number > 0, got '-1'"),
    # Devices through rosetta/device.py (issue 48: cuda:99 and tpu started measuring on the CPU).
    ("gpu_check", ["--device", "tpu"], "--device tpu: not a device name; give {any}"),
    ("gpu_check", ["--device", "cuda:99"], "--device cuda:99: {any}"),
    ("time_to_quality", ["--out", "{tmp}/run", "--budget", "inf"],
     "argument --budget: must be a finite number > 0, got 'inf'"),
    ("time_to_quality", ["--out", "{tmp}/run", "--bleu-at", "101"],
     "argument --bleu-at: must be a finite number >= 0 and <= 100, got '101'"),
    ("decode_speed", ["--repeats", "0"], COUNT.format(flag="--repeats", got="0")),
    ("loop_overhead", ["--pairs", "0"], COUNT.format(flag="--pairs", got="0")),
    ("profile_step", ["--device", "cpu", "--steps", "nan"],
     COUNT.format(flag="--steps", got="nan")),
    # Sizes (issue 57: --batch 10**12 asked for 36 TiB and died in a traceback; --repeats 10**30 ran
    # for ever): a stated maximum (MAX_COUNT), the machine's cores, a preset's max_len, or what the
    # machine's memory holds (os.sysconf: its pages times their size), one check each in one place.
    ("profile_step", ["--device", "cpu", "--length", "1000000000"],
     "argument --length: must be <= 1,024 (preset base's max_len), got 1,000,000,000"),
    ("profile_step", ["--device", "cpu", "--preset", "tiny", "--length", "129"],
     "argument --length: must be <= 128 (preset tiny's max_len), got 129"),
    ("profile_step", ["--device", "cpu", "--batch", "1000000000000"], "argument --batch: must be <= " + MEMORY
     .format(what="rows of 64 tokens a side", got="1,000,000,000,000")),
    ("profile_step", ["--device", "cpu", "--sentences", str(10**9)],
     "argument --sentences: must be <= " + MEMORY.format(what="sentences of 4 beams", got="1,000,000,000")),
    *[("profile_step", ["--device", "cpu", flag, str(MAX_COUNT + 1)],
       COUNT.format(flag=flag, got=MAX_COUNT + 1))
      for flag in ("--warmup", "--steps", "--profiled")],
    ("loop_overhead", ["--repeats", str(10**30)], COUNT.format(flag="--repeats", got=10**30)),
    *[("loop_overhead", [flag, str(MAX_COUNT + 1)], COUNT.format(flag=flag, got=MAX_COUNT + 1))
      for flag in ("--pairs", "--steps")],
    *[("batches", [flag, str(MAX_COUNT + 1)], COUNT.format(flag=flag, got=MAX_COUNT + 1))
      for flag in ("--batches", "--repeats")],
    ("batches", ["--max-tokens", str(10**15)], "argument --max-tokens: must be <= " + MEMORY
     .format(what="tokens", got="1,000,000,000,000,000")),
    ("decode_speed", ["--repeats", str(MAX_COUNT + 1)], COUNT.format(flag="--repeats", got=MAX_COUNT + 1)),
    ("scaling", ["--steps", str(MAX_COUNT + 1)], COUNT.format(flag="--steps", got=MAX_COUNT + 1)),
    ("scaling", ["--warmup-steps", str(MAX_COUNT + 1)],
     f"argument --warmup-steps: must be an integer >= 0 and <= {MAX_COUNT}, got '{MAX_COUNT + 1}'"),
    ("scaling", ["--workers", "1", str(CORES + 1)],
     f"argument --workers: must be an integer >= 1 and <= {CORES}, got '{CORES + 1}'"),
    ("scaling", ["--max-tokens", str(10**15)], "argument --max-tokens: must be <= " + MEMORY
     .format(what="tokens", got="1,000,000,000,000,000")),
    ("scaling", ["--workers", "1", "--per-worker-tokens", str(10**15)],
     "argument --per-worker-tokens: must be <= " + MEMORY.format(what="tokens", got="1,000,000,000,000,000")),
    ("profile_cpu", ["--threads", str(CORES + 1)],
     f"argument --threads: must be an integer >= 1 and <= {CORES}, got '{CORES + 1}'"),
]


def refusal(module: str, argv: list[str], tmp_path: Path, capsys, monkeypatch) -> str:
    """Run benchmarks.MODULE's main on `argv`; the one line it refuses with (exit status 2, returned
    in seconds, nothing measured and nothing written in `tmp_path`)."""
    bench = importlib.import_module(f"benchmarks.{module}")
    for name in MEASURES[module]:
        def measured(*args, _name=name, **kwargs):
            raise AssertionError(f"benchmarks.{module}.{_name} ran before the refusal")

        monkeypatch.setattr(bench, name, measured)
    (tmp_path / "a_file").write_text("mine")
    before = snapshot(tmp_path)
    capsys.readouterr()
    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert time.perf_counter() - start < REFUSED_WITHIN_S
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"benchmarks.{module}: error: "), err
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    return err.removeprefix(f"benchmarks.{module}: error: ").rstrip("\n")


@pytest.mark.parametrize("module,argv,expected", CASES, ids=[f"{m} {' '.join(a)}" for m, a, _ in CASES])
def test_a_benchmark_refuses_before_measuring(module, argv, expected, tmp_path, capsys, monkeypatch):
    if any(a.startswith(("/proc", "/sys")) for a in argv) and not PROC:
        pytest.skip("needs Linux's /proc and /sys")
    tmp = str(tmp_path)
    got = refusal(module, [a.replace("{tmp}", tmp) for a in argv], tmp_path, capsys, monkeypatch)
    # {name}: the results file, named with the device and the date; {any}: the OS's reason, in its words.
    pattern = re.escape(expected.replace("{tmp}", tmp))
    pattern = pattern.replace(re.escape("{name}"), r"[\w.-]+\.json").replace(re.escape("{any}"), ".+")
    assert re.fullmatch(pattern, got), got


def test_default_results_folder_is_checked_too(tmp_path, capsys, monkeypatch):
    """A benchmark without --out-dir writes benchmarks/results (and pitfalls, docs/pitfalls.md): a
    results folder it cannot write is refused before measuring, naming the file (no flag names it)."""
    from benchmarks import decode_speed, pitfalls

    for bench in (decode_speed, pitfalls):
        monkeypatch.setattr(bench, "RESULTS", tmp_path / "a_file")
        got = refusal(bench.__name__.split(".")[1], [], tmp_path, capsys, monkeypatch)
        assert got.startswith(f"cannot write {tmp_path}/a_file/") and got.endswith(
            f".json: {tmp_path}/a_file is a file, not a directory"), got


def test_an_output_folder_that_does_not_exist_yet_is_fine(tmp_path, capsys, monkeypatch):
    """New folders are made when the results are written: the check refuses only what cannot be."""
    from benchmarks import scaling

    measured = {"device": "cpu", "gpus": 0, "environment": {}, "settings": {}, "rows": [], "wall_s": 0.0}
    monkeypatch.setattr(scaling, "run", lambda args: measured)
    monkeypatch.setattr(scaling, "markdown", lambda result: "table\n")
    out = tmp_path / "new" / "dir"
    scaling.main(["--preset", "tiny", "--buckets", "48", "--out-dir", str(out)])
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".md"]
    capsys.readouterr()


def test_a_users_check_writes_under_runs_not_into_the_checkout(tmp_path, capsys, monkeypatch):
    """gpu_check and profile_step, a user's check of their own machine, write runs/benchmarks/ in the
    folder they run in by default (benchmarks/common.py USER_RESULTS; git ignores runs/), not the
    project's record benchmarks/results (RESULTS); --out-dir names another folder. Measurements and the
    machine block stood in for: what is checked is where the files land."""
    from benchmarks import common, gpu_check, profile_step

    stub = {"date": "today", "commit": "abc", "processor": "cpu"}
    for bench in (gpu_check, profile_step):
        monkeypatch.setattr(bench, "environment", lambda: stub)
    monkeypatch.setattr(gpu_check, "parity_checks", lambda *a, **k: None)
    monkeypatch.setattr(profile_step, "run_parts", lambda *a, **k: [])
    monkeypatch.setattr(profile_step, "markdown", lambda result: "# a table\n")
    record = sorted(common.RESULTS.iterdir())
    monkeypatch.chdir(tmp_path)
    gpu_check.main(["--preset", "tiny", "--device", "cpu", "--only", "parity"])
    small = ["--device", "cpu", "--preset", "tiny", "--batch", "2", "--length", "8", "--sentences", "1"]
    profile_step.main(small)
    written = sorted(p.name for p in (tmp_path / "runs" / "benchmarks").iterdir())
    assert [n.split("_")[0] for n in written] == ["gpu-check"] * 2 + ["profile-step"] * 2, written
    assert sorted(common.RESULTS.iterdir()) == record  # nothing new in the checkout's record
    profile_step.main([*small, "--out-dir", str(tmp_path / "mine")])
    assert len(list((tmp_path / "mine").glob("profile-step_*"))) == 2
    capsys.readouterr()
