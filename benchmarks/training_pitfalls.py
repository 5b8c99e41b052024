"""The measured training pitfalls (issue 40, item 3): what each training-loop mistake of the
`rosetta diff --diagnose` catalogue does to a short training run, and whether the diff names it.

One reference run of our trainer for each setting the entries need (`rosetta train --task copy
--preset tiny --dtype float64 --set dropout=0 --trace N`, in-process: plain; with `--clip-norm`;
with `--clip-norm` and `--accumulate 2`), then for each catalogue entry that applies there the
catalogue's own float64 replay (rosetta.diff.training.catalogue.replay) with that one mistake, N
updates from the reference's initial weights on its batches, against the replay without it (ours,
which reproduces the trainer's weights to float64 rounding; the results say how closely):

- first step: the first update after which ||θ_mistake(k) - θ_ours(k)|| / ||θ_ours(k) - θ_0||
  (against the distance ours has travelled; the k biases left out, as `rosetta diff` leaves them:
  PITFALLS 14) exceeds 1e-12; the same ratio after the N-th update;
- the loss: the mean token cross entropy (no smoothing, pad left out: a trace's evaluation loss)
  of the initial weights and of each run's weights after N updates, on step N's batch;
- named: the mistaken run written as a user's trace (TraceWriter, its first `whole` steps stored
  whole) and given to `rosetta diff MINE REF --diagnose --json`: the entries it names.

With the settings below (20 steps, warmup 10, 1,024 tokens a batch, 3 whole steps diagnosed) the
whole measurement takes about a minute and a half on this project's 2-core CPU; the results file
records its own time.

    python -m benchmarks.training_pitfalls         # measure: benchmarks/results/training_pitfalls_<date>.*
    python -m benchmarks.training_pitfalls --docs  # re-render the block of docs/pitfalls.md only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import (
    RESULTS,
    environment,
    load_results,
    newest_results,
    parser,
    replace_block,
    results_block,
    write_results,
)
from rosetta.config import ModelConfig
from rosetta.diff.training.catalogue import ENTRIES, Entry, ReplayStep, Settings, Variant, loss_value, replay
from rosetta.diff.training.compare import compared
from rosetta.diff.training.trace import FullStep, Trace, TraceWriter, read_trace
from rosetta.errors import RosettaError
from rosetta.json_input import field
from rosetta.params import Params
from rosetta.training import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "pitfalls.md"
BEGIN, END = "<!-- training-pitfalls:begin -->", "<!-- training-pitfalls:end -->"
PREFIX = "training_pitfalls"
# Short enough for a benchmark of minutes, long enough for eq. 3 to pass its peak (warmup 10, as the
# training diff's tests and worked example) and the loss to move; clipping at 1.0 acts on the early steps.
SETTINGS = dict(preset="tiny", task="copy", steps=20, warmup=10, max_tokens=1024, seed=0, whole=3,
                clip_norm=1.0)
THRESHOLD = 1e-12  # "the weights differ": far above two float64 replays of one algorithm (they are equal)

# Each catalogue entry judged by a replay -> the numbered item of docs/pitfalls.md that covers it.
PITFALLS: dict[str, int] = {
    "eps_1e-8": 17, "eps_inside_sqrt": 17,
    "beta2_0.999": 18, "beta2_0.98": 18, "no_bias_correction": 18,
    "adamw_decay": 19, "adamw_decay_matrices": 19, "l2_in_gradient": 19, "l2_in_gradient_matrices": 19,
    "schedule_from_zero": 20, "schedule_from_zero_clamped": 20, "scheduler_before_optimizer": 20,
    "schedule_scaled": 20, "constant_rate": 20,
    "clip_per_tensor": 21, "clip_after_adam": 21, "clip_torch_eps": 21, "clip_where_none": 21,
    "clip_before_accumulation": 21,
    "no_label_smoothing": 22, "smooth_over_v_minus_1": 22, "annotated_kl": 22,
    "pad_in_loss": 23, "per_sentence": 23, "loss_summed": 23,
}


def references(settings: Mapping) -> dict[str, tuple[list[str], Settings]]:
    """The reference runs, by name: `rosetta train`'s flags beyond the common ones, and the training
    settings its trace will record. An entry is measured against the first one under whose settings
    it changes anything (Entry.applies)."""
    plain = TrainConfig(warmup_steps=settings["warmup"], seed=settings["seed"])
    clipped = plain.replace(clip_norm=settings["clip_norm"])
    clip = ["--clip-norm", str(settings["clip_norm"])]
    return {"plain": ([], Settings(plain)), "clipped": (clip, Settings(clipped)),
            "accumulated": ([*clip, "--accumulate", "2"], Settings(clipped, 2))}


def rosetta(argv: Sequence[str]) -> int:
    """`rosetta train ...` or `rosetta diff ...` in this process: the commands' own parsers and
    functions (rosetta/harness/commands.py, rosetta/diff/commands.py), as rosetta/cli.py runs them;
    a RosettaError propagates (the benchmark's one-line refusal)."""
    from rosetta.diff.commands import add_parsers as add_diff_parsers
    from rosetta.harness.commands import add_train_parser

    cli = argparse.ArgumentParser(prog="rosetta")
    commands = cli.add_subparsers(dest="command", required=True)
    add_train_parser(commands)
    add_diff_parsers(commands)
    args = cli.parse_args(list(argv))
    args.argv = list(argv)
    return args.func(args)


def train_reference(out: Path, settings: Mapping, extra: Sequence[str]) -> Path:
    """Our torch trainer, float64, dropout 0, every step traced whole; the trace's run directory."""
    n = str(settings["steps"])
    argv = ["train", "--task", settings["task"], "--preset", settings["preset"], "--steps", n, "--trace", n,
            "--set", "dropout=0", "--dtype", "float64", "--warmup", str(settings["warmup"]),
            "--max-tokens", str(settings["max_tokens"]), "--seed", str(settings["seed"]),
            "--eval-every", "0", "--eval-size", "8", "--checkpoint-every", "0", "--no-progress",
            "--out", str(out), *extra]
    with contextlib.redirect_stdout(io.StringIO()):  # its summary table: not ours to print
        code = rosetta(argv)
    if code:
        raise RosettaError(f"the reference run failed (exit {code}): rosetta {' '.join(argv)}")
    return out / "torch"


def distance(a: Params, b: Params) -> float:
    """||a - b|| over every tensor `rosetta diff` compares (not the k biases: PITFALLS 14)."""
    return math.sqrt(sum(float(((a[n] - b[n]) ** 2).sum()) for n in compared(b)))


def eval_loss(cfg: ModelConfig, params: Params, batch: FullStep) -> float:
    """The mean token cross entropy of `params` on `batch`, no smoothing, pad left out (SPEC §4 at
    ε = 0: a trace's evaluation loss), the float64 NumPy reference's logits."""
    import numpy_ref.model as reference

    logits = reference.forward(params, cfg, batch.src, batch.tgt_in)
    return loss_value(logits, batch.labels, cfg.pad_id, 0.0, "ours")[0]


def diagnosis(ref_dir: Path, ref: Trace, steps: Sequence[ReplayStep], out: Path, whole: int) -> dict:
    """The mistaken replay written as a user's float64 trace (its first `whole` steps whole) and
    `rosetta diff MINE REF --diagnose --json`: what it says."""
    with TraceWriter(out / "trace", ref.cfg, full_steps=whole) as trace:
        trace.start(ref.initial())
        for k, step in enumerate(steps, 1):
            batch = ref.full(k)
            trace.step(k, batch.src, batch.tgt_in, batch.labels, step.loss, step.lr, step.grads, step.params)
    with contextlib.redirect_stdout(io.StringIO()):
        code = rosetta(["diff", str(out / "trace"), str(ref_dir), "--diagnose", "--json",
                        str(out / "diff.json")])
    record = json.loads((out / "diff.json").read_text())
    found = record["diagnosis"]
    return dict(exit_code=code, first_difference=record["first_difference"], named=found["explained_by"],
                closest=found["ranked"][0]["names"] if found["ranked"] else None)


def measure(ref_dir: Path, entries: Sequence[Entry], settings: Mapping, work: Path,
            ) -> tuple[dict, list[dict]]:
    """Each entry's replay against ours on one reference trace: (the reference's own row, one row
    per entry)."""
    ref = read_trace(ref_dir)
    train = Settings.from_trace(ref.train_config)
    n, cache = settings["steps"], {}
    theta0 = {k: v.astype(np.float64) for k, v in ref.initial().items()}
    ours = list(replay(ref, train, Variant(), n, cache))
    travelled = [distance(s.params, theta0) for s in ours]
    last = ref.full(n)
    trainer = {k: v.astype(np.float64) for k, v in last.params.items()}
    own = dict(loss_initial=eval_loss(ref.cfg, theta0, last),
               loss_ours=eval_loss(ref.cfg, ours[-1].params, last),
               # The replay against the trainer's own weights after N updates: how far "ours" is the trainer.
               replay_vs_trainer=distance(ours[-1].params, trainer) / travelled[-1],
               train_config=ref.train_config)
    rows = []
    for entry in entries:
        started = time.perf_counter()
        variant = entry.variant(train)
        mistaken = list(replay(ref, train, variant, n, cache))
        # An entry fitted to an observation (λ, a factor) is measured at its Variant's default value.
        value = {"decay": f"λ = {variant.decay:g}", "lr_scale": f"a factor {variant.lr_scale:g}"}
        value = value.get(entry.fit) if entry.fit else None
        rel = [distance(m.params, o.params) / t for m, o, t in zip(mistaken, ours, travelled, strict=True)]
        rows.append(dict(
            name=entry.name, pitfall=PITFALLS.get(entry.name), what=entry.wrong, shown=True,
            value=value,
            first_step=next((k for k, r in enumerate(rel, 1) if r > THRESHOLD), None),
            rel_final=rel[-1], rel_max=max(rel), rel_steps=rel,
            loss_initial=own["loss_initial"], loss_ours=own["loss_ours"],
            loss_mistake=eval_loss(ref.cfg, mistaken[-1].params, last),
            diff=diagnosis(ref_dir, ref, mistaken, work / entry.name, settings["whole"]),
            seconds=round(time.perf_counter() - started, 2)))
    return own, rows


def run(settings: Mapping = SETTINGS, names: Sequence[str] | None = None) -> dict:
    """The measurement (module docstring), for every entry judged by a replay (or those `names`);
    results as the JSON payload. Entries no reference can show get a row with `shown` False and why."""
    started = time.perf_counter()
    wanted = [e for e in ENTRIES if names is None or e.name in names]
    todo, rows, refs = [e for e in wanted if e.judged == "replay"], [], {}
    with tempfile.TemporaryDirectory(prefix="training-pitfalls-") as tmp:
        for ref_name, (extra, expected) in references(settings).items():
            here = [e for e in todo if e.applies(expected)]
            if not here:
                continue  # no entry left that this run can show: not trained
            todo = [e for e in todo if e not in here]
            ref_dir = train_reference(Path(tmp) / ref_name, settings, extra)
            recorded = Settings.from_trace(read_trace(ref_dir).train_config)
            if recorded != expected:  # the entries were chosen for the settings the run was meant to have
                raise RosettaError(f"the {ref_name} reference recorded {recorded}, expected {expected}")
            refs[ref_name], measured = measure(ref_dir, here, settings, Path(tmp) / f"{ref_name}-mine")
            refs[ref_name]["flags"] = extra
            rows += [dict(r, reference=ref_name) for r in measured]
    rows += [dict(name=e.name, pitfall=PITFALLS.get(e.name), what=e.wrong, shown=False,
                  why="no reference run here where it changes anything: the reference already does it")
             for e in todo]
    rows += [dict(name=e.name, pitfall=PITFALLS.get(e.name), what=e.wrong, shown=False,
                  why=f"judged by {e.judged}, not by a replay (docs/training_diff.md)")
             for e in wanted if e.judged != "replay"]
    return dict(environment=environment(), settings=dict(settings), references=refs, rows=rows,
                wall_s=round(time.perf_counter() - started, 1))


# -- rendering -------------------------------------------------------------------------------------------

def _named(r: dict) -> str:
    d = r["diff"]
    if d["named"] == [r["name"]]:
        return f"yes (from step {d['first_difference']})"
    if d["named"]:
        return f"**as** {' + '.join(d['named'])}"
    return "**no**" + (f" (closest: {' + '.join(d['closest'])})" if d["closest"] else "")


def _flags(settings: Mapping) -> str:
    s = settings
    return (f"rosetta train --task {s['task']} --preset {s['preset']} --steps {s['steps']} "
            f"--trace {s['steps']} --warmup {s['warmup']} --max-tokens {s['max_tokens']} --seed {s['seed']} "
            "--set dropout=0 --dtype float64")


def markdown(result: dict) -> str:
    """The page block's body: how it was measured, one row per entry measured, then the others."""
    env, s, refs = result["environment"], result["settings"], result["references"]
    n = s["steps"]
    runs = "; ".join(f"`{name}`: {' '.join(r['flags']) or 'no other flag'}" for name, r in refs.items())
    worst = max(r["replay_vs_trainer"] for r in refs.values())
    losses = ", ".join(f"{r['loss_initial']:.4f} -> {r['loss_ours']:.4f} (`{name}`)"
                       for name, r in refs.items())
    lines = [
        f"Measured {env['date']} on {env.get('machine')} ({env.get('processor')}), commit {env['commit']}, "
        f"numpy {env.get('numpy')}, torch {env.get('torch')}; the whole run took {result['wall_s']:.0f} s. "
        f"Reference runs: `{_flags(s)}`, and then {runs}.",
        "",
        f"How: each row replays the reference's {n} updates in float64 with its one mistake "
        "(`rosetta.diff.training.catalogue.replay`, from the reference's initial weights on its batches) "
        f"and compares them with the replay without it, which reproduces the trainer's weights after {n} "
        f"updates to {worst:.1e} of their distance travelled. *first step*: the first update after which "
        "||θ_mistake - θ_ours|| / ||θ_ours - θ_0|| (the k biases left out, PITFALLS 14) exceeds "
        f"{THRESHOLD:.0e}. *weights off*: that ratio after update {n}: 1 is as far off as the whole "
        f"run has travelled. *loss*: the mean token cross entropy without smoothing (pad left out) on "
        f"step {n}'s batch after {n} updates; ours went {losses}. *named*: the mistaken run written as "
        f"a user's float64 trace ({s['whole']} steps whole) and given to `rosetta diff MINE REF "
        "--diagnose`: whether it names that entry (and from which step the runs differ), another, or none.",
        "",
        f"| mistake | PITFALLS | reference | first step | weights off after {n} | loss after {n}: "
        "ours / mistake | named by `rosetta diff --diagnose`? |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in result["rows"] if r["shown"]):
        first = "none" if r["first_step"] is None else str(r["first_step"])
        what = r["what"] + (f" (here {r['value']})" if r.get("value") else "")
        lines.append(f"| `{r['name']}`: {what} | {r['pitfall'] or '-'} | {r['reference']} | {first} | "
                     f"{r['rel_final']:.1e} | {r['loss_ours']:.4f} / {r['loss_mistake']:.4f} | {_named(r)} |")
    hidden = [r for r in result["rows"] if not r["shown"]]
    if hidden:
        lines += ["", "Catalogue entries not measured here:", ""]
        lines += [f"- `{r['name']}` ({r['why']}): {r['what']}" for r in hidden]
    return "\n".join(lines) + "\n"


def newest(results: Path = RESULTS) -> Path | None:
    return newest_results(PREFIX, results)


def load(path: Path) -> dict:
    return load_results(path, "benchmarks/training_pitfalls.py",
                        ("environment", "settings", "references", "rows", "wall_s"),
                        {"references": field("object")})


def page_block(results: Path = RESULTS) -> str:
    """What docs/pitfalls.md shows between its training markers: the newest results, rendered."""
    return results_block(PREFIX, results, BEGIN, END, lambda path: markdown(load(path)),
                         "python -m benchmarks.training_pitfalls")


def update_page(page: Path = PAGE, results: Path = RESULTS) -> None:
    replace_block(page, BEGIN, END, page_block(results))


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__.split("\n\n")[0])
    cli.add_argument("--docs", action="store_true", help="only re-render docs/pitfalls.md's training block")
    args = cli.parse_args(argv)
    path = newest(RESULTS) if args.docs else None  # RESULTS read now: a test points it elsewhere
    if args.docs and path is None:
        cli.error(f"no {PREFIX}_<date>.json in {RESULTS}: run `python -m benchmarks.training_pitfalls`")
    name = path.stem if path else f"{PREFIX}_{dt.date.today().isoformat()}"
    # What it writes, before it measures: the results, and the page's block.
    cli.check_out_dir(RESULTS, [f"{name}.json", f"{name}.md"], flag=None)
    cli.check_out_dir(PAGE.parent, [PAGE.name], flag=None)
    with cli.refusing():
        result = load(path) if path else run()
    json_path, _ = write_results(name, result, "# Measured training pitfalls\n\n" + markdown(result), RESULTS)
    print(f"wrote {json_path} and {json_path.with_suffix('.md')}")
    update_page(PAGE, RESULTS)
    print(f"updated {PAGE}")


if __name__ == "__main__":
    main()
