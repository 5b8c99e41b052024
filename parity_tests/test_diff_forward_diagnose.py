"""rosetta diff --diagnose: every catalogue entry, built from the correct model and treated as the
other side's dump, is named first, with the stage where the two part.

Expected values come from outside the code under test: the float64 reference numpy_ref.model
(its stages, on configs or weights changed here by hand), formulas written out here, and the
first diverging stage computed here with rosetta.parity.relative_error.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from numpy_ref import model as ref
from rosetta.checkpoint import save_checkpoint
from rosetta.cli import main
from rosetta.config import preset
from rosetta.diff.shared.catalogue import BY_NAME, CATALOGUE, mistaken_stages
from rosetta.diff.shared.diagnose import diagnose
from rosetta.diff.shared.dump import read_dump, stage_order, write_dump
from rosetta.diff.shared.metrics import compare_stages, first_over
from rosetta.diff.shared.variant import Switches, forward_stages, tutorial_positions
from rosetta.errors import ConfigError, InputError
from rosetta.params import init_params
from rosetta.parity import relative_error, target_positions

# float32's parity tolerance (rosetta.parity.TOLERANCES): what a real diff runs with.
TOL = 1e-5

# Tiny: one layer per stack, 4 heads of 4 columns. Source and target lengths differ (7 and 5)
# or keys sized with the query length would change nothing; row 2 of the source is nothing but
# padding, the only way the contract model has a query with every key masked (cross-attention),
# which the -inf and zero-row fills need.
BASE = dict(src_vocab_size=24, tgt_vocab_size=24, d_model=16, num_heads=4, d_ff=32,
            num_encoder_layers=1, num_decoder_layers=1)

# An entry that names a convention the base config already has is tried on a config with the
# other convention (the diagnosis then names the base's).
CONFIG_FOR = {
    "positions_interleaved": dict(positional_encoding="sinusoidal_concat"),
    "layer_norm_eps_1e-5": dict(layer_norm_eps=1e-6),
    "post_norm": dict(norm_first=True),
    "final_norm_missing": dict(final_norm=True),
    "activation_relu": dict(activation="gelu"),
    "embeddings_scaled": dict(scale_embeddings=False),
    "output_tied": dict(share_embeddings="none"),
    "start_token_masked": dict(bos_id=0),  # Marian and Flax: the start token is pad (PITFALLS 12)
}


def config(**changes):
    return preset("tiny", **{**BASE, **changes})


def perturbed(cfg, seed=0):
    """The canonical weights with every bias and LayerNorm moved off zero and one: a scalar
    LayerNorm or an identity final norm would otherwise change nothing."""
    rng = np.random.default_rng(seed)
    return {k: v.astype(np.float64) + (0.0 if k.endswith("embedding") else 0.2 * rng.standard_normal(v.shape))
            for k, v in init_params(cfg, seed).items()}


def small_layer_norm_inputs(params):
    """Epsilon mistakes only show when a LayerNorm's input variance is near the epsilons: at unit
    variance 1e-6 against 1e-12 moves the output by 5e-7, under TOL. Shrinking the first
    encoder layer's attention norm and its FFN biases by 1e-3 gives the FFN norm an input of
    variance ~1e-6, where 1e-5, 1e-6 and 1e-12 all differ by far more than TOL."""
    out = dict(params)
    for name in ("self_attn_norm.scale", "self_attn_norm.bias", "ffn.linear1.bias", "ffn.linear2.bias"):
        out[f"encoder.layers.0.{name}"] = params[f"encoder.layers.0.{name}"] * 1e-3
    return out


def large_mean_layer_norm_inputs(params):
    """E[x²] - E[x]² loses to cancellation only when the mean dwarfs the spread: float64 keeps
    16 digits, so the FFN norm of the first encoder layer gets an input of mean 1e7 and spread ~1
    (its attention norm's bias moved by 1e7, the FFN itself silenced)."""
    out = dict(params)
    out["encoder.layers.0.self_attn_norm.bias"] = params["encoder.layers.0.self_attn_norm.bias"] + 1e7
    for name in ("linear2.kernel", "linear2.bias"):
        out[f"encoder.layers.0.ffn.{name}"] = np.zeros_like(params[f"encoder.layers.0.ffn.{name}"])
    return out


WEIGHTS_FOR = {
    "layer_norm_eps_1e-5": small_layer_norm_inputs,
    "layer_norm_eps_1e-6": small_layer_norm_inputs,
    "layer_norm_eps_1e-12": small_layer_norm_inputs,
    "layer_norm_fast_variance": large_mean_layer_norm_inputs,
}


def batch(cfg):
    rng = np.random.default_rng(1)
    src = rng.integers(3, cfg.src_vocab_size, size=(3, 7))
    tgt = rng.integers(3, cfg.tgt_vocab_size, size=(3, 5))
    src[1, 4:] = cfg.pad_id
    src[2, :] = cfg.pad_id
    tgt[:, 0] = cfg.bos_id
    tgt[1, 3:] = cfg.pad_id
    return src, tgt


def reference_stages(params, cfg, src, tgt):
    stages = {}
    ref.forward(params, cfg, src, tgt, stages, fine=True)
    return stages


def first_parting(cfg, src, tgt, ours, observed):
    """The first stage in forward order (the dump's: a softmax before the o projection reading
    it) whose relative error at the contract positions is over TOL (NaN counts as over)."""
    for stage in sorted(ours, key=stage_order):
        value = ours[stage]
        if stage == "src_embed" or stage.startswith("encoder"):
            where = src != cfg.pad_id
        else:
            where = target_positions(cfg, tgt)
        a, b = observed[stage], value
        if stage.endswith(".weights"):
            a, b = np.moveaxis(a, 1, 2), np.moveaxis(b, 1, 2)
        if not relative_error(a[where], b[where]) <= TOL:
            return stage
    return None


def setup(name):
    cfg = config(**CONFIG_FOR.get(name, {}))
    params = WEIGHTS_FOR.get(name, lambda p: p)(perturbed(cfg))
    # Values a float32 checkpoint holds exactly, so `rosetta diff` on a saved file sees these weights.
    params = {k: v.astype(np.float32).astype(np.float64) for k, v in params.items()}
    src, tgt = batch(cfg)
    return cfg, params, src, tgt


# -- Every entry is found ------------------------------------------------------------------

@pytest.mark.parametrize("name", [entry.name for entry in CATALOGUE])
def test_diagnose_names_each_mistake_first(name, tmp_path, capsys):
    cfg, params, src, tgt = setup(name)
    assert BY_NAME[name].applies(cfg, src, tgt)
    observed = mistaken_stages(name, cfg, params, src, tgt, fine=True)
    if name != "mask_fill_neg_inf":  # a dump refuses NaN: that one is compared in memory
        # As `rosetta diff` gets it: written as an activation dump and read back, checked.
        dump = read_dump(write_dump(tmp_path / "other.npz", src, tgt, observed))
        np.testing.assert_array_equal(dump.src, src)
        observed = dump.stages
    expected_first = first_parting(cfg, src, tgt, reference_stages(params, cfg, src, tgt), observed)
    assert expected_first is not None, f"{name} changes nothing on the test batch"
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.best is not None, result.report()
    assert result.best.names == (name,), result.report()
    assert result.best.first_stage == result.first_stage == expected_first
    # The same stage `rosetta diff` marks in its table (rosetta.diff.shared.metrics).
    rows = compare_stages(cfg.pad_id, src, tgt, observed, reference_stages(params, cfg, src, tgt), TOL)
    assert first_over(rows).stage == expected_first
    assert result.best.rel_after <= TOL < result.best.rel_before
    assert f"{expected_first} diverges" in result.report()
    assert BY_NAME[name].fix in result.report()
    if name != "mask_fill_neg_inf":
        # The command line a user runs: the dump against the correct checkpoint.
        ckpt = save_checkpoint(tmp_path / "correct.safetensors", cfg, params)
        code = main(["diff", str(tmp_path / "other.npz"), f"{ckpt}@numpy:float64", "--tolerance", str(TOL),
                     "--diagnose"])
        out = capsys.readouterr().out
        assert code == 1 and f"{expected_first} diverges" in out and BY_NAME[name].fix in out, out


@pytest.mark.parametrize("weights", ["B", "A"])
def test_the_table_and_the_diagnosis_print_one_number_for_one_error(weights, tmp_path, capsys):
    """One definition of the relative error (rosetta.diff.shared.metrics.stage_error, relative to the
    table's B): the stage `rosetta diff` marks shows the same error in its table and in its diagnosis,
    whichever side holds the weights. They once divided by opposite sides (rel 4.747e-01 in a table,
    5.6e-01 in the diagnosis under it); a mistake that changes the activations' size tells them apart."""
    cfg, params, src, tgt = setup("embeddings_unscaled")
    observed = mistaken_stages("embeddings_unscaled", cfg, params, src, tgt, fine=True)
    sides = [str(write_dump(tmp_path / "other.npz", src, tgt, observed)),
             f"{save_checkpoint(tmp_path / 'correct.safetensors', cfg, params)}@numpy:float64"]
    if weights == "A":
        sides.reverse()  # the model under test, the dump the reference: the diagnosis divides by the dump
    out_json = tmp_path / "d.json"
    assert main(["diff", *sides, "--tolerance", str(TOL), "--diagnose", "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    record = json.loads(out_json.read_text())
    first = record["first_difference"]
    rel = next(row["rel"] for row in record["rows"] if row["stage"] == first)
    assert first == "src_embed" and f"{first} diverges (rel {rel:.1e})" in out, out
    # The two sides' norms differ (no √d): dividing by the other side would print another number.
    correct = reference_stages(params, cfg, src, tgt)["src_embed"]
    assert not 0.9 < np.linalg.norm(observed["src_embed"]) / np.linalg.norm(correct) < 1.1


def test_diagnose_works_from_coarse_stages_alone():
    # A dump without the fine stages (an older backend): the diagnosis still names the entry.
    cfg, params, src, tgt = setup("positions_concat_t2t")
    observed = mistaken_stages("positions_concat_t2t", cfg, params, src, tgt)
    assert not any(s.endswith(".weights") for s in observed)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.best.names == ("positions_concat_t2t",)
    assert result.first_stage == "src_embed"
    assert "explained by positional_encoding = sinusoidal_concat_t2t" in result.report()


# -- Pairs, clean pairs and differences outside the catalogue ------------------------------

def _attention_kernels_transposed(params):
    return {k: (v.T if k.endswith(".kernel") and ("_attn." in k) else v) for k, v in params.items()}


def test_mistaken_stages_applies_several_entries_together():
    cfg, params, src, tgt = setup("kernels_transposed")
    got = mistaken_stages(["positions_concat_t2t", "kernels_transposed"], cfg, params, src, tgt)
    # Independently: the reference on the t2t config with the attention kernels transposed here.
    expected = {}
    t2t = cfg.replace(positional_encoding="sinusoidal_concat_t2t")
    ref.forward(_attention_kernels_transposed(params), t2t, src, tgt, expected)
    assert list(got) == list(expected)
    for stage in expected:
        np.testing.assert_array_equal(got[stage], expected[stage], err_msg=stage)


def test_diagnose_finds_a_pair():
    cfg, params, src, tgt = setup("kernels_transposed")
    observed = mistaken_stages(["positions_concat_t2t", "kernels_transposed"], cfg, params, src, tgt,
                               fine=True)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.best is not None, result.report()
    assert set(result.best.names) == {"positions_concat_t2t", "kernels_transposed"}
    assert result.first_stage == "src_embed"
    single = diagnose(cfg, params, src, tgt, observed, tolerance=TOL, pairs=False)
    assert single.best is None
    assert "nothing in the catalogue explains the difference" in single.report()


@pytest.mark.parametrize("pair", [
    ("kernels_transposed", "layer_norm_eps_1e-6"),  # a large mistake hiding a small one
    ("positions_concat_t2t", "activation_gelu_tanh"),  # the Flax example's two conventions
    ("mask_inverted", "logits_log_softmax"),
    ("heads_interleaved", "positions_from_one"),
])
def test_diagnose_finds_pairs_of_mistakes(pair):
    cfg, params, src, tgt = setup("layer_norm_eps_1e-6")  # small LayerNorm inputs: eps shows
    observed = mistaken_stages(pair, cfg, params, src, tgt, fine=True)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.best is not None, result.report()
    assert set(result.best.names) == set(pair)
    assert result.first_stage == first_parting(cfg, src, tgt, reference_stages(params, cfg, src, tgt),
                                               observed)


def test_a_clean_pair_has_nothing_to_explain():
    cfg, params, src, tgt = setup("kernels_transposed")
    # The other side: numpy_ref itself in float32, as a float32 port that is right would dump.
    observed = reference_stages({k: v.astype(np.float32) for k, v in params.items()}, cfg, src, tgt)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.first_stage is None and result.best is None and result.candidates == []
    assert result.report().startswith("no difference")


def test_a_difference_outside_the_catalogue_is_not_explained():
    cfg, params, src, tgt = setup("kernels_transposed")
    wrong = dict(params)
    wrong["decoder.layers.0.ffn.linear1.kernel"] = wrong["decoder.layers.0.ffn.linear1.kernel"].copy()
    wrong["decoder.layers.0.ffn.linear1.kernel"][3, 5] += 0.5  # one weight, out of any catalogue
    observed = reference_stages(wrong, cfg, src, tgt)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.first_stage == "decoder.layers.0.ffn"
    assert result.best is None
    report = result.report()
    assert "nothing in the catalogue explains the difference" in report
    assert report.count("\n") == 3  # the three closest candidates are listed


# -- The variant forward against the reference and formulas --------------------------------

@pytest.mark.parametrize("changes", [{}, dict(norm_first=True, activation="gelu", share_embeddings="none",
                                              output_bias=True), dict(bos_id=0, final_norm=True)])
def test_variant_with_no_switch_is_the_reference_exactly(changes):
    cfg = config(**changes)
    params = perturbed(cfg)
    src, tgt = batch(cfg)
    expected = reference_stages(params, cfg, src, tgt)
    got = forward_stages(params, cfg, src, tgt, fine=True)
    assert list(got) == list(expected)
    for stage in expected:
        np.testing.assert_array_equal(got[stage], expected[stage], err_msg=stage)


def test_interleaved_heads_are_contiguous_heads_on_permuted_columns():
    # Head j owning columns j, j+h, ... is the contract's split after permuting the q, k, v
    # kernels' output columns (and the o kernel's input rows) so those columns become block j.
    cfg = config()
    params = perturbed(cfg)
    src, tgt = batch(cfg)
    h, dh = cfg.num_heads, cfg.d_head
    perm = np.array([j + h * c for j in range(h) for c in range(dh)])  # block j <- columns j, j+h
    permuted = dict(params)
    for name, value in params.items():
        if "_attn." in name:
            if name.endswith(("q.kernel", "k.kernel", "v.kernel")):
                permuted[name] = value[:, perm]
            elif name.endswith(("q.bias", "k.bias", "v.bias")):
                permuted[name] = value[perm]
            elif name.endswith("o.kernel"):
                permuted[name] = value[perm, :]
    expected = {}
    ref.forward(permuted, cfg, src, tgt, expected)
    got = forward_stages(params, cfg, src, tgt, Switches(heads="interleaved"))
    for stage in expected:
        np.testing.assert_allclose(got[stage], expected[stage], rtol=1e-12, atol=1e-12, err_msg=stage)


def test_tutorial_positions_match_the_loop_written_out():
    d, length = 8, 6
    table = np.zeros((length, d))
    for pos in range(length):
        for i in range(0, d, 2):
            table[pos, i] = math.sin(pos / 10000 ** ((2 * i) / d))
            table[pos, i + 1] = math.cos(pos / 10000 ** ((2 * i) / d))
    np.testing.assert_allclose(tutorial_positions(length, d), table, atol=1e-15)


def test_fills_for_a_query_with_every_key_masked():
    # Row 2 of the source is all padding: its cross-attention weights are uniform in the
    # contract (1/S each), NaN with a -inf fill, zero with a zeroing fast path (PITFALLS 4).
    cfg = config()
    params = perturbed(cfg)
    src, tgt = batch(cfg)
    name = "decoder.layers.0.cross_attn.weights"
    uniform = forward_stages(params, cfg, src, tgt, fine=True)[name][2]
    np.testing.assert_allclose(uniform, 1.0 / src.shape[1], rtol=1e-15)
    assert np.isnan(forward_stages(params, cfg, src, tgt, Switches(fill="neg_inf"), fine=True)[name][2]).all()
    assert not forward_stages(params, cfg, src, tgt, Switches(fill="zero"), fine=True)[name][2].any()


def test_keys_sized_with_the_query_length_change_nothing_when_lengths_agree():
    cfg = config()
    params = perturbed(cfg)
    src, _ = batch(cfg)
    tgt = np.full((3, 7), 5)
    tgt[:, 0] = cfg.bos_id
    np.testing.assert_array_equal(
        forward_stages(params, cfg, src, tgt, Switches(kv_query_length=True))["logits"],
        forward_stages(params, cfg, src, tgt)["logits"])
    assert not BY_NAME["kv_query_length"].applies(cfg, src, tgt)


# -- Bad input -------------------------------------------------------------------------------

def test_unknown_entry_is_a_config_error_naming_it():
    cfg, params, src, tgt = setup("kernels_transposed")
    with pytest.raises(ConfigError, match="'transposed_kernel'"):
        mistaken_stages(["kernels_transposed", "transposed_kernel"], cfg, params, src, tgt)


def test_observed_stage_of_the_wrong_shape_is_an_input_error():
    cfg, params, src, tgt = setup("kernels_transposed")
    observed = {"logits": np.zeros((3, 4, cfg.tgt_vocab_size))}
    with pytest.raises(InputError, match="'logits' has shape"):
        diagnose(cfg, params, src, tgt, observed)
    with pytest.raises(InputError, match="shares no stage"):
        diagnose(cfg, params, src, tgt, {"nonsense": np.zeros(3)})
    with pytest.raises(ConfigError, match="tolerance"):
        diagnose(cfg, params, src, tgt, observed, tolerance=0.0)


def test_entries_identical_on_these_weights_tie_and_either_is_accepted():
    # An untied output kernel that is exactly sqrt(d) E^T (a converter that stored Flax's tied
    # table scaled): dividing the logits by sqrt(d) and tying the output to E give the same
    # logits, so either name explains the difference (docs/diagnose.md, Limits). Both leave a
    # rounding-level error, a tie: it goes to the simpler entry, then catalogue order.
    cfg = config(share_embeddings="none")
    params = perturbed(cfg)
    params["generator.kernel"] = params["tgt_embed.embedding"].T * math.sqrt(cfg.d_model)
    src, tgt = batch(cfg)
    observed = mistaken_stages("output_tied", cfg, params, src, tgt)
    twin = mistaken_stages("logits_over_sqrt_d", cfg, params, src, tgt)
    np.testing.assert_allclose(twin["logits"], observed["logits"], rtol=1e-13)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.first_stage == "logits"
    assert result.best.names in {("output_tied",), ("logits_over_sqrt_d",)}
    assert {c.names for c in result.candidates[:2]} == {("output_tied",), ("logits_over_sqrt_d",)}


def test_a_real_float32_port_with_another_table_is_diagnosed():
    # The other side is the PyTorch backend in float32 built with tensor2tensor's table (the
    # Flax example's convention): its float32 rounding stays, and the diagnosis still names
    # the convention, with a rel after at float32 level instead of 0.
    from rosetta.backends import get_backend

    cfg, params, src, tgt = setup("positions_concat_t2t")
    port = get_backend("torch")(cfg.replace(positional_encoding="sinusoidal_concat_t2t"), params, "float32")
    observed = port.stages(src, tgt)
    result = diagnose(cfg, params, src, tgt, observed, tolerance=TOL)
    assert result.best is not None, result.report()
    assert result.best.names == ("positions_concat_t2t",)
    assert 0 < result.best.rel_after < TOL
    assert result.first_stage == "src_embed"
