"""Decoding speed: tokens per second of cached vs uncached greedy and beam search, per backend.

    python -m benchmarks.decode_speed                 # CPU, `small`-sized model, ~2 minutes
    python -m benchmarks.decode_speed --quick         # tiny model, one repeat (a smoke test)

Uncached search recomputes the whole prefix at every step (NumPy only has that mode: it is
the oracle). Every backend decodes the same batch with the same weights, and the searches are
identical, so every row emits the same tokens; tokens/s counts emitted tokens (eos included).
"""

from __future__ import annotations

import datetime as dt

import numpy as np

from benchmarks.common import RESULTS, environment, parser, time_it, with_machine, write_results
from rosetta import from_params, init_params, preset
from rosetta.cli_args import count
from rosetta.parity import random_batch


def run(quick: bool = False, repeats: int = 3) -> dict:
    if quick:
        cfg = preset("tiny", max_len=64)
        batch, src_len, margin, repeats = 4, 8, 8, 1
    else:  # `small` widths with a 2+2 stack: minutes, not hours, on 2 CPU cores
        cfg = preset("small", num_encoder_layers=2, num_decoder_layers=2, max_len=128)
        batch, src_len, margin = 8, 16, 24
    params = init_params(cfg, seed=0)
    src, _ = random_batch(cfg, batch, src_len, 2, seed=0, pad=False)
    rows = []
    for backend in ("numpy", "torch", "jax"):
        model = from_params(cfg, params, backend, "float32")
        for beam in (1, 4):
            for cache in ((False,) if backend == "numpy" else (True, False)):
                def decode(model=model, beam=beam, cache=cache, backend=backend):
                    if backend == "numpy":
                        return model.generate(src, beam, 0.6, margin)
                    return model._generate(src, beam, 0.6, margin, cache=cache)
                out = decode()
                tokens = sum(len(t) + 1 for t in out.tokens)  # + eos, or the forced last step
                timing = time_it(decode, repeats=repeats, warmup=0 if backend == "numpy" else 1)
                rows.append(dict(backend=backend, search="greedy" if beam == 1 else f"beam {beam}",
                                 cache=cache, tokens=tokens, sentences=batch,
                                 tokens_per_s=tokens / timing["median_s"], **timing))
    return dict(config=cfg.to_dict(), batch=batch, src_len=src_len, margin=margin, rows=rows)


def markdown(result: dict, env: dict) -> str:
    lines = [f"# Decoding speed, {env['date']} (commit {env['commit']}, {env['processor']}, "
             f"torch {env.get('torch')}, jax {env.get('jax')})", "",
             f"batch {result['batch']} x source {result['src_len']}, margin {result['margin']}, "
             f"d_model {result['config']['d_model']}, float32; median of repeats", "",
             "| backend | search | cache | tokens/s | median s | spread s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['backend']} | {r['search']} | {'yes' if r['cache'] else 'no'} | "
                     f"{r['tokens_per_s']:.0f} | {r['median_s']:.3f} | "
                     f"{r['min_s']:.3f}-{r['max_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__)
    cli.add_argument("--quick", action="store_true")
    cli.add_argument("--repeats", type=count, default=3)
    cli.add_argument("--no-write", action="store_true", help="print only")
    cli.add_isa()
    args = cli.parse_args(argv)
    cli.apply_isa(args, argv)  # --isa: the run again, every library capped (docs/benchmarks.md)
    name = f"decode_cpu_{dt.date.today().isoformat()}"
    if not args.no_write and not args.quick:  # benchmarks/results, before any measurement
        cli.check_out_dir(RESULTS, [f"{name}.json", f"{name}.md"], flag=None)
    env = environment()
    result = run(args.quick, args.repeats)
    text = with_machine(markdown(result, env), env)
    print(text)
    if not args.no_write and not args.quick:
        paths = write_results(name, {"environment": env, **result}, text)
        print("wrote", *paths)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
