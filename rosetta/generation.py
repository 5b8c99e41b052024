"""What every backend's search shares (the algorithm itself is documented in numpy_ref/decode.py,
the oracle): the result type, the "impossible" score, the length penalty, the constraints on what
a search emits, the output limits and the stripping of eos and padding; and the one check of
Hugging Face's generation settings (`check_generation_config`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from rosetta.config import ModelConfig
from rosetta.errors import ConfigError, InputError, RosettaError
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
# Beam search's top k of a long row through its k best chunks (torch_impl/decode.py _best_chunks, jax_impl
# top_k_by_chunks; issue 55): the chunk widths tried, the first dividing the row taken (32,000 = 250 x
# 128; 8,000 = 64 x 125).
CHUNK_WIDTHS = (128, 125, 160, 100, 200, 250, 256, 64)


def chunk_width(length: int, k: int) -> int | None:
    """The chunk width for the k best of a row of `length`, None where chunks save nothing (a row
    under 4 k widths, or no width of CHUNK_WIDTHS dividing it)."""
    width = next((w for w in CHUNK_WIDTHS if length % w == 0), None)
    return None if width is None or 4 * k * width > length else width


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
    forced_first: at the first position only this token, its log-probability set to 0 (HF
    `forced_bos_token_id`: M2M100's and NLLB's target language code); None: no forcing.
    Hashable: JAX compiles one search per value."""

    banned: tuple[int, ...] = ()
    renormalize: bool = False
    max_new_tokens: int | None = None
    forced_eos: bool = False
    forced_first: int | None = None

    def banned_ids(self, cfg: ModelConfig) -> np.ndarray:
        """The ids a search never emits: pad and the banned ones."""
        return np.array([cfg.pad_id, *self.banned], dtype=np.int64)


NO_CONSTRAINTS = Constraints()


def check_constraints(cfg: ModelConfig, banned: object = (), renormalize: object = False,
                      max_new_tokens: object = None, forced_eos: object = False,
                      forced_first: object = None) -> Constraints:
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
    if forced_first is not None:
        forced_first = check_int(forced_first, "forced_first", minimum=0)
        if forced_first >= vocab:
            raise InputError(f"forced_first is token id {forced_first}, outside the target vocabulary "
                             f"[0, {vocab})")
        if forced_first == cfg.pad_id or forced_first in ids:
            # Hugging Face forces it anyway (ForcedBOS after NoBadWords); our search never emits pad.
            raise InputError(f"forced_first is token id {forced_first}, which the search may not emit "
                             f"({'pad' if forced_first == cfg.pad_id else 'banned'})")
    return Constraints(tuple(sorted(set(ids))), bool(renormalize), max_new_tokens, bool(forced_eos),
                       forced_first)


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


# -- generation_config.json: Hugging Face's search settings, checked once --------------------------
# The one validator of the settings a Marian directory (or a checkpoint's sidecar) carries:
# `convert` (every --to), `translate`, `generate` and `evaluate` all call it, so what one refuses
# all refuse, before anything is written. Semantics are transformers 5's generate
# (generation/utils.py: _prepare_generated_length, _prepare_special_tokens, _get_logits_processor),
# compared with MarianMTModel.generate in parity_tests/test_generation_settings.py.

HF_NEW_TOKENS = 20  # GenerationConfig's max_length default: generate then adds 20 tokens to its input
# Fields rosetta's search honours as generate does (or notes where it cannot: eos lists, other ids).
HONOURED = ("num_beams", "length_penalty", "max_length", "max_new_tokens", "bad_words_ids", "suppress_tokens",
            "renormalize_logits", "forced_eos_token_id", "forced_bos_token_id", "eos_token_id",
            "decoder_start_token_id", "bos_token_id", "pad_token_id")
# Fields the search does not do, with the value that means "off": a note names each one set.
UNSUPPORTED = {"do_sample": False, "early_stopping": False, "min_length": 0, "min_new_tokens": None,
               "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
               "encoder_repetition_penalty": 1.0, "exponential_decay_length_penalty": None,
               "begin_suppress_tokens": None, "sequence_bias": None,
               "guidance_scale": 1.0, "watermarking_config": None, "token_healing": False, "max_time": None,
               "stop_strings": None, "num_return_sequences": 1, "num_beam_groups": 1,
               "diversity_penalty": 0.0, "penalty_alpha": None, "dola_layers": None, "constraints": None,
               "force_words_ids": None}
# Sampling's settings: generate applies them only with do_sample, whose note covers them.
SAMPLING = frozenset({"temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
                      "eta_cutoff"})
# Fields that change no token generate returns for a Marian model: how it runs (cache, compilation,
# memory), what it returns besides the tokens, speculative decoding (it needs an assistant model or
# prediction heads a Marian directory has none of), metadata; remove_invalid_values acts on
# non-finite logits only, which every search here refuses (check_scores).
WITHOUT_EFFECT = frozenset({
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "low_memory", "compile_config",
    "disable_compile", "prefill_chunk_size", "continuous_batching_config", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "is_assistant",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
    "target_lookbehind", "assistant_ensemble_weight", "speculation_type", "use_mtp", "remove_invalid_values",
    "transformers_version", "_from_model_config"})


@dataclass(frozen=True)
class GenerationSettings:
    """A generation_config.json as rosetta's search runs it (`check_generation_config`).

    max_new_tokens: tokens after the start token, eos included (generate's max_length - 1, or its
    max_new_tokens). decoder_start: the token the decoder starts from (generate's
    decoder_start_token_id, else bos_token_id). forced_first: generate's forced_bos_token_id (M2M100's
    and NLLB's target language code), None without one. notes: one line each for what is not done."""

    source: str  # the file, for messages
    beam: int
    alpha: float
    max_new_tokens: int
    banned: tuple[int, ...]
    renormalize: bool
    forced_eos: bool
    decoder_start: int
    notes: tuple[str, ...] = ()
    forced_first: int | None = None

    def search(self) -> dict[str, Any]:
        """rosetta/cli_args.py's search_settings keys: Hugging Face's beam rule, and a margin that
        never binds before max_new_tokens (every source holds a token), as generate's one limit."""
        return {"beam": self.beam, "alpha": self.alpha, "length_rule": "hf", "margin": self.max_new_tokens,
                "max_new_tokens": self.max_new_tokens, "banned": self.banned,
                "renormalize": self.renormalize, "forced_eos": self.forced_eos,
                "forced_first": self.forced_first}


def _shown(value: object) -> str:
    """repr, cut: a hostile file's value may be megabytes long (or an int too long to print)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return "a value too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


def check_generation_config(gen: Mapping[str, Any], cfg: ModelConfig,
                            source: str | os.PathLike) -> GenerationSettings:
    """generation_config.json's object `gen` (as read) for the model `cfg`: the settings, or a
    ConfigError naming `source` and the field. Absent or null fields take GenerationConfig's
    defaults (greedy, length_penalty 1.0, 20 new tokens within the position table)."""
    where, vocab, notes = str(source), cfg.tgt_vocab_size, []
    in_vocab = f"in [0, {vocab}) (the target vocabulary)"

    def fail(field: str, rule: str, value: object) -> NoReturn:
        raise ConfigError(f"{where}: {field} must be {rule}, got {_shown(value)}")

    def is_id(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < vocab

    def integer(field: str, minimum: int, rule: str = "") -> int | None:
        value = gen.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                                  or (field == "num_beams" and value > vocab)):
            fail(field, f"an integer >= {minimum}{rule}", value)
        return value

    def token_ids(field: str, many: bool = False, empty: bool = False) -> tuple[int, ...] | None:
        value = gen.get(field)
        if value is None or (empty and value == []):
            return None
        items = value if many and isinstance(value, list) and value else [value]
        if not all(map(is_id, items)):
            fail(field, f"a token id {in_vocab}" + (", or a list of them" if many else ""), value)
        return tuple(items)

    beam = integer("num_beams", 1, f" and <= {vocab} (the target vocabulary: each step scores num_beams x "
                                   f"vocabulary candidates)") or 1
    max_length = integer("max_length", 2, " (it counts the decoder start token)")
    max_new = integer("max_new_tokens", 1)
    penalty = gen.get("length_penalty")
    try:
        alpha = check_alpha(1.0 if penalty is None else penalty, "length_penalty")
    except InputError as e:
        raise ConfigError(f"{where}: {e}") from None
    renormalize = gen.get("renormalize_logits")
    if renormalize is not None and not isinstance(renormalize, bool):
        fail("renormalize_logits", "true or false", renormalize)
    eos, forced = token_ids("eos_token_id", many=True), token_ids("forced_eos_token_id", many=True)
    start, bos = token_ids("decoder_start_token_id"), token_ids("bos_token_id")
    forced_first = (token_ids("forced_bos_token_id") or (None,))[0]
    token_ids("pad_token_id")  # generate fills finished rows with it: no token of a translation
    words, suppressed = gen.get("bad_words_ids"), token_ids("suppress_tokens", many=True, empty=True) or ()
    if words is not None and not (isinstance(words, list) and all(isinstance(w, list) and w for w in words)):
        fail("bad_words_ids", "a list of non-empty token id lists", words)
    for entry in words or []:
        if not all(map(is_id, entry)):
            fail(f"bad_words_ids entry {_shown(entry)}", f"token ids {in_vocab}", entry)
        if len(entry) > 1:
            raise ConfigError(f"{where}: bad_words_ids entry {_shown(entry)}: rosetta's search bans single "
                              f"tokens only (generate bans a sequence's last token after the rest)")

    # Length: max_new_tokens wins over max_length; without either, 20 new tokens (the total capped
    # at max_position_embeddings, our max_len), as _prepare_generated_length says.
    if max_new is not None:
        new, field = max_new, "max_new_tokens"
    elif max_length is not None:
        new, field = max_length - 1, "max_length"
    else:
        new, field = max(1, min(HF_NEW_TOKENS, cfg.max_len - 1)), ""
    if new > cfg.max_len:
        notes.append(f"{where}: {field} allows {_shown(new)} new tokens, more than the model's max_len "
                     f"({cfg.max_len}): rosetta's search stops there (generate fails past its positions)")
        new = cfg.max_len  # what the search does anyway; a margin of 10^50 would overflow int64
    # Stops and the start: generate reads them from this file only, not from config.json.
    if eos is None:
        notes.append(f"{where}: eos_token_id is not set: generate then stops only at the length limit; "
                     f"rosetta's search stops at the model's eos ({cfg.eos_id}) too")
    elif set(eos) != {cfg.eos_id}:
        notes.append(f"{where}: eos_token_id={_shown(gen['eos_token_id'])}: generate stops at "
                     f"{', '.join(map(str, eos))}; rosetta's search stops at the model's eos "
                     f"({cfg.eos_id}) only")
    if start is None and bos is None:
        notes.append(f"{where}: neither decoder_start_token_id nor bos_token_id is set (generate refuses "
                     f"to start); rosetta's search starts from the model's bos_id ({cfg.bos_id})")
    decoder_start = (start or bos or (cfg.bos_id,))[0]
    forced_eos = forced is not None and set(forced) == {cfg.eos_id}
    if forced is not None and not forced_eos:
        notes.append(f"{where}: forced_eos_token_id={_shown(gen['forced_eos_token_id'])} is not the "
                     f"model's eos ({cfg.eos_id}): generate forces it at the length limit; rosetta's search "
                     f"does not")
    # Bans: NoBadWords drops [eos] entries; SuppressTokens bans whatever it names. Pad is always out.
    banned = {entry[0] for entry in words or []} - set(eos or ()) | set(suppressed)
    if cfg.eos_id in banned:
        field = "suppress_tokens" if cfg.eos_id in suppressed else "bad_words_ids"
        notes.append(f"{where}: {field} holds the model's eos ({cfg.eos_id}): generate never emits it; "
                     f"rosetta's search does not ban eos (it would end no sentence)")
    if cfg.pad_id not in banned:
        notes.append(f"{where}: bad_words_ids does not hold pad ({cfg.pad_id}): generate may emit it; "
                     f"rosetta's search never does")
    for name, off in UNSUPPORTED.items():
        value = gen.get(name)
        if value is not None and value != off and value not in ([], {}):
            notes.append(f"{where}: {name}={_shown(value)} is not part of rosetta's search; ignored")
    banned = tuple(sorted(banned - {cfg.pad_id, cfg.eos_id}))
    if forced_first is not None and (forced_first == cfg.pad_id or forced_first in banned):
        fail("forced_bos_token_id", "a token the search may emit (not pad, not banned)", forced_first)
    return GenerationSettings(where, beam, alpha, new, banned, bool(renormalize), forced_eos, decoder_start,
                              tuple(notes), forced_first)
