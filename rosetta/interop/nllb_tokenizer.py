"""NLLB-200's tokenizer, read from a Hugging Face NLLB directory: what transformers'
`NllbTokenizerFast` computes (transformers/models/nllb/tokenization_nllb.py and
tokenization_utils_tokenizers.py, read at 5.24, where `NllbTokenizerFast` is `NllbTokenizer`), with
the `tokenizers` package doing the pieces, built as that code builds it.

- Files: `tokenizer.json` (a BPE model: vocab, merges, the SentencePiece normalizer's precompiled
  charsmap; the added tokens with their ids), `tokenizer_config.json` (tokenizer_class NllbTokenizer
  or NllbTokenizerFast; src_lang, tgt_lang, legacy_behaviour, the special tokens, the language codes
  as extra_special_tokens or additional_special_tokens), `special_tokens_map.json` where an older
  transformers wrote one. `sentencepiece.bpe.model` is not read (5.24 reads tokenizer.json first).
- The backend, as `NllbTokenizer.__init__` rebuilds it from tokenizer.json: BPE(vocab, merges,
  unk_token, fuse_unk), the normalizer the precompiled charsmap then `Replace(" {2,}", " ")` (none
  without a charsmap), `Metaspace("▁", prepend_scheme="always")` before and after; the file's own
  pre-tokenizer, decoder and post-processor are not used, as in transformers.
- Ids: the added tokens (tokenizer_config.json's added_tokens_decoder where it has one, else
  tokenizer.json's added_tokens), added in the order of their ids, then the special tokens and the
  language codes not among them, as TokenizersBackend.__init__ adds them; an added token whose id
  in the file is not the one it gets is refused in one line (transformers would silently renumber).
  Language codes: the config's list, else FAIRSEQ_LANGUAGE_CODES (`eng_Latn`, `deu_Latn`, ... 202
  codes); in NLLB-200 they follow the pieces (`eng_Latn` 256047), `<mask>` last.
- Source: `[src_lang] pieces </s>` (`set_src_lang_special_tokens`); with legacy_behaviour true,
  `pieces </s> [src_lang]`. Added tokens' strings in the text (`</s>`, `eng_Latn`) are matched whole,
  as the `tokenizers` library does. encode_target is the same with the target's code.
- Generation: the decoder starts from `</s>` (generation_config.json's decoder_start_token_id) and the
  target's code is forced first: `--tgt-lang` or generation_config.json's forced_bos_token_id
  (NLLB-200's own generation_config.json has none: without --tgt-lang nothing is forced, as generate).
- Decoding: `decode(ids, skip_special_tokens=True)`: the `tokenizers` decode skipping every special
  added token (the four, `<mask>`, the codes); 5.24 never cleans up spaces for a BPE model.

One departure, a refusal rather than another output: an unknown src_lang or --tgt-lang is refused in
one line, where transformers maps it to `<unk>` (id 3) and translates on.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rosetta import json_input
from rosetta.config import ModelConfig
from rosetta.errors import TokenizerError
from rosetta.tokenizer import TOKENIZER_CONFIG, _hf, clean_up_tokenization

TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CLASSES = ("NllbTokenizer", "NllbTokenizerFast")
# FAIRSEQ_LANGUAGE_CODES of tokenization_nllb.py: NllbTokenizer's codes when the config names none.
FAIRSEQ_LANGUAGE_CODES = tuple("""
ace_Arab ace_Latn acm_Arab acq_Arab aeb_Arab afr_Latn ajp_Arab aka_Latn amh_Ethi apc_Arab arb_Arab ars_Arab
ary_Arab arz_Arab asm_Beng ast_Latn awa_Deva ayr_Latn azb_Arab azj_Latn bak_Cyrl bam_Latn ban_Latn bel_Cyrl
bem_Latn ben_Beng bho_Deva bjn_Arab bjn_Latn bod_Tibt bos_Latn bug_Latn bul_Cyrl cat_Latn ceb_Latn ces_Latn
cjk_Latn ckb_Arab crh_Latn cym_Latn dan_Latn deu_Latn dik_Latn dyu_Latn dzo_Tibt ell_Grek eng_Latn epo_Latn
est_Latn eus_Latn ewe_Latn fao_Latn pes_Arab fij_Latn fin_Latn fon_Latn fra_Latn fur_Latn fuv_Latn gla_Latn
gle_Latn glg_Latn grn_Latn guj_Gujr hat_Latn hau_Latn heb_Hebr hin_Deva hne_Deva hrv_Latn hun_Latn hye_Armn
ibo_Latn ilo_Latn ind_Latn isl_Latn ita_Latn jav_Latn jpn_Jpan kab_Latn kac_Latn kam_Latn kan_Knda kas_Arab
kas_Deva kat_Geor knc_Arab knc_Latn kaz_Cyrl kbp_Latn kea_Latn khm_Khmr kik_Latn kin_Latn kir_Cyrl kmb_Latn
kon_Latn kor_Hang kmr_Latn lao_Laoo lvs_Latn lij_Latn lim_Latn lin_Latn lit_Latn lmo_Latn ltg_Latn ltz_Latn
lua_Latn lug_Latn luo_Latn lus_Latn mag_Deva mai_Deva mal_Mlym mar_Deva min_Latn mkd_Cyrl plt_Latn mlt_Latn
mni_Beng khk_Cyrl mos_Latn mri_Latn zsm_Latn mya_Mymr nld_Latn nno_Latn nob_Latn npi_Deva nso_Latn nus_Latn
nya_Latn oci_Latn gaz_Latn ory_Orya pag_Latn pan_Guru pap_Latn pol_Latn por_Latn prs_Arab pbt_Arab quy_Latn
ron_Latn run_Latn rus_Cyrl sag_Latn san_Deva sat_Beng scn_Latn shn_Mymr sin_Sinh slk_Latn slv_Latn smo_Latn
sna_Latn snd_Arab som_Latn sot_Latn spa_Latn als_Latn srd_Latn srp_Cyrl ssw_Latn sun_Latn swe_Latn swh_Latn
szl_Latn tam_Taml tat_Cyrl tel_Telu tgk_Cyrl tgl_Latn tha_Thai tir_Ethi taq_Latn taq_Tfng tpi_Latn tsn_Latn
tso_Latn tuk_Latn tum_Latn tur_Latn twi_Latn tzm_Tfng uig_Arab ukr_Cyrl umb_Latn urd_Arab uzn_Latn vec_Latn
vie_Latn war_Latn wol_Latn xho_Latn ydd_Hebr yor_Latn yue_Hant zho_Hans zho_Hant zul_Latn""".split())
# PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES with NllbTokenizer's defaults, in that order.
NAMED_TOKENS = {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "sep": "</s>", "pad": "<pad>", "cls": "<s>",
                "mask": "<mask>"}
FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
# 5.24 cleans up a BPE tokenizer's decoded spaces only when this is true too.
BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"

_TOKEN = json_input.field("string", "object", "null")  # a token: its string, or an AddedToken's fields
_TOKEN_LIST = json_input.field("array", "object", "null")
CONFIG_SCHEMA = {
    "tokenizer_class": json_input.field("string", "null"),
    "src_lang": json_input.field("string", "null"), "tgt_lang": json_input.field("string", "null"),
    "legacy_behaviour": json_input.field("boolean", "null"),
    "extra_special_tokens": _TOKEN_LIST, "additional_special_tokens": _TOKEN_LIST,
    "added_tokens_decoder": json_input.field("object", "null"),
    "clean_up_tokenization_spaces": json_input.field("boolean", "null"),
    BPE_CLEAN_UP: json_input.field("boolean", "null"),
    **{f"{role}_token": _TOKEN for role in NAMED_TOKENS},
}
TOKENIZER_SCHEMA = {
    "model": json_input.field("object", required=True, fields={
        "type": json_input.field("string", required=True),
        "vocab": json_input.field("object", required=True), "merges": json_input.field("array", "null")}),
    "added_tokens": json_input.field("array", required=True),
    "normalizer": json_input.field("object", "null"),
}


def is_nllb_tokenizer_dir(directory: str | os.PathLike[str], tokenizer_class: str | None) -> bool:
    """An NLLB directory: tokenizer_config.json names an NLLB class and tokenizer.json is there."""
    return tokenizer_class in CLASSES and (Path(directory) / TOKENIZER_JSON).is_file()


class NllbTextTokenizer:
    """rosetta's TextTokenizer over an NLLB directory (the module docstring). `src_lang` is the code
    its encode_source puts first (tokenizer_config.json's, else eng_Latn, as NllbTokenizer);
    `tgt_lang` encode_target's (the config's, else src_lang)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        config_path, tokenizer_path = self.directory / TOKENIZER_CONFIG, self.directory / TOKENIZER_JSON
        config = _read_object(config_path, "the tokenizer config", CONFIG_SCHEMA)
        if not tokenizer_path.is_file():
            raise TokenizerError(f"{tokenizer_path}: missing (NLLB's tokenizer is its {TOKENIZER_JSON})")
        # NLLB-200's is about 17 MB (256k pieces and their merges): within the reader's bound for one file.
        data = json_input.read_json(tokenizer_path, "a tokenizer file", limit=json_input.DEFAULT_LIMIT,
                                    schema=TOKENIZER_SCHEMA, error=TokenizerError)
        if data["model"]["type"] != "BPE":  # NllbTokenizer rebuilds a BPE model whatever the file holds
            raise TokenizerError(f"{tokenizer_path}: model.type is {data['model']['type']!r}; NLLB's "
                                 f"tokenizer is BPE")
        if "added_tokens_decoder" in config:  # where from_pretrained takes the added tokens from
            added, where = _added_from_config(config["added_tokens_decoder"], config_path), config_path
        else:
            added, where = _added_from_file(data["added_tokens"], tokenizer_path), tokenizer_path
            config = _with_special_tokens_map(config, self.directory / SPECIAL_TOKENS_MAP)
        named = {role: _content(config.get(f"{role}_token"), config_path, f"{role}_token") or default
                 for role, default in NAMED_TOKENS.items()}
        self.legacy = bool(config.get("legacy_behaviour"))
        self.codes = _codes(config, config_path)
        self.backend = _backend(data, named["unk"], tokenizer_path)
        _add_tokens(self.backend, added, config, named, self.codes, config_path)
        for token_id, token in sorted(added.items()):
            if (got := self.backend.token_to_id(token.content)) != token_id:
                raise TokenizerError(f"{where}: added token {token.content!r} has id {token_id}, but "
                                     f"transformers 5.24 numbers it {got} "
                                     f"(added tokens follow the vocabulary of tokenizer.json's model, in the "
                                     f"order of their ids)")
        self.special = {role: named[role] for role in ("eos", "pad", "unk")}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces") and config.get(BPE_CLEAN_UP))
        self.src_lang = config.get("src_lang") or "eng_Latn"
        self.tgt_lang = config.get("tgt_lang")
        self.lang_id(self.src_lang, f"{config_path}: src_lang")
        if self.tgt_lang is not None:
            self.lang_id(self.tgt_lang, f"{config_path}: tgt_lang")

    @property
    def src_vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    tgt_vocab_size = src_vocab_size

    def lang_id(self, code: str, what: str = "language") -> int:
        """The id of a language code ("eng_Latn"); a TokenizerError naming `what` otherwise."""
        token_id = self.backend.token_to_id(code) if code in self.codes else None
        if token_id is None:
            shown = ", ".join(c for c in ("eng_Latn", "deu_Latn", "fra_Latn") if c in self.codes) or \
                ", ".join(self.codes[:3])
            raise TokenizerError(f"{what} {code!r} is not a language code of {self.directory} "
                                 f"({len(self.codes)} codes: {shown}, ...)")
        return token_id

    def _ids(self, text: str, lang: str) -> list[int]:
        pieces = self.backend.encode(text, add_special_tokens=False).ids
        code, eos = self.lang_id(lang), self.backend.token_to_id(self.special["eos"])
        # set_src_lang_special_tokens' templates: [code] $A </s>, or with legacy_behaviour $A </s> [code]
        return [*pieces, eos, code] if self.legacy else [code, *pieces, eos]

    def encode_source(self, text: str) -> list[int]:
        """`NllbTokenizerFast(text, src_lang=...).input_ids`."""
        return self._ids(text, self.src_lang)

    def encode_target(self, text: str) -> list[int]:
        """`NllbTokenizerFast(text_target=text, tgt_lang=...).input_ids` (tgt_lang None: src_lang)."""
        return self._ids(text, self.tgt_lang or self.src_lang)

    def decode(self, ids: Iterable[int]) -> str:
        """`NllbTokenizerFast.decode(ids, skip_special_tokens=True)`."""
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=True)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def check_fits(self, cfg: ModelConfig) -> None:
        """Every id inside both embeddings, `</s>` and `<pad>` the config's eos and pad ids."""
        where = self.directory / TOKENIZER_JSON
        for size, field in ((cfg.src_vocab_size, "src_vocab_size"), (cfg.tgt_vocab_size, "tgt_vocab_size")):
            if self.src_vocab_size > size:
                raise TokenizerError(f"{where}: {self.src_vocab_size} ids with the added tokens, but the "
                                     f"model's {field} (its embedding) has {size} rows")
        for role, field_id in (("eos", cfg.eos_id), ("pad", cfg.pad_id)):
            token = self.special[role]
            if self.backend.token_to_id(token) != field_id:
                raise TokenizerError(f"{where}: {token!r} has id {self.backend.token_to_id(token)}, but the "
                                     f"model's {role}_id is {field_id}")

    def __repr__(self) -> str:
        return f"NllbTextTokenizer({str(self.directory)!r}, src_lang={self.src_lang!r})"


def _read_object(path: Path, what: str, schema: Mapping[str, json_input.Field]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json_input.read_json(path, what, schema=schema, error=TokenizerError)


def _content(token: Any, where: Path, field: str) -> str | None:
    """A token's string: the string itself, or an AddedToken's serialized `content`."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise TokenizerError(f"{where}: {field} must be a string or an object with a string content")


def _added_token(fields: Any, where: Path, label: str) -> Any:
    """A `tokenizers.AddedToken` of serialized fields (`AddedToken(**fields)`, as from_pretrained)."""
    if not isinstance(fields, dict) or not isinstance(fields.get("content"), str) or not fields["content"]:
        raise TokenizerError(f"{where}: {label} must be an object with a non-empty string content")
    for flag in FLAGS:
        if not isinstance(fields.get(flag, False), bool):
            raise TokenizerError(f"{where}: {label}.{flag} must be true or false")
    return _hf().AddedToken(fields["content"], **{flag: fields[flag] for flag in FLAGS if flag in fields})


def _added_from_file(entries: list[Any], where: Path) -> dict[int, Any]:
    added = {}
    for i, entry in enumerate(entries):
        label = f"added_tokens[{i}]"
        token_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise TokenizerError(f"{where}: {label}.id must be an integer >= 0")
        if token_id in added:
            raise TokenizerError(f"{where}: {label}: id {token_id} is given twice")
        added[token_id] = _added_token({k: v for k, v in entry.items() if k != "id"}, where, label)
    return added


def _added_from_config(decoder: dict[str, Any], where: Path) -> dict[int, Any]:
    added = {}
    for key, fields in decoder.items():
        if not key.isdigit():
            raise TokenizerError(f"{where}: added_tokens_decoder key {key!r:.40} is not a token id")
        added[int(key)] = _added_token({k: v for k, v in fields.items() if k != "__type"}
                                       if isinstance(fields, dict) else fields, where,
                                       f"added_tokens_decoder[{key}]")
    return added


def _with_special_tokens_map(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config with special_tokens_map.json's tokens over it (from_pretrained's legacy step, taken
    when the config has no added_tokens_decoder): its named tokens replace the config's, its
    extra_special_tokens join the config's list, its additional_special_tokens count where the config
    names no list."""
    tokens_map = _read_object(path, "the special tokens map", {key: CONFIG_SCHEMA[key] for key in (
        "extra_special_tokens", "additional_special_tokens", *(f"{role}_token" for role in NAMED_TOKENS))})
    config = dict(config)
    for key, value in tokens_map.items():
        if key == "extra_special_tokens" and isinstance(value, list):
            listed = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
            config["extra_special_tokens"] = listed + [t for t in value if t not in listed]
        elif key == "additional_special_tokens":
            config.setdefault("additional_special_tokens", value)
        elif key in CONFIG_SCHEMA:
            config[key] = value
    return config


def _codes(config: dict[str, Any], where: Path) -> tuple[str, ...]:
    """The language codes: extra_special_tokens (a list), else additional_special_tokens, else
    FAIRSEQ_LANGUAGE_CODES (NllbTokenizer.__init__; a dict of named tokens is no list of codes)."""
    for key in ("extra_special_tokens", "additional_special_tokens"):
        listed = config.get(key)
        if isinstance(listed, list):
            return tuple(_content(t, where, f"{key}[{i}]") for i, t in enumerate(listed))
    return FAIRSEQ_LANGUAGE_CODES


def _precompiled_charsmap(normalizer: Any, where: Path) -> bytes | None:
    """The SentencePiece charsmap of tokenizer.json's normalizer (a Precompiled one, or inside a
    Sequence), as convert_to_native_format finds it; None without one."""
    if not isinstance(normalizer, dict):
        return None
    parts = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else [normalizer]
    for part in parts if isinstance(parts, list) else []:
        if isinstance(part, dict) and part.get("type") == "Precompiled" and "precompiled_charsmap" in part:
            try:
                return base64.b64decode(part["precompiled_charsmap"], validate=True)
            except (TypeError, binascii.Error) as e:
                raise TokenizerError(f"{where}: normalizer's precompiled_charsmap is not base64: {e}"
                                     ) from None
    return None


def _backend(data: dict[str, Any], unk: str, where: Path) -> Any:
    """The `tokenizers.Tokenizer` NllbTokenizer.__init__ builds of tokenizer.json's vocab and merges."""
    hf = _hf()
    vocab, merges = data["model"]["vocab"], data["model"].get("merges") or []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vocab.values()):
        raise TokenizerError(f"{where}: model.vocab must map pieces to integer ids >= 0")
    pairs = []
    for i, merge in enumerate(merges):
        pair = tuple(merge.split(" ") if isinstance(merge, str) else merge if isinstance(merge, list) else ())
        if len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise TokenizerError(f"{where}: model.merges[{i}] must be two pieces ('a b' or [\"a\", \"b\"])")
        pairs.append(pair)
    charsmap = _precompiled_charsmap(data.get("normalizer"), where)
    try:
        backend = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=unk,
                                             fuse_unk=True, byte_fallback=False))
        if charsmap is not None:
            backend.normalizer = hf.normalizers.Sequence([hf.normalizers.Precompiled(charsmap),
                                                          hf.normalizers.Replace(hf.Regex(r" {2,}"), " ")])
    except Exception as e:  # the Rust side raises plain Exception
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"{where}: cannot build NLLB's BPE model from it: {first_line}") from None
    backend.pre_tokenizer = hf.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.decoder = hf.decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return backend


def _add_tokens(backend: Any, added: dict[int, Any], config: dict[str, Any], named: dict[str, str],
                codes: tuple[str, ...], where: Path) -> None:
    """TokenizersBackend.__init__'s one add_tokens call: the added tokens by id, then the named special
    tokens and the language codes that are not among them (a named token as the config gives it,
    `<mask>` as NllbTokenizer makes it: lstrip, normalized; a code as a special token); a named
    token's string is special whatever its entry says."""
    hf = _hf()
    tokens = [added[i] for i in sorted(added)]
    seen = {t.content for t in tokens}
    for role, content in named.items():
        given = config.get(f"{role}_token")
        if content in seen:
            continue
        if isinstance(given, dict):
            token = _added_token({k: v for k, v in given.items() if k != "__type"}, where, f"{role}_token")
        elif role == "mask":
            token = hf.AddedToken(content, normalized=True, lstrip=True, special=True)
        else:
            token = hf.AddedToken(content, special=True)
        tokens.append(token)
        seen.add(content)
    for code in codes:
        if code not in seen:
            tokens.append(hf.AddedToken(code, special=True))
            seen.add(code)
    for token in tokens:
        token.special = token.special or token.content in named.values()
    backend.add_tokens(tokens)
