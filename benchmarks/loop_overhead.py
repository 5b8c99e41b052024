"""What `rosetta train`'s loop adds around its trainer's step (issue 45, item 9), told apart from
the noise of one row:

    python -m benchmarks.loop_overhead                 # tiny, both frameworks, 6 pairs: ~2 min on 2 cores
    python -m benchmarks.loop_overhead --preset small --pairs 3 --steps 2 --repeats 5

The suite's `loop / step` column (benchmarks/run.py) alternates the same two rows a few times per
size (Size.loop_pairs) and prints the median; on a busy CPU one pair moves by a third. Here they are
alternated through the same function (run.alternate: the loop first in every other pair) with as
many pairs as asked, `--pairs` per framework, and every pair is printed: the benchmark row
(run.bench_training: `Trainer.step` under the harness's Stepper) and the loop row (bench_harness:
`rosetta train` itself, its median step from its own log), each as the suite measures it, with the
suite's batches and settings. Reported per framework: each row's median and spread over the pairs,
each pair's ratio (loop over step), and their median and range. A loop that adds work shows as a
median ratio above 1 with a range that stays above it. JAX is measured first in the process, PyTorch
after it, as in the suite (JAX's rows are the suite's last benchmark rows). Nothing else should run
meanwhile.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
import time

import torch

from benchmarks.common import RESULTS, environment, given_path, parser, with_machine, write_results
from benchmarks.peer import make_peer
from benchmarks.run import SUITES, alternate, training_batches
from rosetta import preset
from rosetta.cli_args import count

FRAMEWORKS = ("jax", "torch")


def run(preset_name: str, pairs: int, steps: int, repeats: int, device: str) -> dict:
    """`pairs` alternations of each framework's benchmark row and loop row, from the same weights on
    the same batches (the cpu suite's size of `preset_name`)."""
    suite = dataclasses.replace(SUITES["cpu"], steps=steps, repeats=repeats)
    size = suite.presets[preset_name]
    _, cfg, params = make_peer(preset(preset_name, max_len=max(128, size.decode_len + size.margin + 1)))
    batches = training_batches(cfg, preset_name, size)
    rows = []
    for framework in FRAMEWORKS:
        found = alternate(cfg, params, batches, preset_name, size, "float32", suite, framework, device, pairs)
        step, loop = [b["median_s"] for b, _ in found], [harness["median_s"] for _, (harness,) in found]
        ratios = [b / a for a, b in zip(step, loop, strict=True)]
        rows.append({"framework": framework, "step_s": step, "loop_s": loop, "ratios": ratios,
                     "median_ratio": statistics.median(ratios)})
    return {"preset": preset_name, "pairs": pairs, "steps": steps, "repeats": repeats, "device": device,
            "batch": [size.batch, size.length], "rows": rows}


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# What the loop adds around the step, {env['date']} (commit {env['commit']}, "
             f"{env['processor']}, {env['cpus']} cores, torch {env['torch']}, jax {env['jax']})", "",
             f"`{result['preset']}`, float32, batch {result['batch'][0]} x {result['batch'][1]}, "
             f"{result['pairs']} pairs per framework, each row {result['repeats']} stretches of "
             f"{result['steps']} steps (median), on {result['device']}; the whole run took "
             f"{result['wall_s']:.0f} s", "",
             "| framework | step, median ms [spread] | loop, median ms [spread] | loop / step per pair | "
             "median ratio [range] |", "| --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['framework']} | {_spread([x * 1e3 for x in r['step_s']], '.1f')} | "
                     f"{_spread([x * 1e3 for x in r['loop_s']], '.1f')} | "
                     f"{' '.join(f'{x:.2f}' for x in r['ratios'])} | {_spread(r['ratios'], '.2f')} |")
    return "\n".join(lines) + "\n"


def _spread(values: list[float], spec: str) -> str:
    """"median [min-max]" of `values`, each formatted by `spec`."""
    low, mid, high = (format(x, spec) for x in (min(values), statistics.median(values), max(values)))
    return f"{mid} [{low}-{high}]"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--preset", default="tiny", choices=sorted(SUITES["cpu"].presets),
                     help="the cpu suite's size of it (default tiny)")
    cli.add_argument("--pairs", type=count, default=6, help="alternations per framework (default 6)")
    cli.add_argument("--steps", type=count, default=4, help="steps a stretch (default 4)")
    cli.add_argument("--repeats", type=count, default=7, help="stretches a row (default 7)")
    cli.add_argument("--out-dir", type=given_path, default=RESULTS)
    cli.add_argument("--no-write", action="store_true", help="print only")
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = f"loop_overhead_{args.preset}_{device}_{dt.date.today().isoformat()}"
    if not args.no_write:  # the files it writes, before the first measurement
        cli.check_out_dir(args.out_dir, [f"{name}.json", f"{name}.md"])
    started, env = time.perf_counter(), environment()
    result = run(args.preset, args.pairs, args.steps, args.repeats, device)
    result |= {"environment": env, "wall_s": time.perf_counter() - started}
    text = with_machine(markdown(result), env)
    print(text)
    if not args.no_write:
        print("wrote", *write_results(name, result, text, args.out_dir))


if __name__ == "__main__":
    main()
