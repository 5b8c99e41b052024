"""`rosetta diff` on 16-bit sides (issue 28): the logits' KL divergence and top-k agreement, and the
low-precision rule (docs/diff.md, "The logits as distributions").

Expected values come from elsewhere than rosetta.diff.shared.metrics: distributions and overlaps worked
out by hand here, PyTorch's own kl_div and log_softmax as a peer, Hoeffding's lemma for the bound
the rule rests on, and the float64 reference (numpy_ref) with a copy whose weights are changed here.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rosetta import init_params, preset
from rosetta.checkpoint import save_checkpoint
from rosetta.cli import main
from rosetta.diff.shared.metrics import (
    BFLOAT16_U,
    ROUNDINGS,
    kl_divergence,
    logit_metrics,
    low_precision_verdict,
    top_k_overlap,
)
from rosetta.parity import diagnostic_batch

# -- KL and top-k against hand-made examples and a peer ------------------------------------------


def test_kl_of_a_hand_made_pair():
    # p_b = (1/2, 1/4, 1/4), p_a = (1/4, 1/2, 1/4): KL(p_b || p_a) = 1/2 ln 2 - 1/4 ln 2 = ln(2) / 4.
    b = np.log([0.5, 0.25, 0.25])
    a = np.log([0.25, 0.5, 0.25]) + 7.0  # softmax ignores a shift of every logit
    assert kl_divergence(a, b) == pytest.approx(math.log(2) / 4, rel=1e-14)
    assert kl_divergence(b, a - 7.0) == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.5),
                                                      rel=1e-14)  # the other direction differs
    assert kl_divergence(b, b) == 0.0


def test_kl_matches_torch_kl_div_even_for_huge_logits():
    rng = np.random.default_rng(0)
    b = rng.normal(0, 3, size=(6, 50)) + np.array([0, 1e4, -1e4, 700, -700, 0])[:, None]  # exp overflows
    a = b + rng.normal(0, 0.1, size=b.shape)
    want = torch.nn.functional.kl_div(torch.log_softmax(torch.from_numpy(a), -1),
                                      torch.log_softmax(torch.from_numpy(b), -1),
                                      reduction="none", log_target=True).sum(-1).numpy()
    got = kl_divergence(a, b)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-15)


def test_top_k_overlap_of_hand_made_logits():
    b = np.array([7.0, 6, 5, 4, 3, 2, 1])  # top 5: tokens 0-4
    a = np.array([7.0, 6, 5, 4, 1, 2, 3])  # top 5: tokens 0-3 and 6
    assert top_k_overlap(a, b, 5) == pytest.approx(4 / 5)
    assert top_k_overlap(a, b, 1) == 1.0
    assert top_k_overlap(-b, b, 3) == 0.0  # reversed: {4, 5, 6} against {0, 1, 2}
    assert top_k_overlap(a[:3], b[:3], 5) == 1.0  # k cut to a 3-token vocabulary


def test_logit_metrics_count_only_the_contract_positions():
    cfg = preset("tiny")
    src, tgt = diagnostic_batch(cfg)
    rng = np.random.default_rng(1)
    b = rng.normal(size=(*tgt.shape, cfg.tgt_vocab_size))
    a = b.copy()
    counted = tgt != cfg.pad_id
    counted[:, 0] = True  # the start token always counts (SPEC §2)
    a[~counted] = rng.normal(size=a[~counted].shape) * 100  # padded positions: anything
    a[0, 1] = -b[0, 1]  # one counted position whose distribution is reversed
    m = logit_metrics(cfg.pad_id, src, tgt, a, b)
    assert m.positions == counted.sum()
    single = kl_divergence(a[0, 1], b[0, 1])
    assert m.kl_max == pytest.approx(single) and m.kl_mean == pytest.approx(single / counted.sum())
    assert m.top1 == pytest.approx(1 - 1 / counted.sum())
    assert m.top5 == pytest.approx(1 - 1 / counted.sum())  # reversed: no top-5 token in common
    a[0, 2, 0] = np.nan
    assert logit_metrics(cfg.pad_id, src, tgt, a, b) is None


# -- The rule's bound: KL <= delta^2 / 2 when no logit moves by more than delta -----------------

def test_hoeffding_bound_behind_the_kl_budget():
    """KL(p || softmax(z + e)) = log E_p[exp e] - E_p[e] <= (2 delta)^2 / 8 for |e| <= delta
    (Hoeffding's lemma): the budget delta^2 / 2, nearly reached by two equal tokens moved apart."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        z = rng.normal(0, rng.uniform(0.1, 10), size=rng.integers(2, 40))
        delta = rng.uniform(1e-4, 0.5)
        e = rng.choice([-delta, delta], size=z.shape) * rng.uniform(0, 1, size=z.shape) ** 0.1
        assert kl_divergence(z + e, z) <= delta ** 2 / 2 * (1 + 1e-12)
    delta = 0.01  # p = (1/2, 1/2), e = (+delta, -delta): KL = log cosh(delta) ~ delta^2/2 - delta^4/12
    assert kl_divergence(np.array([delta, -delta]), np.zeros(2)) == pytest.approx(math.log(math.cosh(delta)))


def test_verdict_excuses_near_ties_and_nothing_else():
    u, k = BFLOAT16_U, ROUNDINGS
    assert u == 1 / 256 and k * u == 1 / 32
    cfg = preset("tiny")
    tgt = np.array([[cfg.bos_id, 5]])
    src = np.array([[5]])
    b = np.zeros((1, 2, 4))
    b[0, :, :2] = [10.0, 10.0 - 0.5]  # delta = 10/32 = 0.3125: a margin of 0.5 is within 2 delta
    a = b.copy()
    a[0, 0, :2] = [9.8, 9.7]  # position 0: same argmax, each logit moved by <= delta
    a[0, 1, :2] = [9.76, 9.74]  # position 1: flipped? no, still token 0
    v = low_precision_verdict(cfg.pad_id, src, tgt, a, b)
    assert v.accepted and v.flips == v.near_ties == 0
    a[0, 1, :2] = [9.7, 9.8]  # a flip across a margin of 0.5 <= 2 delta: a near-tie
    v = low_precision_verdict(cfg.pad_id, src, tgt, a, b)
    assert (v.flips, v.near_ties) == (0, 1)
    b[0, 1, :2] = [10.0, 9.0]  # the same flip across a margin of 1 > 2 delta: a real flip
    v = low_precision_verdict(cfg.pad_id, src, tgt, a, b)
    assert (v.flips, v.accepted) == (1, False)


# -- rosetta diff on bfloat16 sides ----------------------------------------------------------------

def _perturbed(cfg, seed=1):
    rng = np.random.default_rng(seed)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed=0).items()}


# A small model and the tiny one; the `small` preset's widths with a short vocabulary keep it quick.
MODELS = {"tiny": preset("tiny"),
          "small_narrow_vocab": preset("small", src_vocab_size=1000, tgt_vocab_size=1000)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoints(request, tmp_path_factory):
    """The model, and two copies with a real mistake: every weight scaled by 1.1 (a converter
    that multiplied by a stray factor), and the output embedding scaled by 1.5 (a temperature)."""
    cfg = MODELS[request.param]
    params = _perturbed(cfg)
    folder = tmp_path_factory.mktemp(request.param)
    table = "shared_embed.embedding"
    assert table in params  # tied tables: scaling it scales the logits (and the inputs)
    return {"model": save_checkpoint(folder / "m.safetensors", cfg, params),
            "all_scaled": save_checkpoint(folder / "s.safetensors", cfg, {k: v * np.float32(1.1)
                                                                        for k, v in params.items()}),
            "table_scaled": save_checkpoint(folder / "t.safetensors", cfg,
                                            {**params, table: params[table] * np.float32(1.5)})}


def _diff(a, b, tmp_path, capsys):
    out = tmp_path / "d.json"
    code = main(["diff", a, b, "--json", str(out)])
    return code, capsys.readouterr().out, json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_bfloat16_side_passes_the_rule(checkpoints, backend, tmp_path, capsys):
    code, out, record = _diff(f"{checkpoints['model']}@{backend}:bfloat16", str(checkpoints["model"]),
                              tmp_path, capsys)
    lines = out.splitlines()
    metrics = next(line for line in lines if line.startswith("logits: KL mean"))
    assert lines.index(metrics) == lines.index(next(line for line in lines if line.startswith("logits "))) + 1
    verdict = record["low_precision"]
    assert verdict["dtype"] == "bfloat16" and verdict["accepted"], out
    assert verdict["kl_over"] == 0 and verdict["flips"] == 0 and verdict["worst"] < 1
    assert "bfloat16 rule: accepted" in out
    logits = record["logits"]
    assert logits["kl_max"] > 0  # bfloat16 really ran
    assert f"KL mean {logits['kl_mean']:.1e} max {logits['kl_max']:.1e}" in metrics
    assert code == (1 if record["differ"] else 0)  # the exit code is still the relative error's


@pytest.mark.parametrize("mistake", ["all_scaled", "table_scaled"])
def test_a_bfloat16_side_with_a_real_mistake_fails_the_rule(checkpoints, mistake, tmp_path, capsys):
    code, out, record = _diff(f"{checkpoints[mistake]}@torch:bfloat16", str(checkpoints["model"]),
                              tmp_path, capsys)
    verdict = record["low_precision"]
    assert not verdict["accepted"] and verdict["kl_over"] > 0, out
    assert "bfloat16 rule: REJECTED" in out
    assert code == 1


def test_no_verdict_between_float32_and_float64(checkpoints, tmp_path, capsys):
    code, out, record = _diff(f"{checkpoints['model']}@jax", str(checkpoints["model"]), tmp_path, capsys)
    assert code == 0 and record["low_precision"] is None and "rule:" not in out
    assert record["logits"]["top1"] == 1.0 and record["logits"]["kl_max"] < 1e-9


def test_a_float16_dump_gets_the_verdict(tmp_path, capsys):
    from rosetta.backends import from_params
    from rosetta.diff.shared.dump import write_dump

    cfg = preset("tiny")
    params = _perturbed(cfg)
    ckpt = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    src, tgt = diagnostic_batch(cfg)
    stages = from_params(cfg, params, "numpy", "float64").stages(src, tgt)
    dump = write_dump(tmp_path / "half.npz", src, tgt, {k: v.astype(np.float16) for k, v in stages.items()})
    code, out, record = _diff(str(dump), str(ckpt), tmp_path, capsys)
    assert record["low_precision"]["dtype"] == "float16" and record["low_precision"]["accepted"], out
    assert code == 0  # float16's tolerance, 1e-2, holds for values rounded once
