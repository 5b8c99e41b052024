"""Decoding speed against CTranslate2, the engine opus-mt models are deployed with (issue 27).

    python -m benchmarks.decode_ct2            # base-sized Marian model, 7 rounds, minutes on 2 cores
    python -m benchmarks.decode_ct2 --quick    # a small model, one round (the smoke test)
    python -m benchmarks.decode_ct2 --model m2m100   # an M2M100-shaped model instead (issue 58)

The setup: a Marian model of base size (d_model 512, 6 + 6 layers, 8 heads, d_ff 2048, a joint
32,000-token vocabulary, `<pad>` last with a zero row, decoder start = pad, as opus-mt), random
weights with eos banned through the output bias (so every sentence emits exactly `tgt_len`
tokens and each engine does the same work), a batch of 32 random sources of 24 tokens (eos
last). Our PyTorch and JAX backends decode it with the cached search; CTranslate2 decodes the
model our converters wrote (`rosetta convert ... --to ctranslate2`, through CTranslate2's own
converter) at float32 and int8. Beam 4 is timed; greedy is run once to check that our backends
and CTranslate2 float32 emit the same tokens (int8: the fraction that agree), and each engine's
beam-4 tokens are compared once with the float64 reference's beam search (numpy_ref, untimed, on
the first REFERENCE_ROWS sentences).

`--model m2m100`: the same on an M2M100-shaped model of the same size, its target language code
forced first by every engine; benchmarks/decode_ct2_models.py builds both models (the one place
they differ, with the CTranslate2 call's prefix).

Each engine decodes in a process of its own, as users run it (`Engines`: in one process
CTranslate2's OpenMP threads slowed PyTorch's search). Each round runs every engine once, in turn
(interleaved), 7 rounds by default (`--rounds`): per
engine the median over rounds, the spread (fastest and slowest round) and each ratio's range, the
min and max over rounds of that round's ratio against CTranslate2 float32 (whose own speed moved
20% between runs in issue 47: three rounds could not tell 0.8x from 1.0x), after one warm-up call
each (JAX's compilation). Threads: `--threads` for PyTorch,
CTranslate2's intra_threads, and XLA's CPU client (all cores by default: run on a machine whose
core count is the thread count). Nothing else should run meanwhile.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    RESULTS,
    environment,
    given_path,
    isa_sections,
    parser,
    with_machine,
    write_results,
)
from benchmarks.decode_ct2_models import MODELS, build
from rosetta import from_params, load, save_checkpoint
from rosetta.cli_args import integer_type
from rosetta.files import atomic_write_bytes
from rosetta.interop.convert import convert

ROUNDS = 7  # the default: issue 47 asks for at least 7 interleaved rounds
MAX_ROUNDS = 100  # ~10 s a round at base size on 2 cores: a quarter of an hour
# The float64 reference's beam search (numpy_ref, uncached: it recomputes every prefix) over the first
# REFERENCE_ROWS sentences only: over the whole batch of a base-sized model it would take longer than
# the benchmark. Each sentence's search is independent of the others in the batch.
REFERENCE_ROWS = 4


MODEL_NAMES = {"marian": "Marian", "m2m100": "M2M100"}


def ct2_vocabulary(directory: Path) -> list[str]:
    """The tokens of a CTranslate2 model directory, in id order (one vocabulary for both sides)."""
    for name in ("shared_vocabulary.json", "vocabulary.json"):
        if (directory / name).is_file():
            return json.loads((directory / name).read_text(encoding="utf-8"))  # a list: not read_json's
    raise FileNotFoundError(f"{directory}: no shared vocabulary")


class Engines:
    """Each engine in a process of its own, as users run it (`_engine`), started with the spawn method
    (nothing inherited from this process's libraries), stopped on every way out. In one process,
    CTranslate2's OpenMP runtime and PyTorch's met: on this project's 2-core Xeon PyTorch's beam search
    of the base model took 2.2-3.6 s a call after CTranslate2 had translated in its process, against
    1.7-2.0 s alone (JAX's moved within its spread), and CTranslate2's threads kept spinning through a
    later PyTorch loop, doubling its CPU time (docs/benchmarks.md)."""

    def __init__(self, names: list[str], job: dict):
        self.names, self.job, self.conns, self.procs, self.pids = names, job, {}, [], {}

    def __enter__(self) -> Engines:
        spawn = multiprocessing.get_context("spawn")
        try:
            for name in self.names:
                mine, theirs = spawn.Pipe()
                proc = spawn.Process(target=_engine, args=(theirs, name, self.job), daemon=True)
                proc.start()
                self.procs.append(proc)
                self.conns[name] = mine
                self.pids[name] = self._receive(name)  # ready: its pid, once the engine is loaded
        except BaseException:
            self.__exit__()
            raise
        return self

    def _receive(self, name: str):
        try:
            return self.conns[name].recv()
        except EOFError:
            raise RuntimeError(f"decode_ct2: {name}'s process ended (its error is above)") from None

    def decode(self, name: str, beam_size: int) -> tuple[float, list[list[int]]]:
        """`name`'s decoding of the job's batch: the seconds its process timed and the tokens."""
        self.conns[name].send(beam_size)
        return self._receive(name)

    def __exit__(self, *exc) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _engine(conn, name: str, job: dict) -> None:
    """One engine's process: loads `name` ("torch", "jax", "ctranslate2 float32|int8") on the job's
    threads, sends its pid, then decodes the batch for each beam size received until None, sending the
    seconds of that call alone and the tokens."""
    threads, tgt_len = job["threads"], job["tgt_len"]
    if name in ("torch", "jax"):
        if name == "torch":
            import torch

            torch.set_num_threads(threads)
        model = load(job["checkpoint"], name, "float32")

        def decode(beam_size: int) -> list[list[int]]:
            return model.generate(job["src"], beam_size, 1.0, tgt_len, "hf", max_new_tokens=tgt_len,
                                  **job["forced"]).tokens
    else:
        import ctranslate2

        translator = ctranslate2.Translator(job["ct2"], device="cpu", compute_type=name.split()[1],
                                            intra_threads=threads, inter_threads=1)
        ids = {piece: i for i, piece in enumerate(job["pieces"])}

        def decode(beam_size: int) -> list[list[int]]:
            results = translator.translate_batch(job["src_tokens"], beam_size=beam_size,
                                                 max_decoding_length=tgt_len, **job["options"])
            return [[ids[t] for t in r.hypotheses[0]] for r in results]

    conn.send(os.getpid())
    while (beam_size := conn.recv()) is not None:
        start = time.perf_counter()
        tokens = decode(beam_size)
        seconds = time.perf_counter() - start
        conn.send((seconds, [[int(i) for i in row] for row in tokens]))


def run(quick: bool = False, rounds: int = ROUNDS, threads: int = 2, batch: int = 32, src_len: int = 24,
        tgt_len: int = 24, beam: int = 4, model: str = "marian") -> dict:
    """The benchmark: each engine on `threads` threads in a process of its own (`_engine`)."""
    return _run(quick, rounds, threads, batch, src_len, tgt_len, beam, model)


def _run(quick: bool, rounds: int, threads: int, batch: int, src_len: int, tgt_len: int, beam: int,
         model: str) -> dict:
    if quick:
        rounds, batch, src_len, tgt_len = 1, 4, 8, 8
    work = Path(tempfile.mkdtemp(prefix="decode-ct2-"))
    try:  # the two model directories (hundreds of MB at base size) go on every way out
        return _measure(work, quick, rounds, threads, batch, src_len, tgt_len, beam, model)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path, quick: bool, rounds: int, threads: int, batch: int, src_len: int, tgt_len: int,
             beam: int, model: str) -> dict:
    # The one difference between the models: how each is built, and what every engine is told
    # alike (M2M100: the source and target language codes; decode_ct2_models.py).
    built = build(model, quick, work / model)
    cfg, params = built.cfg, built.params
    convert(built.directory, work / "ct2", to_format="ctranslate2")
    pieces = ct2_vocabulary(work / "ct2")  # CTranslate2's tokens, by our ids
    rng = np.random.default_rng(0)
    first = np.tile(np.array(built.src_first, dtype=np.int64), (batch, 1))
    src = np.concatenate([first, rng.integers(*built.words, (batch, src_len - 1 - first.shape[1])),
                          np.full((batch, 1), cfg.eos_id)], axis=1)
    src_tokens = [[pieces[i] for i in row] for row in src]
    options = {**built.ct2_options, **({"target_prefix": [[built.prefix]] * batch} if built.prefix else {})}
    forced = {} if built.forced_first is None else {"forced_first": built.forced_first}

    save_checkpoint(work / "model.safetensors", cfg, params)
    job = {"checkpoint": str(work / "model.safetensors"), "ct2": str(work / "ct2"), "threads": threads,
           "src": src, "src_tokens": src_tokens, "pieces": pieces, "tgt_len": tgt_len, "options": options,
           "forced": forced}
    names = ["torch", "jax", "ctranslate2 float32", "ctranslate2 int8"]
    with Engines(names, job) as engines:
        greedy = {name: engines.decode(name, 1)[1] for name in names}
        reference = greedy["torch"]
        same = {name: float(np.mean([a == b for a, b in zip(out, reference, strict=True)]))
                for name, out in greedy.items()}
        # The float64 reference's beam search, once and untimed: the tokens each engine's beam must give.
        oracle = from_params(cfg, params, "numpy", "float64")
        exact = oracle.generate(src[:REFERENCE_ROWS], beam, 1.0, tgt_len, "hf", max_new_tokens=tgt_len,
                                **forced).tokens
        beam_same = {}
        for name in names:  # also the warm-up: JAX compiles the beam search for this shape
            out = engines.decode(name, beam)[1][:REFERENCE_ROWS]
            beam_same[name] = float(np.mean([a == b for a, b in zip(out, exact, strict=True)]))
        times: dict[str, list[float]] = {name: [] for name in names}
        tokens: dict[str, int] = {}
        for _ in range(rounds):
            for name in names:
                seconds, out = engines.decode(name, beam)
                times[name].append(seconds)
                tokens[name] = sum(len(t) for t in out)
        pids = engines.pids
    ct2 = "ctranslate2 float32"
    rows = []
    for name in names:
        speeds = [tokens[name] / s for s in times[name]]
        # Each round's ratio against CTranslate2 float32 in the same round (the rounds interleave).
        ratios = [(tokens[name] / s) / (tokens[ct2] / c)
                  for s, c in zip(times[name], times[ct2], strict=True)]
        median = statistics.median(times[name])
        rows.append({"engine": name, "tokens": tokens[name], "median_s": median, "min_s": min(times[name]),
                     "max_s": max(times[name]), "tokens_per_s": tokens[name] / median,
                     "tokens_per_s_min": min(speeds), "tokens_per_s_max": max(speeds),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "ratio_range_covers_1": min(ratios) <= 1.0 <= max(ratios),
                     "greedy_same_as_torch": same[name], "beam_same_as_float64": beam_same[name]})
    ct2_speed = next(r for r in rows if r["engine"] == ct2)["tokens_per_s"]
    for row in rows:  # the ratio of the medians (the figure a claim quotes); its range is above
        row["ratio_vs_ct2_float32"] = row["tokens_per_s"] / ct2_speed
    settings = {"model": model, "target_prefix": built.prefix, "config": cfg.to_dict(),
                "batch": batch, "src_len": src_len, "tgt_len": tgt_len, "beam": beam,
                "threads": threads, "rounds": rounds, "search": f"cached beam, length_rule hf, {built.eos}",
                "reference_rows": min(REFERENCE_ROWS, batch), "processes": pids}
    return {"settings": settings, "rows": rows}


def markdown(result: dict, env: dict) -> str:
    s = result["settings"]
    lines = [f"# Decoding against CTranslate2, {env['date']} (commit {env['commit']}, {env['processor']}, "
             f"torch {env.get('torch')}, jax {env.get('jax')}, ctranslate2 {env.get('ctranslate2')})", "",
             f"{MODEL_NAMES[s.get('model', 'marian')]} d_model {s['config']['d_model']}, "
             f"{s['config']['num_encoder_layers']} + "
             f"{s['config']['num_decoder_layers']} layers, vocabulary {s['config']['tgt_vocab_size']}; batch "
             f"{s['batch']} x source {s['src_len']}, exactly {s['tgt_len']} target tokens a sentence, beam "
             f"{s['beam']}, {s['threads']} threads, median of {s['rounds']} interleaved rounds", "",
             "| engine | target tokens/s, median | spread (slowest-fastest round) | × CTranslate2 float32 "
             f"| ratio's range over rounds | median s | greedy tokens = torch | beam tokens = float64 "
             f"(first {s['reference_rows']} sentences) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_min']:.0f}-"
                     f"{r['tokens_per_s_max']:.0f} | {r['ratio_vs_ct2_float32']:.2f} | {r['ratio_min']:.2f}-"
                     f"{r['ratio_max']:.2f} | {r['median_s']:.3f} | {100 * r['greedy_same_as_torch']:.0f}% | "
                     f"{100 * r['beam_same_as_float64']:.0f}% |")
    lines.append("")
    for r in result["rows"]:
        if r["engine"] != "ctranslate2 float32" and r["ratio_range_covers_1"]:
            lines.append(f"- {r['engine']}: the ratio's range over rounds ({r['ratio_min']:.2f}-"
                         f"{r['ratio_max']:.2f}) covers 1.0: this run cannot tell it from CTranslate2 "
                         "float32's speed.")
    return "\n".join(lines) + "\n"


def measured(quick: bool, rounds: int, threads: int, model: str = "marian") -> dict:
    """One run at the ISA in force: its environment (machine block included) and result."""
    import ctranslate2

    env = {**environment(), "ctranslate2": ctranslate2.__version__}
    return {"environment": env, **run(quick, rounds, threads, model=model)}


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--quick", action="store_true", help="a small model, one round (nothing written)")
    cli.add_argument("--rounds", type=integer_type(1, MAX_ROUNDS), default=None,
                     help=f"interleaved rounds (default {ROUNDS}, at most {MAX_ROUNDS}; --quick runs one)")
    cores = os.cpu_count() or 1
    cli.add_argument("--threads", type=integer_type(1, cores), default=min(2, cores),
                     help="PyTorch's, CTranslate2's and XLA's threads (default 2; at most this machine's "
                          f"{os.cpu_count()} cores)")
    cli.add_argument("--model", choices=MODELS, default="marian",
                     help="the model's shape: opus-mt's Marian (default) or M2M100's, its target language "
                          "code forced first (benchmarks/decode_ct2_models.py)")
    cli.add_argument("--out-dir", type=given_path, default=RESULTS)
    cli.add_argument("--no-write", action="store_true", help="print only")
    cli.add_isa(both=True)
    args = cli.parse_args(argv)
    if args.quick and args.rounds is not None:
        cli.error("argument --rounds: --quick runs one round of a small model; leave out one of the two")
    model = "" if args.model == "marian" else f"_{args.model}"  # Marian's: the name it always had
    name = f"decode_ct2{model}_cpu_{dt.date.today().isoformat()}"
    if not args.no_write and not args.quick and not args.part:  # before the minutes of measuring
        cli.check_out_dir(args.out_dir, [f"{name}.json", f"{name}.md"])
    rounds = 1 if args.quick else args.rounds or ROUNDS
    if args.isa == "both":  # each ISA in a process of its own (a library reads its cap when it starts)
        parts = cli.run_isas(argv)
        env = parts["native"]["environment"]
        text = isa_sections(parts, lambda part: markdown(part, part["environment"]))
        payload = {"environment": env, "isas": parts}
    else:
        cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
        payload = measured(args.quick, rounds, args.threads, args.model)
        if args.part:  # a part of --isa both: the parent writes
            atomic_write_bytes(args.part, json.dumps(payload).encode())
            return
        text = with_machine(markdown(payload, payload["environment"]), payload["environment"])
    print(text)
    if not args.no_write and not args.quick:
        paths = write_results(name, payload, text, args.out_dir)
        print("wrote", *paths)


if __name__ == "__main__":
    main()
