"""bfloat16 compute without per-use casts (issue 45, item 4): the float32 weights are cast to
bfloat16 once per forward pass (torch_impl/backend.py: compute_context; jax_impl/backend.py:
compute_weights), the residual stream and LayerNorm's outputs are bfloat16, LayerNorm's statistics
float32. Against the float64 reference (the forward), a formula (LayerNorm), and the path it
replaces (torch.autocast; JAX's per-use casts) over three training steps.

Bounds: bfloat16 keeps 8 significant bits, so one rounding moves a value by at most 2^-9 relative;
u = 2^-8 (the spacing between neighbours: a factor 2 of margin) is used below. `tiny` has 2 + 2
layers of 2-3 sublayers: K = 16 roundings on any path through the network is generous (a few per
sublayer, in series)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rosetta import from_params, init_params, preset
from rosetta.parity import TOLERANCES, random_batch, relative_error, target_positions
from rosetta.training import TrainConfig

CFG = preset("tiny")
PARAMS = init_params(CFG, seed=0)
U = 2.0**-8  # u: bfloat16's relative spacing (twice its unit roundoff)
K = 16  # roundings in series along one path through `tiny` (module docstring)
# Warmup 4: `tiny`'s learning rate climbs to 0.066 at step 3, large steps that move the weights visibly.
TRAIN = TrainConfig(warmup_steps=4, seed=3)


def _batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, tgt = random_batch(CFG, batch=6, src_len=11, tgt_len=9, seed=2)
    labels = np.roll(tgt, -1, axis=1)
    labels[:, -1] = CFG.eos_id
    labels[tgt == CFG.pad_id] = CFG.pad_id
    return src, tgt, labels


# -- the forward pass against the float64 reference -------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_bfloat16_logits_on_weights_cast_once_match_the_float64_reference(backend):
    """The backend model's bfloat16 path is the cast-weights one (its weights are bfloat16 copies while
    it computes; the float32 ones stay its own), within rosetta/parity.py's bfloat16 bound, 3e-2."""
    model = from_params(CFG, PARAMS, backend, "bfloat16")
    if backend == "torch":
        with model._context():
            assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in model.module.parameters()} == {torch.float32}
    else:
        from flax import nnx

        def dtypes(module: nnx.Module) -> set[str]:
            return {str(v.get_value().dtype) for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}

        assert dtypes(nnx.merge(model.graphdef, model.state)) == {"bfloat16"}
        assert dtypes(model.module) == {"float32"}
    src, tgt, _ = _batch()
    want = from_params(CFG, PARAMS, "numpy", "float64").logits(src, tgt)
    err = relative_error(model.logits(src, tgt), want, target_positions(CFG, tgt))
    assert err <= TOLERANCES[backend, "bfloat16"], err


# -- LayerNorm: bfloat16 output, float32 statistics -----------------------------------------

def _layer_norm_input() -> np.ndarray:
    """bfloat16 rows of mean 64 and spread 1 (exactly representable): statistics accumulated in
    bfloat16 would be off by about 64 * 2^-8 = 0.25 in the mean, a quarter of the spread."""
    import ml_dtypes

    x = 64.0 + np.random.default_rng(0).standard_normal((16, 256))
    return x.astype(ml_dtypes.bfloat16)


def _reference_layer_norm(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_layer_norm_on_bfloat16_input_keeps_float32_statistics(backend):
    """The CPU kernels: a bfloat16 output within one bfloat16 rounding (u·|y|, |y| up to ~4 here) of
    the float64 normalisation of the same bfloat16 input, which only float32 (or wider) statistics
    give: bfloat16 ones miss the mean by ~0.25 (see _layer_norm_input), an error ~0.25 in y."""
    x = _layer_norm_input()
    want = _reference_layer_norm(x, CFG.layer_norm_eps)
    if backend == "torch":
        from torch_impl.model import norm_layer

        norm = norm_layer(CFG.replace(d_model=256)).to(torch.bfloat16)
        with torch.no_grad():
            y = norm(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        got = y.double().numpy()
    else:
        import jax.numpy as jnp
        from flax import nnx

        from jax_impl.backend import compute_weights
        from jax_impl.model import norm_layer

        norm = compute_weights(norm_layer(CFG.replace(d_model=256), jnp.bfloat16, nnx.Rngs(0)), jnp.bfloat16)
        y = norm(jnp.asarray(x))
        assert y.dtype == jnp.bfloat16
        got = np.asarray(y, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=U * np.abs(want).max())


# -- the torch forward pass: bfloat16 residual stream, one cast per weight --------------------

class _Casts(TorchDispatchMode):
    """Counts float32 -> bfloat16 casts (aten._to_copy) by input: parameters by address, and
    [B, T, d] activations."""

    def __init__(self, params: list[torch.Tensor], d_model: int):
        super().__init__()
        self.params = {p.data_ptr(): name for name, p in params}
        self.d_model, self.per_param, self.activations = d_model, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        x = args[0] if args else None
        if (func is torch.ops.aten._to_copy.default and isinstance(x, torch.Tensor)
                and x.dtype == torch.float32 and out.dtype == torch.bfloat16):
            name = self.params.get(x.data_ptr())
            if name is not None:
                self.per_param[name] = self.per_param.get(name, 0) + 1
            elif x.dim() == 3 and x.shape[-1] == self.d_model:
                self.activations += 1
        return out


def _torch_trainer(dtype: str = "bfloat16"):
    from torch_impl.train import Trainer

    return Trainer(CFG, PARAMS, TRAIN, device="cpu", dtype=dtype)


def _autocast_forward(module, src, tgt, labels, label_smoothing, compute=None, num_tokens=None, packing=None):
    """Today's path before this item, written out as torch's AMP recipe: float32 weights, the forward
    pass under torch.autocast (LayerNorm, the residual stream and the loss's softmax in float32)."""
    from torch_impl.train import loss_fn

    with torch.autocast(src.device.type, dtype=compute):
        logits = module(src, tgt)
    return loss_fn(logits, labels, CFG.pad_id, label_smoothing, num_tokens)[0]


@pytest.mark.parametrize("path", ["cast once", "autocast"])
def test_torch_forward_casts_each_weight_once_and_no_activation(path):
    """One training forward pass (dropout on) of the trainer: at most one float32 -> bfloat16 cast
    per parameter, every one of them cast, and no [B, T, d] activation cast. The autocast path, run
    for contrast, casts the float32 residual stream before each of q, k, v and the feed-forward: the
    counter sees what this item removes."""
    trainer = _torch_trainer()
    forward = trainer.forward if path == "cast once" else _autocast_forward
    src, tgt, labels = (torch.from_numpy(a) for a in _batch())
    casts = _Casts(list(trainer.module.named_parameters()), CFG.d_model)
    with trainer._context(), casts:
        forward(trainer.module, src, tgt, labels, 0.1, trainer.autocast)
    assert max(casts.per_param.values()) <= 1
    if path == "cast once":
        assert sorted(casts.per_param) == sorted(name for name, _ in trainer.module.named_parameters())
        assert casts.activations == 0
    else:
        assert casts.activations >= 3 * (CFG.num_encoder_layers + 2 * CFG.num_decoder_layers)


def test_torch_residual_stream_and_layer_norm_outputs_are_bfloat16():
    """Forward hooks on the embedding's dropout, every layer and every LayerNorm in one training
    forward pass: all bfloat16 (under autocast they were float32); the loss float32."""
    from torch import nn

    from torch_impl.model import DecoderLayer, EncoderLayer

    trainer = _torch_trainer()
    seen = []
    kinds = (nn.LayerNorm, EncoderLayer, DecoderLayer)
    watched = [m for m in trainer.module.modules() if isinstance(m, kinds)]
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append((type(m).__name__, out.dtype)))
             for m in [*watched, trainer.module.dropout]]
    src, tgt, labels = (torch.from_numpy(a) for a in _batch())
    try:
        with trainer._context():
            loss = trainer.forward(trainer.module, src, tgt, labels, 0.1, trainer.autocast)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == len(watched) + 2  # the embedding dropout runs for the source and the target
    assert {dtype for _, dtype in seen} == {torch.bfloat16}, seen
    assert loss.dtype == torch.float32


def test_torch_compiled_forward_traces_the_cast_in_one_graph(monkeypatch):
    """The cast inside `rosetta train --compile`'s graph: one graph (fullgraph: a break would be an
    error), and its loss equal to the eager one within bfloat16's forward rounding (2·K·u relative:
    the two orders of the same bfloat16 operations, each within K·u of exact; dropout off)."""
    import torch._dynamo.testing

    from torch_impl import compilation, train

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compilation, "BACKEND", counter)
    trainer = _torch_trainer()
    trainer.module.eval()
    src, tgt, labels = (torch.from_numpy(a) for a in _batch())
    with trainer._context():
        eager = train.forward_loss(trainer.module, src, tgt, labels, 0.1, trainer.autocast)
        compiled = train.compiled_forward("plain")(trainer.module, src, tgt, labels, 0.1, trainer.autocast)
        compiled.backward()
    assert counter.frame_count == 1
    assert abs(compiled.item() - eager.item()) <= 2 * K * U * abs(eager.item())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainer.module.parameters())


# -- three training steps against the path it replaces -------------------------------------------
#
# Both paths compute the same function, rounding to bfloat16 in different places; each is within
# K·u of exact, so their losses before any update differ by at most 2·K·u relative. Their updates
# differ more, because Adam normalises: its first update is -lr·g/(|g| + eps) ≈ -lr·sign(g) per
# element, and an element whose gradient is smaller than the paths' rounding difference may flip
# sign, a difference of 2·lr there. The paths differ by the roundings of the residual stream and of
# LayerNorm's output and parameters (bfloat16 now, float32 under autocast): K' = 4 per layer on a
# path through one layer (2-3 sublayer outputs, the LayerNorm), the layers' errors independent, so
# the gradients differ by about 2·K'·u of their tensor's scale G. With a density of at most 1/G near
# zero, a fraction f ≤ 2·(2·K'·u) = 4·K'·u = 1/16 of the elements flip, and the update difference,
# in norm relative to the update (≈ lr·sqrt(n)), is at most sqrt(f·(2·lr)^2·n) / (lr·sqrt(n)) =
# 2·sqrt(f) = 0.5. A path whose gradient does not reach the float32 weights (no update) gives 1, a
# wrong gradient more. Losses after updates: the first step's bound plus the update difference's
# share (0.5) of the loss's change since step 1.
UPDATE_BOUND = 2 * np.sqrt(4 * 4 * U)  # = 0.5


def _relative_update_difference(a: dict, b: dict, start: dict) -> float:
    num = np.sqrt(sum(((a[n] - b[n]) ** 2).sum() for n in a))
    return float(num / np.sqrt(sum(((b[n] - start[n]) ** 2).sum() for n in b)))


def _check_three_steps(new: tuple[list, dict], old: tuple[list, dict], start: dict) -> None:
    (new_losses, new_w), (old_losses, old_w) = new, old
    assert abs(new_losses[0] - old_losses[0]) <= 2 * K * U * old_losses[0]
    for t in (1, 2):
        change = abs(old_losses[t] - old_losses[0])
        assert abs(new_losses[t] - old_losses[t]) <= 2 * K * U * old_losses[t] + UPDATE_BOUND * change
    assert _relative_update_difference(new_w, old_w, start) <= UPDATE_BOUND


def test_torch_three_bfloat16_steps_agree_with_the_autocast_path():
    from torch_impl.train import _train_step

    src, tgt, labels = (torch.from_numpy(a) for a in _batch())
    start = {n: p.detach().double().numpy().copy() for n, p in _torch_trainer().module.named_parameters()}

    def run(forward) -> tuple[list, dict]:
        trainer = _torch_trainer()
        losses = []
        with trainer._context():
            for _ in range(3):
                loss, _, _ = _train_step(trainer.module, trainer.optimizer, trainer.scheduler,
                                         [(src, tgt, labels)], None, TRAIN, trainer.autocast, forward)
                losses.append(float(loss))
        state = trainer.optimizer.state_dict()["state"]
        assert {v.dtype for s in state.values() for k, v in s.items() if k != "step"} == {torch.float32}
        return losses, {n: p.detach().double().numpy() for n, p in trainer.module.named_parameters()}

    _check_three_steps(run(_torch_trainer().forward), run(_autocast_forward), start)


def test_jax_three_bfloat16_steps_agree_with_the_per_use_cast_path(monkeypatch):
    """JAX before this item: the same bfloat16 layers, each promoting its float32 weights where it
    uses them (no compute_weights). The paths differ in LayerNorm's scale and bias only (bfloat16
    now), well inside the same bound."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_impl import train
    from jax_impl.backend import parity_mode
    from jax_impl.convert import build_model

    def per_use(model, rngs, src, tgt, labels, label_smoothing, num_tokens=None, packing=None):
        logits = model(src, tgt, rngs=rngs, packing=packing)
        return train.loss_fn(logits, labels, CFG.pad_id, label_smoothing, num_tokens)[0]

    monkeypatch.setitem(train.FORWARDS, "per-use casts", per_use)
    src, tgt, labels = _batch()

    def weights(model) -> dict:
        return {str(path): np.asarray(v.get_value(), np.float64)
                for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    def run(loss: str) -> tuple[list, dict]:
        model = build_model(CFG, PARAMS, jnp.bfloat16)
        step = train.make_train_step(model, train.make_optimizer(model, TRAIN), nnx.Rngs(dropout=TRAIN.seed),
                                     TRAIN, None, loss)
        return [float(step(src, tgt, labels)[0]) for _ in range(3)], weights(model)

    with parity_mode():
        new, old = run("plain"), run("per-use casts")
    _check_three_steps(new, old, weights(build_model(CFG, PARAMS, jnp.float32)))


def test_torch_ddp_replica_computes_on_the_cast_weights(tmp_path):
    """compute_context around a DistributedDataParallel replica (a one-process gloo group): the cast
    weights are swapped into the wrapped module, the logits are bfloat16, and the float32 gradients
    equal the unwrapped module's bit for bit, through DDP's reducer (two passes: a reducer whose
    hooks did not fire refuses the second forward)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from torch_impl.backend import compute_context
    from torch_impl.convert import build_model
    from torch_impl.train import loss_fn

    src, tgt, labels = (torch.from_numpy(a) for a in _batch())

    def grads(wrap: bool) -> dict[str, torch.Tensor]:
        module = build_model(CFG, PARAMS, torch.float32, torch.device("cpu")).eval()
        replica = DistributedDataParallel(module) if wrap else module
        for _ in range(2):
            module.zero_grad(set_to_none=True)
            with compute_context(replica, torch.bfloat16):
                logits = replica(src, tgt)
            assert logits.dtype == torch.bfloat16
            loss_fn(logits, labels, CFG.pad_id, 0.1)[0].backward()
        return {name: p.grad for name, p in module.named_parameters()}

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = grads(True)
    finally:
        dist.destroy_process_group()
    plain = grads(False)
    assert all(g.dtype == torch.float32 for g in wrapped.values())
    assert all(torch.equal(wrapped[name], plain[name]) for name in plain)
