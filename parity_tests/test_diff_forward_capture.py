"""`rosetta diff` on dumps from your own model (docs/diff.md, "A dump from your own model"):
rosetta.diff.shared.capture's recipes, PyTorch forward hooks and Flax NNX's capture and sow, on a
model written here on top of torch.nn.Transformer (its own layer names, PyTorch's own attention)
and on our own models (torch_impl, jax_impl), whose captured stages must equal their own
`stages(src, tgt, fine=True)`. Split from test_diff_forward.py, whose cases and helpers it shares.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from parity_tests.test_diff_forward import FINE_CONFIGS, fine_names, perturbed_params, tiny_case
from rosetta import preset
from rosetta.backends import from_params
from rosetta.checkpoint import save_checkpoint
from rosetta.cli import main
from rosetta.config import ModelConfig
from rosetta.diff.shared.capture import capture_nnx, capture_torch
from rosetta.diff.shared.dump import read_dump, stage_order, write_dump
from rosetta.diff.shared.metrics import compare_stages, first_over
from rosetta.errors import InputError
from rosetta.parity import random_batch


@pytest.fixture(scope="module")
def tiny():
    return tiny_case()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny):
    cfg, params = tiny[:2]
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "m.safetensors", cfg, params)


# -- the PyTorch hook recipe (docs/diff.md) on a model written independently of torch_impl --------

class Embedder(nn.Module):
    """E[x] * sqrt(d) + PE[pos], the paper's interleaved sines and cosines, written out here."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        d = self.table.embedding_dim
        pos = torch.arange(ids.shape[1], dtype=torch.float64)[:, None]
        angle = pos / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(ids.shape[1], d)
        return self.table(ids) * math.sqrt(d) + pe.float()


class UserModel(nn.Module):
    """A translation model as a PyTorch user writes it: nn.Transformer (post-norm, with the final
    norms nn.Transformer always adds), embeddings and a tied output layer."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, d_ff: int, pad: int = 0):
        super().__init__()
        self.pad = pad
        table = nn.Embedding(vocab, d)
        self.src_embed, self.tgt_embed = Embedder(table), Embedder(table)
        self.transformer = nn.Transformer(d, heads, layers, layers, d_ff, dropout=0.0, batch_first=True)
        self.generator = nn.Linear(d, vocab, bias=False)
        self.generator.weight = table.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_pad, tgt_pad = src == self.pad, tgt == self.pad
        tgt_pad[:, 0] = False  # the start token is never padding
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True = masked
        memory = self.transformer.encoder(self.src_embed(src), src_key_padding_mask=src_pad)
        hidden = self.transformer.decoder(self.tgt_embed(tgt), memory, tgt_mask=causal,
                                          tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return self.generator(hidden)


def load_canonical(model: UserModel, params: dict[str, np.ndarray]) -> None:
    """Our canonical params into the user's modules: kernels [in, out] -> nn.Linear [out, in],
    q, k, v stacked into in_proj (a mapping written here, not the porter's)."""
    t = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in params.items()}
    sd = {"src_embed.table.weight": t["shared_embed.embedding"]}

    def attention(ours: str, theirs: str) -> None:
        sd[f"{theirs}.in_proj_weight"] = torch.cat([t[f"{ours}.{p}.kernel"].T for p in "qkv"])
        sd[f"{theirs}.in_proj_bias"] = torch.cat([t[f"{ours}.{p}.bias"] for p in "qkv"])
        sd[f"{theirs}.out_proj.weight"] = t[f"{ours}.o.kernel"].T
        sd[f"{theirs}.out_proj.bias"] = t[f"{ours}.o.bias"]

    def block(ours: str, theirs: str, norms: list[str]) -> None:
        attention(f"{ours}.self_attn", f"{theirs}.self_attn")
        if "cross_attn_norm" in norms:
            attention(f"{ours}.cross_attn", f"{theirs}.multihead_attn")
        for j in (1, 2):
            sd[f"{theirs}.linear{j}.weight"] = t[f"{ours}.ffn.linear{j}.kernel"].T
            sd[f"{theirs}.linear{j}.bias"] = t[f"{ours}.ffn.linear{j}.bias"]
        for j, norm in enumerate(norms, 1):
            sd[f"{theirs}.norm{j}.weight"] = t[f"{ours}.{norm}.scale"]
            sd[f"{theirs}.norm{j}.bias"] = t[f"{ours}.{norm}.bias"]

    for i in range(len(model.transformer.encoder.layers)):
        block(f"encoder.layers.{i}", f"transformer.encoder.layers.{i}", ["self_attn_norm", "ffn_norm"])
    for i in range(len(model.transformer.decoder.layers)):
        block(f"decoder.layers.{i}", f"transformer.decoder.layers.{i}",
              ["self_attn_norm", "cross_attn_norm", "ffn_norm"])
    for side in ("encoder", "decoder"):
        sd[f"transformer.{side}.norm.weight"] = t[f"{side}.final_norm.scale"]
        sd[f"transformer.{side}.norm.bias"] = t[f"{side}.final_norm.bias"]
    sd["tgt_embed.table.weight"] = sd["generator.weight"] = sd["src_embed.table.weight"]
    model.load_state_dict(sd, strict=True)


def user_name_map(model: UserModel) -> dict[str, str]:
    """Our stage names -> the user's submodule paths (the name map of docs/diff.md's recipe)."""
    tr = model.transformer
    names = {"src_embed": "src_embed", "encoder": "transformer.encoder", "tgt_embed": "tgt_embed",
             "decoder": "transformer.decoder", "logits": "generator"}
    for kind, layers in (("encoder", tr.encoder.layers), ("decoder", tr.decoder.layers)):
        for i in range(len(layers)):
            p, theirs = f"{kind}.layers.{i}", f"transformer.{kind}.layers.{i}"
            attns = {"self_attn": "self_attn", "cross_attn": "multihead_attn"} if kind == "decoder" \
                else {"self_attn": "self_attn"}
            names |= {p: theirs, f"{p}.ffn": f"{theirs}.linear2"}
            for ours, module in attns.items():  # nn.MultiheadAttention returns (output, weights)
                names |= {f"{p}.{ours}": f"{theirs}.{module}", f"{p}.{ours}.weights": f"{theirs}.{module}"}
    return names


def dump_with_hooks(model: UserModel, path, src: np.ndarray, tgt: np.ndarray):
    """The recipe of docs/diff.md: rosetta.diff.shared.capture.capture_torch's forward hooks on the user's
    modules collect the stages."""
    return write_dump(path, src, tgt, capture_torch(model, src, tgt, user_name_map(model)))


def test_hook_recipe_on_a_users_model_with_our_weights_reports_no_difference(tmp_path, capsys):
    cfg = preset("tiny", final_norm=True)  # post-norm plus final norms: nn.Transformer's layout
    params = perturbed_params(cfg)
    ckpt = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    torch.manual_seed(0)
    user = UserModel(cfg.src_vocab_size, cfg.d_model, cfg.num_heads, cfg.num_encoder_layers, cfg.d_ff)
    load_canonical(user, params)
    src, tgt = random_batch(cfg, 3, 8, 6, seed=6)
    dump = dump_with_hooks(user, tmp_path / "user.npz", src, tgt)
    assert set(read_dump(dump).stages) == fine_names(cfg)
    assert main(["diff", str(dump), str(ckpt)]) == 0
    assert "no difference at any stage" in capsys.readouterr().out
    # ... and the recipe sees a mistake: the user's model without the sqrt(d) scaling.
    user.src_embed.forward = lambda ids: Embedder.forward(user.src_embed, ids) / math.sqrt(cfg.d_model)
    dump = dump_with_hooks(user, tmp_path / "unscaled.npz", src, tgt)
    assert main(["diff", str(dump), str(ckpt)]) == 1
    assert "first difference at src_embed " in capsys.readouterr().out


def test_ported_nn_transformer_against_its_own_hook_dump(tmp_path, capsys):
    from rosetta.interop.nn_transformer import save_ported

    torch.manual_seed(3)
    user = UserModel(40, 16, 2, 2, 32)
    with torch.no_grad():
        for name, p in user.named_parameters():
            if "norm" in name:  # LayerNorm starts at identity: move it, so a swap would show
                p.add_(0.1 * torch.randn_like(p))
    src_table = user.src_embed.table
    cfg, ckpt = save_ported(tmp_path / "ported.safetensors", user.transformer, src_table, src_table,
                            user.generator, max_len=64)
    src, tgt = random_batch(cfg, 3, 7, 5, seed=7)
    dump = dump_with_hooks(user, tmp_path / "nn.npz", src, tgt)
    for backend in ("", "@torch"):
        assert main(["diff", f"{ckpt}{backend}", str(dump)]) == 0
    assert capsys.readouterr().out.count("no difference at any stage") == 2


# -- the Flax NNX recipes of docs/diff.md, on our own NNX model (jax_impl) -------------------------

def _nnx_model(cfg, params):
    from jax_impl.backend import parity_mode

    return from_params(cfg, params, "jax").module, parity_mode


def test_nnx_capture_recipe_reports_no_difference(tmp_path, tiny, checkpoint, capsys):
    from flax import nnx

    cfg, params, src, tgt = tiny
    model, parity_mode = _nnx_model(cfg, params)
    with parity_mode():  # docs/diff.md, as printed there
        _, captured = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(src, tgt)
    calls = {".".join(map(str, path[:-1])): value.get_value()
             for path, value in nnx.to_flat_state(captured) if path[-1] == "__call__"}
    ours = {"logits": "generator"}
    for kind in ("encoder", "decoder"):
        for i in range(2):
            p = f"{kind}.layers.{i}"
            attns = ("self_attn", "cross_attn") if kind == "decoder" else ("self_attn",)
            ours |= {p: p, f"{p}.ffn": f"{p}.ffn"}
            ours |= {f"{p}.{a}": f"{p}.{a}" for a in attns}
    # jax_impl's attention is one fused call (jax.nn.dot_product_attention) that returns no
    # probabilities, so no module's output holds them: the sow recipe below collects those.
    stages = {name: np.asarray(calls[path][0]) for name, path in ours.items()}
    dump = write_dump(tmp_path / "nnx.npz", src, tgt, stages)
    assert main(["diff", str(dump), str(checkpoint)]) == 0
    assert "no difference at any stage" in capsys.readouterr().out
    weights = [n for n in fine_names(cfg) if n.endswith(".weights")]
    assert len(read_dump(dump).stages) == len(fine_names(cfg)) - 4 - len(weights)  # embeddings, stacks


def test_nnx_sow_recipe_reports_no_difference(tmp_path, tiny, checkpoint, capsys):
    from flax import nnx

    from jax_impl.model import DecoderLayer, EncoderLayer

    class SowingEncoderLayer(EncoderLayer):  # "if you can edit the model": the layer sows its output
        def __call__(self, *args, **kwargs):
            x = super().__call__(*args, **kwargs)
            self.sow(nnx.Intermediate, "out", x)
            return x

    class SowingDecoderLayer(DecoderLayer):
        def __call__(self, *args, **kwargs):
            x = super().__call__(*args, **kwargs)
            self.sow(nnx.Intermediate, "out", x)
            return x

    cfg, params, src, tgt = tiny
    model, parity_mode = _nnx_model(cfg, params)
    for layer in model.encoder.layers:
        layer.__class__ = SowingEncoderLayer
    for layer in model.decoder.layers:
        layer.__class__ = SowingDecoderLayer
    with parity_mode():  # the sown values, collected as docs/diff.md says
        _, captured = nnx.capture(model, nnx.Intermediate)(src, tgt)
    stages = {".".join(map(str, path[:-1])): np.asarray(value.get_value()[0])
              for path, value in nnx.to_flat_state(captured) if path[-1] == "out"}
    assert set(stages) == {f"{k}.layers.{i}" for k in ("encoder", "decoder") for i in range(2)}
    dump = write_dump(tmp_path / "sow.npz", src, tgt, stages)
    assert main(["diff", str(dump), str(checkpoint)]) == 0
    assert "no difference at any stage" in capsys.readouterr().out


# -- rosetta.diff.shared.capture on our own models (torch_impl, jax_impl) --------------------------------

def our_name_map(cfg: ModelConfig, weights: bool) -> dict[str, str]:
    """Stage -> submodule path in torch_impl's and jax_impl's Transformer, written from their
    attribute names: the model-level dropout runs once per embedding (source first), a stack's
    output is its final norm's or, without one, its last layer's. With `weights`, jax_impl's
    attention-dropout modules, which see the softmax on the explicit (CPU) path."""
    names = {"src_embed": "dropout#0", "tgt_embed": "dropout#1", "logits": "generator"}
    for kind, n in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        names[kind] = f"{kind}.final_norm" if cfg.has_final_norm else f"{kind}.layers.{n - 1}"
        for i in range(n):
            p = f"{kind}.layers.{i}"
            attns = ("self_attn", "cross_attn") if kind == "decoder" else ("self_attn",)
            names |= {p: p, f"{p}.ffn": f"{p}.ffn"} | {f"{p}.{a}": f"{p}.{a}" for a in attns}
            if weights:
                names |= {f"{p}.{a}.weights": f"{p}.{a}.attention_dropout" for a in attns}
    return names


@pytest.mark.parametrize("variant", sorted(FINE_CONFIGS))
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_capture_of_our_models_gives_their_stages(framework, variant):
    import jax

    cfg = preset("tiny", **FINE_CONFIGS[variant])
    params = perturbed_params(cfg)
    src, tgt = random_batch(cfg, 3, 7, 6, seed=2)
    model = from_params(cfg, params, framework, "float32")
    # torch_impl computes the softmax inside a function, not a module: no module returns it.
    weights = framework == "jax" and jax.default_backend() == "cpu"
    names = our_name_map(cfg, weights)
    capture = capture_torch if framework == "torch" else capture_nnx
    got = capture(model.module, src, tgt, names)
    assert list(got) == sorted(names, key=stage_order)
    assert all(v.dtype == np.float32 for v in got.values())
    for want, tolerance in ((model.stages(src, tgt, fine=True), 1e-6),
                            (from_params(cfg, params, "numpy", "float64").stages(src, tgt, fine=True), 1e-5)):
        rows = compare_stages(cfg.pad_id, src, tgt, got, want, tolerance)
        assert len(rows) == len(names) and first_over(rows) is None, [r for r in rows if r.over]


def test_capture_nnx_of_a_bfloat16_model_comes_back_as_float32():
    cfg = preset("tiny")
    params = perturbed_params(cfg)
    src, tgt = random_batch(cfg, 3, 7, 6, seed=2)
    model = from_params(cfg, params, "jax", "bfloat16")
    got = capture_nnx(model.module, src, tgt, {"logits": "generator", "encoder.layers.1": "encoder.layers.1"})
    assert [v.dtype for v in got.values()] == [np.float32, np.float32]
    want = from_params(cfg, params, "numpy", "float64").stages(src, tgt)
    assert first_over(compare_stages(cfg.pad_id, src, tgt, got, want, 3e-2)) is None  # bfloat16's


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("target, message", [
    ("encoder.layers.7", "'encoder.layers.7'"),
    ("encoder.layer.0", "'encoder.layer.0'"),
    ("dropout#2", "'dropout#2' ran 2 times in the forward pass, no call 2"),
])
def test_a_bad_name_map_is_refused_in_one_line_naming_the_path(framework, target, message):
    cfg = preset("tiny")
    src, tgt = random_batch(cfg, 2, 5, 4)
    model = from_params(cfg, perturbed_params(cfg), framework).module
    capture = capture_torch if framework == "torch" else capture_nnx
    with pytest.raises(InputError, match="name map: stage 'encoder.layers.0'") as e:
        capture(model, src, tgt, {"encoder.layers.0": target})
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError, match="'encoder.layers.0.mlp' is not a stage name"):
        capture(model, src, tgt, {"encoder.layers.0.mlp": "encoder.layers.0.ffn"})


def test_capture_leaves_no_hook_or_wrapper_behind():
    from jax_impl.model import EncoderLayer

    cfg = preset("tiny")
    src, tgt = random_batch(cfg, 2, 5, 4)
    torch_model = from_params(cfg, perturbed_params(cfg), "torch").module.train()
    capture_torch(torch_model, src, tgt, {"encoder.layers.0": "encoder.layers.0"})
    assert torch_model.training and not torch_model.encoder.layers[0]._forward_hooks
    before = dict(vars(EncoderLayer))
    capture_nnx(from_params(cfg, perturbed_params(cfg), "jax").module, src, tgt,
                {"encoder.layers.0": "encoder.layers.0"})
    assert dict(vars(EncoderLayer)) == before


class TutorialEmbedder(Embedder):
    """The tutorials' positional loop, `for i in range(0, d, 2): pe[p, i] = sin(p / 10000 ** (2 * i
    / d))`: i already steps by two, so `2 * i` doubles every exponent (a mistake, on purpose)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        d = self.table.embedding_dim
        pe = torch.zeros(ids.shape[1], d, dtype=torch.float64)
        for p in range(ids.shape[1]):
            for i in range(0, d, 2):
                pe[p, i] = math.sin(p / 10000 ** (2 * i / d))
                pe[p, i + 1] = math.cos(p / 10000 ** (2 * i / d))
        return self.table(ids) * math.sqrt(d) + pe.float()


def test_hook_recipe_dump_of_a_users_tutorial_mistake_is_diagnosed(tmp_path, capsys):
    cfg = preset("tiny", final_norm=True)
    params = perturbed_params(cfg)
    ckpt = save_checkpoint(tmp_path / "m.safetensors", cfg, params)
    torch.manual_seed(0)
    user = UserModel(cfg.src_vocab_size, cfg.d_model, cfg.num_heads, cfg.num_encoder_layers, cfg.d_ff)
    load_canonical(user, params)
    user.src_embed = TutorialEmbedder(user.src_embed.table)
    user.tgt_embed = TutorialEmbedder(user.tgt_embed.table)
    src, tgt = random_batch(cfg, 3, 8, 6, seed=6)
    dump = dump_with_hooks(user, tmp_path / "tutorial.npz", src, tgt)
    assert main(["diff", str(dump), str(ckpt), "--diagnose"]) == 1
    out = capsys.readouterr().out
    assert "src_embed diverges" in out, out
    assert "explained by" in out and "when i already steps by 2" in out, out  # the 2i-loop entry's fix


def test_capture_of_hugging_faces_marian_model_with_its_final_logits_bias(opus_mt_dir, tmp_path, capsys):
    """docs/diff.md's Marian recipe: MarianMTModel's logits exist only in its output object (lm_head
    plus final_logits_bias, no submodule returns them): `{"logits": ""}` takes them, with the layers
    by their Hugging Face paths; `rosetta diff` against the directory read by our reference finds no
    difference, and with the bias left out (the lm_head alone) the logits part."""
    pytest.importorskip("transformers")
    import shutil

    import torch

    from rosetta.diff.forward.transformers_side import load_marian_model

    case = tmp_path / "case"  # the example directory with a bias to lose (the example's is all zeros)
    shutil.copytree(opus_mt_dir, case)
    model = load_marian_model(case)
    bias = torch.randn(model.final_logits_bias.shape, generator=torch.Generator().manual_seed(0))
    model.final_logits_bias.copy_(bias)
    model.save_pretrained(case)
    rng = np.random.default_rng(0)
    src = rng.integers(3, model.config.vocab_size, (2, 7))
    tgt = np.concatenate([np.full((2, 1), model.config.decoder_start_token_id), src[:, :5]], axis=1)
    run = lambda m, s, t: m(input_ids=s, decoder_input_ids=t)  # noqa: E731  (MarianMTModel's keywords)
    layers = {"encoder.layers.0": "model.encoder.layers.0", "decoder.layers.1": "model.decoder.layers.1"}
    for name, logits, code in (("right", "", 0), ("lm_head", "lm_head", 1)):
        stages = capture_torch(model, src, tgt, {**layers, "logits": logits}, run=run)
        write_dump(tmp_path / f"{name}.npz", src, tgt, stages)
        capsys.readouterr()
        assert main(["diff", str(tmp_path / f"{name}.npz"), str(case)]) == code
        out = capsys.readouterr().out
        assert ("no difference at any stage" in out) == (code == 0), out
