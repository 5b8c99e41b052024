"""rosetta.diff.shared.plots: the PNGs exist, open, have the size their grid implies, and draw the
model's own attention weights (recorded independently from the float64 reference's softmax),
trimmed to the first sentence's real tokens; bad input is one InputError naming it."""

from __future__ import annotations

import math

import matplotlib.image
import numpy as np
import pytest

import numpy_ref.model as ref
from rosetta import InputError, init_params, preset
from rosetta.diff.shared import plots
from rosetta.diff.shared.plots import plot_attention, plot_diff
from rosetta.parity import random_batch

CURVE_HEIGHT = plots.CURVE_IN[1] + plots.LABELS_IN + plots.TITLE_IN  # plot_diff's curve, its labels, title


def pixels(height_in: float, width_in: float) -> tuple[int, int]:
    """The PNG's (rows, columns) for a figure of that many inches."""
    return round(height_in * plots.DPI), round(width_in * plots.DPI)


CFG = preset("tiny", num_encoder_layers=2, num_decoder_layers=1, num_heads=2, dropout=0.0)


def reference_weights(cfg, params, src, tgt) -> dict[str, np.ndarray]:
    """Attention probabilities straight from numpy_ref's softmax, recorded call by call: the
    reference calls it once per attention sublayer in forward order (encoder layers, then per
    decoder layer self- before cross-attention). Independent of the stage plumbing under test."""
    calls = []
    original = ref.softmax

    def recording(x):
        out = original(x)
        calls.append(out)
        return out

    ref.softmax = recording
    try:
        ref.forward(params, cfg, src, tgt)
    finally:
        ref.softmax = original
    names = [f"encoder.layers.{i}.self_attn.weights" for i in range(cfg.num_encoder_layers)]
    for i in range(cfg.num_decoder_layers):
        names += [f"decoder.layers.{i}.self_attn.weights", f"decoder.layers.{i}.cross_attn.weights"]
    assert len(calls) == len(names)
    return dict(zip(names, calls, strict=True))


@pytest.fixture(scope="module")
def model():
    params = {k: v.astype(np.float64) for k, v in init_params(CFG, seed=0).items()}  # the float64 spec
    src, tgt = random_batch(CFG, batch=3, src_len=7, tgt_len=6, seed=1)
    # Sentence 0 gets trailing padding too, so trimming is exercised.
    src[0, 5:] = CFG.pad_id
    tgt[0, 4:] = CFG.pad_id
    return params, src, tgt, reference_weights(CFG, params, src, tgt)


def test_reference_rows_sum_to_one_where_keys_exist(model):
    _, src, tgt, weights = model
    for name, w in weights.items():
        assert w.shape[:2] == (3, CFG.num_heads)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-12, err_msg=name)
    # Padded source keys get exactly zero weight from every real query.
    enc = weights["encoder.layers.0.self_attn.weights"]
    assert np.all(enc[0, :, :, 5:] == 0.0)


def test_plot_attention_draws_every_layer_and_head(tmp_path, model):
    _, src, tgt, weights = model
    drawn: dict[str, np.ndarray] = {}
    out = plot_attention(tmp_path / "attn.png", weights, src, tgt, drawn=drawn)
    assert out == tmp_path / "attn.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    rows = CFG.num_encoder_layers + 2 * CFG.num_decoder_layers  # encoder; decoder self + cross
    assert image.shape[:2] == (round((plots.PANEL_IN * rows + plots.TITLE_IN) * plots.DPI),
                               round(max(plots.PANEL_IN * CFG.num_heads, plots.MIN_WIDTH_IN) * plots.DPI))
    assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas
    expected_titles = {f"{kind} layer {i} head {h}" for h in range(CFG.num_heads)
                       for kind, n in (("encoder", 2), ("decoder self", 1), ("cross", 1)) for i in range(n)}
    assert set(drawn) == expected_titles
    # First sentence, padding trimmed: 5 real source tokens, 4 real target tokens.
    np.testing.assert_array_equal(drawn["encoder layer 1 head 1"],
                                  weights["encoder.layers.1.self_attn.weights"][0, 1, :5, :5])
    np.testing.assert_array_equal(drawn["decoder self layer 0 head 0"],
                                  weights["decoder.layers.0.self_attn.weights"][0, 0, :4, :4])
    np.testing.assert_array_equal(drawn["cross layer 0 head 1"],
                                  weights["decoder.layers.0.cross_attn.weights"][0, 1, :4, :5])
    for title, m in drawn.items():
        np.testing.assert_allclose(m.sum(-1), 1.0, atol=1e-12, err_msg=title)  # nothing real cut off
    # The decoder self-attention is causal: nothing above the diagonal.
    assert np.all(np.triu(drawn["decoder self layer 0 head 1"], 1) == 0.0)


def test_plot_attention_takes_labels(tmp_path, model):
    _, src, tgt, weights = model
    words = [f"w{i}" for i in range(src.shape[1])]
    out = plot_attention(tmp_path / "a.png", weights, src, tgt, src_labels=words[:5],
                         tgt_labels=["<s>", "a", "b", "c", "x", "y"])
    assert matplotlib.image.imread(out).shape[2] in (3, 4)
    with pytest.raises(InputError, match="src_labels has 3 labels"):
        plot_attention(tmp_path / "b.png", weights, src, tgt, src_labels=["a", "b", "c"])


def test_plot_diff_shows_the_curve_and_the_diverging_layer(tmp_path, model):
    params, src, tgt, weights = model
    # Side B: decoder self-attention of layer 0 blended with uniform causal weights (rows still
    # sum to 1), every other map the same.
    other = dict(weights)
    w = weights["decoder.layers.0.self_attn.weights"]
    other["decoder.layers.0.self_attn.weights"] = w * 0.5 + 0.5 * np.tril(np.ones(w.shape[-2:])) / (
        np.arange(w.shape[-1]) + 1)[:, None]
    rows = [("src_embed", 0.0, 0.0, False), ("encoder.layers.0", 1e-16, 1e-15, False),
            ("decoder.layers.0", 0.2, 0.5, True), ("logits", 0.3, 1.0, True)]
    drawn: dict[str, np.ndarray] = {}
    out = plot_diff(tmp_path / "d.png", rows, weights, other, "decoder.layers.0", tolerance=1e-5,
                    src=src, tgt=tgt, drawn=drawn)
    image = matplotlib.image.imread(out)
    n_rows = 2 * CFG.num_heads  # decoder layer: self- and cross-attention, one row per head
    assert image.shape[:2] == pixels(CURVE_HEIGHT + plots.PANEL_IN * n_rows,
                                     max(plots.CURVE_IN[0], 3 * plots.PANEL_IN))
    # Zero error sits at the log-scale floor; the rest is the rows' rel, in order.
    assert drawn["curve"][0] > 0 and list(drawn["curve"][1:]) == [1e-16, 0.2, 0.3]
    a = drawn["decoder self layer 0 head 1: A"]
    np.testing.assert_array_equal(a, w[0, 1, :4, :4])
    np.testing.assert_array_equal(drawn["decoder self layer 0 head 1: A - B"],
                                  a - other["decoder.layers.0.self_attn.weights"][0, 1, :4, :4])
    assert not drawn["cross layer 0 head 0: A - B"].any()  # cross-attention was left alone


def test_plot_diff_without_weights_draws_only_the_curve(tmp_path):
    rows = [("src_embed", 1e-3, 1e-3, True), ("logits", 1e-2, 1.0, True)]
    drawn: dict[str, np.ndarray] = {}
    out = plot_diff(tmp_path / "c.png", rows, {}, {}, "src_embed", tolerance=1e-5, drawn=drawn)
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == pixels(CURVE_HEIGHT, plots.CURVE_IN[0])
    assert set(drawn) == {"curve"}


def test_bad_input_is_one_input_error(tmp_path, model):
    _, src, tgt, weights = model
    coarse = {"encoder.layers.0": np.zeros((3, 7, 32))}
    with pytest.raises(InputError, match="no attention weights stages.*fine=True"):
        plot_attention(tmp_path / "x.png", coarse, src, tgt)
    bad = {**weights, "decoder.layers.0.cross_attn.weights": np.zeros((3, 2, 6, 6))}
    with pytest.raises(InputError, match=r"'decoder.layers.0.cross_attn.weights' has shape"):
        plot_attention(tmp_path / "x.png", bad, src, tgt)
    with pytest.raises(InputError, match="must be attention weights"):
        plot_attention(tmp_path / "x.png", {"encoder.layers.0.self_attn.weights": np.zeros((3, 7))}, src, tgt)
    with pytest.raises(InputError, match="NaN"):
        nan = np.full((3, 2, 7, 7), math.nan)
        plot_attention(tmp_path / "x.png", {"encoder.layers.0.self_attn.weights": nan}, src, tgt)
    with pytest.raises(InputError, match="src must be"):
        plot_attention(tmp_path / "x.png", weights, src.astype(float), tgt)
    with pytest.raises(InputError, match="first_stage 'nowhere'"):
        plot_diff(tmp_path / "x.png", [("logits", 1.0, 1.0, True)], {}, {}, "nowhere")
    with pytest.raises(InputError, match="comparison row"):
        plot_diff(tmp_path / "x.png", [("logits", 1.0)], {}, {}, None)
    other = {"encoder.layers.0.self_attn.weights": np.zeros((3, 2, 7, 6))}
    with pytest.raises(InputError, match="side A has shape"):
        plot_diff(tmp_path / "x.png", [("encoder.layers.0", 1.0, 1.0, True)], weights, other,
                  "encoder.layers.0")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_plot_attention_from_the_backends_fine_stages(tmp_path, model):
    """The real input: `stages(src, tgt, fine=True)` of the numpy backend holds the same
    attention probabilities as the reference's own softmax, and plot_attention draws them."""
    import rosetta
    params, src, tgt, weights = model
    stages = rosetta.from_params(CFG, params, "numpy").stages(src, tgt, fine=True)
    for name, w in weights.items():
        np.testing.assert_allclose(stages[name], w, rtol=0, atol=1e-14, err_msg=name)
    drawn: dict[str, np.ndarray] = {}
    plot_attention(tmp_path / "fine.png", stages, src, tgt, drawn=drawn)
    np.testing.assert_array_equal(drawn["cross layer 0 head 0"],
                                  stages["decoder.layers.0.cross_attn.weights"][0, 0, :4, :5])
    assert len(drawn) == CFG.num_heads * (CFG.num_encoder_layers + 2 * CFG.num_decoder_layers)


def test_plot_diff_of_a_real_comparison(tmp_path, model):
    """compare_stages rows of the reference against the same model with its padding mask
    inverted (rosetta.diff's own catalogue): the first diverging stage is in encoder layer 0,
    and its drawn maps are the two sides' weights."""
    from rosetta.diff.shared.diagnose import mistaken_stages
    from rosetta.diff.shared.metrics import compare_stages, first_over
    params, src, tgt, weights = model
    ours = mistaken_stages("mask_inverted", CFG, params, src, tgt, fine=True)
    rows = compare_stages(CFG.pad_id, src, tgt, ours, weights | {"logits": ours["logits"]}, 1e-5)
    first = first_over(rows)
    assert first is not None and first.stage == "encoder.layers.0.self_attn.weights"
    drawn: dict[str, np.ndarray] = {}
    plot_diff(tmp_path / "real.png", rows, ours, weights, first.stage, tolerance=1e-5, src=src, tgt=tgt,
              drawn=drawn)
    name = "encoder.layers.0.self_attn.weights"
    np.testing.assert_array_equal(drawn["encoder layer 0 head 0: A"], ours[name][0, 0, :5, :5])
    np.testing.assert_array_equal(drawn["encoder layer 0 head 0: B"], weights[name][0, 0, :5, :5])
    assert np.abs(drawn["encoder layer 0 head 0: A - B"]).max() > 0.1
