"""Hugging Face Marian <-> the canonical checkpoint, checked against transformers' own MarianMTModel.

The expected values come from Hugging Face's code: a `MarianMTModel` built here from `MarianConfig`
(random weights), saved with `save_pretrained`, is the reference for logits and greedy search.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers import MarianConfig, MarianMTModel

import rosetta
from rosetta.backends import MODEL_BACKENDS
from rosetta.errors import CheckpointError, ConfigError
from rosetta.interop.marian import is_marian, params_to_marian, read_marian, write_marian

PAD, EOS = 0, 2
BASE = dict(vocab_size=37, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
            pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=None,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
# Tied and untied vocabularies, swish / gelu / gelu_new / relu, embedding scaling on and off, the
# start token equal to pad (opus-mt) and not.
CONFIGS = {
    "shared-tied-swish-scaled": dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
                                     activation_function="swish", scale_embedding=True),
    "own-vocab-tied-gelu": dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=True,
                                decoder_vocab_size=29, activation_function="gelu", scale_embedding=False),
    "own-vocab-untied-gelu_new-start1": dict(share_encoder_decoder_embeddings=False,
                                             tie_word_embeddings=False, decoder_vocab_size=31,
                                             activation_function="gelu_new", scale_embedding=True,
                                             decoder_start_token_id=1),
    "shared-untied-relu": dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=False,
                               activation_function="relu", scale_embedding=False),
}
TOLERANCE = 1e-5  # relative, float32 Hugging Face vs each backend (numpy in float64)


def make_marian(overrides: dict, seed: int = 0) -> MarianMTModel:
    """A MarianMTModel with every parameter and final_logits_bias drawn at a useful scale."""
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**{**BASE, **overrides})).eval()
    if model.config.share_encoder_decoder_embeddings and not model.config.tie_word_embeddings:
        # transformers 4 tied both stacks to `shared` here; 5 keeps three tables: tie them as 4 did
        model.model.encoder.embed_tokens = model.model.decoder.embed_tokens = model.model.shared
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied tensors appear once: ties survive
            if "embed_positions" in name:  # the sinusoidal table, a frozen parameter
                continue
            p.normal_(1.0 if "layer_norm.weight" in name else 0.0, 0.3)
        model.final_logits_bias.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def marian_dir(request, tmp_path_factory):
    model = make_marian(CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def batch(cfg: rosetta.ModelConfig, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Source ids ending in eos with right padding; decoder input [start, tokens..., pad...]."""
    rng = np.random.default_rng(seed)
    src, tgt = np.full((3, 7), PAD), np.full((3, 6), PAD)
    for b, (n, m) in enumerate([(6, 5), (3, 2), (1, 4)]):
        src[b, :n] = rng.integers(3, cfg.src_vocab_size, size=n)
        src[b, n] = EOS
        tgt[b, 0] = cfg.bos_id
        tgt[b, 1: m + 1] = rng.integers(3, cfg.tgt_vocab_size, size=m)
    return src, tgt


def hf_logits(model: MarianMTModel, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != PAD),
                     decoder_input_ids=torch.tensor(tgt)).logits.double().numpy()


def relative(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float:
    return float(np.linalg.norm((a - b)[where]) / np.linalg.norm(b[where]))


def test_marian_logits_in_every_backend(marian_dir, backend):
    model, path = marian_dir
    assert is_marian(path)
    cfg, params = read_marian(path)
    src, tgt = batch(cfg)
    real = tgt != PAD
    real[:, 0] = True  # the start token is real even where it equals pad (SPEC §2)
    ours = rosetta.from_params(cfg, params, backend=backend).logits(src, tgt)
    assert relative(np.asarray(ours, np.float64), hf_logits(model, src, tgt), real) <= TOLERANCE


def hf_greedy(model: MarianMTModel, src_row: np.ndarray, max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy search on one sentence, without the start token, cut at eos."""
    with torch.no_grad():
        out = model.generate(torch.tensor(src_row[None]), num_beams=1, do_sample=False,
                             max_new_tokens=max_new_tokens, bad_words_ids=[[PAD]],
                             forced_eos_token_id=None)[0, 1:].tolist()
    return [t for t in (out[: out.index(EOS)] if EOS in out else out) if t != PAD]


def end_some_sentences(model: MarianMTModel, src: np.ndarray, steps: int) -> None:
    """Raise eos's bias so that greedy search ends some sentences early and not others: random
    weights rarely choose eos. Along each sentence's greedy path, eos trails the best token by
    some minimum gap; lifting eos by the median of those gaps ends the sentences below it."""
    gaps = []
    for row in src:
        row = row[row != PAD]
        path = [model.config.decoder_start_token_id] + hf_greedy(model, row, steps)
        logits = hf_logits(model, row[None], np.array([path]))[0]
        gaps.append(float((logits.max(-1) - logits[:, EOS]).min()))
    with torch.no_grad():
        model.final_logits_bias[0, EOS] += float(np.median(gaps)) + 1e-3


def test_marian_greedy_equals_generate(marian_dir, tmp_path):
    model, path = marian_dir
    cfg, _ = read_marian(path)
    src, _ = batch(cfg, seed=3)
    margin = 6
    model = MarianMTModel.from_pretrained(path).eval()  # a copy: the fixture's model stays as it is
    end_some_sentences(model, src, steps=src.shape[1] + margin)
    model.save_pretrained(tmp_path / "eos")
    cfg, params = read_marian(tmp_path / "eos")
    limits = (src != PAD).sum(axis=1) + margin
    for backend in MODEL_BACKENDS:
        model_b = rosetta.from_params(cfg, params, backend=backend)
        ours = model_b.generate(src, beam_size=1, max_len_margin=margin)
        for b, row in enumerate(src):  # one sentence at a time: Hugging Face has one length limit per call
            assert ours.tokens[b] == hf_greedy(model, row[row != PAD], int(limits[b])), (backend, b)
    lengths = [len(t) for t in ours.tokens]
    assert any(n < limit for n, limit in zip(lengths, limits, strict=True)), lengths  # some ended with eos
    assert any(n > 0 for n in lengths), lengths


def hf_beam(model: MarianMTModel, src_row: np.ndarray, max_new_tokens: int, alpha: float) -> list[int]:
    """Hugging Face's beam search (4 beams, its default early_stopping=False) on one sentence."""
    with torch.no_grad():
        out = model.generate(torch.tensor(src_row[None]), num_beams=4, do_sample=False, length_penalty=alpha,
                             early_stopping=False, max_new_tokens=max_new_tokens, bad_words_ids=[[PAD]],
                             forced_eos_token_id=None)[0, 1:].tolist()
    return [t for t in (out[: out.index(EOS)] if EOS in out else out) if t != PAD]


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_marian_beam_with_the_hugging_face_rule_equals_generate(marian_dir, tmp_path, alpha):
    model, path = marian_dir
    cfg, _ = read_marian(path)
    src, _ = batch(cfg, seed=4)
    margin = 5
    model = MarianMTModel.from_pretrained(path).eval()
    end_some_sentences(model, src, steps=src.shape[1] + margin)
    model.save_pretrained(tmp_path / "eos")
    cfg, params = read_marian(tmp_path / "eos")
    limits = (src != PAD).sum(axis=1) + margin
    theirs = [hf_beam(model, row[row != PAD], int(limit), alpha)
              for row, limit in zip(src, limits, strict=True)]
    for backend in MODEL_BACKENDS:
        ours = rosetta.from_params(cfg, params, backend=backend).generate(
            src, beam_size=4, alpha=alpha, max_len_margin=margin, length_rule="hf")
        assert ours.tokens == theirs, backend


def test_marian_to_ours_to_marian_is_bit_exact(marian_dir):
    _, path = marian_dir
    stored = safetensors.numpy.load_file(str(path / "model.safetensors"))
    cfg, params = read_marian(path)
    back = params_to_marian(cfg, params)
    for name, value in stored.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name
    for name in set(back) - set(stored):  # we also write the tied copies transformers 5 needs
        assert name.endswith("embed_tokens.weight")
        assert np.array_equal(back[name], stored["model.shared.weight"])


@pytest.mark.parametrize("share", ["all", "src_tgt", "decoder", "none"])
def test_ours_to_marian_to_ours_and_from_pretrained(tmp_path, share):
    cfg = rosetta.ModelConfig(src_vocab_size=23, tgt_vocab_size=23 if share in ("all", "src_tgt") else 19,
                              d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=2, d_ff=24,
                              dropout=0.0, positional_encoding="sinusoidal_concat", share_embeddings=share,
                              output_bias=True, activation="gelu_tanh", max_len=40,
                              activation_dropout=0.0, final_norm=False)
    rng = np.random.default_rng(0)
    params = {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in rosetta.init_params(cfg, seed=0).items()}
    write_marian(tmp_path / "hf", cfg, params)
    cfg2, params2 = read_marian(tmp_path / "hf")
    assert cfg2 == cfg
    assert set(params2) == set(params) and all(np.array_equal(params2[k], params[k]) for k in params)
    hf = MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    src, tgt = batch(cfg)
    real = tgt != PAD
    real[:, 0] = True
    ours = rosetta.from_params(cfg, params, backend="numpy").logits(src, tgt)
    assert relative(ours, hf_logits(hf, src, tgt), real) <= TOLERANCE


def test_absent_biases_are_written_as_zeros(tmp_path):
    cfg = rosetta.ModelConfig(src_vocab_size=11, tgt_vocab_size=11, d_model=8, num_heads=2,
                              num_encoder_layers=1,
                              num_decoder_layers=1, d_ff=8, positional_encoding="sinusoidal_concat",
                              attention_bias=False, ffn_bias=False, output_bias=False)
    params = rosetta.init_params(cfg, seed=1)
    write_marian(tmp_path / "hf", cfg, params)
    cfg2, params2 = read_marian(tmp_path / "hf")
    assert cfg2.attention_bias and cfg2.ffn_bias and cfg2.output_bias
    src, tgt = batch(cfg)
    a = rosetta.from_params(cfg, params, backend="numpy").logits(src, tgt)
    b = rosetta.from_params(cfg2, params2, backend="numpy").logits(src, tgt)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("field, value", [("norm_first", True), ("final_norm", True),
                                          ("positional_encoding", "sinusoidal_interleaved"),
                                          ("layer_norm_eps", 1e-6), ("position_offset", 2)])
def test_unrepresentable_config_is_refused_and_nothing_written(tmp_path, field, value):
    base = dict(src_vocab_size=11, tgt_vocab_size=11, d_model=8, num_heads=2, num_encoder_layers=1,
                num_decoder_layers=1, d_ff=8, positional_encoding="sinusoidal_concat")
    cfg = rosetta.ModelConfig(**{**base, field: value})
    with pytest.raises(ConfigError, match=field):
        write_marian(tmp_path / "hf", cfg, rosetta.init_params(cfg, seed=0))
    assert not (tmp_path / "hf").exists()


def _saved(tmp_path, overrides=CONFIGS["own-vocab-tied-gelu"]):
    path = tmp_path / "m"
    make_marian(overrides).save_pretrained(path)
    return path


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    path = _saved(tmp_path)
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    name = "model.decoder.layers.1.encoder_attn.v_proj.bias"
    kept = {k: v for k, v in tensors.items() if k != name}
    safetensors.numpy.save_file(kept, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        read_marian(path)
    tensors[name] = tensors[name][:-1]
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        read_marian(path)


def test_config_that_is_not_marian_or_inconsistent_is_refused(tmp_path):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    assert not is_marian(path)
    with pytest.raises(ConfigError, match="model_type"):
        read_marian(path)
    (path / "config.json").write_text(json.dumps({**config, "decoder_attention_heads": 2}))
    with pytest.raises(ConfigError, match="decoder_attention_heads"):
        read_marian(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError):
        read_marian(path)


def test_pytorch_model_bin_is_read_weights_only(tmp_path):
    model = make_marian(CONFIGS["shared-tied-swish-scaled"])
    path = tmp_path / "bin"
    model.save_pretrained(path)
    reference = read_marian(path)[1]
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    _, params = read_marian(path)
    assert all(np.array_equal(params[k], reference[k]) for k in reference)

    class Payload:  # an arbitrary object: weights_only unpickling must refuse it, never run it
        def __reduce__(self):
            return (print, ("pickle code ran",))

    torch.save({"model.shared.weight": Payload()}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        read_marian(path)


def test_shared_flag_without_tied_output_follows_what_transformers_computes(tmp_path):
    """share_encoder_decoder_embeddings without tie_word_embeddings: transformers 5 computes with
    three separate tables (encoder, decoder, lm_head); the conversion reads what it computes."""
    torch.manual_seed(5)
    model = MarianMTModel(MarianConfig(**{**BASE, "share_encoder_decoder_embeddings": True,
                                          "tie_word_embeddings": False})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.normal_(1.0 if "layer_norm.weight" in name else 0.0, 0.3)
    assert not torch.equal(model.model.encoder.embed_tokens.weight, model.model.decoder.embed_tokens.weight)
    model.save_pretrained(tmp_path)
    cfg, params = read_marian(tmp_path)
    assert cfg.share_embeddings == "none"
    src, tgt = batch(cfg)
    real = tgt != PAD
    real[:, 0] = True
    ours = rosetta.from_params(cfg, params, backend="numpy").logits(src, tgt)
    assert relative(ours, hf_logits(model, src, tgt), real) <= TOLERANCE
