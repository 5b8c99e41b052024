"""The search settings of Hugging Face's generation_config.json (banned tokens, renormalized
log-probabilities, a cap on new tokens, eos forced at the limit; rosetta.generation.Constraints):
the oracle's step equals Hugging Face's own logits processors, every backend's search equals the
oracle's, and a converted Marian model decodes as `MarianMTModel.generate` does with them."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers import MarianMTModel

from numpy_ref.decode import constrain, log_softmax
from parity_tests.test_decoding import SCORE_TOLERANCE, _perturbed
from parity_tests.test_interop_marian import CONFIGS, EOS, PAD, end_some_sentences, make_marian
from rosetta import InputError, from_params, preset
from rosetta.generation import NEG, Constraints
from rosetta.interop.marian import read_marian
from rosetta.parity import random_batch

# -- the oracle's step is Hugging Face's logits processors, in their order ---------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_the_oracle_constrains_as_hugging_faces_logits_processors(renormalize):
    from transformers.generation.logits_process import (
        ForcedEOSTokenLogitsProcessor,
        LogitNormalization,
        LogitsProcessorList,
        NoBadWordsLogitsProcessor,
    )

    cfg = preset("tiny")
    banned, max_length = (5, 9, 40), 7
    logp = log_softmax(np.random.default_rng(0).normal(size=(4, cfg.tgt_vocab_size)) * 3)
    last = np.array([False, True, False, True])  # rows at their last allowed position
    ours = constrain(logp, cfg, Constraints(banned, renormalize, forced_eos=True), last)
    # Hugging Face's beam search: log_softmax, then the processors in _get_logits_processor's order.
    processors = LogitsProcessorList([
        NoBadWordsLogitsProcessor([[cfg.pad_id], *([b] for b in banned)], cfg.eos_id),
        ForcedEOSTokenLogitsProcessor(max_length, cfg.eos_id),
        *([LogitNormalization()] if renormalize else [])])
    for row in range(len(logp)):
        cur_len = max_length - 1 if last[row] else 2  # ForcedEOS fires at cur_len == max_length - 1
        theirs = processors(torch.zeros((1, cur_len), dtype=torch.long), torch.from_numpy(logp[row: row + 1]))
        theirs = theirs[0].numpy()
        out = np.isneginf(theirs)
        np.testing.assert_array_equal(ours[row, out], NEG)  # -inf there, NEG (finite) here
        np.testing.assert_allclose(ours[row, ~out], theirs[~out], rtol=1e-12, atol=1e-12)
    assert ours[last, cfg.eos_id].tolist() == [0.0, 0.0]  # HF's forced eos: 0, renormalized or not
    if renormalize:
        np.testing.assert_allclose(np.log(np.exp(ours).sum(-1)), 0.0, atol=1e-12)


@pytest.mark.parametrize("renormalize", [False, True])
def test_the_oracle_forces_the_first_token_as_hugging_faces_processors(renormalize):
    """forced_first (generate's forced_bos_token_id) at the first position: that token alone, at 0,
    after the bans and before forced eos and the renormalization, as _get_logits_processor orders them."""
    from transformers.generation.logits_process import (
        ForcedBOSTokenLogitsProcessor,
        ForcedEOSTokenLogitsProcessor,
        LogitNormalization,
        LogitsProcessorList,
        NoBadWordsLogitsProcessor,
    )

    cfg = preset("tiny")
    forced, banned, max_length = 17, (5, 9), 7
    logp = log_softmax(np.random.default_rng(1).normal(size=(3, cfg.tgt_vocab_size)) * 3)
    processors = LogitsProcessorList([
        NoBadWordsLogitsProcessor([[cfg.pad_id], *([b] for b in banned)], cfg.eos_id),
        ForcedBOSTokenLogitsProcessor(forced), ForcedEOSTokenLogitsProcessor(max_length, cfg.eos_id),
        *([LogitNormalization()] if renormalize else [])])
    constraints = Constraints(banned, renormalize, forced_eos=True, forced_first=forced)
    for first, cur_len in ((True, 1), (False, 2)):
        ours = constrain(logp, cfg, constraints, np.zeros(3, bool), first)
        theirs = processors(torch.zeros((3, cur_len), dtype=torch.long), torch.from_numpy(logp)).numpy()
        out = np.isneginf(theirs)
        np.testing.assert_array_equal(ours[out], NEG)
        np.testing.assert_allclose(ours[~out], theirs[~out], rtol=1e-12, atol=1e-12)
    assert (constrain(logp, cfg, constraints, np.zeros(3, bool), True).argmax(-1) == forced).all()


# -- every backend's search equals the oracle's --------------------------------------------------

CFG = preset("tiny", max_len=40, num_encoder_layers=1, num_decoder_layers=1)  # one layer: quicker to compile
MARGIN = 6
FORCED = 61  # forced_first: a token the unconstrained searches do not start with (search_case checks)
OPTIONS = {  # BANNED stands for the tokens the unconstrained search emits most
    "banned": dict(banned="BANNED"),
    "renormalize": dict(renormalize=True),
    "max_new_tokens": dict(max_new_tokens=4),
    "forced_eos": dict(forced_eos=True),
    "forced_first": dict(forced_first=FORCED),
    "all": dict(banned="BANNED", renormalize=True, max_new_tokens=5, forced_eos=True, forced_first=FORCED),
}


@pytest.fixture(scope="module")
def search_case():
    """Random weights and sources, and per search the tokens its unconstrained output uses most."""
    params = _perturbed(CFG, seed=5)
    src, _ = random_batch(CFG, 4, 8, 2, seed=6)
    oracle = from_params(CFG, params, "numpy")
    most = {}
    for beam in (1, 4):
        plain = oracle.generate(src, beam, max_len_margin=MARGIN)
        most[beam] = tuple(tok for tok, _ in Counter(t for row in plain.tokens for t in row).most_common(2))
        assert FORCED not in most[beam] and all(row[:1] != [FORCED] for row in plain.tokens)
    return params, src, oracle, most


def _options(name: str, most: tuple[int, ...]) -> dict:
    return {k: most if v == "BANNED" else v for k, v in OPTIONS[name].items()}


@pytest.mark.ported
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_backend_equals_the_oracle_under_each_option(search_case, backend, beam, option):
    params, src, oracle, most = search_case
    kwargs = _options(option, most[beam])
    want = oracle.generate(src, beam, max_len_margin=MARGIN, **kwargs)
    got = from_params(CFG, params, backend).generate(src, beam, max_len_margin=MARGIN, **kwargs)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.scores, want.scores, rtol=SCORE_TOLERANCE)


def test_torch_forced_first_without_the_one_row_first_step(search_case, monkeypatch):
    """With FIRST_ONE_ROW off, beam search's step 0 runs every beam's row and would rank on the logits
    (RANK_LOGITS) but for the forced first token: the same tokens as the oracle."""
    from torch_impl import decode

    params, src, oracle, _ = search_case
    monkeypatch.setattr(decode, "FIRST_ONE_ROW", False)
    want = oracle.generate(src, 4, max_len_margin=MARGIN, forced_first=FORCED)
    got = from_params(CFG, params, "torch").generate(src, 4, max_len_margin=MARGIN, forced_first=FORCED)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.scores, want.scores, rtol=SCORE_TOLERANCE)


@pytest.mark.parametrize("beam", [1, 4])
def test_the_options_do_what_they_say_in_the_oracle(search_case, beam):
    """What each option changes, on the oracle that the test above holds every backend to."""
    _, src, oracle, most = search_case
    limits = np.minimum((src != CFG.pad_id).sum(1) + MARGIN, CFG.max_len)
    plain = oracle.generate(src, beam, max_len_margin=MARGIN)
    run = {name: oracle.generate(src, beam, max_len_margin=MARGIN, **_options(name, most[beam]))
           for name in OPTIONS}
    assert not {t for row in run["banned"].tokens for t in row} & set(most[beam])
    assert run["banned"].tokens != plain.tokens
    if beam == 1:  # renormalizing over non-pad tokens raises each step's log-probability, not its choice
        assert run["renormalize"].tokens == plain.tokens
        assert (run["renormalize"].scores > plain.scores).all()
    assert (run["renormalize"].scores != plain.scores).all()  # beam: its path and scores move too
    capped = [len(r) for r in run["max_new_tokens"].tokens]
    if beam == 1:  # the same path, cut
        assert capped == [min(len(r), 4) for r in plain.tokens]
    assert max(capped) == 4 < max(map(len, plain.tokens))
    # Forced eos: the last allowed token is eos, so at most limit - 1 tokens remain after stripping.
    assert all(len(r) < limit for r, limit in zip(run["forced_eos"].tokens, limits, strict=True))
    assert max(len(r) for r in run["all"].tokens) == 4  # a row reached the cap of 5 and ended in eos
    # Forced first: every sentence starts with it; its step adds 0 to the score.
    assert all(row[:1] == [FORCED] for key in ("forced_first", "all") for row in run[key].tokens)
    assert run["forced_first"].tokens != plain.tokens


# -- against Hugging Face's own generate ----------------------------------------------------------

CAP, HF_MARGIN = 6, 3  # max_new_tokens (Hugging Face max_length 7) binds for sources of 4+ tokens


def hf_generate(model: MarianMTModel, row: np.ndarray, max_length: int, num_beams: int, alpha: float,
                banned: tuple[int, ...]) -> list[int]:
    """`MarianMTModel.generate` with opus-mt's generation_config.json settings on one sentence
    (Hugging Face has one max_length per call), without the start token, cut at eos."""
    beam = dict(length_penalty=alpha, early_stopping=False) if num_beams > 1 else {}
    with torch.no_grad():
        out = model.generate(torch.tensor(row[None]), num_beams=num_beams, do_sample=False, **beam,
                             max_length=max_length, bad_words_ids=[[PAD], *([t] for t in banned)],
                             renormalize_logits=True, forced_eos_token_id=EOS)[0, 1:].tolist()
    return [t for t in (out[: out.index(EOS)] if EOS in out else out) if t != PAD]


@pytest.fixture(scope="module")
def marian_case(tmp_path_factory):
    """A random opus-mt-like Marian (start token = pad) whose eos bias ends some sentences early,
    its conversion, and sources of 1 to 7 tokens + eos."""
    rng = np.random.default_rng(7)
    src = np.full((6, 8), PAD)
    for b, n in enumerate([7, 1, 5, 3, 6, 2]):
        src[b, :n] = rng.integers(3, 37, size=n)
        src[b, n] = EOS
    model = make_marian(CONFIGS["shared-tied-swish-scaled"], seed=2)
    end_some_sentences(model, src, steps=CAP)
    path = tmp_path_factory.mktemp("opus-mt-like")
    model.save_pretrained(path)
    return model, src, *read_marian(path)


@pytest.mark.parametrize("num_beams, alpha", [(1, 1.0), (4, 0.6), (4, 1.0)])
def test_generation_config_settings_equal_hugging_face_generate(marian_case, num_beams, alpha):
    model, src, cfg, params = marian_case
    oracle = from_params(cfg, params, "numpy")
    plain = oracle.generate(src, num_beams, alpha, HF_MARGIN, "hf", max_new_tokens=CAP)
    banned = (Counter(t for row in plain.tokens for t in row).most_common(1)[0][0],)  # one that matters
    limits = np.minimum((src != PAD).sum(1) + HF_MARGIN, CAP)
    theirs = [hf_generate(model, row[row != PAD], int(limit) + 1, num_beams, alpha, banned)
              for row, limit in zip(src, limits, strict=True)]
    options = dict(banned=banned, renormalize=True, max_new_tokens=CAP, forced_eos=True)
    for backend in ("numpy", "torch", "jax"):
        ours = from_params(cfg, params, backend).generate(src, num_beams, alpha, HF_MARGIN, "hf", **options)
        assert ours.tokens == theirs, backend
    # The settings mattered: some sentences hit the cap (without forced eos they run to it without
    # eos; with it, eos is their last token) while others end with eos before it.
    unforced = oracle.generate(src, num_beams, alpha, HF_MARGIN, "hf", **{**options, "forced_eos": False})
    capped = [b for b, limit in enumerate(limits) if limit == CAP]
    assert any(len(unforced.tokens[b]) == CAP and len(theirs[b]) == CAP - 1 for b in capped), theirs
    assert any(len(row) < limit - 1 for row, limit in zip(theirs, limits, strict=True)), theirs
    assert not {t for row in theirs for t in row} & set(banned)


# -- bad values are refused in one line ------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(banned=(5, 64)), "banned holds token id 64, outside the target vocabulary [0, 64)"),
    (dict(banned=[-1]), "banned token id must be an integer >= 0, got -1"),
    (dict(banned=[2]), "banned holds eos (id 2), which ends every sentence and cannot be banned"),
    (dict(banned=7), "banned must be a sequence of target token ids, got 7"),
    (dict(banned=[[7]]), "banned token id must be an integer >= 0, got [7]"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer >= 1, got 2.0"),
    (dict(renormalize="yes"), "renormalize must be True or False, got 'yes'"),
    (dict(forced_eos=1), "forced_eos must be True or False, got 1"),
    (dict(forced_first=64), "forced_first is token id 64, outside the target vocabulary [0, 64)"),
    (dict(forced_first=True), "forced_first must be an integer >= 0, got True"),
    (dict(forced_first=0), "forced_first is token id 0, which the search may not emit (pad)"),
    (dict(forced_first=7, banned=[7]), "forced_first is token id 7, which the search may not emit (banned)"),
])
def test_bad_constraints_are_refused_in_one_line(backend, kwargs, message):
    with pytest.raises(InputError) as err:  # CFG: a target vocabulary of 64 tokens, eos 2
        from_params(CFG, _perturbed(CFG), backend).generate(np.array([[5, 6, 2]]), **kwargs)
    assert str(err.value) == message


def test_numpy_ids_are_ids_and_defaults_change_nothing():
    cfg = preset("tiny", max_len=16)
    model = from_params(cfg, _perturbed(cfg, seed=2), "numpy")
    src = np.array([[5, 6, 7, 2], [8, 9, 2, 0]])
    plain = model.generate(src, 2, max_len_margin=3)
    same = model.generate(src, 2, max_len_margin=3, banned=np.array([cfg.pad_id]), renormalize=np.False_,
                          max_new_tokens=np.int64(cfg.max_len), forced_eos=False)
    assert same.tokens == plain.tokens and np.array_equal(same.scores, plain.scores)
