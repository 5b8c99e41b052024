"""Training the torch.nn.Transformer peer (peer_impl/model.py) through the harness:
`rosetta train --backend peer`, the peer row of a time-to-quality table (docs/training.md).

`Trainer` is torch_impl/train.py's, with the peer in place of our module: the same loss,
Adam, schedule (SPEC §4), dropout generator seeding and bfloat16 autocast, run on the
nn.Transformer model. Its weights go in and out canonical (checkpoints are canonical
safetensors) and its resumable state is keyed and laid out as the torch backend's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import torch

from peer_impl.model import from_peer, peer_from_params, peer_rows, to_peer
from rosetta.config import ModelConfig
from rosetta.distributed import launch_env
from rosetta.errors import RosettaError
from rosetta.interop.nn_transformer import port_nn_transformer
from rosetta.params import Params, canonical_dtype, param_shapes
from rosetta.training import TrainConfig
from torch_impl import train
from torch_impl.backend import DTYPES, Model
from torch_impl.convert import torch_name

_MOMENTS = ("exp_avg", "exp_avg_sq")


class Trainer(train.Trainer):
    """torch_impl/train.py's `Trainer` on a `PeerTransformer`: one process, one device, bucketed
    batches, the plain loss (what the peer has no counterpart of is refused, naming the flag)."""

    framework: ClassVar[str] = "peer"

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], train_cfg: TrainConfig,
                 device: str | None = None, dtype: str = "float32", parity: bool | None = None,
                 accumulate: int = 1, shard: bool = False, num_devices: int | None = None,
                 loss: str = "plain", compile: bool = False, compile_cache: str | None = None):
        if shard:
            raise RosettaError("--shard: the nn.Transformer peer trains in one process (no FSDP2 sharding)")
        if compile:  # torch.compile(fullgraph) stops at a data-dependent check of nn.MultiheadAttention
            raise RosettaError("--compile: the nn.Transformer peer's attention checks its masks' values, "
                               "which torch.compile cannot capture in one graph; train it uncompiled")
        if loss != "plain":
            raise RosettaError(f"--loss {loss}: the nn.Transformer peer returns logits; train it with "
                               "--loss plain")
        if launch_env().distributed:
            raise RosettaError("--nproc: the nn.Transformer peer trains in one process; launch it alone")
        peer = peer_from_params(cfg, params)  # refuses what nn.Transformer cannot express
        # The parent builds our module, its optimizer, the generator and the precision settings;
        # the peer then takes the module's place and gets its own optimizer and schedule.
        super().__init__(cfg, params, train_cfg, device=device, dtype=dtype, parity=parity,
                         accumulate=accumulate, shard=False, num_devices=num_devices, loss="plain")
        # float64 stays float64
        self.module = self.replica = peer.to(self.device, DTYPES[dtype].params).train()
        self.optimizer, self.scheduler = train.make_optimizer(self.module, train_cfg)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def params(self) -> Params:
        """The current weights, ported to canonical by rosetta/interop/nn_transformer.py (the
        port users of nn.Transformer run), float32 NumPy copies (float64 for a float64 trainer)."""
        peer = self.module
        cfg = self.cfg
        _, params = port_nn_transformer(
            peer.transformer, peer.embed, peer.embed, peer.generator,
            positional_encoding=cfg.positional_encoding, scale_embeddings=cfg.scale_embeddings,
            pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id, max_len=cfg.max_len,
            dtype=canonical_dtype(self.dtype))
        return params

    def backend_model(self) -> Model:
        """The torch backend's model on the peer's current (canonical) weights. Evaluation decodes
        with our cached beam search, not nn.Transformer's re-decode loop, so a BLEU difference
        between the peer and torch rows of a table comes from training alone."""
        return Model(self.cfg, self.params(), self.dtype, device=str(self.device))

    # -- resumable state, keyed as the torch backend's ---------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """torch_impl/train.py's state with Adam's moments under the torch backend's parameter
        names and layouts (q, k, v apart, Linear weights [out, in]): Adam is elementwise, so a
        moment maps exactly as its parameter does."""
        state = super().state_dict()
        peer_names = [name for name, _ in self.module.named_parameters()]
        if f"optimizer.{peer_names[0]}.step" not in state:
            return state  # no update yet: no moments
        moments = {m: from_peer(self.cfg, {name: torch.from_numpy(state.pop(f"optimizer.{name}.{m}"))
                                           for name in peer_names}, canonical_dtype(self.dtype))
                   for m in _MOMENTS}
        steps = {name: state.pop(f"optimizer.{name}.step") for name in peer_names}
        for peer_name, name, _, _ in peer_rows(self.cfg):
            key, transposed = torch_name(name)
            for m in _MOMENTS:
                value = moments[m][name]
                state[f"optimizer.{key}.{m}"] = np.ascontiguousarray(value.T if transposed else value)
            state[f"optimizer.{key}.step"] = steps[peer_name]  # q, k and v share in_proj's count
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore a `state_dict()`: the torch backend's names and layouts mapped onto the peer's."""
        keys = {name: torch_name(name) for name in param_shapes(self.cfg)}
        if not all(f"optimizer.{key}.{m}" in state for key, _ in keys.values() for m in (*_MOMENTS, "step")):
            super().load_state_dict(state)  # no moments yet, or some missing: check_state names them
            return
        state = dict(state)
        for m in _MOMENTS:
            canonical = {}
            for name, (key, transposed) in keys.items():
                value = np.asarray(state.pop(f"optimizer.{key}.{m}"))
                canonical[name] = value.T if transposed else value
            for peer_name, tensor in to_peer(self.cfg, canonical).items():
                state[f"optimizer.{peer_name}.{m}"] = tensor.numpy()
        steps = {name: state.pop(f"optimizer.{key}.step") for name, (key, _) in keys.items()}
        for peer_name, name, _, _ in peer_rows(self.cfg):
            state[f"optimizer.{peer_name}.step"] = steps[name]
        super().load_state_dict(state)
