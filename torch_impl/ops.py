"""PyTorch-only speed paths of torch_impl/model.py: attention as one fused SDPA kernel (explicit
on CPUs with attention dropout; FlexAttention over the packed blocks on CUDA), dropout from 16
random bits a value on CPUs (and functionalised RNG for compiled CUDA steps), the incremental-
decoding cache (written in place), weights packed once for CPU decoding, and the positional
buffer's growth outside compiled graphs.
jax_impl/ops.py holds JAX's, under the same names where they match, in the same order
(parity_tests/test_structure.py); numpy_ref/model.py computes the same numbers the plain way (and
decodes without a cache).

Shapes: B batch, h heads, Tq query length, Tk key length, dh d_head.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from rosetta.machine import intel_cpu
from rosetta.positional import grown_rows, model_table


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | SegmentMask,
              dropout: float, weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eq. 1, softmax(q k^T / sqrt(dh), masked) v, for q (B, h, Tq, dh), k, v (B, h, Tk, dh) and
    a boolean mask broadcastable to (B, h, Tq, Tk), in one F.scaled_dot_product_attention call
    (attention-weight dropout inside it): (B, Tq, h, dh), and with `weights` the softmax. Keys and
    values (a cache's dtype, maybe) are cast to the queries' type. A SegmentMask (packed rows,
    `packed_mask`) takes FlexAttention over its BlockMask instead where `flex_runs`; otherwise its
    dense form, as before."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    flex = isinstance(mask, SegmentMask) and flex_runs(q.device.type, q.shape[-1], dropout, weights)
    segments = mask if flex else None
    mask = mask.dense if isinstance(mask, SegmentMask) else mask
    # Not SDPA on CPUs with attention dropout (training): its CPU math path draws one float per
    # weight (bernoulli_); the explicit path below drops with cpu_dropout's 16-bit draws, 3% less
    # per `small` step in a paired run on this project's CPU (docs/benchmarks.md).
    # Compiled (rosetta train --compile): SDPA's dropout, lowered by inductor to its own generator.
    explicit = dropout > 0.0 and q.device.type == "cpu" and not torch.compiler.is_compiling()
    probabilities = None
    if explicit or weights:  # SDPA does not return its probabilities: computed the reference's way
        # Scores and softmax in float32 at least (float64 stays float64), as jax_impl's path. Masked
        # scores hold the most negative finite value: uniform weights, not NaN, where every key is
        # masked (SPEC §2, PITFALLS 4).
        wide = torch.promote_types(q.dtype, torch.float32)
        scores = (q @ k.transpose(-2, -1)).to(wide) / math.sqrt(q.shape[-1])
        probabilities = scores.masked_fill(~mask, torch.finfo(wide).min).softmax(dim=-1)
    if explicit:
        y = cpu_dropout(probabilities, dropout).to(q.dtype) @ v
    else:
        # SPEC §2: a query with no key left gets uniform weights, i.e. the mean of the values. SDPA's
        # kernels need not give it (-inf for a boolean mask; on an H100 even a finite additive mask
        # gave another answer: PITFALLS 4), so such a row attends to every key and its output is
        # replaced below, whatever kernel ran (as jax_impl/ops.py's fused_attention). Its gradient
        # to q and k is then exactly zero, as uniform weights' is.
        no_key = ~mask.any(dim=-1, keepdim=True)  # (B, h or 1, Tq, 1)
        if segments is not None:  # FlexAttention gives such a row zeros: replaced below as well
            y = segments.attend(q, k, v)
        else:
            backends = sdpa_backends(q.device.type, q.dtype)
            with contextlib.nullcontext() if backends is None else sdpa_kernel(backends, set_priority=True):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | no_key, dropout_p=dropout)
        y = torch.where(no_key, v.mean(dim=-2, keepdim=True), y)
    return y.transpose(1, 2), probabilities if weights else None


def sdpa_backends(device_type: str, dtype: torch.dtype) -> list[SDPBackend] | None:
    """SDPA's kernels in order of preference for `attention`, or None: torch's own choice. On CUDA in
    bfloat16/float16, cuDNN's attention first: torch's default order (flash, memory-efficient, math,
    cuDNN) never reaches it, and sends a boolean mask to the memory-efficient kernel (issue 45). A GPU
    or shape that cuDNN cannot take falls to the next; the row-without-keys rule is applied after the
    kernel, whichever ran. GPU effect: not measured yet. CPUs and float32 keep torch's choice."""
    if device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH]


# Packed rows' attention kernel by device type, read once per mask by packed_mask (docs/packing.md):
# "dense", the block-diagonal boolean mask through SDPA (every block computed); "flex", FlexAttention
# over a BlockMask of the segment ids, eager (torch's reference: it materialises the scores); or
# "flex_compiled", flex_attention compiled once (compiled_flex), whose kernel skips the blocks where
# no query may see a key. In a compiled model the two flex values are the same kernel. CUDA takes
# "flex_compiled" (GPU effect: not measured); a CPU keeps "dense": torch 2.13's CPU FlexAttention has
# no backward (training), and no CPU speed-up was measured. Tests set other values (the CPU twin).
PACKED_ATTENTION: dict[str, str] = {"cuda": "flex_compiled"}
PACKED_KERNELS = ("dense", "flex", "flex_compiled")


@dataclass(frozen=True)
class SegmentMask:
    """A packed batch's mask in two forms: `dense` [B, 1, Tq, Tk] (model.segment_mask's), which the
    row-without-keys rule and the paths FlexAttention lacks (recorded softmax, attention dropout)
    read, and `block`, the same rule as FlexAttention's BlockMask (`block_mask`)."""

    dense: torch.Tensor
    block: BlockMask
    compiled: bool

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(dh), masked) v (B, h, Tq, dh) over the BlockMask's allowed pairs; a
        query with no key gets zeros (the caller applies SPEC §2's rule, as for SDPA)."""
        flex = compiled_flex() if self.compiled and not torch.compiler.is_compiling() else flex_attention
        return flex(q, k, v, block_mask=self.block)


def flex_runs(device_type: str, d_head: int, dropout: float, weights: bool) -> bool:
    """Whether a SegmentMask's attention takes FlexAttention: not with attention dropout or a softmax
    to return (it has neither), nor on CUDA with heads under 16 wide (torch 2.13's Triton kernel
    raises NotImplementedError there: tl.dot; `tiny`'s are 8). Otherwise the dense mask."""
    return dropout == 0.0 and not weights and (device_type != "cuda" or d_head >= 16)


def packed_mask(dense: torch.Tensor, q_segments: torch.Tensor, k_segments: torch.Tensor,
                causal: bool) -> torch.Tensor | SegmentMask:
    """model.segment_mask's result for attention: the dense mask [B, 1, Tq, Tk] itself, or with a
    BlockMask of the same segments (a SegmentMask), by PACKED_ATTENTION for the mask's device."""
    kind = PACKED_ATTENTION.get(dense.device.type, "dense")
    if kind not in PACKED_KERNELS:
        raise ValueError(f"PACKED_ATTENTION[{dense.device.type!r}] is {kind!r}, not one of {PACKED_KERNELS}")
    if kind == "dense":
        return dense
    return SegmentMask(dense, block_mask(q_segments, k_segments, causal), kind == "flex_compiled")


def block_mask(q_segments: torch.Tensor, k_segments: torch.Tensor, causal: bool = False,
               block: int = 128) -> BlockMask:
    """FlexAttention's BlockMask for packed rows, q_segments [B, Tq] and k_segments [B, Tk]: the rule
    of model.segment_mask (a query sees keys of its own nonzero segment, causal: at positions <= its
    own; Flax WMT's segmentation masks) as a mask_mod over the segment ids, one for every head.
    Tiles of `block` x `block` positions (FlexAttention's default) where no query sees a key are
    left out: a row shorter than two tiles skips nothing, but its kernel still masks inside."""
    def same_segment(b, h, q, k):
        return (q_segments[b, q] == k_segments[b, k]) & (k_segments[b, k] != 0)

    def causal_segment(b, h, q, k):
        return same_segment(b, h, q, k) & (q >= k)

    rows, queries, keys = q_segments.shape[0], q_segments.shape[1], k_segments.shape[1]
    return create_block_mask(causal_segment if causal else same_segment, rows, None, queries, keys,
                             device=q_segments.device, BLOCK_SIZE=block)


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention under torch.compile, once per process (FlexAttention's documented use: its
    fused kernel, forward and backward, which reads only the BlockMask's non-empty tiles). One graph
    per mask kind and shape (encoder, causal, cross-attention); a new batch's segments reuse it."""
    return torch.compile(flex_attention, dynamic=False)


def cpu_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout (§5.4) at rate 0 < p < 1 from 16 random bits per value (one 64-bit draw
    from torch's generator gives four): torch's CPU `bernoulli_` draws a float per value and was
    ~20% of a `small` training step on this project's CPU (docs/benchmarks.md). p is rounded to a
    multiple of 2^-16 (0.1 -> 0.100006) and the scale is exactly 1/(1-p) for that p."""
    dropped = min(round(p * 65536), 65535)  # of the 65536 values a 16-bit draw takes, those dropped
    words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64, device=x.device)
    bits = words.random_(-2**63, None).view(torch.int16)[:x.numel()].view(x.shape)  # full 64-bit range
    # int16 draws are uniform on [-32768, 32767]; the mask is written once, as 1/(1-p) or 0 in
    # x's dtype (one pass, not a comparison, a cast and a scaling).
    scale = torch.full((), 65536 / (65536 - dropped), dtype=x.dtype)
    return x * torch.where(bits >= dropped - 32768, scale, torch.zeros((), dtype=x.dtype))


class Dropout(nn.Dropout):
    """Inverted dropout (§5.4), by cpu_dropout on CPUs; GPUs keep F.dropout's kernel.
    jax_impl.ops.Dropout draws the same way (its own stream)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled, F.dropout too: dynamo captures no in-place random_, and inductor draws its own bits.
        if not self.training or self.p == 0.0 or x.device.type != "cpu" or torch.compiler.is_compiling():
            return super().forward(x)
        return cpu_dropout(x, self.p)


def dropout_rng(device_type: str, compiled: bool, graphs: bool = False) -> contextlib.AbstractContextManager:
    """torch.compile's functionalised RNG around a compiled training step on CUDA that is not captured
    as CUDA graphs (`graphs`: compilation.training_options; `--accumulate` above one), AOTAutograd's
    `functionalize_rng_ops`: each random op becomes a philox draw from a (seed, offset) read off
    the CUDA generator, a pure function of them, so the partitioner may regenerate a dropout mask in
    the backward pass from the saved (seed, offset) instead of saving the mask, and inductor fuses
    it with the bias and residual add around it. The masks come from another stream than inductor's
    own seeds (docs/training.md: dropout streams). CUDA only: torch 2.13 functionalises only CUDA's
    philox generator and refuses a CPU random op with it on (parity_tests/test_dropout_streams.py);
    eager steps never see it. Off under CUDA graphs: it passes the (seed, offset) as host tensors, a
    CPU input that keeps inductor from capturing the graph whole (the lead, not established, for the
    partitioned graph whose capture failed on an H200: compilation.CUDA_GRAPHS); inductor's own seeds
    live on the device. GPU effect: not measured."""
    functionalise = compiled and device_type == "cuda" and not graphs
    return torch._functorch.config.patch(functionalize_rng_ops=functionalise)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """Eq. 1 for a decoding step's few queries (one a row, or a sentence's K beams; eager): q (B, h,
    Tq, dh) over k, v (B, h, Tk, dh), with a boolean mask broadcastable to (B, h, Tq, Tk) or None
    (every key visible), by two batched matmuls: (B, Tq, h, dh). `attention`'s explicit path without
    dropout: scores and softmax in float32 at least, masked scores the most negative finite value,
    so a query with no key left gets uniform weights (SPEC §2) from the softmax itself, with no
    repair after the kernel (a mean over the values and a select) and no mask where none is given."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.to(q.dtype).transpose(-2, -1)).to(wide) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(wide).min)
    return (scores.softmax(dim=-1).to(q.dtype) @ v.to(q.dtype)).transpose(1, 2)


def fused_linear(linears: list[nn.Linear], rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the outputs of `linears` side by side from one GEMM over their weights concatenated once,
    here (per search): a decoding step's q, k and v (LayerCache.self_attend). oneDNN-packed for `rows`
    rows where packed_linears packs (CPU float32 inference). The same products, in the GEMM's order."""
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    if not _can_pack(linears[0]):
        return functools.partial(F.linear, weight=weight, bias=bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=rows)
    return functools.partial(_packed_linear, packed, bias)


@dataclass
class LayerCache:
    """One decoder layer's keys and values (N, h, length, dh) for incremental decoding, a speed
    path: self-attention over the L output positions (filled as decoding goes, in place),
    cross-attention over the S source positions (computed once, per sentence: `cross_attend`). The
    self-attention rows are N = B x beams; the cross ones B. The decoding step's position t
    is an int when eager, a 0-d tensor on the device when compiled (torch_impl/decode.py).
    Every layer's self-attention keys and values live in one tensor, `stack` [layers, 2, N, h,
    length, dh] (Transformer.init_cache), so that beam search reorders them with one gather a step
    (`reorder_stack`, issue 47); `self_k` and `self_v` are this layer's slices of it, computed when
    read (a compiled step's only cache input is the stack: no aliased inputs). `plain`, set per eager
    search (torch_impl/decode.py's STEP_ATTENTION): the single-query path (`self_attend`,
    `cross_attend`); `fused_qkv` with it (decode.FUSED_QKV): q, k and v from one GEMM."""

    stack: torch.Tensor
    layer: int
    cross_k: torch.Tensor
    cross_v: torch.Tensor
    plain: bool = False
    fused_qkv: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def self_k(self) -> torch.Tensor:
        return self.stack[self.layer, 0]

    @property
    def self_v(self) -> torch.Tensor:
        return self.stack[self.layer, 1]

    def write(self, t: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Writes the keys and values (N, h, 1, dh) of position t in place; returns the keys, values
        and self-attention mask [..., L] to attend over. An int t: positions <= t only (no masked
        work; their weights are the whole masked cache's up to summation order: a masked score, the
        dtype's most negative finite value (SPEC §2), has exp exactly 0 beside position t's, but
        SDPA's sums group differently by length, so the last bits differ). A tensor t: written by
        index_copy_, the whole cache attended, positions > t masked: static shapes and addresses for
        a compiled step and CUDA graphs (jax_impl's dynamic_update_slice; Hugging Face's StaticCache)."""
        if isinstance(t, int):
            self.self_k[:, :, t: t + 1], self.self_v[:, :, t: t + 1] = k, v
            return self.self_k[:, :, :t + 1], self.self_v[:, :, :t + 1], mask[..., :t + 1]
        self.self_k.index_copy_(2, t.view(1), k.to(self.self_k.dtype))
        self.self_v.index_copy_(2, t.view(1), v.to(self.self_v.dtype))
        return self.self_k, self.self_v, mask

    def reorder(self, rows: torch.Tensor, t: int | torch.Tensor) -> None:
        """Beam search's reordering, at the start of step t (before `write`): row i takes row rows[i],
        in place. An int t moves positions < t only (the others hold nothing yet); a tensor t the
        whole cache (static shapes). Not after the write: inductor fuses an in-place gather of a tensor
        that an index_copy_ wrote earlier in the same graph into one kernel that reads rows it has
        already overwritten (silently wrong keys; pytorch/pytorch#198270, CPU and CUDA)."""
        for cache in (self.self_k, self.self_v):
            if isinstance(t, int):
                cache[:, :, :t] = cache[rows, :, :t]
            else:
                cache.copy_(cache.index_select(0, rows))

    def self_attend(self, attention: nn.Module, h: torch.Tensor, t: int | torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """Self-attention of the new tokens h [N, 1, d] at position t by `attention` (the layer's
        MultiHeadAttention): their keys and values written (`write`), then attended. `plain` and an int
        t (eager): plain_attention over positions <= t with no mask (each is a real token), q, k and v
        from one GEMM with `fused_qkv`; else attention.attend, as the training forward computes."""
        if not self.plain or not isinstance(t, int):
            k, v, mask = self.write(t, *attention.project_kv(h), mask)
            return attention.attend(h, k, v, mask)
        if self.fused_qkv is None:
            q, (k, v) = attention.split_heads(attention.q(h)), attention.project_kv(h)
        else:
            q, k, v = (attention.split_heads(x) for x in self.fused_qkv(h).chunk(3, dim=-1))
        k, v, _ = self.write(t, k, v, mask)
        return attention.o(plain_attention(q, k, v, None).reshape(h.shape))

    def cross_attend(self, attention: nn.Module, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Cross-attention of h [N, 1, d] over the cached encoder keys and values by `attention` (the
        layer's MultiHeadAttention). The keys and values (B, h, S, dh) may be a sentence's,
        B dividing N (beam search: rows b*K .. b*K + K - 1 are sentence b's K beams): each sentence's
        K rows are then K queries (B, K, d) of one attention over them, as the training forward's
        target positions are, with `mask` [B, 1, 1, S]: keys and values computed and read once per
        sentence, not per beam (issue 47). Attention is per query, so each row gets its own result:
        the same numbers up to the GEMMs' summation order. B = N (greedy): each row its own. `plain`
        (eager): plain_attention, `mask` None where no source has padding."""
        x_q = h.reshape(self.cross_k.shape[0], -1, h.shape[-1])
        if not self.plain:
            return attention.attend(x_q, self.cross_k, self.cross_v, mask).reshape(h.shape)
        y = plain_attention(attention.split_heads(attention.q(x_q)), self.cross_k, self.cross_v, mask)
        return attention.o(y.reshape(x_q.shape)).reshape(h.shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.stack, self.cross_k, self.cross_v


def reorder_stack(stack: torch.Tensor, rows: torch.Tensor, t: int | torch.Tensor,
                  spare: torch.Tensor | None = None) -> torch.Tensor:
    """LayerCache.reorder for every layer at once (decode.STACKED_CACHE): row i of the stack [layers,
    2, N, h, L, dh] takes row rows[i], by one gather over the row axis, at the start of step t (before
    any write: LayerCache.reorder says why); returns the reordered stack. An int t (eager) gathers
    positions < t into the first len(rows) rows of `spare` (a buffer of the stack's full shape: double
    buffering, one pass over the keys where a gather in place is a gather into a temporary and a copy
    back; fewer rows than N where finished sentences are dropped: decode.Steps.keep) and returns them
    (a view of `spare`). A tensor t (compiled) reorders the whole stack in place: static shapes and
    addresses."""
    if not isinstance(t, int):
        return stack.copy_(stack.index_select(2, rows))
    kept = spare[:, :, :len(rows)]
    torch.index_select(stack[:, :, :, :, :t], 2, rows, out=kept[:, :, :, :, :t])
    return kept


def grow_positions(model: nn.Module, rows: int) -> None:
    """Replaces `model.positions` by a table of at least `rows` positions (rosetta/positional.py's
    grown_rows), on the same device and in the same dtype. Eager, once per new length: a compiled
    step's caller grows the table before it (decode.Steps, train.Trainer.step), and a graph that would
    grow it is refused while it is traced (a NumPy table traced into a graph would be recomputed in it)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the position table grows outside a compiled step: position_table(rows) first")
    table = model_table(model.cfg, grown_rows(rows, model.positions.shape[0], model.cfg.max_len))
    with torch.inference_mode(False):  # a plain tensor, usable by training later
        model.positions = torch.from_numpy(table).to(model.positions.device, model.positions.dtype)


def _can_pack(module: nn.Module) -> bool:
    """CPU float32 weights, no gradients, no CPU autocast (bfloat16 activations: oneDNN cannot
    create the packed float32 primitive for them), and oneDNN's packed linear in this torch build."""
    params = list(module.parameters())
    return (bool(params) and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# The output projection over the vocabulary (a base model's largest GEMM: 43% of a beam step's FLOPs)
# goes through MKL's packed SGEMM on Intel's CPUs where this torch build has it, as CTranslate2 runs its
# GEMMs there: [128, 512] x [512, 32000] 194 -> 241 GFLOP/s natively and 103 -> 136 capped at AVX2 against
# oneDNN's packed (this project's 2-core Xeon). Elsewhere MKL takes its generic path: on the 2-core
# AVX-512 AMD EPYC oneDNN's packed ran it at 455 GFLOP/s natively and 240 capped, MKL's at 160 under
# both (issue 55). The other linears stay with oneDNN (no steady gain at their shapes).
@functools.cache
def _mkl_packs() -> bool:
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
            and intel_cpu())


def _pack_projection(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if _mkl_packs():
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=rows)


def _packed_projection(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                       x: torch.Tensor) -> torch.Tensor:
    if _mkl_packs():
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    return _packed_linear(packed, bias, x)


@contextlib.contextmanager
def packed_linears(module: nn.Module, rows: int) -> Iterator[None]:
    """Inference on a CPU in float32: every nn.Linear of `module`, and the output projection (over the target
    vocabulary: MKL's packing where _mkl_packs), computes with its weight packed by oneDNN instead of
    repacked by the GEMM at every call (torch.ops.mkldnn._linear_pointwise: what torch.compile's CPU
    backend calls for a frozen linear). At decoding's shapes 1.3-1.9x the plain GEMM ([128, 512] x [512,
    2048]: 2.3 -> 1.3 ms; the output projection over 32k: 46 -> 20 ms; this project's CPU): the same
    products in another summation order (relative difference ~4e-7). The output bias is added in the GEMM
    where logit_scale is 1 (a separate add over [rows, V] took 4.5 ms a beam step of decode_ct2's model).
    `rows` is the batch the packing is tuned for. The packed weights are kept on the module (`_packed`)
    and reused while the weights and `rows` are unchanged (packing took ~150 ms a call there, as
    CTranslate2 packs once, at load). Anything else (a GPU, bfloat16, gradients) runs as it is."""
    if not _can_pack(module):
        yield
        return
    generator = module.generator
    weight = generator.weight if generator.weight is not None else module.tgt_table.weight
    scaled = generator.logit_scale != 1.0
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    packed = _packed_weights(module, [*(linear.weight for linear in linears), weight], rows)
    patched = []
    try:
        for linear, packed_weight in zip(linears, packed[:-1], strict=True):
            linear.forward = functools.partial(_packed_linear, packed_weight, linear.bias)
            patched.append(linear)
        bias = None if scaled else generator.bias
        projection = functools.partial(_packed_projection, packed[-1], weight, bias, rows)

        def output(hidden: torch.Tensor, tgt_table: nn.Embedding) -> torch.Tensor:
            # Generator.forward with the packed weight (the table the model passes is `weight`).
            logits = projection(hidden)
            if not scaled:
                return logits  # its bias, if any, added in the GEMM
            logits = logits * generator.logit_scale
            return logits if generator.bias is None else logits + generator.bias

        generator.forward = output
        patched.append(generator)
        yield
    finally:
        for m in patched:  # the instance attribute shadowed the class's forward
            del m.forward


def _packed_weights(module: nn.Module, weights: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """oneDNN's packing of each weight for `rows` rows (the last, the output projection's: MKL's where
    _mkl_packs), kept on `module` and reused while every weight is the same tensor, unmodified (its
    address and version counter: an optimizer step or load_state_dict changes them) and `rows` the
    same. Weights made in inference mode have no version counter: packed anew at each call."""
    try:
        key = (rows, *((id(w), w.data_ptr(), w._version) for w in weights))
    except RuntimeError:  # "Inference tensors do not track version counter"
        key = None
    kept = getattr(module, "_packed", None)
    if key is None or kept is None or kept[0] != key:
        pack = functools.partial(torch.ops.mkldnn._reorder_linear_weight, batch_size=rows)
        kept = module._packed = (key, [*(pack(w) for w in weights[:-1]), _pack_projection(weights[-1], rows)])
    return kept[1]


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_heap(device_type: str) -> None:
    """From the first CPU search on, under glibc, the process keeps the memory it frees in malloc's
    heap for its next tensors (no mmap for large blocks, no trimming) instead of handing it back to the
    OS and taking it again as fresh pages, as a caching allocator does (CTranslate2 has its own; torch's
    CUDA allocator keeps memory the same way): a beam-4 call of decode_ct2's model took ~44,800 page
    faults (~80 ms of system time) a call, none so (issue 55). The cost: the process's resident memory
    stays at its peak (malloc_trim(0) hands the free part back). Once per process; elsewhere (a GPU,
    macOS, musl) nothing changes."""
    if device_type == "cpu":
        _heap_kept()


@functools.cache
def _heap_kept() -> bool:
    """mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2^31 - 1), once, where the C library is glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
