"""What a training run reports: its JSON-lines log read back, a per-framework summary, the plot
(loss and throughput against step, one line per framework), the side-by-side summary files, and
the progress bar while it trains.
Framework-free; matplotlib with the Agg backend (no display needed).

Every file written here carries a tag that says rosetta wrote it (a `format` field in JSON, a
closing sentence in Markdown, a PNG text chunk), and none replaces a file without one
(`check_overwritable`): a user's own summary.md or plot.png in the output directory is refused
by name, never overwritten.
"""

from __future__ import annotations

import json
import math
import statistics
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rosetta import json_input
from rosetta.backends import TRAINING_BACKENDS
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes

Record = dict[str, Any]

RESULT_FORMAT = "rosetta-result/1"
SUMMARY_FORMAT = "rosetta-summary/1"
SUMMARY_FOOTER = "Written by `rosetta train` (rosetta-summary/1); the next run in this directory rewrites it."
PLOT_SOFTWARE = "rosetta-transformer (rosetta-plot/1)"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Bounds on the run files read back (rosetta/json_input.py): a run writes a few kB of settings and
# results, and one log line of ~200 bytes per logged step.
RUN_FILE_LIMIT = 16 * 2**20
LOG_LINE_LIMIT, LOG_LIMIT = 2**20, 2**30
# run.json's fields that its readers use (`rosetta evaluate`, `translate`, `--resume`), typed. The
# backend is one that trains (the registry's): a run.json saying "numpy" or an unknown name was obeyed.
RUN_SCHEMA = {
    "backend": json_input.field("string", choices=TRAINING_BACKENDS), "identity": json_input.field("object"),
    "args": json_input.field("object", fields={"task": json_input.field("string", "null"),
                                               "pair": json_input.field("string", "null")}),
}


def _png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (keyword -> text), read up to the image data, where
    matplotlib and Pillow put them; {} for anything that is not a PNG."""
    with path.open("rb") as f:
        if f.read(8) != PNG_SIGNATURE:
            return {}
        found = {}
        while len(head := f.read(8)) == 8:
            length, kind = struct.unpack(">I4s", head)
            if kind in (b"IDAT", b"IEND"):
                break
            body = f.read(length + 4)[:length]  # the chunk and its CRC
            if kind == b"tEXt":
                key, _, text = body.partition(b"\0")
                found[key.decode("latin-1")] = text.decode("latin-1")
        return found


def _json_object(path: Path) -> dict[str, Any]:
    try:
        return read_json(path)
    except RosettaError:  # not ours, then: the caller asks only whether rosetta wrote it
        return {}


def written_by_rosetta(path: Path) -> bool:
    """Whether the file at `path` carries this module's tag. Files from before the tags are
    recognised by their fixed shape: summary.json's two keys, summary.md's title, result.json's
    keys, and a matplotlib PNG beside one of those."""
    if path.is_symlink() or not path.is_file():
        return False
    if path.suffix == ".json":
        data = _json_object(path)
        return (data.get("format") in (RESULT_FORMAT, SUMMARY_FORMAT) or set(data) == {"backends", "run"}
                or {"backend", "dtype", "steps", "train_time_s", "wall_time_s"} <= set(data))
    if path.suffix == ".md":
        text = path.read_text(encoding="utf-8", errors="replace")
        return SUMMARY_FOOTER in text or text.startswith("# Training summary: task ")
    if path.suffix == ".png":
        software = _png_text(path).get("Software", "")
        return software == PLOT_SOFTWARE or (
            software.startswith("Matplotlib") and any(written_by_rosetta(path.with_name(name))
                                                      for name in ("summary.json", "result.json")))
    return False


def check_overwritable(path: Path) -> None:
    """Refuse to replace `path` unless it is missing or rosetta wrote it (`written_by_rosetta`)."""
    if (path.exists() or path.is_symlink()) and not written_by_rosetta(path):
        raise RosettaError(f"{path} exists and was not written by rosetta train (it carries no rosetta "
                           f"format tag): refusing to overwrite it; move it away or choose another --out")


def read_log(path: Path) -> list[Record]:
    """The records of a log.jsonl, through the one JSON reader (rosetta/json_input.py: each line
    bounded); a torn last line (a killed writer) is skipped, any other bad line refused naming it."""
    if not path.is_file():
        return []
    records = []
    for number, record in json_input.read_json_lines(path, LOG_LINE_LIMIT, "a log record", error=RosettaError,
                                                     nonfinite=True, cut_off=None, file_limit=LOG_LIMIT):
        if not isinstance(record, dict):
            raise RosettaError(f"{path}: line {number}: not a log record (a JSON object)")
        records.append(record)
    return records


def read_json(path: Path, schema: Mapping[str, json_input.Field] | None = None) -> dict[str, Any]:
    """A JSON object the harness wrote (state.json, result.json, summary.json, run.json), through the
    one JSON reader (bounded; a diverged run's NaN reads as NaN), its fields checked against
    `schema`; or one line naming the file."""
    return json_input.read_json(path, "a run file", limit=RUN_FILE_LIMIT, schema=schema, error=RosettaError,
                                nonfinite=True)


def write_log(path: Path, records: Iterable[Record]) -> None:
    """Replace a log atomically (used to drop the records after the checkpoint resumed from)."""
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(kept) if kept else None


def summarize(records: Sequence[Record], totals: Mapping[str, float] | None = None,
              target_bleu: float | None = None) -> Record:
    """One framework's run in numbers, each saying what it covers:

    - `steps`, `final_loss`: the last step and its training loss (the last step is always logged);
      `val_loss`, `first_val_loss`, `bleu`, `exact_match`: the last (first) evaluation;
    - `median_*`: medians over the LOGGED steps (every log_every-th and the last) that were not
      the first of their batch shape (those include compilation and autotuning: PITFALLS 13);
      `timed_steps` says how many steps that is;
    - `step_time_total_s`, `src_tokens_total`, `tgt_tokens_total`: sums over EVERY step since
      step 1, logged or not, across resumes (`totals`, the harness's counters): step time is the
      forward and backward pass and the update, without evaluation, checkpoints, logging or
      compilation; tokens are real (non-pad) ones. None where unknown (a resume from a checkpoint
      without counters);
    - `compile_time_total_s`, `compiles`: the seconds the steps spent compiling (JAX; torch.compile)
      and the programs compiled (a persistent cache's reads not counted), over every step;
    - `wall_time_s`: the training loop's wall-clock time up to its last record, evaluations and
      checkpoints included, across resumes (the time between sessions not counted);
    - `peak_memory_bytes`: the largest peak logged (peaks only grow: the last step's);
    - `world_size` (data-parallel workers: processes × devices), `accumulate`, `worker_rows` (rows of
      one worker's micro-batch, last step), `median_tgt_tokens_per_s_per_worker`, and
      `median_scaling_efficiency` (tokens/s ÷ (workers × the --baseline run's), None without one);
    - `evaluations`: every evaluation's step, wall time, target tokens trained so far, BLEU and
      validation loss; `time_to_target`: the first of them at or above `target_bleu` (None if none)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    timed = [r for r in train if not r.get("first_of_shape")] or train
    last_eval = evals[-1] if evals else {}
    totals = totals or {}
    curve = [{"step": r["step"], "elapsed_s": r.get("elapsed_s"), "bleu": r.get("bleu"),
              "tgt_tokens_total": r.get("tgt_tokens_total"), "val_loss": r.get("val_loss")} for r in evals]
    reached = [e for e in curve
               if target_bleu is not None and e["bleu"] is not None and e["bleu"] >= target_bleu]
    return {
        "steps": train[-1]["step"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "val_loss": last_eval.get("val_loss"),
        "first_val_loss": evals[0]["val_loss"] if evals else None,
        "bleu": last_eval.get("bleu"),
        "exact_match": last_eval.get("exact_match"),
        "median_tgt_tokens_per_s": _median([r["tgt_tokens_per_s"] for r in timed]),
        "median_src_tokens_per_s": _median([r["src_tokens_per_s"] for r in timed]),
        "median_tgt_tokens_per_s_padded": _median([r["tgt_tokens_per_s_padded"] for r in timed]),
        "median_step_time_s": _median([r["step_time_s"] for r in timed]),
        "median_tflops_per_s": _median([r["tflops_per_s"] for r in timed]),
        "median_mfu": _median([r["mfu"] for r in timed]),
        "timed_steps": len(timed),
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in train), default=None),
        "step_time_total_s": totals.get("step_time_s"),
        "compile_time_total_s": totals.get("compile_s"),
        "compiles": totals.get("compiles"),
        "src_tokens_total": totals.get("src_tokens"),
        "tgt_tokens_total": totals.get("tgt_tokens"),
        "wall_time_s": max((r.get("elapsed_s", 0.0) for r in records), default=0.0),
        "device": train[-1].get("device") if train else None,
        "world_size": train[-1].get("world_size", 1) if train else None,
        "accumulate": train[-1].get("accumulate", 1) if train else None,
        "worker_rows": train[-1].get("worker_rows") if train else None,
        "median_tgt_tokens_per_s_per_worker": _median([r.get("tgt_tokens_per_s_per_worker") for r in timed]),
        "median_scaling_efficiency": _median([r.get("scaling_efficiency") for r in timed]),
        "bleu_average": next((r.get("bleu") for r in reversed(records) if r.get("kind") == "eval_average"),
                             None),
        "target_bleu": target_bleu,
        "time_to_target": reached[0] if reached else None,
        "evaluations": curve,
    }


def write_plot(path: Path, logs: Mapping[str, Sequence[Record]], title: str = "") -> None:
    """Training loss (lines; validation loss as markers) and target tokens/s against step,
    one colour per framework."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    # Fixed margins, not tight_layout (which draws every label to measure it: a third of a plot's time)
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13, top=0.84 if title else 0.9, wspace=0.25)
    for i, (name, records) in enumerate(logs.items()):
        color = f"C{i}"
        train = [r for r in records if r.get("kind") == "train"]
        evals = [r for r in records if r.get("kind") == "eval"]
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=color,
                     label=f"{name} train")
        if evals:
            ax_loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--", color=color,
                         label=f"{name} validation")
        ax_speed.plot([r["step"] for r in train], [r["tgt_tokens_per_s"] for r in train], color=color,
                      label=name)
    ax_loss.set(xlabel="step", ylabel="loss (label-smoothed)", title="loss")
    ax_speed.set(xlabel="step", ylabel="target tokens / s (real)", title="throughput")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    check_overwritable(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100, metadata={"Software": PLOT_SOFTWARE})
    plt.close(fig)
    tmp.replace(path)


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def write_summary(out: Path, results: Mapping[str, Record], run: Record) -> None:
    """summary.json (everything) and summary.md (a side-by-side table) in `out`."""
    for name in ("summary.json", "summary.md"):
        check_overwritable(out / name)
    summary = {"format": SUMMARY_FORMAT, "backends": results, "run": run}
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=2).encode("utf-8"))
    names = list(results)
    rows = [
        ("device", lambda r: str(r.get("device"))),
        ("data-parallel workers × accumulated micro-batches",
         lambda r: f"{r.get('world_size') or 1} × {r.get('accumulate') or 1}"),
        ("steps", lambda r: str(r["steps"])),
        ("final train loss (last step)", lambda r: _fmt(r["final_loss"], ".4f")),
        ("validation loss (first → last)",
         lambda r: f"{_fmt(r['first_val_loss'], '.4f')} → {_fmt(r['val_loss'], '.4f')}"),
        ("BLEU", lambda r: _fmt(r["bleu"], ".2f")),
        ("BLEU of the averaged last checkpoints (--average-last)",
         lambda r: _fmt(r.get("bleu_average"), ".2f")),
        ("exact match", lambda r: _fmt(r["exact_match"], ".3f")),
        ("median target tokens/s", lambda r: _fmt(r["median_tgt_tokens_per_s"], ",.0f")),
        ("median source tokens/s", lambda r: _fmt(r["median_src_tokens_per_s"], ",.0f")),
        ("median target tokens/s per worker",
         lambda r: _fmt(r.get("median_tgt_tokens_per_s_per_worker"), ",.0f")),
        ("scaling efficiency vs --baseline", lambda r: _fmt(r.get("median_scaling_efficiency"), ".1%")),
        ("median step time (ms)",
         lambda r: _fmt(None if r["median_step_time_s"] is None else 1e3 * r["median_step_time_s"], ".1f")),
        ("median model TFLOP/s", lambda r: _fmt(r["median_tflops_per_s"], ".4f")),
        ("median MFU", lambda r: _fmt(r["median_mfu"], ".2%")),
        ("steps in the medians (logged, not first of shape)", lambda r: _fmt(r.get("timed_steps"), "d")),
        ("step time, all steps (s)", lambda r: _fmt(r.get("step_time_total_s"), ",.2f")),
        ("compilation, all steps (s; programs compiled)",
         lambda r: f"{_fmt(r.get('compile_time_total_s'), ',.1f')}; {_fmt(r.get('compiles'), 'd')}"),
        ("target tokens trained, all steps", lambda r: _fmt(r.get("tgt_tokens_total"), ",d")),
        ("source tokens trained, all steps", lambda r: _fmt(r.get("src_tokens_total"), ",d")),
        ("peak memory (MiB)",
         lambda r: _fmt(None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**20, ",.0f")),
        ("wall time of the training loop (s)", lambda r: _fmt(r["wall_time_s"], ".1f")),
        ("stopped by", lambda r: str(r.get("stopped_by", "steps"))),
        ("minutes to the target BLEU (step)",
         lambda r: "–" if not r.get("time_to_target") else
         f"{r['time_to_target']['elapsed_s'] / 60:.1f} ({r['time_to_target']['step']})"),
    ]
    lines = [f"# Training summary: task {run.get('task')}, preset {run.get('preset')}, "
             f"dtype {run.get('dtype')}", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(fn(results[n]) for n in names) + " |" for label, fn in rows]
    lines += ["", "Medians are over the logged steps (every --log-every-th and the last) that were not the "
              "first of their batch shape (compilation excluded). Totals are over every step, logged or not; "
              "step time is the forward and backward pass and the update, compilation apart; wall time adds "
              "evaluations and checkpoints. Tokens are real (non-pad) ones. MFU counts matmul FLOPs of real "
              "tokens (rosetta/harness/metrics.py); – where the device's peak rate is unknown (pass "
              "--peak-tflops) or a count is unknown. Scaling efficiency is tokens/s ÷ (workers × the "
              "one-device run's tokens/s), – unless `--baseline` names that run. Compilation's seconds "
              "include tracing and reading programs from JAX's persistent cache; its count is of programs "
              "compiled, not read (a run after one of the same shapes: seconds, and 0 programs).", "",
              SUMMARY_FOOTER]
    atomic_write_bytes(out / "summary.md", ("\n".join(lines) + "\n").encode("utf-8"))


def write_combined_report(out: Path, backends: Sequence[str], run: Record) -> None:
    """plot.png, summary.json and summary.md over every finished backend run in `out`, those of
    `backends` first; `run` the settings (RunConfig.to_dict())."""
    results, logs = {}, {}
    found = sorted(p.name for p in out.iterdir() if (p / "result.json").is_file())
    for name in [b for b in backends if b in found] + [b for b in found if b not in backends]:
        results[name] = read_json(out / name / "result.json")
        logs[name] = read_log(out / name / "log.jsonl")
    if results:
        write_plot(out / "plot.png", logs, title=f"{run.get('task')}: {' vs '.join(results)}")
        write_summary(out, results, run)


class NoProgress:
    """The progress bar's interface, doing nothing."""

    def update(self, n: int) -> None: ...
    def set_postfix(self, **kwargs: Any) -> None: ...
    def close(self) -> None: ...


def progress_bar(show: bool | None, desc: str, total: int, initial: int) -> Any:
    """A tqdm bar on stderr when it is a terminal (`show` None) or when `show`; NoProgress otherwise."""
    if not (sys.stderr.isatty() if show is None else show):
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoProgress()
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
