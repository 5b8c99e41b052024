"""Flax WMT interop (rosetta/interop/flax_wmt.py) against independent references.

Expected values never come from the converter: (1) a float64 NumPy forward written here from the
example's documented rules (google/flax examples/wmt/models.py: pre-norm, LayerNorm eps 1e-6, the
sinusoidal_init table, head-shaped attention kernels, unscaled embeddings, `logits_via_embedding`
dividing by sqrt(d), masks `ids > 0` with the decoder mask taken from the targets); (2) a model
built here from flax.linen's own primitives (nn.Embed, nn.LayerNorm, nn.MultiHeadDotProductAttention,
nn.Dense) with the example's module names, initialised by flax; (3) flax.serialization itself for
the msgpack bytes, both ways.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from flax import linen as nn

import rosetta
from rosetta import CheckpointError, ConfigError, ModelConfig, init_params, save_checkpoint
from rosetta.interop import flax_msgpack
from rosetta.interop.flax_msgpack import decode_tree, encode_tree
from rosetta.interop.flax_wmt import is_flax_wmt, read_flax_wmt, write_flax_wmt

# (share_embeddings, logits_via_embedding) of the example's TransformerConfig -> ours
MODES = {(True, True): "all", (True, False): "src_tgt", (False, True): "decoder", (False, False): "none"}
B, S, T, LAYERS, MLP = 3, 7, 6, 2, 24
POSITIONS = "sinusoidal_concat_t2t"


# -- the example's structure and math, written from its documented rules ---------------------------

def t2t_table(length: int, d: int) -> np.ndarray:
    """models.sinusoidal_init: [sin | cos], frequencies exp(-i ln(10000) / (d/2 - 1))."""
    div = np.exp(np.arange(d // 2) * -(np.log(10000.0) / (d // 2 - 1)))
    angles = np.arange(length)[:, None] * div[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def example_tree(rng: np.random.Generator, share: bool, lve: bool, d: int, heads: int,
                 vs: int = 13, vt: int = 11) -> dict:
    """A params tree with the example's names and shapes, random float32 values."""
    vt = vs if share else vt
    dh = d // heads

    def w(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return {"scale": (1 + w(d, scale=0.2)), "bias": w(d, scale=0.2)}

    def mha():
        return {"query": {"kernel": w(d, heads, dh)}, "key": {"kernel": w(d, heads, dh)},
                "value": {"kernel": w(d, heads, dh)}, "out": {"kernel": w(heads, dh, d)}}

    def mlp():
        return {"Dense_0": {"kernel": w(d, MLP), "bias": w(MLP, scale=0.1)},
                "Dense_1": {"kernel": w(MLP, d), "bias": w(d, scale=0.1)}}

    encoder = {f"encoderblock_{i}": {"LayerNorm_0": norm(), "MultiHeadDotProductAttention_0": mha(),
                                     "LayerNorm_1": norm(), "MlpBlock_0": mlp()} for i in range(LAYERS)}
    encoder["encoder_norm"] = norm()
    decoder = {f"encoderdecoderblock_{i}": {
        "LayerNorm_0": norm(), "MultiHeadDotProductAttention_0": mha(), "LayerNorm_1": norm(),
        "MultiHeadDotProductAttention_1": mha(), "LayerNorm_2": norm(), "MlpBlock_0": mlp()}
        for i in range(LAYERS)}
    decoder["encoderdecoder_norm"] = norm()
    tree = {"encoder": encoder, "decoder": decoder}
    if share:
        tree["shared_embedding"] = {"embedding": w(vs, d, scale=1.0)}
    else:
        encoder["Embed_0"] = {"embedding": w(vs, d, scale=1.0)}
        decoder["Embed_0"] = {"embedding": w(vt, d, scale=1.0)}
    if not lve:
        decoder["logitdense"] = {"kernel": w(d, vt), "bias": w(vt, scale=0.1)}
    return tree


def _ln(x, p):
    x64 = np.asarray(x, np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    return (x64 - mu) / np.sqrt(var + 1e-6) * p["scale"].astype(np.float64) + p["bias"].astype(np.float64)


def _attention(p, xq, xkv, mask):
    q = np.einsum("btd,dhk->bthk", xq, p["query"]["kernel"].astype(np.float64))
    k = np.einsum("bsd,dhk->bshk", xkv, p["key"]["kernel"].astype(np.float64))
    v = np.einsum("bsd,dhk->bshk", xkv, p["value"]["kernel"].astype(np.float64))
    scores = np.einsum("bthk,bshk->bhts", q / np.sqrt(q.shape[-1]), k)
    scores = np.where(mask[:, None], scores, np.finfo(np.float64).min)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hkd,bthk->btd", p["out"]["kernel"].astype(np.float64),
                     np.einsum("bhts,bshk->bthk", weights, v))


def _mlp(p, x):
    h = np.maximum(x @ p["Dense_0"]["kernel"].astype(np.float64) + p["Dense_0"]["bias"], 0.0)
    return h @ p["Dense_1"]["kernel"].astype(np.float64) + p["Dense_1"]["bias"]


def example_logits(tree: dict, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The example's Transformer(inputs, targets) in float64."""
    enc, dec = tree["encoder"], tree["decoder"]
    src_table = (tree.get("shared_embedding") or enc["Embed_0"])["embedding"].astype(np.float64)
    tgt_table = (tree.get("shared_embedding") or dec["Embed_0"])["embedding"].astype(np.float64)
    d = src_table.shape[1]
    enc_mask = (inputs > 0)[:, :, None] & (inputs > 0)[:, None, :]
    causal = np.tril(np.ones((targets.shape[1],) * 2, bool))
    dec_mask = (targets > 0)[:, :, None] & (targets > 0)[:, None, :] & causal
    cross_mask = (targets > 0)[:, :, None] & (inputs > 0)[:, None, :]
    x = src_table[inputs] + t2t_table(inputs.shape[1], d)  # no sqrt(d) on the embeddings
    for i in range(LAYERS):
        p = enc[f"encoderblock_{i}"]
        x = x + _attention(p["MultiHeadDotProductAttention_0"], _ln(x, p["LayerNorm_0"]),
                           _ln(x, p["LayerNorm_0"]), enc_mask)
        x = x + _mlp(p["MlpBlock_0"], _ln(x, p["LayerNorm_1"]))
    memory = _ln(x, enc["encoder_norm"])
    shifted = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]  # shift_right: decoder starts with 0
    y = tgt_table[shifted] + t2t_table(targets.shape[1], d)
    for i in range(LAYERS):
        p = dec[f"encoderdecoderblock_{i}"]
        h = _ln(y, p["LayerNorm_0"])
        y = y + _attention(p["MultiHeadDotProductAttention_0"], h, h, dec_mask)
        y = y + _attention(p["MultiHeadDotProductAttention_1"], _ln(y, p["LayerNorm_1"]), memory, cross_mask)
        y = y + _mlp(p["MlpBlock_0"], _ln(y, p["LayerNorm_2"]))
    y = _ln(y, dec["encoderdecoder_norm"])
    if "logitdense" in dec:
        return y @ dec["logitdense"]["kernel"].astype(np.float64) + dec["logitdense"]["bias"]
    return y @ tgt_table.T / np.sqrt(d)  # logits_via_embedding


def batch(rng: np.random.Generator, vs: int, vt: int) -> tuple[np.ndarray, np.ndarray]:
    """Source ids and target labels (real tokens then 0-padding), as the example's data."""
    inputs = rng.integers(1, vs, (B, S))
    inputs[1, 4:], inputs[2, 2:] = 0, 0
    targets = rng.integers(1, vt, (B, T))
    targets[1, 3:], targets[2, 5:] = 0, 0
    return inputs, targets


def ours_logits(cfg: ModelConfig, params: dict, inputs: np.ndarray, targets: np.ndarray,
                backend: str) -> np.ndarray:
    decoder_input = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]  # start token 0 = our bos_id
    return rosetta.from_params(cfg, params, backend=backend).logits(inputs, decoder_input)


def rel_err(got: np.ndarray, want: np.ndarray, targets: np.ndarray) -> float:
    """Max error over the label positions (targets > 0: the example's loss weights), relative to
    the largest logit there. Logits at padded label positions are not part of either contract."""
    real = targets > 0
    return float(np.abs(got - want)[real].max() / np.abs(want[real]).max())


def assert_same_leaves(got: dict, want: dict) -> None:
    """The same paths (in any order), and every leaf the same dtype, shape and bits."""
    flat_got, flat_want = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (got, want))
    assert sorted(map(jax.tree_util.keystr, flat_got)) == sorted(map(jax.tree_util.keystr, flat_want))
    want_by_key = {jax.tree_util.keystr(k): v for k, v in flat_want.items()}
    for key, value in flat_got.items():
        other = want_by_key[jax.tree_util.keystr(key)]
        assert value.dtype == other.dtype and value.shape == other.shape, jax.tree_util.keystr(key)
        assert np.array_equal(value, other), jax.tree_util.keystr(key)


def write_tree(path: Path, tree: dict, wrap: bool = True) -> Path:
    path.write_bytes(flax.serialization.msgpack_serialize({"params": tree} if wrap else tree))
    return path


# -- ours -> flax-wmt -> ours ---------------------------------------------------------------------

def example_config(**changes) -> ModelConfig:
    """A tiny model in the example's conventions, with the read defaults for what a tree doesn't say:
    tied and unscaled (logits_via_embedding read as it is), logit_scale = 1/sqrt(d) (models.py:
    `logits / jnp.sqrt(y.shape[-1])`) unless `changes` say otherwise."""
    fields = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, num_heads=2, num_encoder_layers=2,
                  num_decoder_layers=2, d_ff=MLP, norm_first=True, final_norm=True, layer_norm_eps=1e-6,
                  positional_encoding="sinusoidal_concat_t2t", pad_id=0, bos_id=0, eos_id=2, max_len=256,
                  dropout=0.1, attention_dropout=0.1, attention_bias=False)
    cfg = ModelConfig.from_dict({**fields, **changes})
    tied = cfg.share_embeddings in ("all", "decoder")
    if tied and not cfg.scale_embeddings and "logit_scale" not in changes:
        cfg = cfg.replace(logit_scale=1 / math.sqrt(cfg.d_model))
    return cfg


def perturbed(cfg: ModelConfig, seed: int = 1) -> dict[str, np.ndarray]:
    """Canonical params with every tensor random, except the biases the example has no place for
    (attention biases, a tied output bias): those are zero, the only value that can be dropped."""
    rng = np.random.default_rng(seed)
    params = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
              for k, v in init_params(cfg, seed=0).items()}
    for name in params:
        if name.endswith(("attn.q.bias", "attn.k.bias", "attn.v.bias", "attn.o.bias")) or (
                name == "generator.bias" and cfg.share_embeddings in ("all", "decoder")):
            params[name] = np.zeros_like(params[name])
    return params


# share_embeddings x scale_embeddings, each with its own combination of the bias flags.
ROUND_TRIPS = [
    ("all", True, dict()),
    ("all", False, dict(attention_bias=True, output_bias=True)),
    ("decoder", True, dict(ffn_bias=False, tgt_vocab_size=11)),
    ("decoder", False, dict(tgt_vocab_size=11, attention_bias=True)),
    ("src_tgt", True, dict(output_bias=True)),
    ("src_tgt", False, dict(output_bias=False, ffn_bias=False)),
    ("none", True, dict(output_bias=True, tgt_vocab_size=9, attention_bias=True)),
    ("none", False, dict(output_bias=False, src_vocab_size=17)),
]


@pytest.mark.parametrize("share,scale,extra", ROUND_TRIPS, ids=[f"{s}-scale_{c}" for s, c, _ in ROUND_TRIPS])
def test_round_trip_is_bit_exact(tmp_path: Path, share: str, scale: bool, extra: dict):
    # d_model 16: sqrt(d) = 4, so the sqrt(d) rescales of the tied/scaled conventions are exact.
    cfg = example_config(share_embeddings=share, scale_embeddings=scale, **extra)
    params = perturbed(cfg)
    path = write_flax_wmt(tmp_path / "m.msgpack", cfg, params)
    assert is_flax_wmt(path)
    # What flax reads is the example's tree, and flax writes the very same bytes back.
    data = path.read_bytes()
    restored = flax.serialization.msgpack_restore(data)
    assert flax.serialization.msgpack_serialize(restored) == data
    shared, lve = share in ("all", "src_tgt"), share in ("all", "decoder")
    vocab = (cfg.src_vocab_size, cfg.tgt_vocab_size)
    expected = example_tree(np.random.default_rng(0), shared, lve, 16, 2, *vocab)
    assert jax.tree_util.tree_map(np.shape, restored["params"]) == jax.tree_util.tree_map(np.shape, expected)
    got_cfg, got = read_flax_wmt(path, scale_embeddings=scale, attention_bias=cfg.attention_bias,
                                 ffn_bias=cfg.ffn_bias, output_bias=cfg.output_bias)
    assert got_cfg == cfg
    assert list(got) == list(params)
    for name, value in params.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


@pytest.mark.parametrize("share,scale", [("all", False), ("all", True), ("src_tgt", True), ("none", False)])
def test_round_trip_rounding_when_sqrt_d_is_not_a_power_of_two(tmp_path: Path, share: str, scale: bool):
    # d_model 32: sqrt(32) is irrational. The rescaled tensors (the tables when scale_embeddings)
    # come back within one ulp; every other tensor, and everything of an unscaled model, tied
    # (logit_scale 1/sqrt(32)) or not, is moved bit for bit.
    cfg = example_config(d_model=32, num_heads=4, share_embeddings=share, scale_embeddings=scale,
                         output_bias=share in ("none", "src_tgt"))
    params = perturbed(cfg)
    cfg2, got = read_flax_wmt(write_flax_wmt(tmp_path / "m.msgpack", cfg, params), scale_embeddings=scale)
    assert cfg2 == cfg
    rescaled = {n for n in params if scale and n.endswith(".embedding")}
    assert bool(rescaled) == scale
    for name, value in params.items():
        if name in rescaled:
            ulps = np.abs(got[name].view(np.int32).astype(np.int64) - value.view(np.int32).astype(np.int64))
            assert ulps.max() <= 1, name
        else:
            assert np.array_equal(got[name], value), name


# -- a tree with the example's names -> our model: logits against the float64 reference ------------

@pytest.mark.parametrize("d,heads", [(16, 2), (32, 4)])
@pytest.mark.parametrize("share,lve", list(MODES), ids=list(MODES.values()))
def test_example_tree_logits_match_reference(tmp_path: Path, share: bool, lve: bool, d: int, heads: int):
    rng = np.random.default_rng(7)
    tree = example_tree(rng, share, lve, d, heads)
    vs, vt = tree_vocab(tree)
    inputs, targets = batch(rng, vs, vt)
    want = example_logits(tree, inputs, targets)
    path = write_tree(tmp_path / "ex.msgpack", tree, wrap=(d == 16))  # with and without {"params": ...}
    assert is_flax_wmt(path)
    for scale in (False, True):
        cfg, params = read_flax_wmt(path, scale_embeddings=scale)
        assert cfg.share_embeddings == MODES[(share, lve)]
        sizes = (cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.src_vocab_size, cfg.tgt_vocab_size)
        assert sizes == (d, heads, MLP, vs, vt)
        assert (cfg.pad_id, cfg.bos_id, cfg.eos_id, cfg.norm_first, cfg.has_final_norm, cfg.layer_norm_eps,
                cfg.positional_encoding, cfg.max_len) == (0, 0, 2, True, True, 1e-6, POSITIONS, 256)
        # float64 compute: equal to summation order, except where a sqrt(32) rescale rounded a
        # float32 tensor once (half an ulp, 6e-8 relative, per rescaled number): the tables read
        # with scale_embeddings. logits_via_embedding is logit_scale = 1/sqrt(d): nothing rescaled.
        assert cfg.logit_scale == (1 / math.sqrt(d) if lve and not scale else 1.0)
        rounded = d == 32 and scale
        assert rel_err(ours_logits(cfg, params, inputs, targets, "numpy"), want, targets) <= (
            1e-6 if rounded else 1e-10)
        if d == 32 and not scale:  # the float32 backends (the same configs as the linen test's)
            for backend in ("torch", "jax"):
                err = rel_err(ours_logits(cfg, params, inputs, targets, backend), want, targets)
                assert err <= 1e-5, backend
        if not scale:  # example -> ours -> example: every leaf bit for bit, whatever the mode
            back = flax.serialization.msgpack_restore(write_flax_wmt(tmp_path / "back.msgpack", cfg,
                                                                     params).read_bytes())["params"]
            assert_same_leaves(back, tree)


def tree_vocab(tree: dict) -> tuple[int, int]:
    if "shared_embedding" in tree:
        v = tree["shared_embedding"]["embedding"].shape[0]
        return v, v
    return tree["encoder"]["Embed_0"]["embedding"].shape[0], tree["decoder"]["Embed_0"]["embedding"].shape[0]


# -- a model built from flax.linen's own primitives ----------------------------------------------

LINEN_D, LINEN_HEADS = 32, 4


def _mha(name: str) -> nn.MultiHeadDotProductAttention:
    return nn.MultiHeadDotProductAttention(num_heads=LINEN_HEADS, use_bias=False, deterministic=True,
                                           name=name)


def _scales_around_one(tree: dict) -> dict:
    """LayerNorm scales (the only `scale` leaves) near one, as trained ones are."""
    return {key: _scales_around_one(value) if isinstance(value, dict)
            else value + np.float32(1) if key == "scale" else value for key, value in tree.items()}


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(MLP, name="Dense_0")(x))
        return nn.Dense(x.shape[-1], name="Dense_1")(h)


class LinenEncoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + _mha("MultiHeadDotProductAttention_0")(nn.LayerNorm(name="LayerNorm_0")(x), mask=mask)
        return x + LinenMlp(name="MlpBlock_0")(nn.LayerNorm(name="LayerNorm_1")(x))


class LinenDecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, y, memory, self_mask, cross_mask):
        y = y + _mha("MultiHeadDotProductAttention_0")(nn.LayerNorm(name="LayerNorm_0")(y), mask=self_mask)
        y = y + _mha("MultiHeadDotProductAttention_1")(nn.LayerNorm(name="LayerNorm_1")(y), memory,
                                                       mask=cross_mask)
        return y + LinenMlp(name="MlpBlock_0")(nn.LayerNorm(name="LayerNorm_2")(y))


class LinenEncoder(nn.Module):
    vocab: int
    shared: nn.Module | None = None

    @nn.compact
    def __call__(self, inputs):
        embed = self.shared if self.shared is not None else nn.Embed(self.vocab, LINEN_D, name="Embed_0")
        x = embed(inputs) + jnp.asarray(t2t_table(inputs.shape[1], LINEN_D), jnp.float32)
        mask = nn.make_attention_mask(inputs > 0, inputs > 0)
        for i in range(LAYERS):
            x = LinenEncoderBlock(name=f"encoderblock_{i}")(x, mask)
        return nn.LayerNorm(name="encoder_norm")(x)


class LinenDecoder(nn.Module):
    vocab: int
    lve: bool
    shared: nn.Module | None = None

    @nn.compact
    def __call__(self, memory, inputs, targets):
        embed = self.shared if self.shared is not None else nn.Embed(self.vocab, LINEN_D, name="Embed_0")
        shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
        y = embed(shifted) + jnp.asarray(t2t_table(targets.shape[1], LINEN_D), jnp.float32)
        self_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0),
                                     nn.make_causal_mask(targets))
        cross_mask = nn.make_attention_mask(targets > 0, inputs > 0)
        for i in range(LAYERS):
            y = LinenDecoderBlock(name=f"encoderdecoderblock_{i}")(y, memory, self_mask, cross_mask)
        y = nn.LayerNorm(name="encoderdecoder_norm")(y)
        if self.lve:
            return embed.attend(y) / jnp.sqrt(y.shape[-1])
        return nn.Dense(self.vocab, name="logitdense")(y)


class LinenTransformer(nn.Module):
    share: bool
    lve: bool
    vs: int
    vt: int

    @nn.compact
    def __call__(self, inputs, targets):
        shared = nn.Embed(self.vs, LINEN_D, name="shared_embedding") if self.share else None
        memory = LinenEncoder(self.vs, shared, name="encoder")(inputs)
        return LinenDecoder(self.vt, self.lve, shared, name="decoder")(memory, inputs, targets)


@pytest.mark.parametrize("share,lve", list(MODES), ids=list(MODES.values()))
def test_linen_built_model_matches(tmp_path: Path, share: bool, lve: bool):
    rng = np.random.default_rng(3)
    vs, vt = (13, 13) if share else (13, 11)
    inputs, targets = batch(rng, vs, vt)
    model = LinenTransformer(share, lve, vs, vt)
    # flax's own init decides the tree (names, shapes); traced with eval_shape, which is fast.
    # The values are random: flax's initialisers would leave biases zero and LayerNorm at identity,
    # and every tensor must be non-trivial so that a dropped bias, scale or sqrt(d) cannot pass.
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.asarray(inputs), jnp.asarray(targets))
    params = jax.tree_util.tree_map(
        lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32), shapes["params"])
    params = _scales_around_one(params)

    def apply(variables):
        with jax.default_matmul_precision("highest"):
            return np.asarray(model.apply(variables, jnp.asarray(inputs), jnp.asarray(targets)), np.float64)

    want = apply({"params": params})
    # flax's own tree has exactly the example's names and shapes.
    assert jax.tree_util.tree_map(np.shape, params) == jax.tree_util.tree_map(
        np.shape, example_tree(rng, share, lve, LINEN_D, LINEN_HEADS, vs, vt))
    cfg, ours = read_flax_wmt(write_tree(tmp_path / "linen.msgpack", params))
    for backend in ("numpy", "torch", "jax"):
        assert rel_err(ours_logits(cfg, ours, inputs, targets, backend), want, targets) <= 1e-5, backend
    assert cfg.logit_scale == (1 / math.sqrt(LINEN_D) if lve else 1.0)
    # And back: flax's tree -> ours -> flax's tree is exact, every leaf and the file's every byte
    # (nothing is rescaled: logits_via_embedding is our logit_scale), so the linen model gives
    # its very logits again.
    back = write_flax_wmt(tmp_path / "back.msgpack", cfg, ours)
    restored = flax.serialization.msgpack_restore(back.read_bytes())
    assert_same_leaves(restored["params"], params)
    assert back.read_bytes() == (tmp_path / "linen.msgpack").read_bytes()
    assert np.array_equal(apply(restored), want)


# -- the msgpack codec is flax.serialization's, byte for byte -------------------------------------

def codec_tree() -> dict:
    rng = np.random.default_rng(5)
    return {"b": {"z": rng.standard_normal((3, 2)).astype(np.float32), "a": np.arange(5, dtype=np.int32)},
            "a": {"bf": rng.standard_normal(4).astype(jnp.bfloat16), "f64": rng.standard_normal((2, 1, 2)),
                  "scalar": np.asarray(1.5, np.float16), "empty": np.zeros((0, 3), np.float32),
                  "npscalar": np.float32(2.5)}}


def assert_same_tree(a, b) -> None:
    assert isinstance(a, dict) == isinstance(b, dict)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same_tree(a[key], b[key])
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_codec_is_byte_compatible_with_flax():
    tree = codec_tree()
    ours = encode_tree(tree)
    assert ours == flax.serialization.msgpack_serialize(tree)
    assert_same_tree(flax.serialization.msgpack_restore(ours), decode_tree(ours))
    assert_same_tree(decode_tree(flax.serialization.msgpack_serialize(tree)),
                     flax.serialization.msgpack_restore(ours))


def test_codec_chunked_arrays_match_flax(monkeypatch):
    # flax splits arrays above MAX_CHUNK_SIZE (1 GiB) into chunks; shrink the limit on both sides.
    monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 16)
    monkeypatch.setattr(flax_msgpack, "MAX_CHUNK_SIZE", 16)
    tree = codec_tree()
    theirs = flax.serialization.msgpack_serialize(tree)
    assert b"__msgpack_chunked_array__" in theirs
    assert encode_tree(tree) == theirs
    assert_same_tree(decode_tree(theirs), flax.serialization.msgpack_restore(theirs))


# -- refusals -------------------------------------------------------------------------------

WRITE_REFUSALS = {
    "norm_first": dict(norm_first=False),
    "final_norm": dict(final_norm=False),
    "layer_norm_eps": dict(layer_norm_eps=1e-5),
    "positional_encoding": dict(positional_encoding="sinusoidal_concat"),
    "activation": dict(activation="gelu"),
    "pad_id": dict(pad_id=3),
    "bos_id": dict(bos_id=1),
    "num_encoder_layers": dict(num_decoder_layers=1),
    "d_model": dict(d_model=2, num_heads=1),
    "position_offset": dict(position_offset=1),
}


@pytest.mark.parametrize("field", sorted(WRITE_REFUSALS))
def test_write_refuses_unrepresentable_config(tmp_path: Path, field: str):
    cfg = example_config(**WRITE_REFUSALS[field])
    with pytest.raises(ConfigError, match=field):
        write_flax_wmt(tmp_path / "m.msgpack", cfg, perturbed(cfg))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field,share,bias", [("attention_bias", "all", "encoder.layers.1.self_attn.k.bias"),
                                              ("output_bias", "decoder", "generator.bias")])
def test_write_refuses_nonzero_bias_the_example_lacks(tmp_path: Path, field: str, share: str, bias: str):
    cfg = example_config(share_embeddings=share, tgt_vocab_size=13, **{field: True})
    params = perturbed(cfg)
    params[bias] = params[bias].copy()
    params[bias][1] = 0.5
    with pytest.raises(ConfigError, match=field):
        write_flax_wmt(tmp_path / "m.msgpack", cfg, params)
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_bad_params(tmp_path: Path):
    cfg = example_config()
    params = perturbed(cfg)
    bad = dict(params)
    bad["decoder.final_norm.scale"] = params["decoder.final_norm.scale"].copy()
    bad["decoder.final_norm.scale"][0] = np.nan
    with pytest.raises(CheckpointError, match="decoder.final_norm.scale"):
        write_flax_wmt(tmp_path / "m.msgpack", cfg, bad)
    with pytest.raises(CheckpointError, match="shared_embed.embedding .*overflows float16"):
        write_flax_wmt(tmp_path / "m.msgpack", cfg, {**params, "shared_embed.embedding":
                                                     np.full((13, 16), 1e6)}, dtype="float16")
    missing = {k: v for k, v in params.items() if k != "encoder.layers.0.ffn.linear2.bias"}
    with pytest.raises(CheckpointError, match="encoder.layers.0.ffn.linear2.bias"):
        write_flax_wmt(tmp_path / "m.msgpack", cfg, missing)
    assert list(tmp_path.iterdir()) == []


def _mutate(tree: dict, path: str, value=None, delete: bool = False) -> dict:
    node = tree
    *parents, leaf = path.split("/")
    for key in parents:
        node = node.setdefault(key, {})
    if delete:
        del node[leaf]
    else:
        node[leaf] = value
    return tree


BLOCK = "decoder/encoderdecoderblock_1"
READ_REFUSALS = {
    "missing": (lambda t: _mutate(t, f"{BLOCK}/LayerNorm_2/scale", delete=True),
                f"{BLOCK}/LayerNorm_2/scale"),
    "misshapen": (lambda t: _mutate(t, f"{BLOCK}/MlpBlock_0/Dense_1/kernel", np.zeros((16, MLP), np.float32)),
                  "Dense_1/kernel has shape"),
    "learned_positions": (lambda t: _mutate(t, "encoder/posembed_input/pos_embedding",
                                            np.zeros((1, 256, 16), np.float32)), "posemb_init"),
    "attention_bias": (lambda t: _mutate(t, f"{BLOCK}/MultiHeadDotProductAttention_1/query/bias",
                                         np.zeros((2, 8), np.float32)), "use_bias"),
    "int_dtype": (lambda t: _mutate(t, "encoder/encoder_norm/bias", np.zeros(16, np.int32)), "dtype int32"),
    "mixed_dtypes": (lambda t: _mutate(t, "encoder/encoder_norm/bias", np.zeros(16, np.float64)),
                     "mix dtypes"),
    "nan": (lambda t: _mutate(t, f"{BLOCK}/LayerNorm_0/bias", np.full(16, np.nan, np.float32)), "NaN"),
    "not_an_array": (lambda t: _mutate(t, "encoder/encoder_norm/scale", 3), "not an array"),
    "qkv_dim": (lambda t: _mutate(t, "encoder/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel",
                                  np.zeros((16, 2, 4), np.float32)), "qkv_dim"),
    "no_layers": (lambda t: {**t, "encoder": {"encoder_norm": t["encoder"]["encoder_norm"]}},
                  "encoderblock_0"),
}


@pytest.mark.parametrize("case", sorted(READ_REFUSALS))
def test_read_refuses_bad_tree(tmp_path: Path, case: str):
    mutate, message = READ_REFUSALS[case]
    tree = mutate(example_tree(np.random.default_rng(0), True, True, 16, 2))
    path = write_tree(tmp_path / "bad.msgpack", tree)
    error = ConfigError if case == "qkv_dim" else CheckpointError
    with pytest.raises(error, match=message):
        read_flax_wmt(path)


def _ext(shape, dtype: str, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb((shape, dtype, data), use_bin_type=True))


def _good_bytes() -> bytes:
    return flax.serialization.msgpack_serialize(
        {"params": example_tree(np.random.default_rng(0), True, True, 16, 2)})


BYTE_REFUSALS = {
    "empty": (b"", "empty"),
    "garbage": (bytes(range(256)) * 4, "msgpack"),
    "truncated": (_good_bytes()[:5000], "truncated"),
    "trailing_bytes": (_good_bytes() + b"\x00", "msgpack"),
    "not_a_map": (msgpack.packb([1, 2, 3]), "not a params tree"),
    "hostile_shape": (msgpack.packb({"params": {"x": _ext([2**40, 2**40], "float32", b"\0" * 16)}}),
                      "declares shape"),
    "negative_dim": (msgpack.packb({"a": _ext([-1, 4], "float32", b"\0" * 16)}), "bad shape"),
    "unknown_dtype": (msgpack.packb({"a": _ext([2], "V8", b"\0" * 16)}), "unsupported dtype"),
    "object_dtype": (msgpack.packb({"a": _ext([2], "object", b"\0" * 16)}), "unsupported dtype"),
    "bad_array_record": (msgpack.packb({"a": msgpack.ExtType(1, b"\xc1\xc1")}), "corrupt array record"),
    "duplicate_key": (b"\x82" + msgpack.packb("params") + msgpack.packb({}) + msgpack.packb("params")
                      + msgpack.packb({}), "duplicate key"),
    "deep_nesting": (b"\x91" * 100_000 + b"\xc0", "msgpack"),
    "deep_maps": (b"\x81\xa1a" * 900 + b"\xc0", "nested deeper"),  # within msgpack's limit, not Python's
}


@pytest.mark.parametrize("case", sorted(BYTE_REFUSALS))
def test_read_refuses_bad_bytes(tmp_path: Path, case: str):
    data, message = BYTE_REFUSALS[case]
    path = tmp_path / "bad.msgpack"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=message):
        read_flax_wmt(path)
    assert not is_flax_wmt(path)


def test_read_overrides(tmp_path: Path):
    path = write_tree(tmp_path / "m.msgpack", example_tree(np.random.default_rng(0), False, False, 16, 2))
    cfg, _ = read_flax_wmt(path, max_len=64, dropout=0.0, attention_dropout=0.0, eos_id=5, pad_id=0)
    assert (cfg.max_len, cfg.dropout, cfg.attention_dropout, cfg.eos_id) == (64, 0.0, 0.0, 5)
    with pytest.raises(ConfigError, match="pad_id"):
        read_flax_wmt(path, pad_id=1)
    with pytest.raises(ConfigError, match="norm_first"):
        read_flax_wmt(path, norm_first=False)
    with pytest.raises(ConfigError, match="contradicts the tree"):
        read_flax_wmt(path, d_model=32)
    with pytest.raises(ConfigError, match="unknown or unsupported override"):
        read_flax_wmt(path, colour="blue")
    # The example's biases are trained, not zero: they cannot be dropped.
    with pytest.raises(ConfigError, match="ffn_bias"):
        read_flax_wmt(path, ffn_bias=False)
    with pytest.raises(ConfigError, match="output_bias"):
        read_flax_wmt(path, output_bias=False)
    with pytest.raises(CheckpointError, match="no such file"):
        read_flax_wmt(tmp_path / "absent.msgpack")


# -- detection -------------------------------------------------------------------------------

def test_is_flax_wmt(tmp_path: Path):
    tree = example_tree(np.random.default_rng(0), False, True, 16, 2)
    assert is_flax_wmt(write_tree(tmp_path / "bare.msgpack", tree, wrap=False))
    assert is_flax_wmt(write_tree(tmp_path / "wrapped.msgpack", tree))
    # A legacy msgpack TrainState (flax.training.checkpoints): step, params, opt_state (sorted first).
    state = {"step": np.int32(100), "params": tree, "opt_state": {"0": {"mu": tree, "nu": tree}},
             "dynamic_scale": None}
    (tmp_path / "state.msgpack").write_bytes(flax.serialization.msgpack_serialize(state))
    assert is_flax_wmt(tmp_path / "state.msgpack")
    cfg, _ = read_flax_wmt(tmp_path / "state.msgpack")
    assert cfg.share_embeddings == "decoder"

    not_ours = {
        "empty": b"", "garbage": os.urandom(4096), "other_tree": flax.serialization.msgpack_serialize(
            {"params": {"encoder": {"layer": np.zeros(3)}, "decoder": {}}}),
        "scalar": msgpack.packb(7), "truncated": (tmp_path / "wrapped.msgpack").read_bytes()[:-10],
    }
    for name, data in not_ours.items():
        (tmp_path / name).write_bytes(data)
        assert not is_flax_wmt(tmp_path / name), name
    cfg = example_config()
    save_checkpoint(tmp_path / "ours.safetensors", cfg, perturbed(cfg))
    assert not is_flax_wmt(tmp_path / "ours.safetensors")
    assert not is_flax_wmt(tmp_path / "absent")
    assert not is_flax_wmt(tmp_path)
    rng = np.random.default_rng(11)
    for i in range(200):  # never raises, whatever the bytes
        (tmp_path / "fuzz").write_bytes(bytes([0x80 + (i % 16)]) + rng.bytes(int(rng.integers(0, 64))))
        assert is_flax_wmt(tmp_path / "fuzz") in (True, False)


def test_sqrt_d_conventions_are_the_documented_ones(tmp_path: Path):
    """The two readings of logits_via_embedding (module docstring, footnote 3), checked on the
    numbers: scale_embeddings=False copies every tensor and sets logit_scale = 1/sqrt(d);
    scale_embeddings=True divides the table by sqrt(d), copies the norm, keeps logit_scale 1."""
    tree = example_tree(np.random.default_rng(2), True, True, 16, 2)
    path = write_tree(tmp_path / "m.msgpack", tree)
    table = tree["shared_embedding"]["embedding"]
    norm = tree["decoder"]["encoderdecoder_norm"]
    cfg, plain = read_flax_wmt(path)
    assert cfg.logit_scale == 0.25
    assert np.array_equal(plain["shared_embed.embedding"], table)
    assert np.array_equal(plain["decoder.final_norm.scale"], norm["scale"])
    assert np.array_equal(plain["decoder.final_norm.bias"], norm["bias"])
    cfg, scaled = read_flax_wmt(path, scale_embeddings=True)
    assert cfg.logit_scale == 1.0
    assert np.array_equal(scaled["shared_embed.embedding"], table / np.float32(math.sqrt(16)))
    assert np.array_equal(scaled["decoder.final_norm.scale"], norm["scale"])


# A logit_scale the example does not have (its logits are y E^T / sqrt(d) or y K + b) moves into the
# decoder's final norm, whose output feeds only the logits: (share, scale_embeddings, logit_scale).
FOLDED = [("all", False, 1.0), ("decoder", False, 0.3), ("all", True, 0.3), ("none", False, 0.3),
          ("src_tgt", True, 1.0)]


@pytest.mark.parametrize("share,scale,logit_scale", FOLDED, ids=[f"{a}-scale_{b}-{c}" for a, b, c in FOLDED])
def test_write_moves_a_logit_scale_the_example_lacks_into_the_final_norm(tmp_path: Path, share: str,
                                                                        scale: bool, logit_scale: float):
    cfg = example_config(d_model=32, num_heads=4, share_embeddings=share, scale_embeddings=scale,
                         logit_scale=logit_scale, tgt_vocab_size=11 if share in ("decoder", "none") else 13)
    params = perturbed(cfg)
    path = write_flax_wmt(tmp_path / "m.msgpack", cfg, params)
    tree = flax.serialization.msgpack_restore(path.read_bytes())["params"]
    rng = np.random.default_rng(4)
    inputs, targets = batch(rng, cfg.src_vocab_size, cfg.tgt_vocab_size)
    want = ours_logits(cfg, params, inputs, targets, "numpy")
    # The example's own rules (float64, written here) on the tree: our logits, to the float32
    # rounding of the rescaled norm (and tables).
    assert rel_err(example_logits(tree, inputs, targets), want, targets) <= 1e-6
    norm = tree["decoder"]["encoderdecoder_norm"]["scale"]
    expected = logit_scale * (math.sqrt(32) if share in ("all", "decoder") and not scale else 1.0)
    assert np.allclose(norm, params["decoder.final_norm.scale"] * expected, rtol=3e-7, atol=0)  # 1 ulp
