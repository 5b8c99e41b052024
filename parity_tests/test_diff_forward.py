"""The forward diff, `rosetta diff A B` on models and dumps, and the fine stages it compares
(issue 13, docs/diff.md); the recipes for dumps from your own model are in
test_diff_forward_capture.py.

Expected values come from elsewhere than the code under test: the float64 reference (numpy_ref)
for every backend's fine stages, Hugging Face's MarianMTModel for the Marian side, and the tensor
we perturbed for where a difference must first show.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from parity_tests.test_diff_forward_diagnose import CONFIG_FOR
from rosetta import init_params, preset
from rosetta.backends import from_params
from rosetta.checkpoint import save_checkpoint
from rosetta.cli import main
from rosetta.config import ModelConfig
from rosetta.diff.shared.catalogue import CATALOGUE
from rosetta.diff.shared.dump import dump_model, read_dump, write_dump
from rosetta.diff.shared.metrics import compare_stages, first_over
from rosetta.errors import CheckpointError
from rosetta.parity import diagnostic_batch, random_batch, target_positions


def perturbed_params(cfg: ModelConfig, seed: int = 1) -> dict[str, np.ndarray]:
    """Every tensor moved off its initial value, so a dropped bias or scale cannot pass by luck."""
    rng = np.random.default_rng(seed)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed=0).items()}


def fine_names(cfg: ModelConfig) -> set[str]:
    """The stage names of the interface, written out from the brief, not from the code."""
    names = {"src_embed", "encoder", "tgt_embed", "decoder", "logits"}
    for i in range(cfg.num_encoder_layers):
        p = f"encoder.layers.{i}"
        names |= {p, f"{p}.self_attn", f"{p}.self_attn.weights", f"{p}.ffn"}
    for i in range(cfg.num_decoder_layers):
        p = f"decoder.layers.{i}"
        names |= {p, f"{p}.self_attn", f"{p}.self_attn.weights", f"{p}.cross_attn",
                  f"{p}.cross_attn.weights", f"{p}.ffn"}
    return names


FINE_CONFIGS = {
    "post_norm_relu": {},
    "pre_norm_gelu_final_norm": dict(norm_first=True, activation="gelu"),
    "unequal_layers_8_heads_start_is_pad": dict(num_encoder_layers=3, num_decoder_layers=1, num_heads=8,
                                                bos_id=0),
}


# -- 1. fine stages in every backend ----------------------------------------------------------

@pytest.mark.ported
@pytest.mark.parametrize("variant", sorted(FINE_CONFIGS))
def test_fine_stages_match_the_float64_reference(backend, variant):
    cfg = preset("tiny", **FINE_CONFIGS[variant])
    params = perturbed_params(cfg)
    src, tgt = random_batch(cfg, 3, 7, 6, seed=2)
    want = from_params(cfg, params, "numpy", "float64").stages(src, tgt, fine=True)
    got = from_params(cfg, params, backend, "float32").stages(src, tgt, fine=True)
    assert set(want) == set(got) == fine_names(cfg)
    rows = compare_stages(cfg.pad_id, src, tgt, got, want, 1e-5)
    assert len(rows) == len(want)
    assert first_over(rows) is None, [r for r in rows if r.over]
    assert all(r.rel > 0 for r in rows if r.stage != "src_embed")  # float32 really ran


def test_attention_weights_are_distributions_over_the_keys_that_exist(backend):
    cfg = preset("tiny")
    src, tgt = random_batch(cfg, 4, 7, 6, seed=3)
    stages = from_params(cfg, perturbed_params(cfg), backend).stages(src, tgt, fine=True)
    src_keys, tgt_keys = src != cfg.pad_id, tgt != cfg.pad_id
    tgt_keys[:, 0] = True
    causal = np.tril(np.ones((tgt.shape[1],) * 2, bool))
    allowed = {"encoder.layers.0.self_attn.weights": src_keys[:, None, None, :],
               "decoder.layers.0.self_attn.weights": causal[None, None] & tgt_keys[:, None, None, :],
               "decoder.layers.0.cross_attn.weights": src_keys[:, None, None, :]}
    for name, keys in allowed.items():
        w = stages[name].astype(np.float64)
        assert w.shape[1] == cfg.num_heads
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5, err_msg=name)
        assert np.abs(np.where(keys, 0.0, w)).max() < 1e-6, name  # no weight on pad or future keys


def test_coarse_stages_are_unchanged_without_fine():
    cfg = preset("tiny")
    src, tgt = random_batch(cfg, seed=4)
    model = from_params(cfg, perturbed_params(cfg), "numpy", "float64")
    coarse, fine = model.stages(src, tgt), model.stages(src, tgt, fine=True)
    assert set(coarse) == {n for n in fine_names(cfg) if not n.endswith(("attn", "weights", "ffn"))}
    for name, value in coarse.items():
        np.testing.assert_array_equal(value, fine[name])


# -- 2. the dump format ------------------------------------------------------------------------

def tiny_case():
    """The tiny preset with perturbed weights and a padded batch of 3 (test_diff_forward_capture.py's too)."""
    cfg = preset("tiny")
    params = perturbed_params(cfg)
    src, tgt = random_batch(cfg, 3, 6, 5, seed=5)
    return cfg, params, src, tgt


@pytest.fixture(scope="module")
def tiny():
    return tiny_case()


def test_dump_round_trip(tmp_path, tiny):
    cfg, params, src, tgt = tiny
    model = from_params(cfg, params, "numpy", "float64")
    path = dump_model(model, tmp_path / "d.npz", src, tgt)
    dump = read_dump(path)
    np.testing.assert_array_equal(dump.src, src)
    np.testing.assert_array_equal(dump.tgt, tgt)
    assert set(dump.stages) == fine_names(cfg)
    np.testing.assert_array_equal(dump.stages["logits"], model.logits(src, tgt))
    assert list(dump.stages)[0] == "src_embed" and list(dump.stages)[-1] == "logits"  # forward order


def _bad_dump(tmp_path, tiny, change) -> str:
    cfg, params, src, tgt = tiny
    stages = from_params(cfg, params, "numpy", "float64").stages(src, tgt, fine=True)
    arrays = {"src": src, "tgt": tgt, **stages}
    change(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # bypasses write_dump's checks, as someone else's code would
    return str(path)


BAD_DUMPS = {
    "unknown stage": (lambda a: a.update({"encoder.layers.0.attn": a["encoder.layers.0"]}),
                      r"unknown stage name 'encoder\.layers\.0\.attn'"),
    "wrong length": (lambda a: a.update({"decoder.layers.0": a["decoder.layers.0"][:, :-1]}),
                     r"stage 'decoder\.layers\.0' has shape \(3, 4, 32\).*\[B, T, d\]"),
    "widths disagree": (lambda a: a.update({"encoder": a["encoder"][..., :16]}),
                        r"stage 'encoder' has d = 16 but stage 'src_embed' has 32"),
    "weights shape": (lambda a: a.update({"decoder.layers.1.cross_attn.weights":
                                          a["decoder.layers.1.self_attn.weights"]}),
                      r"'decoder\.layers\.1\.cross_attn\.weights' has shape.*\[B, h, T, S\]"),
    "nan": (lambda a: a["decoder.layers.1.ffn"].__setitem__((0, 0, 0), np.nan),
            r"stage 'decoder\.layers\.1\.ffn' holds NaN or infinity"),
    "missing src": (lambda a: a.pop("src"), r"no 'src' array"),
    "missing tgt": (lambda a: a.pop("tgt"), r"no 'tgt' array"),
    "float ids": (lambda a: a.update({"tgt": a["tgt"].astype(np.float32)}), r"'tgt' must hold integer"),
    "rows disagree": (lambda a: a.update({"tgt": a["tgt"][:2]}), r"'src' has 3 rows but 'tgt' has 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_DUMPS))
def test_bad_dumps_are_refused_naming_the_problem(tmp_path, tiny, case, capsys):
    change, message = BAD_DUMPS[case]
    path = _bad_dump(tmp_path, tiny, change)
    with pytest.raises(CheckpointError, match=message):
        read_dump(path)
    cfg, params = tiny[:2]
    ckpt = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    assert main(["diff", str(ckpt), path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rosetta: error:") and len(err.strip().splitlines()) == 1


def test_write_dump_refuses_what_read_dump_would(tmp_path, tiny):
    cfg, params, src, tgt = tiny
    with pytest.raises(CheckpointError, match="unknown stage name 'decoder.layers.0.mlp'"):
        write_dump(tmp_path / "x.npz", src, tgt, {"decoder.layers.0.mlp": np.zeros((3, 5, 32))})
    assert not (tmp_path / "x.npz").exists()


# -- 3-4. rosetta diff on clean pairs ------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny):
    cfg, params = tiny[:2]
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "m.safetensors", cfg, params)


@pytest.mark.parametrize("pair", [("", "@torch"), ("@jax", "@torch"), ("@numpy:float64", "")])
def test_backends_of_one_checkpoint_report_no_difference(checkpoint, pair, tmp_path, capsys):
    out_json = tmp_path / "d.json"
    a, b = (f"{checkpoint}{suffix}" for suffix in pair)
    assert main(["diff", a, b, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "no difference at any stage" in out
    record = json.loads(out_json.read_text())
    assert record["differ"] is False and record["first_difference"] is None
    assert {row["stage"] for row in record["rows"]} == fine_names(preset("tiny"))
    float64_only = pair == ("@numpy:float64", "")
    assert record["tolerance"] == (1e-10 if float64_only else 1e-5)  # the larger TOLERANCES entry
    assert all(not row["over"] for row in record["rows"])


# -- a real difference ----------------------------------------------------------------------

@pytest.mark.parametrize("tensor, first", [
    ("decoder.layers.1.ffn.linear1.kernel", "decoder.layers.1.ffn"),
    ("decoder.layers.1.cross_attn.k.kernel", "decoder.layers.1.cross_attn.weights"),
    ("encoder.layers.0.self_attn.v.bias", "encoder.layers.0.self_attn"),
])
def test_a_perturbed_tensor_is_found_at_its_first_stage(tmp_path, tiny, checkpoint, tensor, first, capsys):
    cfg, params, src, tgt = tiny
    changed = dict(params)
    changed[tensor] = params[tensor] + np.float32(0.05)
    dump = dump_model(from_params(cfg, changed, "torch"), tmp_path / "other.npz", src, tgt)
    out_json = tmp_path / "d.json"
    assert main(["diff", str(dump), str(checkpoint), "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert f"first difference at {first} " in out
    marked = [line for line in out.splitlines() if "<- first difference" in line]
    assert len(marked) == 1 and marked[0].split()[0] == first
    record = json.loads(out_json.read_text())
    assert record["differ"] is True and record["first_difference"] == first
    rows = {row["stage"]: row for row in record["rows"]}
    assert rows[first]["over"] and rows["logits"]["over"]


# -- bad input --------------------------------------------------------------------------------

def test_sides_with_different_configs_are_refused_naming_the_field(tmp_path, checkpoint, capsys):
    cfg = preset("tiny", d_ff=48)
    other = save_checkpoint(tmp_path / "o.safetensors", cfg, init_params(cfg))
    assert main(["diff", str(checkpoint), str(other)]) == 2
    assert "the sides differ in d_ff: 64" in capsys.readouterr().err


def test_a_dump_of_another_model_shape_is_refused(tmp_path, checkpoint, capsys):
    cfg = preset("tiny", d_model=16, d_ff=32, num_heads=2)
    src, tgt = random_batch(cfg, seed=0)
    dump = dump_model(from_params(cfg, init_params(cfg), "numpy"), tmp_path / "small.npz", src, tgt)
    assert main(["diff", str(dump), str(checkpoint)]) == 2
    assert "d_model 16, the model has 32" in capsys.readouterr().err


def test_two_dumps_of_different_batches_are_refused(tmp_path, tiny, capsys):
    cfg, params, src, tgt = tiny
    model = from_params(cfg, params)
    a = dump_model(model, tmp_path / "a.npz", src, tgt)
    b = dump_model(model, tmp_path / "b.npz", *random_batch(cfg, seed=9))
    assert main(["diff", str(a), str(b)]) == 2
    assert "holds another batch" in capsys.readouterr().err
    assert main(["diff", str(a), str(a)]) == 0  # the same batch: compared, equal


# -- a converted Marian model ------------------------------------------------------------------

def test_marian_directory_against_its_converted_checkpoint(tmp_path, capsys):
    from transformers import MarianConfig, MarianMTModel

    from rosetta.interop.convert import convert

    torch.manual_seed(0)
    marian = MarianMTModel(MarianConfig(
        vocab_size=37, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, forced_eos_token_id=None,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, activation_function="swish",
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for name, p in marian.named_parameters():
            if "embed_positions" not in name:
                p.normal_(1.0 if "layer_norm.weight" in name else 0.0, 0.3)
    marian.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "m.safetensors")
    out_json = tmp_path / "d.json"
    assert main(["diff", str(tmp_path / "hf"), f"{tmp_path / 'm.safetensors'}@torch",
                 "--json", str(out_json)]) == 0
    assert "no difference at any stage" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["tolerance"] == 1e-5


def test_contract_positions_ignore_padding(tiny):
    """A difference only at pad positions is no difference (SPEC §2)."""
    cfg, params, src, tgt = tiny
    assert (src == cfg.pad_id).any() and (tgt == cfg.pad_id).any()
    a = from_params(cfg, params, "numpy", "float64").stages(src, tgt, fine=True)
    b = {k: v.copy() for k, v in a.items()}
    b["encoder"][src == cfg.pad_id] += 1.0
    b["logits"][~target_positions(cfg, tgt)] += 1.0
    assert first_over(compare_stages(cfg.pad_id, src, tgt, a, b, 1e-12)) is None
    b["logits"][0, 0, 0] += 1.0
    assert first_over(compare_stages(cfg.pad_id, src, tgt, a, b, 1e-12)).stage == "logits"


# -- --diagnose, --plot, rosetta attention -------------------------------------------------------

def test_diagnose_names_a_flipped_positional_encoding(tmp_path, tiny, checkpoint, capsys):
    """A port that lays out sines and cosines Marian's way (PITFALLS 1): the diagnosis names it."""
    cfg, params, src, tgt = tiny
    wrong = cfg.replace(positional_encoding="sinusoidal_concat")
    dump = dump_model(from_params(wrong, params, "torch"), tmp_path / "pe.npz", src, tgt)
    assert main(["diff", str(dump), str(checkpoint), "--diagnose"]) == 1
    out = capsys.readouterr().out
    assert "first difference at src_embed " in out
    verdict = out.splitlines()[-1]
    assert "positional_encoding = sinusoidal_concat" in verdict and "src_embed" in verdict


def test_diagnose_between_two_dumps_needs_weights(tmp_path, tiny, capsys):
    cfg, params, src, tgt = tiny
    a = dump_model(from_params(cfg, params), tmp_path / "a.npz", src, tgt)
    b = dump_model(from_params(cfg.replace(scale_embeddings=False), params), tmp_path / "b.npz", src, tgt)
    assert main(["diff", str(a), str(b), "--diagnose"]) == 2
    assert "--diagnose needs the weights of one side" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, tiny, checkpoint, capsys):
    cfg, params, src, tgt = tiny
    q = "decoder.layers.0.self_attn.q.kernel"
    changed = {**params, q: params[q] * 2}
    dump = dump_model(from_params(cfg, changed), tmp_path / "q.npz", src, tgt)
    assert main(["diff", str(dump), str(checkpoint), "--plot", str(tmp_path / "d.png")]) == 1
    assert "first difference at decoder.layers.0.self_attn.weights " in capsys.readouterr().out
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args", [[], ["--src", "5 6 7 2", "--tgt", "1 8 9"]])
def test_attention_plots_one_sentence_pair(tmp_path, checkpoint, args, capsys):
    out = tmp_path / "a.png"
    assert main(["attention", f"{checkpoint}@jax", "--out", str(out), *args]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--src", "5 6 7 2"], "give both --src and --tgt"),
    (["--src", "5 6 700 2", "--tgt", "1 8 9"], "--src: token id 700 is outside the source vocabulary"),
    (["--src", "5 6", "--tgt", "1 x"], "--tgt: 'x' is not a token id"),
])
def test_attention_refuses_bad_ids(tmp_path, checkpoint, args, message, capsys):
    assert main(["attention", str(checkpoint), "--out", str(tmp_path / "a.png"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()


# -- the diagnostic batch: every catalogue entry can show ------------------------------------------

@pytest.mark.parametrize("name", [entry.name for entry in CATALOGUE])
def test_the_diagnostic_batch_lets_every_catalogue_entry_show(name):
    from rosetta.diff.shared.catalogue import BY_NAME, mistaken_stages
    from rosetta.diff.shared.variant import forward_stages

    entry = BY_NAME[name]
    cfg = preset("tiny", **CONFIG_FOR.get(name, {}))  # test_diagnose's: where the entry applies
    src, tgt = diagnostic_batch(cfg)
    assert entry.requires is None or entry.requires(cfg, src, tgt)
    assert entry.applies(cfg, src, tgt)
    params = {k: np.asarray(v, np.float64) for k, v in perturbed_params(cfg).items()}
    correct = forward_stages(params, cfg, src, tgt, fine=True)
    with np.errstate(all="ignore"):
        wrong = mistaken_stages(name, cfg, params, src, tgt, fine=True)
    assert any(not np.array_equal(wrong[s], correct[s], equal_nan=True) for s in correct), name


def test_diagnostic_batch_layout():
    """The rows docs/diff.md describes, for the tiny preset and a short max_len."""
    for cfg in (preset("tiny"), preset("tiny", bos_id=0), preset("tiny", max_len=5)):
        src, tgt = diagnostic_batch(cfg, seed=3)
        S, T = min(11, cfg.max_len), min(9, cfg.max_len - 1)
        assert src.shape == (4, S) and tgt.shape == (4, T)
        real_src, real_tgt = src != cfg.pad_id, tgt != cfg.pad_id
        assert real_src[0].all() and real_tgt[0, 1:].all()          # row 0: full length
        assert 0 < real_src[1].sum() < S and 0 < real_tgt[1, 1:].sum() < T - 1  # row 1: padded
        assert not real_src[2].any()                                # row 2: all padding
        assert real_src[3].sum() == 1 and not real_tgt[3, 1:].any()  # row 3: one token, the start token
        assert (tgt[:, 0] == cfg.bos_id).all()
        np.testing.assert_array_equal(diagnostic_batch(cfg, seed=3)[0], src)  # deterministic
    src, _ = random_batch(preset("tiny"))  # the old default: no source row of nothing but padding
    assert (src != preset("tiny").pad_id).any(axis=1).all()


def test_diff_runs_on_the_diagnostic_batch_by_default(tmp_path, checkpoint, capsys):
    cfg = preset("tiny")
    counted = {}
    for flags in ([], ["--batch", "random"], ["--batch", "random", "--seed", "4"]):
        out = tmp_path / "d.json"
        assert main(["diff", f"{checkpoint}@torch", str(checkpoint), "--json", str(out), *flags]) == 0
        counted[" ".join(flags)] = json.loads(out.read_text())["logits"]["positions"]
    # The number of counted target positions tells which batch ran (rosetta.parity.target_positions).
    assert counted[""] == target_positions(cfg, diagnostic_batch(cfg)[1]).sum()
    assert counted["--batch random"] == target_positions(cfg, random_batch(cfg)[1]).sum()
    assert counted["--batch random --seed 4"] == target_positions(cfg, random_batch(cfg, seed=4)[1]).sum()
    capsys.readouterr()
    assert main(["diff", str(checkpoint), str(checkpoint), "--batch", "random", "--src", "5 6"]) == 2
    assert "--batch picks the batch of two models without --src" in capsys.readouterr().err


def test_two_dumps_of_different_widths_are_refused(tmp_path, tiny, capsys):
    cfg, params, src, tgt = tiny
    a = dump_model(from_params(cfg, params), tmp_path / "a.npz", src, tgt)
    narrow = preset("tiny", d_model=16, d_ff=32, num_heads=2)
    b = dump_model(from_params(narrow, init_params(narrow)), tmp_path / "b.npz", src, tgt)
    assert main(["diff", str(a), str(b)]) == 2
    assert "stage 'src_embed' has shape (3, 6, 32) on one side and (3, 6, 16)" in capsys.readouterr().err


def test_side_specs(tmp_path, checkpoint, capsys):
    from rosetta.diff.forward.sides import parse_side

    side = parse_side(f"{checkpoint}@torch:float64")
    assert (side.model.name, side.model.dtype, side.tolerance) == ("torch", "float64", 1e-12)
    assert side.weights[0] == side.config == preset("tiny")
    assert parse_side(str(checkpoint)).model.dtype == "float64"
    odd = tmp_path / "a@b"  # an '@' that is not a backend belongs to the path
    odd.mkdir()
    at = save_checkpoint(odd / "m.safetensors", *load_tiny(checkpoint))
    assert parse_side(str(at)).model.name == "numpy"
    assert main(["diff", f"{checkpoint}@torch:int8", str(checkpoint)]) == 2
    assert "backend 'torch' has no dtype 'int8'" in capsys.readouterr().err


def load_tiny(path):
    from rosetta import load_checkpoint

    ckpt = load_checkpoint(path)
    return ckpt.config, ckpt.params


@pytest.mark.parametrize("content, message", [
    (None, "no such dump file"),
    (b"not a zip", "not a readable .npz dump"),
    ("npy", "not a readable .npz dump"),
    ("dir", "x.npz: a directory, not an .npz dump file"),
    ("fifo", "x.npz: not a regular file, not an .npz dump file"),  # never opened: opening one blocks
])
def test_unreadable_dumps_are_refused(tmp_path, checkpoint, content, message, capsys):
    import os

    path = tmp_path / "x.npz"
    if content == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    elif content == "dir":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        read_dump(path)
    capsys.readouterr()
    assert main(["diff", str(path), str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rosetta: error:") and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Linux's /proc: no file can be created there")
@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_no_file_can_be_created_at_is_refused_before_the_diff(checkpoint, flag, capsys):
    """Issue 39: `diff A B --diagnose --json /proc/x.json` compared, diagnosed, then died on the
    temporary file; now argparse refuses it first, naming the flag, the path and the folder."""
    import time

    capsys.readouterr()
    start = time.perf_counter()
    assert main(["diff", str(checkpoint), str(checkpoint), "--diagnose", flag, "/proc/x.out"]) == 2
    err = capsys.readouterr().err
    assert err == (f"rosetta: error: argument {flag}: cannot write /proc/x.out: a file cannot be created in "
                   f"/proc (No such file or directory)\n"), err
    assert time.perf_counter() - start < 5  # before any model is run (argparse)
