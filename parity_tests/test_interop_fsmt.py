"""Hugging Face FSMT (fairseq's WMT19 Transformer) <-> the canonical checkpoint, checked against
transformers' own FSMTForConditionalGeneration.

The expected values come from Hugging Face's code: an `FSMTForConditionalGeneration` built here from
`FSMTConfig` (random weights), saved with `save_pretrained`, is the reference for logits, greedy and
beam search; the float64 comparison reads fairseq's positional table from its formula, written out
here (modeling_fsmt.SinusoidalPositionalEmbedding.get_embedding, in float64).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers import FSMTConfig, FSMTForConditionalGeneration
from transformers.models.fsmt import modeling_fsmt

import rosetta
from rosetta.backends import MODEL_BACKENDS
from rosetta.cli import main
from rosetta.errors import CheckpointError, ConfigError, TokenizerError
from rosetta.interop.convert import convert, detect_format
from rosetta.interop.fsmt import is_fsmt, params_to_fsmt, read_fsmt, table_tolerance, write_fsmt

EOS = 2  # fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3; the decoder starts from </s>
BASE = dict(langs=["en", "de"], src_vocab_size=23, tgt_vocab_size=19, d_model=16, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1, eos_token_id=EOS,
            decoder_start_token_id=EOS, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0)
# (FSMTConfig fields, how the test ties the tables, the sharing the tables then show). Every sharing,
# relu / gelu / gelu_new / swish, embedding scaling on and off, fairseq's pad 1 and another (pad 3:
# positions from row 4).
CONFIGS = {
    "none-relu-scaled": (dict(activation_function="relu", scale_embedding=True), None, "none"),
    "decoder-gelu-unscaled": (dict(activation_function="gelu", scale_embedding=False), "output", "decoder"),
    "all-swish-tied": (dict(activation_function="swish", src_vocab_size=19, tie_word_embeddings=True),
                       None, "all"),
    "src_tgt-gelu_new-pad3": (dict(activation_function="gelu_new", src_vocab_size=19, pad_token_id=3),
                              "encoder", "src_tgt"),
}
# Relative, float32 Hugging Face vs each backend: float32 rounds each of the few hundred operations on
# a logit's path by 6e-8 relative; LayerNorm and the 0.3-scale random weights amplify it at most ~10x
# here, and HF's float32 positional table (table_tolerance) adds < 1e-6 at these positions: <= 5e-7
# observed in every backend and case (transformers 5.24), 1e-5 leaves a margin, while a convention
# error moves logits by O(0.1) (position_offset 0 instead of pad + 1: 0.24 to 0.40).
TOLERANCE = 1e-5
# Relative, float64 vs float64: 1.1e-16 per operation through the same amplification gives ~1e-14
# at most (<= 9e-16 observed); 1e-12 is above it and far below any convention error.
TOLERANCE_64 = 1e-12


def make_fsmt(name: str, seed: int = 0) -> FSMTForConditionalGeneration:
    """An FSMTForConditionalGeneration of CONFIGS[name], every parameter drawn at a useful scale, its
    tables tied as the case says (copies: FSMT keeps three tensors unless tie_word_embeddings)."""
    overrides, tie, _ = CONFIGS[name]
    torch.manual_seed(seed)
    model = FSMTForConditionalGeneration(FSMTConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():  # tied tensors appear once: ties survive
            if "embed_positions" in pname:  # the sinusoidal table, a frozen parameter
                continue
            p.normal_(1.0 if "layer_norm.weight" in pname else 0.0, 0.3)
        decoder = model.model.decoder
        if tie == "output":  # fairseq's WMT19 models: the output projection is the target table
            decoder.output_projection.weight.copy_(decoder.embed_tokens.weight)
        if tie == "encoder":
            model.model.encoder.embed_tokens.weight.copy_(decoder.embed_tokens.weight)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def fsmt_dir(request, tmp_path_factory):
    model = make_fsmt(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def batch(cfg: rosetta.ModelConfig, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Source ids ending in eos with right padding; decoder input [start, tokens..., pad...]; tokens
    from 4 up (no special id)."""
    rng = np.random.default_rng(seed)
    src, tgt = np.full((3, 7), cfg.pad_id), np.full((3, 6), cfg.pad_id)
    for b, (n, m) in enumerate([(6, 5), (3, 2), (1, 4)]):
        src[b, :n] = rng.integers(4, cfg.src_vocab_size, size=n)
        src[b, n] = EOS
        tgt[b, 0] = cfg.bos_id
        tgt[b, 1: m + 1] = rng.integers(4, cfg.tgt_vocab_size, size=m)
    return src, tgt


def hf_logits(model: FSMTForConditionalGeneration, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Teacher-forced logits. use_cache=False: FSMTModel builds its causal and decoder-padding masks
    only then, and config.json's use_cache (true) would leave the decoder unmasked."""
    pad = model.config.pad_token_id
    with torch.no_grad():
        return model(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != pad),
                     decoder_input_ids=torch.tensor(tgt), use_cache=False).logits.double().numpy()


def relative(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float:
    return float(np.linalg.norm((a - b)[where]) / np.linalg.norm(b[where]))


def real_targets(cfg: rosetta.ModelConfig, tgt: np.ndarray) -> np.ndarray:
    return tgt != cfg.pad_id  # the start token is </s>, never pad (the reader refuses that)


def fairseq_table(rows: int, d: int, pad: int) -> torch.Tensor:
    """get_embedding of modeling_fsmt.py in float64: exp(-i ln(1e4) / (d/2 - 1)), [sin | cos], row pad 0."""
    half = d // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    table[pad] = 0
    return table


def test_fsmt_logits_in_every_backend(fsmt_dir, backend):
    name, model, path = fsmt_dir
    assert is_fsmt(path) and detect_format(path) == "fsmt"
    cfg, params = read_fsmt(path)
    assert cfg.share_embeddings == CONFIGS[name][2]
    assert cfg.position_offset == model.config.pad_token_id + 1
    src, tgt = batch(cfg)
    ours = rosetta.from_params(cfg, params, backend=backend).logits(src, tgt)
    theirs = hf_logits(model, src, tgt)
    assert relative(np.asarray(ours, np.float64), theirs, real_targets(cfg, tgt)) <= TOLERANCE


def test_fsmt_logits_in_float64(fsmt_dir, backend, monkeypatch):
    """Every backend in float64 against Hugging Face in float64, its positional tables replaced by
    fairseq's formula in float64 (it computes them in float32: table_tolerance). FSMT's causal mask
    helper fills a float32 tensor with the compute dtype's minimum, which overflows in float64: it
    gets the float64 minimum instead (the same zero weight after softmax)."""
    monkeypatch.setattr(modeling_fsmt, "fill_with_neg_inf", lambda t: t.fill_(torch.finfo(t.dtype).min))
    _, model, path = fsmt_dir
    cfg, params = read_fsmt(path)
    hf = copy.deepcopy(model).double()
    with torch.no_grad():
        for stack in (hf.model.encoder, hf.model.decoder):
            stack.embed_positions.weight.copy_(fairseq_table(*stack.embed_positions.weight.shape, cfg.pad_id))
    src, tgt = batch(cfg, seed=2)
    ours = rosetta.from_params(cfg, params, backend=backend, dtype="float64").logits(src, tgt)
    assert relative(np.asarray(ours), hf_logits(hf, src, tgt), real_targets(cfg, tgt)) <= TOLERANCE_64


def test_fsmt_to_ours_to_fsmt_is_bit_exact(fsmt_dir):
    """Every stored tensor comes back bit for bit, the positional tables (recomputed, not stored in
    our checkpoint) within fairseq's float32 rounding of them."""
    _, _, path = fsmt_dir
    stored = safetensors.numpy.load_file(str(path / "model.safetensors"))
    cfg, params = read_fsmt(path)
    back = params_to_fsmt(cfg, params)
    assert set(back) == set(stored)
    for name, value in stored.items():
        assert back[name].dtype == value.dtype, name
        if "embed_positions" in name:
            bound = table_tolerance(value.shape[0], value.dtype)
            assert np.max(np.abs(back[name].astype(np.float64) - value)) <= bound, name
        else:
            assert np.array_equal(back[name], value), name


@pytest.mark.parametrize("share", ["all", "src_tgt", "decoder", "none"])
def test_ours_to_fsmt_to_ours_and_from_pretrained(tmp_path, share):
    """A checkpoint of ours, `rosetta convert --to fsmt`: the config and weights come back exactly,
    and transformers' from_pretrained computes our logits."""
    cfg = rosetta.ModelConfig(src_vocab_size=21 if share in ("decoder", "none") else 19, tgt_vocab_size=19,
                              d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=2, d_ff=24,
                              dropout=0.0, activation_dropout=0.0, activation="gelu_tanh", max_len=40,
                              positional_encoding="sinusoidal_concat_t2t", position_offset=2,
                              share_embeddings=share, pad_id=1, bos_id=EOS, eos_id=EOS, final_norm=False)
    rng = np.random.default_rng(0)
    params = {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in rosetta.init_params(cfg, seed=0).items()}
    rosetta.save_checkpoint(tmp_path / "ours.safetensors", cfg, params)
    result = convert(tmp_path / "ours.safetensors", tmp_path / "hf", to_format="fsmt")
    assert result.to_format == "fsmt"
    cfg2, params2 = read_fsmt(tmp_path / "hf")
    assert cfg2 == cfg
    assert set(params2) == set(params) and all(np.array_equal(params2[k], params[k]) for k in params)
    hf = FSMTForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    src, tgt = batch(cfg)
    ours = rosetta.from_params(cfg, params, backend="numpy").logits(src, tgt)
    assert relative(ours, hf_logits(hf, src, tgt), real_targets(cfg, tgt)) <= TOLERANCE


# -- search against generate ---------------------------------------------------------------------

def hf_search(model: FSMTForConditionalGeneration, src_row: np.ndarray, max_new_tokens: int, beams: int = 1,
              alpha: float = 1.0) -> list[int]:
    """Hugging Face's search on one sentence (beam: its default early_stopping=False), without the
    start token, cut at eos, pad never generated (as ours)."""
    pad = model.config.pad_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor(src_row[None]), num_beams=beams, do_sample=False,
                             length_penalty=alpha, early_stopping=False, max_new_tokens=max_new_tokens,
                             bad_words_ids=[[pad]], forced_eos_token_id=None)[0, 1:].tolist()
    return [t for t in (out[: out.index(EOS)] if EOS in out else out) if t != pad]


def end_some_sentences(model: FSMTForConditionalGeneration, src: np.ndarray, steps: int) -> None:
    """Lift eos's logit so that greedy search ends some sentences early and not others (random
    weights rarely choose eos). FSMT's logits have no bias: coordinate 0 of the last LayerNorm is
    made the constant 1 (scale 0, bias 1), so column 0 of the (untied) output projection is one;
    eos's entry is then the median, over the sentences, of the least gap by which eos trails the best
    token along the greedy path."""
    norm, out = model.model.decoder.layers[-1].final_layer_norm, model.model.decoder.output_projection
    pad = model.config.pad_token_id
    with torch.no_grad():
        norm.weight[0], norm.bias[0] = 0.0, 1.0
        out.weight[:, 0] = 0.0
    gaps = []
    for row in src:
        row = row[row != pad]
        path = [model.config.decoder_start_token_id] + hf_search(model, row, steps)
        logits = hf_logits(model, row[None], np.array([path]))[0]
        gaps.append(float((logits.max(-1) - logits[:, EOS]).min()))
    with torch.no_grad():
        out.weight[EOS, 0] = float(np.median(gaps)) + 1e-3


SEARCHED = ["none-relu-scaled", "src_tgt-gelu_new-pad3"]  # an untied output projection to lift eos in


@pytest.fixture(scope="module", params=SEARCHED)
def ending_dir(request, tmp_path_factory):
    """A model of SEARCHED whose greedy search ends some of `batch(seed=3)`'s sentences early."""
    model = make_fsmt(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, _ = read_fsmt(path)
    src, _ = batch(cfg, seed=3)
    end_some_sentences(model, src, steps=src.shape[1] + 6)
    model.save_pretrained(path)
    cfg, params = read_fsmt(path)
    return model, cfg, params, src


def test_fsmt_greedy_equals_generate(ending_dir):
    model, cfg, params, src = ending_dir
    margin = 6
    limits = (src != cfg.pad_id).sum(axis=1) + margin
    theirs = [hf_search(model, row[row != cfg.pad_id], int(limit))
              for row, limit in zip(src, limits, strict=True)]
    for backend in MODEL_BACKENDS:
        model_b = rosetta.from_params(cfg, params, backend=backend)
        ours = model_b.generate(src, beam_size=1, max_len_margin=margin)
        assert ours.tokens == theirs, backend
    lengths = [len(t) for t in theirs]
    assert any(n < limit for n, limit in zip(lengths, limits, strict=True)), lengths  # some ended with eos
    assert any(n > 0 for n in lengths), lengths


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_fsmt_beam_with_the_hugging_face_rule_equals_generate(ending_dir, alpha):
    model, cfg, params, src = ending_dir
    margin = 5
    limits = (src != cfg.pad_id).sum(axis=1) + margin
    theirs = [hf_search(model, row[row != cfg.pad_id], int(limit), beams=4, alpha=alpha)
              for row, limit in zip(src, limits, strict=True)]
    for backend in MODEL_BACKENDS:
        ours = rosetta.from_params(cfg, params, backend=backend).generate(
            src, beam_size=4, alpha=alpha, max_len_margin=margin, length_rule="hf")
        assert ours.tokens == theirs, backend


# -- refusals ------------------------------------------------------------------------------------

def _saved(tmp_path, name="none-relu-scaled"):
    path = tmp_path / "m"
    make_fsmt(name).save_pretrained(path)
    return path


@pytest.mark.parametrize("field, value", [
    ("decoder_attention_heads", 2), ("decoder_ffn_dim", 16), ("activation_function", "quick_gelu"),
    ("decoder_start_token_id", 1), ("eos_token_id", [2, 3]), ("tie_word_embeddings", True),
    ("dtype", "int8"), ("scale_embedding", "yes"), ("pad_token_id", None), ("model_type", "bart")])
def test_config_fields_fsmt_computes_and_we_cannot_are_refused(tmp_path, field, value):
    """Each is refused naming the field: heads or widths per stack, an activation, a start token equal
    to pad (FSMT masks it), several end tokens, one table for unequal vocabularies, a non-float dtype,
    a mistyped or null field, another model."""
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError, match=field):
        read_fsmt(path)


def test_fields_fsmt_ignores_are_noted_once(tmp_path, capsys):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    extra = {"normalize_before": True, "encoder_layerdrop": 0.1, "hidden_size": 16, "my_field": 1}
    (path / "config.json").write_text(json.dumps({**config, **extra}))
    read_fsmt(path)
    read_fsmt(path)
    err = capsys.readouterr().err
    for field in ("normalize_before", "encoder_layerdrop", "my_field"):
        assert err.count(field) == 1, (field, err)
    assert "hidden_size" not in err  # an alias of d_model, agreeing with it


@pytest.mark.parametrize("field, value", [
    ("norm_first", True), ("final_norm", True), ("positional_encoding", "sinusoidal_concat"),
    ("position_offset", 0), ("layer_norm_eps", 1e-6), ("output_bias", True), ("logit_scale", 0.5),
    ("bos_id", 1)])
def test_unrepresentable_config_is_refused_and_nothing_written(tmp_path, field, value):
    base = dict(src_vocab_size=11, tgt_vocab_size=11, d_model=8, num_heads=2, num_encoder_layers=1,
                num_decoder_layers=1, d_ff=8, positional_encoding="sinusoidal_concat_t2t", position_offset=2,
                pad_id=1, bos_id=2, eos_id=2, max_len=16)
    cfg = rosetta.ModelConfig(**{**base, field: value})
    with pytest.raises(ConfigError, match=field):
        write_fsmt(tmp_path / "hf", cfg, rosetta.init_params(cfg, seed=0))
    assert not (tmp_path / "hf").exists()


def test_missing_misshapen_and_foreign_tensors_are_named(tmp_path):
    path = _saved(tmp_path)
    weights = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    name = "model.decoder.layers.1.encoder_attn.v_proj.bias"
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if k != name}, str(weights))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        read_fsmt(path)
    out = "model.decoder.output_projection.weight"  # untied: FSMT would draw it at random
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if k != out}, str(weights))
    with pytest.raises(CheckpointError, match="output projection"):
        read_fsmt(path)
    safetensors.numpy.save_file({**tensors, name: tensors[name][:-1]}, str(weights))
    with pytest.raises(CheckpointError, match="shape"):
        read_fsmt(path)
    bias = np.zeros((1, 19), np.float32)  # BART's and Marian's logits bias: FSMT has none
    safetensors.numpy.save_file({**tensors, "final_logits_bias": bias}, str(weights))
    with pytest.raises(CheckpointError, match="unexpected tensor final_logits_bias"):
        read_fsmt(path)
    table = "model.encoder.embed_positions.weight"
    shifted = np.roll(tensors[table], 1, axis=0)  # a table one row off: FSMT would compute with it
    safetensors.numpy.save_file({**tensors, table: shifted}, str(weights))
    with pytest.raises(CheckpointError, match=table.replace(".", r"\.")):
        read_fsmt(path)


# -- the tokenizer's files -----------------------------------------------------------------------

def write_fsmt_tokenizer(path, src_size: int, tgt_size: int) -> None:
    """The files FSMTTokenizer.save_pretrained writes (fairseq's special ids), for sizes of a model."""
    special = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for name, size in (("vocab-src.json", src_size), ("vocab-tgt.json", tgt_size)):
        vocab = {**special, **{f"w{i}</w>": i for i in range(4, size)}}
        (path / name).write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("w 1</w>\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"langs": ["en", "de"],
                                                            "tokenizer_class": "FSMTTokenizer"}))


def test_tokenizer_files_travel_and_translate_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    """DIR -> ours -> --to fsmt: the vocabularies, merges and langs go along (checked against the
    model); `rosetta translate` on the directory names what tokenizing its text needs."""
    path = _saved(tmp_path)
    write_fsmt_tokenizer(path, 23, 19)
    convert(path, tmp_path / "ours.safetensors")
    for name in ("vocab-src.json", "vocab-tgt.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / "ours.tokenizer" / name).read_bytes() == (path / name).read_bytes(), name
    convert(tmp_path / "ours.safetensors", tmp_path / "back", to_format="fsmt")
    assert (tmp_path / "back" / "vocab-tgt.json").read_bytes() == (path / "vocab-tgt.json").read_bytes()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["langs"] == ["en", "de"]
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("Hallo Welt\n"))
    assert main(["translate", "--checkpoint", str(tmp_path / "back"), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sacremoses" in err and "vocab-src.json" in err, err


def test_tokenizer_of_another_model_is_refused_before_writing(tmp_path):
    path = _saved(tmp_path)
    write_fsmt_tokenizer(path, 23, 17)  # the target vocabulary of another model
    with pytest.raises(TokenizerError, match="vocab-tgt.json"):
        convert(path, tmp_path / "ours.safetensors")
    assert not (tmp_path / "ours.safetensors").exists()
