"""`rosetta train --backend peer`: torch.nn.Transformer (peer_impl/model.py) trained by the harness
with the torch backend's recipe (peer_impl/train.py).

The oracle is the torch backend, itself at parity with the float64 reference (test_training.py,
test_harness.py): from the same canonical weights, without dropout, one peer step gives its loss,
weights and Adam state. The weights' round trip is checked against the independent port
(rosetta/interop/nn_transformer.py). Tiny preset, copy task, CPU (2 cores)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks.peer import make_peer  # noqa: E402
from parity_tests.dp_case import LOSS_RTOL, WEIGHTS_RTOL, compare  # noqa: E402
from peer_impl import train as peer_train  # noqa: E402
from peer_impl.model import peer_from_params  # noqa: E402
from rosetta import RosettaError, init_params, load_checkpoint, preset  # noqa: E402
from rosetta.backends import from_params, load  # noqa: E402
from rosetta.cli import main  # noqa: E402
from rosetta.errors import ConfigError  # noqa: E402
from rosetta.harness.batching import BatchIterator  # noqa: E402
from rosetta.harness.data import synthetic_pairs  # noqa: E402
from rosetta.harness.trainer_state import load_trainer_state  # noqa: E402
from rosetta.interop.nn_transformer import port_nn_transformer  # noqa: E402
from rosetta.training import TrainConfig  # noqa: E402
from torch_impl import train  # noqa: E402

pytestmark = pytest.mark.trainable

# Post-norm without final LayerNorms (the paper; nn.Transformer's are removed), and pre-norm with
# them and GELU: the two shapes of model nn.Transformer can be.
CONFIGS = {"post_norm": {}, "pre_norm_gelu": {"norm_first": True, "activation": "gelu"}}
TRAIN = TrainConfig(warmup_steps=10, lr_factor=0.5)


def port_back(peer, cfg):
    return port_nn_transformer(peer.transformer, peer.embed, peer.embed, peer.generator,
                               positional_encoding=cfg.positional_encoding, pad_id=cfg.pad_id,
                               bos_id=cfg.bos_id, eos_id=cfg.eos_id, max_len=cfg.max_len)


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_canonical_to_peer_to_port_gives_the_same_params_and_config(overrides):
    cfg = preset("tiny", dropout=0.2, attention_dropout=0.1, **overrides)
    params = init_params(cfg, 3)
    ported_cfg, ported = port_back(peer_from_params(cfg, params), cfg)
    assert list(ported) == list(params)
    assert all(np.array_equal(ported[name], params[name]) for name in params)
    for field in ("has_final_norm", "norm_first", "activation", "dropout", "attention_dropout",
                  "activation_dropout_rate", "share_embeddings"):
        assert getattr(ported_cfg, field) == getattr(cfg, field), field


def test_make_peer_weights_build_the_same_peer():
    import torch

    cfg = preset("tiny", dropout=0.0, attention_dropout=0.0)
    peer, ported_cfg, params = make_peer(cfg, seed=1)
    rebuilt = peer_from_params(ported_cfg, params)
    src = torch.tensor([[5, 6, 7, 2, 0], [8, 9, 10, 11, 2]])
    tgt = torch.tensor([[1, 5, 6, 7, 0], [1, 8, 9, 10, 11]])
    with torch.no_grad():
        assert torch.equal(peer.eval()(src, tgt), rebuilt.eval()(src, tgt))


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_peer_step_equals_one_torch_step(overrides):
    """One update of the peer and of our torch trainer, in float64 ("the same algorithm?": in
    float32, Adam's first step, lr·g/(|g| + eps), turns a rounding difference in a gradient near
    zero into a step of up to 2 lr, a CPU-dependent amount; the bounds: parity_tests/dp_case.py)."""
    cfg = preset("tiny", dropout=0.0, attention_dropout=0.0, **overrides)
    params = init_params(cfg, 0)
    pairs = synthetic_pairs("copy", 200, cfg.src_vocab_size, 1, 16, seed=0)
    batch = next(BatchIterator.from_config(pairs, cfg, max_tokens=512, buckets=[24], seed=0))
    ours = train.Trainer(cfg, params, TRAIN, device="cpu", dtype="float64")
    peer = peer_train.Trainer(cfg, params, TRAIN, device="cpu", dtype="float64")
    expected, got = ours.read(ours.step(batch)), peer.read(peer.step(batch))
    assert got["loss"] == pytest.approx(expected["loss"], rel=LOSS_RTOL)
    assert got["lr"] == expected["lr"]
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=LOSS_RTOL)
    a, b = ours.params(), peer.params()
    assert list(a) == list(b) and all(v.dtype == np.float64 for v in [*a.values(), *b.values()])
    worst, through_outputs = compare(cfg, b, a, batch)  # k biases through the outputs (PITFALLS 14)
    assert worst <= WEIGHTS_RTOL and through_outputs <= WEIGHTS_RTOL
    # The resumable state is keyed and laid out as the torch backend's (Adam's moments included).
    state_a, state_b = ours.state_dict(), peer.state_dict()
    assert sorted(state_a) == sorted(state_b)
    for key in state_a:
        assert state_a[key].dtype == state_b[key].dtype and state_a[key].shape == state_b[key].shape, key
        if ".k.bias." not in key and not key.startswith("rng."):
            # Adam's moments after one step, (1 - b1) g and (1 - b2) g²: as close as the gradients.
            difference = np.abs(state_b[key] - state_a[key]).max()
            assert difference <= WEIGHTS_RTOL * np.abs(state_a[key]).max(), key
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a if k.startswith("rng."))
    # The evaluation model is the torch backend's on the peer's weights.
    assert type(peer.backend_model()) is type(ours.backend_model())


COPY = ["--task", "copy", "--max-tokens", "512", "--buckets", "24", "--train-size", "400", "--eval-size", "8",
        "--bleu-samples", "4", "--warmup", "10", "--lr-factor", "0.5", "--device", "cpu", "--no-progress",
        "--backend", "peer", "--checkpoint-every", "3", "--eval-every", "0", "--keep", "5",
        "--average-last", "2", "--set", "dropout=0.1", "--set", "attention_dropout=0.1"]


def test_rosetta_train_peer_writes_canonical_checkpoints_and_resumes_exactly(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--out", str(straight), "--steps", "6", *COPY]) == 0
    assert main(["train", "--out", str(split), "--steps", "3", *COPY]) == 0
    assert main(["train", "--out", str(split), "--steps", "6", "--resume", *COPY]) == 0
    last = Path("peer/checkpoints/step-00000006")
    a, b = (load_checkpoint(run / last / "model.safetensors") for run in (straight, split))
    assert list(a.params) == list(b.params)
    assert all(np.array_equal(a.params[n], b.params[n]) for n in a.params)  # dropout on: the rng resumed
    state_a, state_b = (load_trainer_state(run / last / "trainer_state.safetensors", "peer")
                        for run in (straight, split))
    assert sorted(state_a) == sorted(state_b) and all(np.array_equal(state_a[k], state_b[k]) for k in state_a)
    assert (straight / "peer" / "averaged.safetensors").is_file()  # --average-last: decoded by torch
    # Canonical: the float64 reference loads it and agrees with the torch backend on its logits.
    src, tgt = np.array([[5, 6, 7, 2]]), np.array([[1, 5, 6, 7]])
    reference = load(straight / last / "model.safetensors", "numpy").logits(src, tgt)
    ours = from_params(a.config, a.params, "torch").logits(src, tgt)
    np.testing.assert_allclose(np.asarray(ours, np.float64), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("flags, named", [
    (["--nproc", "2"], "--nproc"), (["--shard"], "--shard"), (["--batching", "packed"], "--batching"),
    (["--loss", "chunked"], "--loss"), (["--compile"], "--compile"),
])
def test_unsupported_flags_are_refused_in_one_line(flags, named, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--backend", "peer", "--out", str(out), *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and named in error[0] and "peer" in error[0], error
    assert not out.exists()


@pytest.mark.parametrize("field, value", [("share_embeddings", "none"), ("output_bias", True),
                                          ("attention_bias", False), ("activation", "silu"),
                                          ("scale_embeddings", False)])
def test_configs_nn_transformer_cannot_express_are_refused_by_field(field, value):
    cfg = preset("tiny", **{field: value})
    with pytest.raises(ConfigError, match=field):
        peer_train.Trainer(cfg, init_params(cfg, 0), TRAIN, device="cpu")
    assert issubclass(ConfigError, RosettaError)
