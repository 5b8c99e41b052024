"""PyTorch's float32 training linears by oneDNN on a CPU that is not Intel's (torch_impl/onednn.py,
issue 55): the GEMMs forward and backward within float32's bound of the float64 products, and the rule
that sends a linear there, exercised on any CPU (the CPU's vendor is given by the test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rosetta import init_params, preset
from rosetta.parity import random_batch
from torch_impl import onednn
from torch_impl.convert import build_model

U = 2.0 ** -24  # float32's unit roundoff


def _within_dot_bound(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, n: int) -> bool:
    """|got - exact| <= gamma_n sum |a_i b_i| elementwise: the bound of any order of summing n float32
    products (Higham, Accuracy and Stability, eq. 3.5), the operands exact in float64."""
    gamma = n * U / (1 - n * U)
    return bool(((got.double() - exact).abs() <= gamma * magnitude + 1e-30).all())


@pytest.mark.parametrize("bias, d_in, d_out", [(True, 40, 56), (False, 40, 56), (True, 56, 40)])
def test_gemms_forward_and_backward_are_the_products_within_float32s_bound(bias, d_in, d_out):
    """Both ways of W's gradient: MKL's GEMM where d_out > d_in, oneDNN's otherwise."""
    if not onednn._onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, d_in, generator=gen).transpose(0, 1).requires_grad_()  # [3, 24, d_in], strided
    w = torch.randn(d_out, d_in, generator=gen).requires_grad_()
    b = torch.randn(d_out, generator=gen).requires_grad_() if bias else None
    g = torch.randn(3, 24, d_out, generator=gen)
    y = onednn._OneDNNLinear.apply(x, w, b)
    y.backward(g)
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    exact = xd @ wd.T + (b.detach().double() if bias else 0)
    magnitude = xd.abs() @ wd.abs().T + (b.detach().double().abs() if bias else 0)
    assert _within_dot_bound(y.detach(), exact, magnitude, d_in + bias)
    assert _within_dot_bound(x.grad, gd @ wd, gd.abs() @ wd.abs(), d_out)
    rows_g, rows_x = gd.reshape(-1, d_out), xd.reshape(-1, d_in)
    assert _within_dot_bound(w.grad, rows_g.T @ rows_x, rows_g.abs().T @ rows_x.abs(), 72)
    if bias:
        assert _within_dot_bound(b.grad, rows_g.sum(0), rows_g.abs().sum(0), 72)


def _model_linears(intel: bool, monkeypatch) -> tuple[torch.nn.Module, list[int]]:
    """tiny's PyTorch model, the CPU said to be Intel's or not, and a counter of the linears oneDNN runs."""
    monkeypatch.setattr(onednn, "intel_cpu", lambda: intel)
    onednn._onednn_trains.cache_clear()
    cfg = preset("tiny")
    module = build_model(cfg, init_params(cfg, seed=0)).eval()  # no dropout: the paths compare exactly
    calls, apply = [0], onednn._OneDNNLinear.apply
    def counted(*args):
        calls[0] += 1
        return apply(*args)

    monkeypatch.setattr(onednn._OneDNNLinear, "apply", counted)
    return module, calls


def _loss(module: torch.nn.Module) -> torch.Tensor:
    cfg = module.cfg
    src, tgt = (torch.from_numpy(a) for a in random_batch(cfg, 2, 5, 4, seed=1))
    return module(src, tgt).float().square().mean()


@pytest.fixture(autouse=True)
def _real_cpu_afterwards():
    yield
    onednn._onednn_trains.cache_clear()  # the next test asks the real CPU again


def test_every_training_linear_goes_to_onednn_off_intel_and_none_on_intel(monkeypatch):
    if not onednn._onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    module, calls = _model_linears(intel=False, monkeypatch=monkeypatch)
    linears = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    _loss(module).backward()
    assert calls[0] == linears + 1  # every projection and the output one (Generator)
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)
    module, calls = _model_linears(intel=True, monkeypatch=monkeypatch)
    _loss(module).backward()
    assert calls[0] == 0


@pytest.mark.parametrize("case", ["no gradient", "float64", "a torch function mode", "a dispatch mode",
                                  "no rows"])
def test_anything_but_eager_float32_training_takes_f_linear(case, monkeypatch):
    """Inference, float64 (the suite's exact trainers), and a mode that watches F.linear or its aten ops
    (rosetta diff's TF32 emulation, FlopCounterMode) see the plain F.linear."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    module, calls = _model_linears(intel=False, monkeypatch=monkeypatch)
    if case == "no rows":  # oneDNN refuses an empty product; F.linear gives the empty result and gradients
        x = torch.zeros(0, 5, 8, requires_grad=True)
        weight = torch.nn.Parameter(torch.ones(4, 8))
        onednn.linear(x, weight, torch.nn.Parameter(torch.ones(4))).sum().backward()
        assert x.grad.shape == x.shape and not weight.grad.any()
    elif case == "no gradient":
        with torch.no_grad():
            _loss(module)
    elif case == "float64":
        _loss(module.double()).backward()
    else:
        with Watching() if case == "a torch function mode" else Counting():
            _loss(module).backward()
    assert calls[0] == 0


def test_a_float32_gradient_by_onednn_is_as_near_the_float64_one_as_f_linears(monkeypatch):
    """The model's gradients in float32 by oneDNN's GEMMs and by F.linear's, each against the float64
    model's: the same function summed in another order, so within a few times the plain path's error."""
    if not onednn._onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    grads = {}
    for name, intel, dtype in [("onednn", False, torch.float32), ("plain", True, torch.float32),
                               ("exact", True, torch.float64)]:
        module, calls = _model_linears(intel=intel, monkeypatch=monkeypatch)
        _loss(module.to(dtype)).backward()
        grads[name] = {k: p.grad.double().numpy() for k, p in module.named_parameters() if p.grad is not None}
        assert (calls[0] > 0) == (name == "onednn")
    for key, exact in grads["exact"].items():
        scale = np.abs(exact).max() + 1e-30
        errors = [np.abs(grads[n][key] - exact).max() / scale for n in ("onednn", "plain")]
        assert errors[0] <= 4 * errors[1] + 64 * U, (key, errors)
