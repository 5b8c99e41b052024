"""Pictures for `rosetta attention` and `rosetta diff --plot`: every attention map of a model, and
where two implementations part (the per-stage error curve, then the two sides' attention maps at
the first diverging layer with their difference).

Inputs are the fine stages of `BackendModel.stages(src, tgt, fine=True)`: attention weights
`{encoder,decoder}.layers.{i}.self_attn.weights` [B, H, q, k] and
`decoder.layers.{i}.cross_attn.weights` [B, H, T, S]. Only the first sentence of the batch is
drawn, with its padding trimmed (padded keys hold weight 0 and padded queries are outside the
contract, SPEC §2). Figures are drawn without pyplot (no display, no global state) and written
atomically, so a failed render never leaves half a PNG.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rosetta.errors import InputError
from rosetta.files import atomic_write_bytes

PANEL_IN = 2.0  # inches per attention panel; a figure's size follows from its grid (tests rely on it)
TITLE_IN = 0.6  # inches above the grid for the figure's title
DPI = 80
MIN_WIDTH_IN = 6.0  # a one- or two-head model still gets room for the figure's title
CURVE_IN = (10.0, 4.0)  # the error curve of plot_diff: width, height in inches
LABELS_IN = 2.4  # below the curve: its stage names (fine names run to 35 characters)

_WEIGHTS = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(self_attn|cross_attn)\.weights$")
_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)(\.|$)")
_KIND = {("encoder", "self_attn"): "encoder", ("decoder", "self_attn"): "decoder self",
         ("decoder", "cross_attn"): "cross"}


# -- input checks --------------------------------------------------------------------------

def _ids(name: str, ids: object) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{name} must be a non-empty [batch, length] array of integer token ids, "
                         f"got shape {arr.shape} dtype {arr.dtype}")
    return arr


def _weight_stages(stages: Mapping[str, np.ndarray], what: str) -> list[tuple[str, str, int, str]]:
    """(stage name, side, layer, sublayer) of every attention weights stage, in forward order:
    encoder layers, then per decoder layer self- before cross-attention."""
    found = []
    for name in stages:
        m = _WEIGHTS.match(name)
        if m:
            side, layer, sublayer = m.group(1), int(m.group(2)), m.group(3)
            if (side, sublayer) == ("encoder", "cross_attn"):
                raise InputError(f"{what}: {name!r} is not a stage (the encoder has no cross-attention)")
            found.append((name, side, layer, sublayer))
    if not found:
        raise InputError(f"{what} hold no attention weights stages (*.self_attn.weights, "
                         "*.cross_attn.weights): compute them with model.stages(src, tgt, fine=True)")
    order = {"encoder": 0, "decoder": 1}
    return sorted(found, key=lambda f: (order[f[1]], f[2], f[3] == "cross_attn"))


def _check_weights(name: str, w: object, src: np.ndarray | None, tgt: np.ndarray | None,
                   side: str, sublayer: str) -> np.ndarray:
    """The stage as a float64 [B, H, q, k] array, its shape checked against src and tgt."""
    try:
        arr = np.asarray(w, dtype=np.float64)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 4 or 0 in arr.shape:
        raise InputError(f"stage {name!r} must be attention weights [batch, heads, queries, keys], "
                         f"got shape {np.shape(w)}")
    if not np.isfinite(arr).all():
        raise InputError(f"stage {name!r} holds NaN or infinity")
    if src is not None and tgt is not None:
        q = src.shape[1] if side == "encoder" else tgt.shape[1]
        k = tgt.shape[1] if (side, sublayer) == ("decoder", "self_attn") else src.shape[1]
        if arr.shape[0] != src.shape[0] or arr.shape[2:] != (q, k):
            raise InputError(f"stage {name!r} has shape {arr.shape}, but src {src.shape} and tgt "
                             f"{tgt.shape} need [{src.shape[0]}, heads, {q}, {k}]")
    return arr


def _labels(name: str, labels: Sequence[str] | None, ids: np.ndarray, keep: int) -> list[str]:
    """Tick labels for the first `keep` positions: the given labels (one per position of the row,
    or one per kept position), else the ids as text."""
    if labels is None:
        return [str(int(i)) for i in ids[:keep]]
    labels = [str(x) for x in labels]
    if len(labels) not in (len(ids), keep):
        raise InputError(f"{name} has {len(labels)} labels, but the first sentence has {len(ids)} "
                         f"positions ({keep} before padding)")
    return labels[:keep]


def _real_length(ids: np.ndarray, pad_id: int, is_target: bool) -> int:
    """Positions before trailing padding; target position 0 (the start token) is never padding
    even when it equals pad_id (PITFALLS 12)."""
    real = ids != pad_id
    if is_target:
        real[0] = True
    nonzero = np.flatnonzero(real)
    return int(nonzero[-1]) + 1 if nonzero.size else 1  # an all-padding source: keep one column


# -- drawing -------------------------------------------------------------------------------

def _figure(width_in: float, height_in: float):
    # Figure without pyplot: no display backend, no global figure registry, safe in threads.
    from matplotlib.figure import Figure
    return Figure(figsize=(width_in, height_in), dpi=DPI)


def _save(fig, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)  # no bbox_inches="tight": the size follows the grid
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _heatmap(ax, matrix: np.ndarray, title: str, xlabels: list[str], ylabels: list[str],
             vmin: float, vmax: float, cmap: str = "viridis") -> None:
    ax.imshow(matrix, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=8)
    small = max(3, min(7, int(120 / max(len(xlabels), len(ylabels), 1))))
    ax.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=small)
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=small)


def plot_attention(
    path: str | os.PathLike, stages: Mapping[str, np.ndarray], src: object, tgt: object,
    src_labels: Sequence[str] | None = None, tgt_labels: Sequence[str] | None = None,
    pad_id: int = 0, drawn: dict[str, np.ndarray] | None = None,
) -> Path:
    """One PNG: every layer and head of encoder self-, decoder self- and cross-attention of the
    first sentence (one row of panels per layer and kind, one column per head), tokens on the
    axes (queries down, keys across). `drawn`, if given, receives each panel's matrix by title
    ("encoder layer 0 head 1"), exactly what was drawn."""
    src, tgt = _ids("src", src), _ids("tgt", tgt)
    found = _weight_stages(stages, "the stages")
    s_len, t_len = _real_length(src[0], pad_id, False), _real_length(tgt[0], pad_id, True)
    s_lab = _labels("src_labels", src_labels, src[0], s_len)
    t_lab = _labels("tgt_labels", tgt_labels, tgt[0], t_len)
    weights = [_check_weights(n, stages[n], src, tgt, side, sub) for n, side, _, sub in found]
    heads = {w.shape[1] for w in weights}
    if len(heads) != 1:
        raise InputError(f"the attention weights stages disagree on the number of heads: {sorted(heads)}")
    H = heads.pop()
    height = PANEL_IN * len(found) + TITLE_IN
    fig = _figure(max(PANEL_IN * H, MIN_WIDTH_IN), height)
    fig.suptitle("attention weights, sentence 0 (queries down, keys across)", fontsize=10)
    # Margins in inches (the last row's rotated labels need ~0.45), as fractions of the figure.
    grid = fig.add_gridspec(len(found), H, top=1 - TITLE_IN / height, bottom=0.45 / height,
                            hspace=0.7, wspace=0.5, left=0.06, right=0.98)
    for row, ((_, side, layer, sub), w) in enumerate(zip(found, weights, strict=True)):
        queries = (s_lab, s_len) if side == "encoder" else (t_lab, t_len)
        keys = (t_lab, t_len) if (side, sub) == ("decoder", "self_attn") else (s_lab, s_len)
        for h in range(H):
            title = f"{_KIND[side, sub]} layer {layer} head {h}"
            matrix = w[0, h, :queries[1], :keys[1]]
            _heatmap(fig.add_subplot(grid[row, h]), matrix, title, keys[0], queries[0], 0.0, 1.0)
            if drawn is not None:
                drawn[title] = matrix
    return _save(fig, path)


def _row(r: object) -> tuple[str, float, float, bool]:
    """One StageRow (stage, rel, max_abs, over), duck-typed as a tuple."""
    try:
        stage, rel, max_abs, over = tuple(r)  # type: ignore[arg-type]
        return str(stage), float(rel), float(max_abs), bool(over)
    except (TypeError, ValueError):
        raise InputError(f"a comparison row must be (stage, rel, max_abs, over), got {r!r}") from None


def plot_diff(
    path: str | os.PathLike, rows: Sequence[object], stages_a: Mapping[str, np.ndarray],
    stages_b: Mapping[str, np.ndarray], first_stage: str | None, tolerance: float | None = None,
    labels: tuple[str, str] = ("A", "B"), src: object = None, tgt: object = None, pad_id: int = 0,
    drawn: dict[str, np.ndarray] | None = None,
) -> Path:
    """The relative error ||a - b|| / ||b|| of every compared stage in forward order (log scale,
    `tolerance` as a line, `first_stage` marked) and, when `first_stage` lies in a layer whose
    attention weights both sides hold, that layer's maps of sentence 0: side A, side B and A - B,
    one row per head and attention kind. Without such weights only the curve is drawn. With
    `src` and `tgt` the maps are trimmed to the real tokens. `drawn` receives the matrices."""
    parsed = [_row(r) for r in rows]
    if not parsed:
        raise InputError("no comparison rows to plot: the two sides share no stage")
    bad = [(s, rel) for s, rel, _, _ in parsed if not (rel >= 0) or math.isinf(rel)]
    names = [s for s, *_ in parsed]
    if first_stage is not None and first_stage not in names:
        raise InputError(f"first_stage {first_stage!r} is not one of the compared stages")
    if tolerance is not None and not (tolerance >= 0 and math.isfinite(tolerance)):
        raise InputError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    pairs = _diverging_maps(stages_a, stages_b, first_stage, src, tgt, pad_id)
    H = pairs[0][2].shape[0] if pairs else 0
    n_rows = len(pairs) * H
    width = max(CURVE_IN[0], 3 * PANEL_IN)
    total = CURVE_IN[1] + LABELS_IN + PANEL_IN * n_rows + TITLE_IN
    fig = _figure(width, total)
    fig.suptitle(f"{labels[0]} vs {labels[1]}: relative error per stage"
                 + (f", first over tolerance: {first_stage}" if first_stage else ", none over tolerance"),
                 fontsize=10)
    # Row 1 is left empty: the curve's stage names hang into it.
    grid = fig.add_gridspec(2 + n_rows, 3, height_ratios=[CURVE_IN[1], LABELS_IN] + [PANEL_IN] * n_rows,
                            top=1 - TITLE_IN / total, bottom=0.35 / total, hspace=0.45, wspace=0.4,
                            left=0.08, right=0.97)
    ax = fig.add_subplot(grid[0, :])
    # log scale cannot show 0 (bit-identical stages) or NaN: draw those at a floor, say so.
    floor = 1e-18
    y = np.array([rel if rel > 0 and math.isfinite(rel) else floor for _, rel, _, _ in parsed])
    x = np.arange(len(parsed))
    ax.semilogy(x, y, marker="o", markersize=3, label="||a - b|| / ||b||")
    over = [i for i, (_, _, _, o) in enumerate(parsed) if o]
    ax.semilogy(x[over], y[over], "o", color="tab:red", markersize=4, label="over tolerance")
    if tolerance:  # a log scale has no 0: tolerance 0 (bit-identical) draws no line
        ax.axhline(tolerance, color="gray", linestyle="--", label=f"tolerance {tolerance:.0e}")
    if first_stage is not None:
        i = names.index(first_stage)
        ax.axvline(i, color="tab:red", linestyle=":", label=f"first: {first_stage}")
    if bad:
        ax.text(0.01, 0.02, f"NaN/inf at {', '.join(s for s, _ in bad[:3])}", transform=ax.transAxes,
                fontsize=7, color="tab:red")
    step = max(1, len(names) // 60)  # fine stages of a big model: label every step-th stage
    ax.set_xticks(x[::step], names[::step], rotation=90, fontsize=6)
    ax.set_ylabel("relative error")
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    if drawn is not None:
        drawn["curve"] = y
    for p, (title, a, b) in enumerate(pairs):
        diff = a - b
        lim = float(np.abs(diff).max()) or 1.0
        for h in range(H):
            r = 2 + p * H + h
            for c, (m, name, lo, hi, cmap) in enumerate([
                    (a[h], labels[0], 0.0, 1.0, "viridis"), (b[h], labels[1], 0.0, 1.0, "viridis"),
                    (diff[h], f"{labels[0]} - {labels[1]}", -lim, lim, "RdBu_r")]):
                # The difference panel's colour scale is symmetric about 0, its bound in the title.
                shown = name if c < 2 else f"{name}, |max| {lim:.1e}"
                sub_ax = fig.add_subplot(grid[r, c])
                sub_ax.imshow(m, vmin=lo, vmax=hi, cmap=cmap, aspect="auto", interpolation="nearest")
                sub_ax.set_title(f"{title} head {h}:\n{shown}", fontsize=7)
                sub_ax.tick_params(labelsize=5)
                if drawn is not None:
                    drawn[f"{title} head {h}: {name}"] = m
    return _save(fig, path)


def _diverging_maps(stages_a: Mapping[str, np.ndarray], stages_b: Mapping[str, np.ndarray],
                    first_stage: str | None, src: object, tgt: object,
                    pad_id: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(panel title, A [H, q, k], B [H, q, k]) of sentence 0 for each attention kind of the first
    diverging layer that both sides hold weights for; [] when there is none."""
    m = _LAYER.match(first_stage or "")
    if m is None:
        return []  # embeddings, final norms, logits: no attention map to show
    side, layer = m.group(1), int(m.group(2))
    src_ids = None if src is None else _ids("src", src)
    tgt_ids = None if tgt is None else _ids("tgt", tgt)
    if (src_ids is None) != (tgt_ids is None):
        raise InputError("give both src and tgt (to trim the padding), or neither")
    out = []
    for sub in ("self_attn", "cross_attn") if side == "decoder" else ("self_attn",):
        name = f"{side}.layers.{layer}.{sub}.weights"
        if name not in stages_a or name not in stages_b:
            continue
        a = _check_weights(name, stages_a[name], src_ids, tgt_ids, side, sub)
        b = _check_weights(name, stages_b[name], src_ids, tgt_ids, side, sub)
        if a.shape != b.shape:
            raise InputError(f"stage {name!r}: side A has shape {a.shape}, side B {b.shape}")
        a, b = a[0], b[0]
        if src_ids is not None and tgt_ids is not None:
            s_len = _real_length(src_ids[0], pad_id, False)
            t_len = _real_length(tgt_ids[0], pad_id, True)
            q = s_len if side == "encoder" else t_len
            k = t_len if (side, sub) == ("decoder", "self_attn") else s_len
            a, b = a[:, :q, :k], b[:, :q, :k]
        out.append((f"{_KIND[side, sub]} layer {layer}", a, b))
    return out


def plot_training_diff(path: str | os.PathLike, a: object, b: object, rows: Sequence[object],
                       first_step: int | None, steps: int) -> Path:
    """`rosetta diff TRACE_A TRACE_B --plot`: the two loss curves over the compared steps, and
    per step the relative difference of the loss, gradients and updated weights (the training
    diff's metrics: its StepRows, read by attribute; 0 drawn at the floor of the log axis), the
    first difference marked."""
    fig = _figure(8.0, 6.0)
    top, bottom = fig.subplots(2, 1, sharex=True)
    x = np.arange(1, steps + 1)
    for trace, label in ((a, "A"), (b, "B")):
        top.plot(x, [s.loss for s in trace.steps[:steps]], label=f"{label}: {trace.path}", lw=1.2)
    top.set_ylabel("training loss")
    top.legend(fontsize=7)
    floor = 1e-18
    for key in ("loss", "grads", "params"):
        values = [max(getattr(r, key), floor) if np.isfinite(getattr(r, key)) else np.nan for r in rows]
        bottom.semilogy([r.step for r in rows], values, marker=".", label=key)
    if first_step is not None:
        for ax in (top, bottom):
            ax.axvline(first_step, color="red", ls="--", lw=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative difference (A vs B)")
    bottom.legend(fontsize=7)
    fig.suptitle(f"training traces: first difference at step {first_step}" if first_step
                 else "training traces: agree")
    return _save(fig, path)
