"""Time to quality (issue 16): the multi30k recipe trained by the harness under a time budget,
per framework and for the `torch.nn.Transformer` peer trained by the same harness; then the
test2016 and test2017 sacreBLEU (cased, 13a, beam 4, α 0.6) of the last checkpoint and of the
average of the last ones. Run it alone on the machine: on 2 cores any other process slows
every step several times.

    python -m benchmarks.time_to_quality --train --budget 25 --backends torch peer --out runs/ttq25
    python -m benchmarks.time_to_quality --out runs/ttq25          # the table of a finished run only

Each backend trains in turn (`rosetta train --recipe multi30k --time-budget B`), then `rosetta
evaluate` scores its newest checkpoint and its `averaged.safetensors` on both test sets (files
`eval_{last,avg}_<split>.json` in the backend's directory). The table (minutes to the first
validation BLEU at or above each `--bleu-at` value, with its step; final BLEU on the test sets)
goes to benchmarks/results/ttq_<device>_<date>.{json,md}, with the machine and the commit.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, environment, given_path, parser, with_machine, write_results
from rosetta.cli_args import nonempty_path, positive_real, real_type
from rosetta.errors import RosettaError
from rosetta.harness.report import RUN_SCHEMA
from rosetta.json_input import read_json

SPLITS = ("test_2016_flickr", "test_2017_flickr")
SEARCH = ["--beam", "4", "--alpha", "0.6"]
BLEU = real_type(0.0, 100.0)  # a --bleu-at threshold: sacreBLEU scores lie in [0, 100]


def rosetta(*args: str) -> None:
    """One `rosetta` command in this interpreter's environment; a failure stops the run."""
    command = [sys.executable, "-m", "rosetta.cli", *args]
    print("$", " ".join(command[2:]), flush=True)
    if subprocess.run(command).returncode != 0:  # its own one-line error is already on stderr
        raise SystemExit(f"time_to_quality: `rosetta {args[0]}` failed; stopping")


def train_and_evaluate(out: Path, backends: list[str], budget: float, data_dir: str | None) -> None:
    data = ["--data-dir", data_dir] if data_dir else []
    rosetta("train", "--recipe", "multi30k", "--time-budget", str(budget), "--backend", *backends,
            "--out", str(out), *data)
    for backend in backends:
        run = out / backend
        for split in SPLITS:
            rosetta("evaluate", str(run), "--split", split, *SEARCH, "--backend", "torch", *data,
                    "--out", str(run / f"eval_last_{split}.json"))
            if (run / "averaged.safetensors").is_file():  # a bare checkpoint: the run's pair given
                pair = _read_json(run / "run.json", "run settings", RUN_SCHEMA)["args"]["pair"]
                rosetta("evaluate", str(run / "averaged.safetensors"),
                        "--tokenizer", str(run / "tokenizer.json"), "--pair", pair, "--split", split,
                        *SEARCH, "--backend", "torch", *data, "--out", str(run / f"eval_avg_{split}.json"))


def _read_json(path: Path, what: str, schema: dict | None = None) -> dict:
    """A run's JSON file; a corrupt one stops the table with one line naming it."""
    try:  # the one JSON reader: bounded, and run.json's fields typed (rosetta/json_input.py)
        return read_json(path, f"a {what} file", nonfinite=True, schema=schema)
    except RosettaError as e:
        raise SystemExit(str(e)) from None


def _bleu(path: Path) -> dict | None:
    if not path.is_file():
        return None
    report = _read_json(path, "`rosetta evaluate` report")
    try:
        return {"score": float(report["bleu"]["score"]), "signature": str(report["bleu"]["signature"])}
    except (KeyError, TypeError, ValueError):
        raise SystemExit(f"{path}: not a `rosetta evaluate` report (no bleu score and signature)") from None


def table(out: Path, bleu_at: list[float]) -> dict:
    """Per backend directory of `out` that holds a result.json: the evaluations, the minutes to
    each validation BLEU in `bleu_at`, and the test BLEU of the last checkpoint and the average."""
    rows = []
    for result_path in sorted(out.glob("*/result.json")):
        result = _read_json(result_path, "run result")
        evaluations = result.get("evaluations") or []
        reached = {}
        for x in bleu_at:
            first = next((e for e in evaluations if e.get("bleu") is not None and e["bleu"] >= x), None)
            reached[str(x)] = (None if first is None
                               else {"minutes": first["elapsed_s"] / 60, "step": first["step"]})
        run = result_path.parent
        rows.append({
            "backend": result["backend"], "stopped_by": result.get("stopped_by"),
            "steps": evaluations[-1]["step"] if evaluations else None,
            "minutes": evaluations[-1]["elapsed_s"] / 60 if evaluations else None,
            "val_bleu_last": evaluations[-1]["bleu"] if evaluations else None,
            "val_bleu_average": result.get("bleu_average"), "reached": reached, "evaluations": evaluations,
            "test": {f"{kind}_{split}": _bleu(run / f"eval_{kind}_{split}.json")
                     for kind in ("last", "avg") for split in SPLITS},
        })
    if not rows:
        raise SystemExit(f"{out}: no finished backend run (no */result.json)")
    return {"run_dir": str(out), "bleu_at": bleu_at, "rows": rows}


def markdown(result: dict) -> str:
    env = result["environment"]
    signature = next((t["signature"] for r in result["rows"] for t in r["test"].values() if t), "–")
    heads = [f"min to val BLEU {x:g}" for x in result["bleu_at"]]
    lines = [
        "# Time to quality: the multi30k recipe (de→en) under a time budget", "",
        f"{env['date']}, {env.get('processor')} ({env.get('torch_threads')} torch threads), commit "
        f"{env['commit']}, torch {env.get('torch')}, jax {env.get('jax')}. {result['settings']}. Validation "
        "BLEU: the harness's evaluations (beam 4, α 0.6, whole val split; minutes include evaluations). "
        f"Test BLEU: `rosetta evaluate`, sacreBLEU {signature}; last = newest checkpoint, avg = "
        "average of the last checkpoints (the recipe's `average_last`). The peer is torch.nn.Transformer "
        "trained by the same harness, decoded by our beam search.", "",
        "| backend | stopped by | steps | minutes | " + " | ".join(heads) + " | val BLEU last / avg | "
        "test2016 last / avg | test2017 last / avg |",
        "| --- " * (7 + len(heads)) + "|",
    ]

    def pair(row: dict, split: str) -> str:
        scores = [row["test"][f"{kind}_{split}"] for kind in ("last", "avg")]
        return " / ".join("–" if s is None else f"{s['score']:.2f}" for s in scores)

    for r in result["rows"]:
        reached = [("not reached" if v is None else f"{v['minutes']:.1f} (step {v['step']})")
                   for v in r["reached"].values()]
        val = " / ".join("–" if v is None else f"{v:.2f}"
                         for v in (r["val_bleu_last"], r["val_bleu_average"]))
        lines.append(f"| {r['backend']} | {r['stopped_by']} | {r['steps']} | {r['minutes']:.1f} | "
                     + " | ".join(reached) + f" | {val} | {pair(r, SPLITS[0])} | {pair(r, SPLITS[1])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--out", type=given_path, required=True, help="the run directory")
    cli.add_argument("--train", action="store_true", help="train and evaluate first (else tabulate only)")
    cli.add_argument("--budget", type=positive_real, default=25.0, help="minutes each (default 25)")
    cli.add_argument("--backends", nargs="+", default=["torch", "peer"], choices=("torch", "jax", "peer"))
    cli.add_argument("--bleu-at", nargs="+", type=BLEU, default=[25.0, 30.0, 35.0],
                     help="validation BLEU thresholds of the table (default 25 30 35)")
    cli.add_argument("--data-dir", type=nonempty_path, help="Multi30k directory (default: the harness's)")
    cli.add_argument("--results-dir", type=given_path, default=RESULTS)
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    env = environment()  # before training: the commit the run is made from
    device = "".join(c if c.isalnum() else "-" for c in (env.get("gpu") or "cpu").lower()).strip("-")
    name = f"ttq_{device}_{dt.date.today().isoformat()}"
    cli.check_out_dir(args.results_dir, [f"{name}.json", f"{name}.md"], flag="--results-dir")
    if args.train:  # what training writes and reads, before its minutes
        cli.check_out_dir(args.out, [f"{b}/run.json" for b in args.backends], flag="--out")
        from rosetta.harness.data import resolve_data_dir

        with cli.refusing("--data-dir" if args.data_dir else None):
            resolve_data_dir(args.data_dir)
    started = time.perf_counter()
    if args.train:
        train_and_evaluate(args.out, args.backends, args.budget, args.data_dir)
    result = table(args.out, args.bleu_at) | {"environment": env}
    run_path = next(args.out.glob("*/run.json"), None)
    run_json = _read_json(run_path, "run settings", RUN_SCHEMA) if run_path else {}
    budget = (run_json.get("args") or {}).get("time_budget")
    result["settings"] = f"recipe multi30k, --time-budget {budget} min per backend"
    if args.train:
        result["wall_s"] = time.perf_counter() - started
    text = with_machine(markdown(result), env)
    print(text)
    print("wrote", *write_results(name, result, text, args.results_dir))


if __name__ == "__main__":
    main()
