"""benchmarks/pitfalls.py: its core runs on a tiny model and measures what the mistakes do
(checked against independent expectations: a zero mistake costs nothing, a wrong positional
table moves every embedding at once), and docs/pitfalls.md shows exactly the newest committed
results. Nothing is timed here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import pitfalls
from rosetta import init_params, preset
from rosetta.parity import random_batch, relative_error, target_positions

TINY = dict(preset="tiny", batch=2, src_len=8, tgt_len=7, seed=0, dropout=0.0, perturb=0.1)


@pytest.fixture(scope="module")
def tiny_result():
    return pitfalls.run(TINY, mistakes=pitfalls.FLIPS, gradient=True)


def test_core_runs_on_tiny(tiny_result):
    rows = {r["name"]: r for r in tiny_result["rows"]}
    assert list(rows) == ["none"] + [m.name for m in pitfalls.FLIPS]
    none = rows["none"]
    # The correct model against itself: exactly zero in float64, float32 rounding (~1e-7, far
    # below its 1e-5 tolerance), bfloat16 weights somewhere between 1e-4 and its 3e-2 tolerance.
    assert none["rel_float64"] == 0.0 and none["first_stage"] is None
    assert 0 < none["rel_float32"] < 1e-6 and 1e-4 < none["rel_bfloat16"] < 3e-2
    # A wrong positional table changes the very first stage; norm placement shows in layer 0.
    assert rows["positions_concat"]["first_stage"] == "src_embed"
    assert rows["pre_norm"]["first_stage"] == "encoder.layers.0"
    for r in rows.values():
        assert r["shown"] and all(math.isfinite(r[k]) for k in ("rel_float64", "rel_float32", "rel_bfloat16"))
        if r["name"] != "none":
            assert r["grad_rel"] > 0 and r["grad_tensor"] == "decoder.layers.1.ffn_norm.scale"
            # Triangle inequality: float32 moves the error by at most its own rounding, which
            # scales with the mistaken output's norm (<= (1 + rel) times the reference's).
            floor = 3 * none["rel_float32"] * (1 + r["rel_float64"])
            assert abs(r["rel_float32"] - r["rel_float64"]) <= floor
    assert rows["positions_concat"]["noticed_float32"] and rows["positions_concat"]["noticed_bfloat16"]
    text = pitfalls.markdown(tiny_result)
    assert text.count("\n| `") == len(rows) and "`layer_norm_eps`" in text


def _tiny():
    cfg = preset("tiny", dropout=0.0)
    params = pitfalls.perturbed(init_params(cfg, seed=0), 0.1, seed=0)
    return cfg, {k: v.astype(np.float64) for k, v in params.items()}, *random_batch(cfg, 2, 8, 7, seed=0)


def test_epsilon_row_matches_an_independent_computation():
    """The layer_norm_eps row's float64 error, recomputed here with the reference at the two
    epsilons directly (not through the script's mistake plumbing)."""
    import numpy_ref.model as ref
    cfg, params, src, tgt = _tiny()
    want = ref.forward(params, cfg, src, tgt)
    got = ref.forward(params, cfg.replace(layer_norm_eps=1e-6), src, tgt)
    expected = relative_error(got, want, target_positions(cfg, tgt))
    rows = pitfalls.measure(cfg, params, src, tgt, [pitfalls.FLIPS[0]], gradient=False)
    assert rows[1]["name"] == "layer_norm_eps" and rows[1]["grad_rel"] is None
    assert rows[1]["rel_float64"] == pytest.approx(expected, rel=1e-9)
    # LayerNorm's output moves by about (eps_a - eps_b) / (2 var): ~5e-6 at unit variance.
    assert 1e-7 < expected < 1e-4


def test_catalogue_forward_is_mistaken_stages():
    """The script runs each catalogue entry through the catalogue's own build; in float64 that
    is exactly engineer 2's mistaken_stages, for a config flip, a weight transform and a switch."""
    from rosetta.diff.shared.diagnose import mistaken_stages
    cfg, params, src, tgt = _tiny()
    by_name = {m.name: m for m in pitfalls.catalogue_mistakes()}
    for name in ("pre_norm", "kernels_transposed", "mask_inverted"):
        ours = by_name[name].stages(cfg, params, src, tgt)
        theirs = mistaken_stages(name, cfg, params, src, tgt)
        np.testing.assert_array_equal(ours["logits"], theirs["logits"], err_msg=name)
    assert by_name["pre_norm"].build is not None and by_name["mask_inverted"].build is None


def test_loss_gradient_matches_finite_differences():
    """PyTorch's gradient of the loss w.r.t. one LayerNorm scale entry against a central finite
    difference of the same loss computed by the NumPy reference (float64)."""
    import numpy_ref.model as ref
    cfg, params, src, tgt = _tiny()
    labels = random_batch(cfg, 2, 1, 8, seed=1, pad=False)[1][:, 1:]
    tensor, j, h = "decoder.layers.1.ffn_norm.scale", 5, 1e-6
    where = target_positions(cfg, tgt)

    def loss(p):
        logits = ref.forward(p, cfg, src, tgt)[where]
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return -log_probs[np.arange(len(logits)), labels[where]].mean()

    plus, minus = dict(params), dict(params)
    plus[tensor], minus[tensor] = params[tensor].copy(), params[tensor].copy()
    plus[tensor][j] += h
    minus[tensor][j] -= h
    numeric = (loss(plus) - loss(minus)) / (2 * h)
    grad = pitfalls.loss_gradient(cfg, params, src, tgt, labels, tensor)
    assert grad.shape == (cfg.d_model,)
    assert grad[j] == pytest.approx(numeric, rel=1e-6, abs=1e-10)


def test_page_shows_the_newest_results():
    """The block of docs/pitfalls.md is exactly what `python -m benchmarks.pitfalls --docs`
    renders from the newest benchmarks/results/pitfalls_<date>.json, measured on `base`."""
    assert pitfalls.page_block() in pitfalls.PAGE.read_text(), "run `python -m benchmarks.pitfalls --docs`"
    result = pitfalls.load(pitfalls.newest())
    assert result["settings"]["preset"] == "base" and result["rows"][0]["name"] == "none"
    assert pitfalls.newest().with_suffix(".md").exists()


def test_bad_results_file_is_named(tmp_path):
    bad = tmp_path / "pitfalls_2026-01-01.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="missing environment"):
        pitfalls.load(bad)
    bad.write_text("garbage")
    with pytest.raises(SystemExit, match="not valid JSON"):
        pitfalls.page_block(tmp_path)
