"""The measured pitfalls page (issue 13, item 5): what each porting mistake of the catalogue does
to the `base` model's output, and whether a typical parity test would notice.

For each mistake: the relative error ||logits_mistaken - logits_correct|| / ||logits_correct||
at contract positions (rosetta.parity), the largest absolute difference, the first stage where
the relative error exceeds 1e-5, and the same error when the mistaken port runs in float32 and
in bfloat16, against the float64 correct reference -- what a port's parity test compares -- with
the verdict of that dtype's tolerance (rosetta.parity.TOLERANCES: 1e-5 float32, 3e-2 bfloat16).
For mistakes that are a config flip, also the effect on one gradient (PyTorch autograd, float64):
a mistake can hide under the logit tolerance and still steer training.

    python -m benchmarks.pitfalls            # measure, write benchmarks/results/pitfalls_<date>.*
    python -m benchmarks.pitfalls --docs     # re-render the block of docs/pitfalls.md only
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

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
from rosetta.config import ModelConfig, preset
from rosetta.params import init_params
from rosetta.parity import TOLERANCES, random_batch, relative_error, target_positions

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "pitfalls.md"
BEGIN, END = "<!-- pitfalls:begin -->", "<!-- pitfalls:end -->"
FIRST_STAGE_THRESHOLD = 1e-5  # "where does it start to show": float32's parity tolerance
TOL_F32, TOL_BF16 = TOLERANCES["torch", "float32"], TOLERANCES["torch", "bfloat16"]
# Source and target lengths differ so that kv_query_length can show.
SETTINGS = dict(preset="base", batch=2, src_len=16, tgt_len=15, seed=0, dropout=0.0, perturb=0.1)

Stages = dict[str, np.ndarray]
Params = dict[str, np.ndarray]
Build = Callable[[ModelConfig, Params], tuple[ModelConfig, Params]]
StagesFn = Callable[[ModelConfig, Params, np.ndarray, np.ndarray], Stages]


class Mistake(NamedTuple):
    """One entry: its name, PITFALLS number, what goes wrong; `stages(cfg, params, src, tgt)`,
    the float64 coarse stages of the mistaken model; `build(cfg, params)`, the mistaken model's
    config and weights when the mistake is expressible as those alone (then its gradient is
    measured with PyTorch), else None; `applies(cfg, src, tgt)` and `detect`, whether and on
    what kind of batch the mistake can show at all."""
    name: str
    pitfall: str
    what: str
    stages: StagesFn
    build: Build | None = None
    applies: Callable[[ModelConfig, np.ndarray, np.ndarray], bool] = lambda cfg, src, tgt: True
    detect: str = "any batch"


def reference_stages(cfg: ModelConfig, params: Mapping[str, np.ndarray], src: np.ndarray,
                     tgt: np.ndarray) -> Stages:
    """Coarse stages of the NumPy reference in forward order, computed in the weights' dtype."""
    import numpy_ref.model as ref
    stages: Stages = {}
    ref.forward(dict(params), cfg, src, tgt, stages)
    return stages


def _flip(name: str, pitfall: str, what: str, **changes) -> Mistake:
    """A config flip that needs no other weights (the test's list: no catalogue needed)."""
    def build(cfg: ModelConfig, params: Params) -> tuple[ModelConfig, Params]:
        return cfg.replace(**changes), params

    def stages(cfg, params, src, tgt):
        return reference_stages(*build(cfg, params), src, tgt)
    return Mistake(name, pitfall, what, stages, build,
                   lambda cfg, src, tgt: cfg.replace(**changes) != cfg)


FLIPS: list[Mistake] = [
    _flip("layer_norm_eps", "2", "LayerNorm epsilon 1e-6 (Flax's default) instead of 1e-5",
          layer_norm_eps=1e-6),
    _flip("positions_concat", "1", "positional table: all sines then all cosines (HF Marian)",
          positional_encoding="sinusoidal_concat"),
    _flip("pre_norm", "3", "pre-norm residuals instead of post-norm (no final norm)",
          norm_first=True, final_norm=False),
    _flip("no_embedding_scale", "8", "embeddings not multiplied by sqrt(d_model)", scale_embeddings=False),
]


def catalogue_mistakes() -> list[Mistake]:
    """Every entry of rosetta.diff.shared.catalogue. Its forward is the catalogue's own build (config,
    weights, switches) run by rosetta.diff.shared.variant in the dtype of the weights given (float64:
    exactly `mistaken_stages`); entries made of config and weights alone (no code switch) also
    carry `build`, for the PyTorch gradient."""
    from rosetta.diff.shared.catalogue import CATALOGUE, build
    from rosetta.diff.shared.variant import forward_stages

    out = []
    for entry in CATALOGUE:
        def stages(cfg, params, src, tgt, _entry=entry):
            dtype = next(iter(params.values())).dtype
            cfg2, params2, switches = build([_entry], cfg, params)
            # A transform may add float64 tensors (identity final norms): keep one dtype.
            return forward_stages({k: np.asarray(v, dtype) for k, v in params2.items()}, cfg2, src, tgt,
                                  switches)

        def built(cfg, params, _entry=entry):
            cfg2, params2, _ = build([_entry], cfg, params)
            return cfg2, params2
        torch_able = entry.how in ("config", "weights") and not entry.switches
        out.append(Mistake(entry.name, "" if entry.pitfall is None else str(entry.pitfall), entry.wrong,
                           stages, built if torch_able else None, entry.applies, entry.detect))
    return out


def _where(cfg: ModelConfig, stage: str, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Contract positions of a stage: non-pad source positions for the encoder side, the
    target positions of rosetta.parity for the decoder side and the logits."""
    if stage == "src_embed" or stage.startswith("encoder"):
        return src != cfg.pad_id
    return target_positions(cfg, tgt)


def _rel(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float | None:
    """relative_error, or None where the mistake makes the output non-finite (NaN rows)."""
    err = relative_error(a, b, where)
    return err if np.isfinite(err) else None


def first_over(cfg: ModelConfig, ours: Stages, reference: Stages, src: np.ndarray, tgt: np.ndarray,
               threshold: float = FIRST_STAGE_THRESHOLD) -> str | None:
    """The first stage, in the reference's forward order, whose relative error exceeds `threshold`."""
    for stage, want in reference.items():
        if stage in ours:
            err = _rel(ours[stage], want, _where(cfg, stage, src, tgt))
            if err is None or err > threshold:
                return stage
    return None


def rounded(params: Mapping[str, np.ndarray], dtype: str) -> Params:
    """The weights for a forward in `dtype`: float64 and float32 as such (NumPy computes in the
    weights' dtype); bfloat16 as float32 arrays holding bfloat16-rounded values (round to
    nearest even, through PyTorch: NumPy has no bfloat16), so the arithmetic is float32."""
    if dtype in ("float64", "float32"):
        return {k: np.asarray(v, dtype) for k, v in params.items()}
    import torch
    return {k: torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16).float().numpy()
            for k, v in params.items()}


def perturbed(params: Mapping[str, np.ndarray], scale: float, seed: int) -> Params:
    """init_params with every LayerNorm scale and every bias moved off its initial constant
    (scale 1 + N(0, scale²), bias N(0, (scale/5)²)), as training leaves them: at exactly 1 and 0
    a mistake in how they are read (one scalar per LayerNorm) cannot show."""
    rng = np.random.default_rng(seed)
    out = dict(params)
    for name, value in params.items():
        if name.endswith("norm.scale"):
            out[name] = (value + scale * rng.standard_normal(value.shape)).astype(value.dtype)
        elif name.endswith("bias"):
            out[name] = (value + scale / 5 * rng.standard_normal(value.shape)).astype(value.dtype)
    return out


def loss_gradient(cfg: ModelConfig, params: Mapping[str, np.ndarray], src: np.ndarray, tgt: np.ndarray,
                  labels: np.ndarray, tensor: str) -> np.ndarray:
    """d(cross-entropy)/d(tensor) at the contract's target positions: PyTorch float64 autograd,
    the model in eval mode (dropout off: PITFALLS 10)."""
    import torch

    from torch_impl.backend import Model
    from torch_impl.convert import torch_name

    module = Model(cfg, params, "float64", device="cpu").module
    with torch.enable_grad():
        logits = module(torch.from_numpy(src), torch.from_numpy(tgt))
        where = torch.from_numpy(target_positions(cfg, tgt))
        loss = torch.nn.functional.cross_entropy(logits[where], torch.from_numpy(labels)[where])
        weight = module.get_parameter(torch_name(tensor)[0])
        return torch.autograd.grad(loss, weight)[0].numpy()


def measure(cfg: ModelConfig, params: Mapping[str, np.ndarray], src: np.ndarray, tgt: np.ndarray,
            mistakes: list[Mistake], gradient: bool = True) -> list[dict]:
    """One row per mistake that this batch can show (and a first row, `none`, for the correct
    model itself: the rounding floor every other row's error sits on). A mistake the batch
    cannot show gets a row with `shown` False and its `detect` requirement."""
    weights = {dtype: rounded(params, dtype) for dtype in ("float64", "float32", "bfloat16")}
    none = Mistake("none", "", "the correct model (the rounding floor)", reference_stages)
    reference = reference_stages(cfg, weights["float64"], src, tgt)
    where, want = target_positions(cfg, tgt), reference["logits"]
    labels = random_batch(cfg, src.shape[0], 1, tgt.shape[1] + 1, seed=99, pad=False)[1][:, 1:]
    tensor = f"decoder.layers.{cfg.num_decoder_layers - 1}.ffn_norm.scale"
    correct_grad = None
    rows = []
    for m in [none] + mistakes:
        if not m.applies(cfg, src, tgt):
            # Why not: the model already follows that convention, or the batch lacks what it needs.
            already = m.build is not None and m.build(cfg, dict(params))[0] == cfg
            rows.append(dict(name=m.name, pitfall=m.pitfall, what=m.what, shown=False, detect=m.detect,
                             why="the model already does this" if already else f"needs {m.detect}"))
            continue
        started = time.perf_counter()
        ours = {dtype: m.stages(cfg, p, src, tgt) for dtype, p in weights.items()}
        rel = {dtype: _rel(s["logits"], want, where) for dtype, s in ours.items()}
        diff = np.abs(ours["float64"]["logits"] - want)[where]
        row = dict(
            name=m.name, pitfall=m.pitfall, what=m.what, shown=True, detect=m.detect,
            rel_float64=rel["float64"],
            max_abs_float64=float(diff.max()) if np.isfinite(diff).all() else None,
            first_stage=first_over(cfg, ours["float64"], reference, src, tgt),
            rel_float32=rel["float32"], rel_bfloat16=rel["bfloat16"],
            # Non-finite logits fail any test that looks; None (NaN) counts as caught.
            noticed_float32=rel["float32"] is None or rel["float32"] > TOL_F32,
            noticed_bfloat16=rel["bfloat16"] is None or rel["bfloat16"] > TOL_BF16,
            grad_rel=None, grad_tensor=None,
        )
        if gradient and m.build is not None and m.name != "none":
            if correct_grad is None:
                correct_grad = loss_gradient(cfg, weights["float64"], src, tgt, labels, tensor)
            ours_grad = loss_gradient(*m.build(cfg, weights["float64"]), src, tgt, labels, tensor)
            row["grad_rel"], row["grad_tensor"] = relative_error(ours_grad, correct_grad), tensor
        row["seconds"] = round(time.perf_counter() - started, 2)
        rows.append(row)
    return rows


def run(settings: dict = SETTINGS, mistakes: list[Mistake] | None = None, gradient: bool = True) -> dict:
    """The measurement: the preset with random weights (rosetta.init_params) and one fixed random
    padded batch; results as the JSON payload."""
    started = time.perf_counter()
    cfg = preset(settings["preset"], dropout=settings["dropout"])
    params = perturbed(init_params(cfg, seed=settings["seed"]), settings["perturb"], settings["seed"])
    src, tgt = random_batch(cfg, settings["batch"], settings["src_len"], settings["tgt_len"],
                            seed=settings["seed"])
    rows = measure(cfg, params, src, tgt, catalogue_mistakes() if mistakes is None else mistakes, gradient)
    return dict(environment=environment(), settings=dict(settings), rows=rows,
                wall_s=round(time.perf_counter() - started, 1))


# -- rendering -----------------------------------------------------------------------------

def _e(x: float | None, nan: str = "NaN") -> str:
    return nan if x is None else f"{x:.1e}"


def _caught(r: dict, key: str) -> str:
    if r["name"] == "none":
        return "-"  # the correct model: its rounding, no verdict
    return "yes" if r[key] else "**no**"


def markdown(result: dict) -> str:
    """The page block's body: how it was measured, one table row per mistake the batch shows,
    then the mistakes it cannot show and why."""
    env, s = result["environment"], result["settings"]
    lines = [
        f"Measured {env['date']} on {env.get('machine')} ({env.get('processor')}), commit {env['commit']}, "
        f"numpy {env.get('numpy')}, torch {env.get('torch')}; the whole run took {result['wall_s']:.0f} s. "
        f"Model: preset `{s['preset']}` (dropout {s['dropout']}), random weights `rosetta.init_params(seed="
        f"{s['seed']})` with LayerNorm scales and biases moved off 1 and 0 as training would "
        f"(`benchmarks.pitfalls.perturbed`, {s['perturb']}); batch: `rosetta.parity.random_batch`, "
        f"{s['batch']} x {s['src_len']} source and "
        f"{s['batch']} x {s['tgt_len']} target ids, padded, seed {s['seed']}.",
        "",
        "How: every error is ||ours - reference|| / ||reference|| at the contract positions "
        "(`rosetta.parity`), the reference being the correct model in float64 (`numpy_ref`). "
        "*float64*: the mistake alone (the catalogue's mistaken model, "
        "`rosetta.diff.shared.catalogue.mistaken_stages`). *float32*: the same NumPy forward "
        "(`rosetta.diff.shared.variant`) with float32 weights and arithmetic, what a float32 port's parity "
        "test sees. *bfloat16*: that forward with the weights rounded to bfloat16 and float32 "
        "arithmetic (NumPy has no bfloat16, and the catalogue's code-level mistakes exist only in "
        "the NumPy variant; a real bfloat16 forward also rounds the activations, so its floor differs "
        f"from this page's `none` row). Caught: over the dtype's tolerance in `rosetta.parity.TOLERANCES` "
        f"({TOL_F32:.0e} float32, {TOL_BF16:.0e} bfloat16), or NaN. *first stage*: the first coarse "
        f"stage whose float64 relative error exceeds {FIRST_STAGE_THRESHOLD:.0e}. *gradient*: for "
        "mistakes made of config and weights alone, the relative error of the cross-entropy loss's "
        "gradient with respect to one LayerNorm scale (PyTorch autograd, float64, the batch's next "
        "tokens drawn at random). The first row is the correct model: the rounding floor under every "
        "other row.",
        "",
        "| mistake | PITFALLS | logits rel. error (float64) | max abs | first stage over 1e-5 | float32 "
        "rel. error | caught at 1e-5? | bfloat16 rel. error | caught at 3e-2? | gradient rel. error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in result["rows"] if r["shown"]):
        lines.append(
            f"| `{r['name']}`: {r['what']} | {r['pitfall'] or '-'} | {_e(r['rel_float64'])} | "
            f"{_e(r['max_abs_float64'])} | {r['first_stage'] or 'none'} | {_e(r['rel_float32'])} | "
            f"{_caught(r, 'noticed_float32')} | {_e(r['rel_bfloat16'])} | {_caught(r, 'noticed_bfloat16')} | "
            f"{_e(r['grad_rel'], nan='-')} |")
    tensor = next((r["grad_tensor"] for r in result["rows"] if r.get("grad_tensor")), None)
    if tensor:
        lines += ["", f"Gradient tensor: `{tensor}`."]
    hidden = [r for r in result["rows"] if not r["shown"]]
    if hidden:
        lines += ["", "Catalogue entries this model and batch cannot show:", ""]
        lines += [f"- `{r['name']}` ({r['why']}): {r['what']}" for r in hidden]
    return "\n".join(lines) + "\n"


def newest(results: Path = RESULTS) -> Path | None:
    return newest_results("pitfalls", results)


def load(path: Path) -> dict:
    return load_results(path, "benchmarks/pitfalls.py", ("environment", "settings", "rows", "wall_s"))


def page_block(results: Path = RESULTS) -> str:
    """What docs/pitfalls.md shows between its markers: the newest results, rendered."""
    return results_block("pitfalls", results, BEGIN, END, lambda path: markdown(load(path)),
                         "python -m benchmarks.pitfalls")


def update_page(page: Path = PAGE, results: Path = RESULTS) -> None:
    replace_block(page, BEGIN, END, page_block(results))


def main(argv: list[str] | None = None) -> None:
    cli = parser(__file__, __doc__.split("\n\n")[0])
    cli.add_argument("--docs", action="store_true", help="only re-render docs/pitfalls.md's block")
    cli.add_argument("--no-gradient", action="store_true", help="skip the PyTorch gradient column")
    args = cli.parse_args(argv)
    path = newest() if args.docs else None
    if args.docs and path is None:
        cli.error(f"no pitfalls_<date>.json in {RESULTS}: run `python -m benchmarks.pitfalls`")
    name = path.stem if path else f"pitfalls_{dt.date.today().isoformat()}"
    # What it writes, before it measures: the results, and the page's block.
    cli.check_out_dir(RESULTS, [f"{name}.json", f"{name}.md"], flag=None)
    cli.check_out_dir(PAGE.parent, [PAGE.name], flag=None)
    result = load(path) if path else run(gradient=not args.no_gradient)
    json_path, _ = write_results(name, result, "# Measured porting pitfalls\n\n" + markdown(result))
    print(f"wrote {json_path} and {json_path.with_suffix('.md')}")
    update_page()
    print(f"updated {PAGE}")


if __name__ == "__main__":
    main()
