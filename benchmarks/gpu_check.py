"""The GPU path checked in one command: one line per check, PASS or FAIL, a non-zero exit if any
fails, and a results file (runs/benchmarks/gpu-check_<device>_<date>.{json,md}: a user's run,
benchmarks/common.py USER_RESULTS; `--out-dir` elsewhere).

    python -m benchmarks.gpu_check                          # a GPU: `base`, at most 5 minutes
    python -m benchmarks.gpu_check --preset tiny            # a CPU: the same checks, in the suite

What it checks, each against an independent reference (the float64 NumPy model, a formula):
- parity: every backend and dtype's logits against float64 (float32 <= 1e-6 with TF32 off and
  `highest` precision, the trainers' parity mode; bfloat16 <= 3e-2);
- training: one step of every training path, bucketed and packed, plain and chunked loss, PyTorch
  eager, PyTorch compiled (bucketed plain and packed chunked: each setting compiled once, a graph
  costs ~35 s on a 2-core CPU) and JAX, through the trainers `rosetta train` builds: each step's
  loss within a float32 bound of the float64 reference loss of the same batch and weights, so the
  frameworks' losses agree with each other; and three steps of PyTorch compiled against eager;
- attention: the fused path (SDPA; jax.nn.dot_product_attention, cuDNN on a GPU) against the
  float64 formula, with a row whose keys are all masked (SPEC §2: uniform weights);
- decoding: PyTorch's compiled search (CUDA graphs on a GPU) gives the eager search's tokens, and
  cached greedy and beam-4 tokens are equal across PyTorch and JAX in float32;
- the harness: 20 `rosetta train` steps per framework, with their tokens/s and MFU, beside the same
  trainer's steps timed by the benchmark (the loop's median step over the benchmark's).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch runs in this process too

from benchmarks.common import USER_RESULTS, environment, parser, write_results
from numpy_ref import model as reference
from rosetta import init_params, preset
from rosetta.backends import from_params, get_backend, get_trainer
from rosetta.cli_args import positive_int, positive_real
from rosetta.config import PRESETS, ModelConfig
from rosetta.device import check_device
from rosetta.harness.batching import BatchIterator
from rosetta.harness.loop import train
from rosetta.harness.run_config import RunConfig
from rosetta.harness.tasks import load_task
from rosetta.parity import TOLERANCES, parity_report, random_batch
from rosetta.training import Batch, TrainConfig, Trainer

# The issue's bounds for parity on a GPU (rosetta.parity.TOLERANCES allows float32 1e-5 anywhere).
PARITY = {"float32": 1e-6, "bfloat16": 3e-2, "float16": 1e-2, "float64": 1e-12}
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
TRAIN = TrainConfig(warmup_steps=4000)  # the paper's schedule: step 1's lr is tiny, as in a real run
F_GRAD = TOLERANCES[("torch", "float32")]  # a float32 gradient against float64, relative (rosetta/parity.py)
U32 = 2.0**-24  # float32's unit roundoff
GROUPS = ("parity", "train", "attention", "decode", "harness")  # the checks, in the order they run


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'} {self.name}: {self.detail} ({self.seconds:.1f} s)"


def timed(checks: list[Check], name: str, fn: Callable[[], tuple[bool, str]]) -> None:
    """Run one check, print its line; an exception fails it (naming the exception), nothing stops."""
    start = time.perf_counter()
    try:
        passed, detail = fn()
    except Exception as e:  # noqa: BLE001 - a broken path is a failed check, reported in one line
        passed, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    checks.append(Check(name, passed, detail, time.perf_counter() - start))
    print(checks[-1].line(), flush=True)


# -- parity ----------------------------------------------------------------------------------

def parity_checks(checks: list[Check], cfg: ModelConfig, params: dict) -> None:
    rows = parity_report(cfg, params, ["torch", "jax"])
    for row in rows:
        bound = PARITY[row.dtype]
        timed(checks, f"parity {row.backend} {row.dtype}", lambda r=row, b=bound: (
            r.finite and r.relative_error <= b, f"relative error {r.relative_error:.2e} (bound {b:.0e})"))


# -- training ---------------------------------------------------------------------------------

def batches(cfg: ModelConfig, length: int, rows: int) -> dict[str, Batch]:
    """A bucketed and a packed batch the harness builds from the copy task's pairs."""
    pairs = load_task("copy", vocab_size=min(cfg.src_vocab_size, cfg.tgt_vocab_size),
                      synthetic_max_len=length // 2).train_pairs
    made = {}
    for name, packing in (("bucketed", False), ("packed", True)):
        iterator = BatchIterator.from_config(pairs, cfg, max_tokens=rows * length, buckets=(length,),
                                             packing=packing)
        made[name] = next(iterator)
    return made


def reference_loss(cfg: ModelConfig, params: dict, batch: Batch, eps: float) -> tuple[float, float, float]:
    """SPEC §4's loss of `batch` in float64 NumPy (numpy_ref), and ||z||_2, the logits' norm over
    the labelled positions: a logit error of relative size F moves the mean loss by at most 2 F
    ||z||_2 (the cross entropy's gradient in the logits has L1 norm <= 2 per position); third, the
    norm of the logits as the model gives them (before the softmax's shift): what F is relative to."""
    p64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    z = reference.forward(p64, cfg, batch.src, batch.tgt_in, packing=batch.packing())
    labelled = batch.labels != cfg.pad_id
    raw = float(np.linalg.norm(z[labelled]))
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    y = batch.labels[labelled]
    rows = logp[labelled]
    per = (1 - eps) * -rows[np.arange(len(y)), y] + eps * -rows.mean(axis=-1)
    return float(per.sum() / max(len(y), 1)), float(np.linalg.norm(z[labelled])), raw


def adam_weights(t: int, b1: float, b2: float) -> tuple[list[float], list[float]]:
    """Update t's bias-corrected moments as weighted sums of the gradients g_1..g_t (Kingma & Ba
    alg. 1): m̂_t = Σ a_k g_k, v̂_t = Σ c_k g_k²."""
    a = [(1 - b1) * b1 ** (t - k) / (1 - b1**t) for k in range(1, t + 1)]
    c = [(1 - b2) * b2 ** (t - k) / (1 - b2**t) for k in range(1, t + 1)]
    return a, c


def adam_ratio(t: int, b1: float, b2: float) -> float:
    """sup |m̂_t| / sqrt(v̂_t) over gradients: Adam's largest step at update t in units of lr (eps
    aside). Cauchy-Schwarz on m̂_t = Σ a_k g_k, v̂_t = Σ c_k g_k² gives sqrt(Σ a_k² / c_k)."""
    a, c = adam_weights(t, b1, b2)
    return math.sqrt(sum(x * x / y for x, y in zip(a, c, strict=True)))


class RoundingDrift:
    """How far, weight by weight, two float32 runs of the same function (compiled and eager: the
    float64 test, parity_tests/test_compiled_drift.py, shows they are) may be apart after each
    update (Adam, §5.3; Kingma & Ba alg. 1), from eager's own gradients. Update r, per run: the
    gradient within F_GRAD·‖g_r‖ of float64's (rosetta/parity.py; a norm bounds every entry), so
    the runs' entries differ by at most δ_r = 2 F_GRAD ‖g_r‖. Then |Δm̂| <= A = Σ a_k δ_k and
    |Δ√v̂| <= B = sqrt(Σ c_k δ_k²) (the triangle inequality in v̂'s weighted norm), and with
    u = m̂ / (√v̂ + ε) eager's step, the other's u' = m̂' / (√v̂' + ε) differs by
    |Δm̂ / (√v̂' + ε) + u (√v̂' - √v̂) / (√v̂' + ε)| <= (A + |u| B) / (max(√v̂ - B, 0) + ε):
    small where |g| is well above δ, and never more than |u| + R_r (R_r: adam_ratio, the most any
    step can be; a gradient within δ of zero can flip its sign, which the bound before issue 48
    took for every weight). Each run's optimizer rounds ~10 times an update (the moments, their
    corrections, the root, ε, the quotient, lr, the subtraction) and its stored moments carry the
    earlier updates': 10 r u of the step, and u of the weight.
    Left out, as in the float64 bound that holds: the curvature's feedback (weights apart give the
    next gradients apart), second order in lr. It is small at the start of eq. 3's warm-up, where
    gpu_check steps (TRAIN: lr <= 7e-6 over 10 steps at `tiny`; on an AMD EPYC the weights that do
    not flip ended within 2% of their bound, the key biases, pure rounding flipped, within 37%),
    not at rates 8,000 to 30,000 times larger (warmup 4: 78% after 10 steps): this bound is for
    the first steps of a warm-up."""

    def __init__(self, train_cfg: TrainConfig, params: dict) -> None:
        self.train_cfg, self.deltas = train_cfg, []
        zero = {k: np.zeros(np.shape(v)) for k, v in params.items()}
        self.m, self.v, self.apart = dict(zero), dict(zero), dict(zero)

    def loss(self, grads: dict) -> float:
        """The next loss's part (first order: Σ |∂L/∂w| · how far w may be apart)."""
        return sum(float((np.abs(g) * self.apart[k]).sum()) for k, g in grads.items())

    def update(self, grads: dict, lr: float, weights: dict) -> None:
        tc, t = self.train_cfg, len(self.deltas) + 1
        b1, b2, eps = tc.adam_b1, tc.adam_b2, tc.adam_eps
        self.deltas.append(2 * F_GRAD * math.sqrt(sum(float((g.astype(np.float64) ** 2).sum())
                                                     for g in grads.values())))
        a, c = adam_weights(t, b1, b2)
        shift = sum(x * d for x, d in zip(a, self.deltas, strict=True))
        root = math.sqrt(sum(y * d * d for y, d in zip(c, self.deltas, strict=True)))
        ratio = adam_ratio(t, b1, b2)
        for k, g in grads.items():
            g = g.astype(np.float64)
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            s = np.sqrt(self.v[k] / (1 - b2**t))
            u = np.abs(self.m[k] / (1 - b1**t) / (s + eps))
            moved = np.minimum(u + ratio, (shift + u * root) / (np.maximum(s - root, 0) + eps))
            self.apart[k] = self.apart[k] + lr * moved + 2 * U32 * (np.abs(weights[k]) + 10 * t * lr * u)


def training_checks(checks: list[Check], cfg: ModelConfig, params: dict, device: str, length: int,
                    rows: int) -> None:
    made = batches(cfg, length, rows)
    tol = PARITY["float32"]
    paths = [(fw, batching, loss) for fw in ("torch", "jax") for batching in made
             for loss in ("plain", "chunked")]
    paths += [("torch.compile", "bucketed", "plain"), ("torch.compile", "packed", "chunked")]
    references = {name: reference_loss(cfg, params, batch, TRAIN.label_smoothing)
                  for name, batch in made.items()}
    losses: dict[tuple[str, str], list[float]] = {}
    for framework, batching, loss in paths:
        want, norm, _ = references[batching]
        bound = 2 * tol * norm

        def one(framework=framework, batching=batching, loss=loss, want=want, bound=bound):
            trainer = get_trainer(framework.split(".")[0])(
                cfg, params, TRAIN, device=None if framework == "jax" else device, loss=loss,
                compile=framework == "torch.compile", parity=True)
            got = trainer.read(trainer.step(made[batching]))["loss"]
            losses.setdefault((batching, loss), []).append(got)
            diff = abs(got - want)
            return diff <= bound, (f"loss {got:.7f}, float64 {want:.7f}, |diff| {diff:.1e} "
                                   f"(bound 2·{tol:.0e}·||z|| = {bound:.1e})")

        timed(checks, f"train {framework} {batching} {loss}", one)
    # Each loss within 2 F ||z|| of the same float64 loss: any two within twice that.
    timed(checks, "train: the frameworks' losses agree", lambda: (
        all(max(v) - min(v) <= 4 * tol * references[key[0]][1] for key, v in losses.items()),
        "; ".join(f"{b} {loss}: spread {max(v) - min(v):.1e} over {len(v)}"
                  for (b, loss), v in losses.items())))
    timed(checks, "train torch.compile against eager, 3 steps",
          lambda: compiled_steps(cfg, params, device, made["bucketed"]))


def compiled_steps(cfg: ModelConfig, params: dict, device: str, batch: Batch, steps: int = 3,
                   train_cfg: TrainConfig = TRAIN, other: Trainer | None = None) -> tuple[bool, str]:
    """compiled_drift's steps in one line: PASS when every loss and the weights at the end are
    within their bounds."""
    rows, weights = compiled_drift(cfg, params, device, batch, steps, train_cfg, other)
    lines = [f"step {r['step']}: |diff| {r['diff']:.1e} (bound {r['bound']:.1e}, "
             f"{r['every_flip'] / r['bound']:.0f}x under every weight flipping)" for r in rows]
    within = all(r["diff"] <= r["bound"] for r in rows) and weights <= 1
    return within, "; ".join(lines) + f"; weights at most {weights:.2g} of their bound"


def compiled_drift(cfg: ModelConfig, params: dict, device: str, batch: Batch, steps: int = 3,
                   train_cfg: TrainConfig = TRAIN, other: Trainer | None = None) -> tuple[list[dict], float]:
    """`steps` updates, eager and compiled (or `other`, a trainer), from the same weights on the same
    batch (dropout off, no clipping). The float64 test shows the compiled graph is eager's function,
    so in float32 they differ by rounding only. The loss at step t, per run against float64 at the
    same weights: its gradient in position n's logits is (p_n - q_n)/N, ‖p_n - q_n‖ <= √2, so by
    Cauchy-Schwarz over the N positions |ΔL| <= √2 F ‖z‖ / √N (F: float32's parity bound, relative
    to the logits' norm ‖z‖), plus F·L for the loss's own arithmetic; twice that between the runs.
    Then the weights' difference (RoundingDrift) moves it by at most Σ |∂L/∂w| · apart(w). Returns
    per step {step, diff, bound, every_flip: the bound before issue 48, every weight a full 2 lr R
    apart}, and the weights' largest difference at the end over its bound."""
    eager = get_trainer("torch")(cfg, params, train_cfg, device=device, compile=False, parity=True)
    compiled = other if other is not None else get_trainer("torch")(
        cfg, params, train_cfg, device=device, compile=True, parity=True)
    count = math.sqrt(int((batch.labels != cfg.pad_id).sum()))
    drift, flips, rows, weights = RoundingDrift(train_cfg, params), 0.0, [], params
    old_rounding = 0.0
    for t in range(1, steps + 1):
        want, shifted, norm = reference_loss(cfg, weights, batch, train_cfg.label_smoothing)  # eager's
        old_rounding = old_rounding or 4 * PARITY["float32"] * shifted  # before issue 48: step 1's
        step = eager.step(batch, keep_grads=True)
        grads = step.pop("grads")
        a, b = eager.read(step), compiled.read(compiled.step(batch))
        rounding = 2 * PARITY["float32"] * (math.sqrt(2) * norm / count + abs(want))
        g1 = sum(float(np.abs(g).sum()) for g in grads.values())
        rows.append({"step": t, "diff": abs(a["loss"] - b["loss"]), "bound": rounding + drift.loss(grads),
                     "every_flip": old_rounding + g1 * flips})
        weights = eager.params()
        drift.update(grads, a["lr"], weights)
        flips += 2 * a["lr"] * adam_ratio(t, train_cfg.adam_b1, train_cfg.adam_b2)
    theirs = compiled.params()
    return rows, max(float((np.abs(weights[k].astype(np.float64) - theirs[k]) / drift.apart[k]).max())
                     for k in theirs)


# -- attention -----------------------------------------------------------------------------------

def attention_checks(checks: list[Check], device: str) -> None:
    import jax.numpy as jnp
    import torch

    from jax_impl.backend import parity_mode
    from jax_impl.ops import fused_attention
    from torch_impl.ops import attention as torch_attention

    rng = np.random.default_rng(0)
    B, h, T, dh = 2, 4, 16, 32
    q, k, v = (rng.standard_normal((B, h, T, dh)) for _ in range(3))
    mask = rng.random((B, 1, T, T)) > 0.3
    mask[0, 0, 3, :] = False  # a query whose keys are all masked: uniform weights (SPEC §2)
    scores = np.where(mask, q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh), np.finfo(np.float64).min)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ v  # (B, h, T, dh)
    want = want.transpose(0, 2, 1, 3)
    for dtype, bound in (("float32", 1e-5), ("bfloat16", 3e-2)):
        def run_torch(dtype=dtype):
            tdt = getattr(torch, dtype)
            args = [torch.tensor(x, dtype=tdt, device=device) for x in (q, k, v)]
            with torch.inference_mode():
                y, _ = torch_attention(*args, torch.tensor(mask, device=device), 0.0)
            return y.float().cpu().numpy()

        def run_jax(dtype=dtype):
            jdt = getattr(jnp, dtype)
            with parity_mode():  # float32 at full precision: TF32 by default on a GPU (3.8e-4 on an H200)
                y = fused_attention(*(jnp.asarray(x, jdt) for x in (q, k, v)), jnp.asarray(mask))
            return np.asarray(y.astype(jnp.float32))

        for name, fn in (("torch SDPA", run_torch), ("jax dot_product_attention", run_jax)):
            def compare(fn=fn, bound=bound):
                err = float(np.linalg.norm(fn() - want) / np.linalg.norm(want))
                return err <= bound, f"relative error {err:.1e} against float64 (bound {bound:.0e})"

            timed(checks, f"attention {name} {dtype}", compare)


# -- decoding -----------------------------------------------------------------------------------

def decoding_checks(checks: list[Check], cfg: ModelConfig, params: dict, device: str) -> None:
    src, _ = random_batch(cfg, 8, 12, 2, seed=3)
    margin = 8
    torch_model = get_backend("torch")
    torch_eager = torch_model(cfg, params, "float32", device=device, compile=False)
    torch_compiled = torch_model(cfg, params, "float32", device=device, compile=True)
    jax_model = from_params(cfg, params, "jax", "float32")
    for beam in (1, 4):
        search = "greedy" if beam == 1 else f"beam {beam}"
        eager = torch_eager.generate(src, beam, 0.6, margin)

        def compiled(eager=eager, beam=beam):
            got = torch_compiled.generate(src, beam, 0.6, margin)
            same = got.tokens == eager.tokens
            return same, f"{'the same' if same else 'different'} tokens for {len(src)} sentences"

        def across(eager=eager, beam=beam):
            other = jax_model.generate(src, beam, 0.6, margin)
            same = other.tokens == eager.tokens
            return same, f"PyTorch and JAX: {'the same' if same else 'different'} tokens"

        timed(checks, f"decode torch compiled {search}", compiled)
        timed(checks, f"decode torch = jax {search}", across)


# -- the harness ---------------------------------------------------------------------------------

def harness_checks(checks: list[Check], preset_name: str, device: str, dtype: str, max_tokens: int,
                   peak_tflops: float | None) -> None:
    for backend, settings in (("torch", {}), ("jax", {})):
        def one(backend=backend, settings=settings):
            run = RunConfig(backends=(backend,), task="copy", preset=preset_name, steps=20, log_every=5,
                            eval_every=0, checkpoint_every=0, eval_size=4, bleu_samples=4,
                            max_tokens=max_tokens,
                            dtype=dtype, device=device if backend == "torch" else None, progress=False,
                            warmup=4000, peak_tflops=peak_tflops, **settings)
            with tempfile.TemporaryDirectory() as out:
                result = train(replace(run, out=out))[backend]
            mfu = result["median_mfu"]
            finite = result["final_loss"] is not None and math.isfinite(result["final_loss"])
            return finite, (f"median step {result['median_step_time_s'] * 1e3:.1f} ms, "
                            f"{result['median_tgt_tokens_per_s']:,.0f} target tokens/s, MFU "
                            f"{'not known on this device' if mfu is None else format(mfu, '.1%')}, "
                            f"compiled {result['compiles']} programs in "
                            f"{result['compile_time_total_s']:.1f} s")

        timed(checks, f"harness {backend} 20 steps", one)


def main(argv: list[str] | None = None) -> int:
    cli = parser(__file__, __doc__)
    cli.add_argument("--preset", default="base", choices=sorted(PRESETS))
    cli.add_argument("--device", default=None,
                     help="torch's device: cpu, cuda or cuda:N (default: cuda if there is one, else cpu)")
    cli.add_out_dir(USER_RESULTS)
    cli.add_argument("--no-write", action="store_true", help="print the lines only")
    cli.add_argument("--seed", type=positive_int, default=1)
    cli.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS),
                     help="only these groups of checks (default: all; the results file names them)")
    cli.add_argument("--peak-tflops", type=positive_real, default=None,
                     help="the GPU's peak TFLOP/s in bfloat16, for the harness's MFU (default: "
                          "rosetta/flops.py's table of known GPUs)")
    args = cli.parse_args(argv)
    import torch

    with cli.refusing():  # the one device parser (rosetta/device.py), before anything is measured
        given = check_device(args.device, torch.cuda.device_count())
    device = given.torch if given else "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    env = environment()
    name = re.sub(r"[^a-z0-9]+", "-", (env.get("gpu") or "cpu").lower()).strip("-")
    # "gpu-check", not "gpu_": benchmarks/report.py takes gpu_*.json for the GPU suite's results.
    name = f"gpu-check_{name}_{dt.date.today().isoformat()}"
    if not args.no_write:  # the files, refused before any check runs
        cli.check_out_dir(args.out_dir, [f"{name}.json", f"{name}.md"])
    cfg = preset(args.preset, **NO_DROPOUT)
    params = init_params(cfg, seed=args.seed)
    gpu = device.startswith("cuda")
    length, rows = (64, 64) if gpu else (24, 16)
    checks: list[Check] = []
    groups = {
        "parity": lambda: parity_checks(checks, cfg, params),
        "train": lambda: training_checks(checks, cfg, params, device, length, rows),
        "attention": lambda: attention_checks(checks, device),
        "decode": lambda: decoding_checks(checks, cfg, params, device),
        "harness": lambda: harness_checks(checks, args.preset, device, "bfloat16" if gpu else "float32",
                                          25000 if gpu else 1024, args.peak_tflops),
    }
    for group in GROUPS:
        if group in args.only:
            groups[group]()
    failed = [c for c in checks if not c.passed]
    wall = time.perf_counter() - started
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed in {wall:.0f} s", flush=True)
    if not args.no_write:
        result = {"environment": env, "preset": args.preset, "device": device, "wall_s": wall,
                  "groups": [g for g in GROUPS if g in args.only],
                  "checks": [asdict(c) for c in checks], "passed": not failed}
        only = "" if set(args.only) == set(GROUPS) else f" (only {', '.join(result['groups'])})"
        text = (f"# GPU check: {args.preset} on {env.get('gpu') or env['processor']}{only}\n\n"
                f"{env['date']}, commit "
                f"{env['commit']}, torch {env.get('torch')}, jax {env.get('jax')}; {wall:.0f} s.\n\n"
                + "\n".join(f"- {c.line()}" for c in checks) + "\n")
        print("wrote", *write_results(name, result, text, args.out_dir))
        json.dumps(result)  # the results are JSON-able
    print(f"next: python -m benchmarks.profile_step --preset {args.preset}{'' if gpu else ' --device cpu'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
