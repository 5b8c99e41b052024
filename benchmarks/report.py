"""What a benchmark run leaves behind, from its JSON: the Markdown tables, the plot, and the
copy of the newest tables in docs/benchmarks.md.

    python -m benchmarks.report benchmarks/results/gpu_*.json   # re-render their .md and .png
    python -m benchmarks.report --docs        # docs/benchmarks.md <- newest cpu and gpu tables,
                                              # README.md <- the GPU head-to-head (newest per group);
                                              # both rendered before either is written

benchmarks/run.py calls `markdown` and `plot` after every run; the block in docs/benchmarks.md
(between its markers; `--readme` is the flag's older name, from when the block was in the
README) is refreshed on request only (a test checks that it matches the newest results files).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

from benchmarks.common import (
    HARNESS,
    IMPL_ORDER,
    RESULTS,
    given_path,
    load_results,
    machine_line,
    newest_results,
    parser,
    replace_block,
)
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.json_input import check_schema, field

ROOT = Path(__file__).parent.parent
BENCHMARK_DOC = ROOT / "docs" / "benchmarks.md"  # the page that shows the newest tables
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
SUITES_IN_README = ("gpu", "cpu")  # newest results file of each, in this order
README = ROOT / "README.md"  # its "On your own GPU" head-to-head table, between these markers:
GPU_BEGIN, GPU_END = "<!-- gpu-head-to-head:begin -->", "<!-- gpu-head-to-head:end -->"
# A GPU suite's results: the whole suite (gpu_...) or some of its tasks (gpu-train_..., gpu-decode_...).
GPU_RESULTS = re.compile(r"^gpu(-(train|forward|decode))*_[a-z0-9-]+_\d{4}-\d\d-\d\d\.json$")


def _sorted(rows: list[dict], task: str) -> list[dict]:
    """One task's rows in run order of presets and dtypes, implementations in IMPL_ORDER."""
    rows = [r for r in rows if r["task"] == task]
    groups = list(dict.fromkeys((r["preset"], r["dtype"]) for r in rows))
    searches = list(dict.fromkeys(r.get("search", "greedy") for r in rows))  # run order: greedy, beam 4, wide
    return sorted(rows, key=lambda r: (groups.index((r["preset"], r["dtype"])),
                                       searches.index(r.get("search", "greedy")),
                                       r.get("batching") == "packed", IMPL_ORDER.index(r["impl"])))


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _percent(x: float | None) -> str:
    """MFU as a percentage: one decimal, or two significant digits under 1%."""
    return "–" if x is None else f"{100 * x:.1f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def _group(r: dict) -> tuple[str, str, str]:
    """A plot's group of bars: preset, dtype, and the search (decoding) or packed rows (training)."""
    return r["preset"], r["dtype"], r.get("search", "packed" if r.get("batching") == "packed" else "")


def _range(bounds: list[float] | None, pairs: int) -> str:
    """ " [low–high] over N pairs" of a loop/step median taken over alternated pairs (benchmarks/run.py)."""
    return f" [{bounds[0]:.2f}–{bounds[1]:.2f}, {pairs} pairs]" if bounds and pairs > 1 else ""


def tables(result: dict) -> str:
    """The training, forward and decoding tables of one run; training rows with their batching and
    real-token share where the run recorded them (benchmarks/run.py since issue 45)."""
    shares = any("real_token_share" in r for r in result["rows"] if r["task"] == "train")
    lines = [
        "Training (one optimizer step, dropout on; `(rosetta train)`: the training loop on the same "
        "batches, its median step over the benchmark row's in the last column (the median over alternated "
        "pairs of the two rows, with its range, where the run took several)"
        + ("; real tokens: the share of the batches' target slots that are not padding)" if shares else ")"),
        "",
        "| preset | dtype | impl | " + ("batching | real tokens | " if shares else "") + "step ms | "
        "target tokens/s (real) | padded tokens/s | MFU | peak mem GB | ratio vs peer | loop / step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if shares else ""),
    ]
    for r in _sorted(result["rows"], "train"):
        mem = None if r.get("peak_memory_bytes") is None else r["peak_memory_bytes"] / 1e9
        spread = f" [{r['min_s'] * 1e3:.1f}–{r['max_s'] * 1e3:.1f}]" if "min_s" in r else ""
        share = f"{r.get('batching', '–')} | {_percent(r.get('real_token_share'))} | " if shares else ""
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['impl']} | {share}{r['median_s'] * 1e3:.1f}{spread} | "
            f"{r['tokens_per_s']:,.0f} | {r['padded_tokens_per_s']:,.0f} | {_percent(r.get('mfu'))} | "
            f"{_fmt(mem, '.2f')} | {_fmt(r.get('ratio_vs_peer'), '.2f')} | "
            f"{_fmt(r.get('vs_benchmark'), '.2f')}{_range(r.get('vs_benchmark_range'), r.get('pairs', 1))} |"
        )
    hosted = [r for r in _sorted(result["rows"], "train") if "host_s" in r]
    if hosted:  # rosetta/harness/stepping.py: a loop whose host phases reach its step is host-bound
        lines += ["", "The loop's host, ms per step (dispatching the step, drawing and copying the next "
                  "batch, counting its work) beside its step: "
                  + "; ".join(f"{r['preset']} {r['dtype']} {r['impl']}: "
                              + ", ".join(f"{p} {v * 1e3:.2f}" for p, v in r["host_s"].items())
                              + f" of {r['median_s'] * 1e3:.1f}" for r in hosted)]
    lines += ["", "Forward latency (one batch)", "",
              "| preset | dtype | impl | ms | sentences/s | ratio vs peer |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in _sorted(result["rows"], "forward"):
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['impl']} | {r['median_s'] * 1e3:.2f} "
            f"[{r['min_s'] * 1e3:.2f}–{r['max_s'] * 1e3:.2f}] | {r['sentences_per_s']:,.0f} | "
            f"{_fmt(r.get('ratio_vs_peer'), '.2f')} |"
        )
    lines += ["", "Decoding (cached; the peer: nn.Transformer re-decoding the prefix, greedy only, float32)",
              "", "| preset | dtype | impl | search | s | sentences/s | tokens/s | ratio vs peer |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in _sorted(result["rows"], "decode"):
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['impl']} | {r['search']} | {r['median_s']:.3f} | "
            f"{r['sentences_per_s']:,.1f} | {r['tokens_per_s']:,.0f} | "
            f"{_fmt(r.get('ratio_vs_peer'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


_NUMBER = field("number", required=True)
# What the tables read of a results file and of each of its rows (others pass: files carry more).
# (Their presence: load_results's `keys`.)
RESULT = {"environment": field("object"), "suite": field("string"), "device": field("string"),
          "sizes": field("object")}
ROW = {"task": field("string", required=True, choices=("train", "forward", "decode")),
       "preset": field("string", required=True), "dtype": field("string", required=True),
       "impl": field("string", required=True, choices=IMPL_ORDER), "median_s": _NUMBER,
       **{name: field("number", "null") for name in ("min_s", "max_s", "mfu", "ratio_vs_peer",
                                                   "vs_benchmark", "peak_memory_bytes", "real_token_share")},
       "search": field("string"), "batching": field("string")}
# The figures each task's table prints.
TASK_FIELDS = {"train": {"tokens_per_s": _NUMBER, "padded_tokens_per_s": _NUMBER},
               "forward": {"sentences_per_s": _NUMBER},
               "decode": {"search": field("string", required=True), "tokens_per_s": _NUMBER,
                          "sentences_per_s": _NUMBER}}


def load(path: Path) -> dict:
    """A results JSON written by benchmarks/run.py, or a clear error naming the file and what is
    wrong: its top-level fields, and each row's (`rows[i]: ...`), as the tables read them."""
    result = load_results(path, "benchmarks/run.py", ("environment", "suite", "device", "rows", "sizes"),
                          schema=RESULT)
    for i, row in enumerate(result["rows"]):
        where = f"{path}: rows[{i}]"
        if not isinstance(row, dict):
            raise SystemExit(f"{where} must be an object, got {type(row).__name__}")
        try:
            check_schema(row, ROW, str(path), RosettaError, f"rows[{i}].")
            check_schema(row, TASK_FIELDS[row["task"]], str(path), RosettaError, f"rows[{i}].")
        except RosettaError as e:
            raise SystemExit(str(e)) from None
    return result


def describe(result: dict) -> str:
    """One paragraph: when, which machine and commit, which versions and settings."""
    env, settings = result["environment"], result.get("settings", {})
    sizes = "; ".join(
        f"{k}: train/forward {v['batch']}x{v['length']}, decode {v['decode_batch']} sentences x "
        f"{v['decode_len']} + {v['margin']}" for k, v in result["sizes"].items()
    )
    extra = "".join(f", {k} {v}" for k, v in settings.items())
    if "wall_s" in result:
        extra += f"; the whole run took {result['wall_s']:.0f} s"
    return (
        f"{env['date']}, {result['device']} ({env.get('machine')}), commit {env['commit']}, "
        f"torch {env.get('torch')}, jax {env.get('jax')}, flax {env.get('flax')}{extra}. Median "
        f"of {result['rows'][0]['repeats']} repeats (spread in brackets); ratio vs peer = peer "
        "time / our time for the same work (torch.nn.Transformer, same weights; > 1: faster than "
        f"the peer; decoding: per emitted token). Sizes: {sizes}. {machine_line(env)}.\n"
    )


def markdown(result: dict) -> str:
    """The results file's Markdown: title, description, tables."""
    return (f"# Benchmarks: {result['suite']} suite on {result['device']}\n\n{describe(result)}\n"
            + tables(result) + failures(result))


def failures(result: dict) -> str:
    """The measurements that failed (benchmarks/common.py attempt), each with its error; none: nothing."""
    failed = result.get("failed") or []
    return "".join(["\n## Failed\n\n"] + [f"- {r['preset']} {r['dtype']} {r['task']} {r['impl']}: "
                                             f"`{r['error']}`\n" for r in failed]) if failed else ""


def plot(result: dict, path: Path) -> Path | None:
    """Ratio vs the peer of every measurement (> 1: faster than nn.Transformer), one panel per
    task that has one; training bars carry their MFU where the device's peak is known. Written
    atomically; None, and no file, when no row has a ratio (e.g. bfloat16 decoding alone: the peer
    decodes in float32 only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in ("train", "forward", "decode")
             if any(r["task"] == t and r.get("ratio_vs_peer") is not None for r in result["rows"])]
    if not tasks:
        return None
    fig, axes = plt.subplots(len(tasks), 1, figsize=(10, 3.2 * len(tasks)), squeeze=False)
    palette = ("tab:gray", "tab:red", "lightcoral", "tab:orange", "tab:blue", "lightskyblue", "black")
    colors = dict(zip([i for i in IMPL_ORDER if not i.endswith(HARNESS)], palette, strict=True))
    for ax, task in zip(axes[:, 0], tasks, strict=True):
        rows = [r for r in _sorted(result["rows"], task) if r.get("ratio_vs_peer") is not None]
        groups = list(dict.fromkeys(_group(r) for r in rows))
        impls = [i for i in IMPL_ORDER if any(r["impl"] == i for r in rows)]
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            offset = (j - (len(impls) - 1) / 2) * width
            for r in (r for r in rows if r["impl"] == impl):
                x = groups.index(_group(r)) + offset
                ax.bar(x, r["ratio_vs_peer"], width, color=colors[impl.removesuffix(HARNESS)],
                       hatch="//" if impl.endswith(HARNESS) else None,
                       label=impl if r is next(q for q in rows if q["impl"] == impl) else None)
                if r.get("mfu"):
                    ax.annotate(_percent(r["mfu"]), (x, r["ratio_vs_peer"]), ha="center",
                                va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)), [" ".join(g).strip() for g in groups], fontsize=8)
        ax.set_ylabel("ratio vs peer")
        ax.set_title({"train": "training step (labels: MFU)", "forward": "forward latency",
                      "decode": "decoding, per emitted token"}[task], fontsize=10)
        ax.legend(fontsize=8, ncol=len(impls))
    fig.suptitle(f"{result['suite']} suite, {result['device']}, commit {result['environment']['commit']}",
                 fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def newest(suite: str, results: Path = RESULTS) -> Path | None:
    """The newest complete results file of a suite (names end in the ISO date)."""
    return newest_results(suite, results)


def _link(path: Path, page: Path = BENCHMARK_DOC) -> str:
    """A Markdown link to `path` that resolves from the page's folder, shown as the path from
    the repository root; a path outside the repository is shown as it is, unlinked."""
    if not path.is_relative_to(ROOT):
        return f"`{path}`"
    return f"[`{path.relative_to(ROOT).as_posix()}`]({Path(os.path.relpath(path, page.parent)).as_posix()})"


def readme_block(results: Path = RESULTS) -> str:
    """What docs/benchmarks.md shows between its markers: the newest tables of each suite."""
    parts = [BEGIN]
    for suite in SUITES_IN_README:
        path = newest(suite, results)
        if path is None:
            continue
        result = load(path)
        parts += [f"**`--suite {suite}`**, from {_link(path)} (plot: {_link(path.with_suffix('.png'))}): "
                  + describe(result), tables(result)]
    return "\n".join(parts + [END])


def update_docs(results: Path = RESULTS) -> None:
    """docs/benchmarks.md's tables and the README's GPU table, both rendered (every results file read)
    before either page is written: a bad results file leaves both pages as they were."""
    blocks = [(BENCHMARK_DOC, BEGIN, END, readme_block(results)),
              (README, GPU_BEGIN, GPU_END, gpu_head_to_head(results, README))]
    for page, begin, end, block in blocks:
        replace_block(page, begin, end, block)


def newest_gpu_groups(results: Path = RESULTS) -> dict[tuple[str, str, str], tuple[Path, dict]]:
    """(task, preset, dtype) -> the newest GPU suite results file with rows of it (a run of some tasks
    or presets counts for those), and that file: a group's rows, ours and the peer's, from one run."""
    files = sorted((p for p in results.glob("gpu*.json") if GPU_RESULTS.match(p.name)),
                   key=lambda p: (p.stem[-10:], p.name))  # oldest first: the newest file wins a group
    chosen: dict[tuple[str, str, str], tuple[Path, dict]] = {}
    for path in files:
        result = load(path)
        if result["device"] != "cpu":
            chosen |= {(r["task"], r["preset"], r["dtype"]): (path, result) for r in result["rows"]}
    return chosen


def gpu_head_to_head(results: Path = RESULTS, page: Path = README) -> str:
    """The README's GPU table between its markers: each (preset, dtype)'s training and decoding rows
    from the newest GPU results file that has them (newest_gpu_groups), PyTorch, JAX and the peer side
    by side, each row numbered with its run (GPU, commit, date, results file) listed below the tables."""
    groups = newest_gpu_groups(results)
    runs = dict(groups.values())  # path -> its results, in the order first met
    train = ["| preset | dtype | impl | batching | step ms | MFU | ratio vs peer | peak mem GB | run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    decode = ["| preset | dtype | impl | search | tokens/s | ratio vs peer | run |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for (task, preset_name, dtype), (path, result) in sorted(groups.items(), key=lambda g: g[0][1:]):
        run = list(runs).index(path) + 1
        rows = [r for r in _sorted(result["rows"], task) if (r["preset"], r["dtype"]) == (preset_name, dtype)]
        for r in rows if task == "train" else []:
            mem = None if r.get("peak_memory_bytes") is None else r["peak_memory_bytes"] / 1e9
            kind = "" if "real_flops_per_step" in r or r.get("mfu") is None else " padded"
            train.append(f"| {preset_name} | {dtype} | {r['impl']} | {r.get('batching', 'bucketed')} | "
                         f"{r['median_s'] * 1e3:.1f} | {_percent(r.get('mfu'))}{kind} | "
                         f"{_fmt(r.get('ratio_vs_peer'), '.2f')} | {_fmt(mem, '.1f')} | {run} |")
        for r in rows if task == "decode" else []:
            decode.append(f"| {preset_name} | {dtype} | {r['impl']} | {r['search']} | "
                          f"{r['tokens_per_s']:,.0f} | {_fmt(r.get('ratio_vs_peer'), '.2f')} | {run} |")
    listed = []
    for n, (path, result) in enumerate(runs.items(), start=1):
        commit = result["environment"].get("commit", "?").split()[0]
        link = Path(os.path.relpath(path.with_suffix(".md"), page.parent)).as_posix()
        listed.append(f"{n}. {result['device']}, commit {commit}, {path.stem[-10:]}: "
                      f"[`{path.with_suffix('.md').name}`]({link})")
    return "\n".join([GPU_BEGIN, "Training (one optimizer step; MFU real-token where the run recorded its "
                      "real tokens, else over the padded batch: \"padded\")", "", *train, "",
                      "Decoding (cached; the peer decodes greedy in float32 only)", "", *decode, "",
                      "The runs:", "", *listed, GPU_END])


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("results", nargs="*", type=given_path, help="results JSON files to re-render")
    cli.add_argument("--docs", "--readme", dest="docs", action="store_true",
                     help=f"refresh the benchmark tables in {BENCHMARK_DOC.relative_to(ROOT)} "
                          "(--readme: the same, the flag's older name)")
    args = cli.parse_args(argv)
    for path in args.results:  # every file it writes, before the first is written
        cli.check_out_dir(path.parent, [path.with_suffix(".md").name, path.with_suffix(".png").name],
                          flag="results")
    if args.docs:
        cli.check_out_dir(BENCHMARK_DOC.parent, [BENCHMARK_DOC.name], flag=None)
        cli.check_out_dir(README.parent, [README.name], flag=None)
    for path in args.results:
        result = load(path)
        atomic_write_bytes(path.with_suffix(".md"), markdown(result).encode())
        print("wrote", path.with_suffix(".md"), plot(result, path.with_suffix(".png")))
    if args.docs:
        update_docs()
        print("updated", BENCHMARK_DOC, README)


if __name__ == "__main__":
    main()
