"""What every backend's search shares (the algorithm itself is documented in numpy_ref/decode.py,
the oracle): the result type, the "impossible" score, the length penalty, the constraints on what
a search emits, the output limits and the stripping of eos and padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rosetta.config import ModelConfig
from rosetta.errors import InputError, RosettaError
from rosetta.inputs import check_int, check_real

NEG = -1e9  # "impossible" score: finite, so NEG - NEG is 0, not NaN
# Beam search's rule for finished hypotheses (PITFALLS 15). "wu": score log P / lp(n) with
# lp(n) = ((5 + n) / 6)^alpha (Wu et al. 2016, eq. 14), finished candidates from all 2K, stop when
# no alive hypothesis can win even at the length limit. "hf": Hugging Face generate's beam search
# (transformers 5, early_stopping=False): log P / n^alpha, finished candidates only from the top K
# of the 2K, stop judged at the current length n (its heuristic).
LENGTH_RULES = ("wu", "hf")
# The largest length-penalty exponent. Wu et al. tune alpha in [0, 1] (0.6 for the paper's beam).
# The framework backends compute lp in float32: with n up to max_len's bound 2^20 (config LIMITS),
# lp <= (2^20)^5 = 2^100 stays far inside float32 (2^128), so no alpha in [0, ALPHA_MAX] can make
# lp overflow and turn every score into -0.0, which a larger alpha (1e300) does.
ALPHA_MAX = 5.0


@dataclass(frozen=True)
class Generation:
    """Per sentence: emitted tokens (without the start token and without eos) and score
    (sum of log-probabilities for greedy; that over lp(length) for beam search)."""

    tokens: list[list[int]]
    scores: np.ndarray


@dataclass(frozen=True)
class Constraints:
    """What a search may emit besides the model's choice, as Hugging Face's generation_config.json
    says it (docs/decoding.md). The defaults change nothing: pad alone is banned.

    banned: target ids never emitted, besides pad (HF `bad_words_ids` of single tokens).
    renormalize: log-probabilities renormalized over the tokens left (HF `renormalize_logits`).
    max_new_tokens: at most this many tokens per sentence, eos included (HF `max_length` - 1).
    forced_eos: at a sentence's last allowed position only eos (HF `forced_eos_token_id` = eos).
    Hashable: JAX compiles one search per value."""

    banned: tuple[int, ...] = ()
    renormalize: bool = False
    max_new_tokens: int | None = None
    forced_eos: bool = False

    def banned_ids(self, cfg: ModelConfig) -> np.ndarray:
        """The ids a search never emits: pad and the banned ones."""
        return np.array([cfg.pad_id, *self.banned], dtype=np.int64)


NO_CONSTRAINTS = Constraints()


def check_constraints(cfg: ModelConfig, banned: object = (), renormalize: object = False,
                      max_new_tokens: object = None, forced_eos: object = False) -> Constraints:
    """The checked Constraints, or an InputError naming the argument at fault."""
    try:
        items = None if isinstance(banned, (str, bytes)) else list(banned)
    except TypeError:  # not iterable
        items = None
    if items is None:
        raise InputError(f"banned must be a sequence of target token ids, got {banned!r}")
    ids = [check_int(tok, "banned token id", minimum=0) for tok in items]
    vocab = cfg.tgt_vocab_size
    for tok in ids:
        if tok >= vocab:
            raise InputError(f"banned holds token id {tok}, outside the target vocabulary [0, {vocab})")
        if tok == cfg.eos_id:
            # Hugging Face drops eos from bad_words_ids silently; a search without eos never ends.
            raise InputError(f"banned holds eos (id {tok}), which ends every sentence and cannot be banned")
    for name, flag in (("renormalize", renormalize), ("forced_eos", forced_eos)):
        if not isinstance(flag, (bool, np.bool_)):
            raise InputError(f"{name} must be True or False, got {flag!r}")
    if max_new_tokens is not None:
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", minimum=1)
    return Constraints(tuple(sorted(set(ids))), bool(renormalize), max_new_tokens, bool(forced_eos))


def check_alpha(alpha: object, name: str = "alpha") -> float:
    """`alpha` as a float if it is a finite number in [0, ALPHA_MAX] (an InputError naming `name`)."""
    alpha = check_real(alpha, name, minimum=0.0)
    if alpha > ALPHA_MAX:
        raise InputError(f"{name} must be at most {ALPHA_MAX:g}, got {alpha:g}: the length penalty "
                         f"((5 + n) / 6)^alpha overflows beyond (Wu et al. 2016 use 0 to 1)")
    return alpha


def check_scores(gen: Generation, where: str) -> Generation:
    """`gen` if every sentence's score is finite. A search returns finite scores (its "impossible"
    is NEG, and a banned token's log-probability of -inf never wins a sentence's best score),
    so NaN or infinity means the logits were not finite: refused as `rosetta parity` fails them."""
    bad = ~np.isfinite(np.asarray(gen.scores, dtype=np.float64))
    if bad.any():
        rows = ", ".join(map(str, np.flatnonzero(bad)[:5])) + (", ..." if bad.sum() > 5 else "")
        raise RosettaError(f"non-finite scores in the search (the weights overflow float32?): {where}, "
                           f"sentence {rows} of the batch; `rosetta parity --checkpoint` shows the "
                           f"non-finite logits")
    return gen


def length_penalty(length: np.ndarray | int, alpha: float, rule: str = "wu") -> np.ndarray:
    """lp(Y) = ((5 + |Y|) / 6)^alpha, Wu et al. 2016, eq. 14; |Y|^alpha for rule "hf"."""
    n = np.asarray(length, dtype=np.float64)
    return n**alpha if rule == "hf" else ((5.0 + n) / 6.0) ** alpha


def output_limits(cfg: ModelConfig, src: np.ndarray, max_len_margin: int,
                  max_new_tokens: int | None = None) -> tuple[np.ndarray, int]:
    """Per-sentence limits (real source length + margin, at most max_len and max_new_tokens) and
    the static buffer length L = min(S + margin, max_len, max_new_tokens) every backend allocates."""
    cap = cfg.max_len if max_new_tokens is None else min(cfg.max_len, max_new_tokens)
    limits = np.minimum((src != cfg.pad_id).sum(axis=1) + max_len_margin, cap)
    return np.maximum(limits, 1), max(1, min(src.shape[1] + max_len_margin, cap))


def strip(cfg: ModelConfig, tokens: np.ndarray) -> list[list[int]]:
    """Each row up to (not including) its first eos; pad fills the rest."""
    out = []
    for row in np.asarray(tokens).tolist():
        row = row[: row.index(cfg.eos_id)] if cfg.eos_id in row else row
        out.append([tok for tok in row if tok != cfg.pad_id])
    return out
