"""Test-set evaluation (paper §6.1: BLEU of beam search, beam 4, length penalty alpha 0.6):
decode a Multi30k split with `model.generate` through the tokenizer, then score the detokenised
hypotheses against the raw references with sacreBLEU: corpus BLEU (cased, its default 13a
tokenisation) and chrF, each reported with its signature so that a score can be reproduced.

Deviation from the paper: it reports tokenized BLEU on WMT newstest2014; we report sacreBLEU
on detokenised text (Post 2018), the comparable number, on Multi30k.

`evaluate_model` is the API (the training loop can call it on an in-memory model);
`evaluate_split` adds the data and `write_report` the atomic JSON file of `rosetta evaluate`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rosetta.backends import BackendModel
from rosetta.checkpoint import atomic_write_bytes
from rosetta.errors import RosettaError
from rosetta.harness.tokenizer import Tokenizer
from rosetta.harness.translate import translate_lines

FORMAT = "rosetta-evaluate/1"
# The characters str.splitlines breaks at. A hypothesis is one line (of the --hyps file, of
# sacreBLEU's input): a model can emit the newline byte, so each break becomes a space.
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _sacrebleu() -> Any:
    try:
        import sacrebleu
    except ImportError:
        raise RosettaError("evaluation needs sacrebleu: pip install 'rosetta-transformer[train]'") from None
    return sacrebleu


def score(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> dict[str, Any]:
    """sacreBLEU corpus BLEU and chrF of `hypotheses` against one reference each, with the
    signatures (`tokenize="none"` for id strings, which are tokens already)."""
    if len(hypotheses) != len(references):
        raise RosettaError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    sacrebleu = _sacrebleu()
    bleu_metric = sacrebleu.metrics.BLEU(tokenize=tokenize)
    chrf_metric = sacrebleu.metrics.CHRF()
    bleu = bleu_metric.corpus_score(list(hypotheses), [list(references)])
    chrf = chrf_metric.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": {"score": bleu.score, "signature": str(bleu_metric.get_signature()), "text": str(bleu),
                 "counts": list(bleu.counts), "totals": list(bleu.totals),
                 "precisions": list(bleu.precisions), "bp": bleu.bp, "sys_len": bleu.sys_len,
                 "ref_len": bleu.ref_len},
        "chrf": {"score": chrf.score, "signature": str(chrf_metric.get_signature()), "text": str(chrf)},
    }


def evaluate_model(model: BackendModel, tokenizer: Tokenizer | None, sources: Sequence[str],
                   references: Sequence[str], beam: int = 4, alpha: float = 0.6, max_len_margin: int = 50,
                   batch_size: int = 32, length_rule: str = "wu") -> dict[str, Any]:
    """Translate `sources` (rosetta/harness/translate.py: translate_lines) and score them against
    `references`: {"sentences", "hypotheses", "bleu": {...}, "chrf": {...}, "decode_time_s"}.
    Without a tokenizer (the synthetic tasks) sources are id lines and BLEU counts ids."""
    if len(sources) != len(references):
        raise RosettaError(f"{len(sources)} sources for {len(references)} references")
    if not sources:
        raise RosettaError("nothing to evaluate: no sentences")
    if tokenizer is not None and tokenizer.vocab_size != model.config.src_vocab_size:
        raise RosettaError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's source vocabulary "
                           f"has {model.config.src_vocab_size}: not the tokenizer the model was trained with")
    start = time.perf_counter()
    hypotheses = [_LINE_BREAKS.sub(" ", h) for h in translate_lines(
        model, tokenizer, sources, beam, alpha, max_len_margin, batch_size, length_rule)]
    decode_time = time.perf_counter() - start
    scores = score(hypotheses, references, tokenize="13a" if tokenizer is not None else "none")
    return {"sentences": len(sources), "hypotheses": hypotheses, **scores, "decode_time_s": decode_time}


def resolve_model(path: str | os.PathLike[str], tokenizer: str | os.PathLike[str] | None
                  ) -> tuple[Path, Path, dict[str, Any] | None]:
    """(model.safetensors, tokenizer.json, the run's run.json record or None) of a run or
    checkpoint directory (rosetta/harness/translate.py: resolve_run), or of a checkpoint file
    with `tokenizer`. A text model needs its tokenizer: a run of a synthetic task has none."""
    from rosetta.harness.translate import resolve_run

    path = Path(path)
    if path.is_file() and path.name != "latest":
        if tokenizer is None:
            raise RosettaError(f"{path} is a checkpoint file: give its --tokenizer (or pass the run "
                               f"directory)")
        checkpoint, tokenizer_path = path, Path(tokenizer)
    else:
        if tokenizer is not None:
            raise RosettaError("--tokenizer goes with a checkpoint file; a run directory holds its own")
        checkpoint, tokenizer_path = resolve_run(path)
        if tokenizer_path is None:
            raise RosettaError(f"{path}: no tokenizer.json beside its checkpoint (a synthetic-task run?): "
                               f"evaluate scores text models on Multi30k")
    if not tokenizer_path.is_file():
        raise RosettaError(f"tokenizer file {str(tokenizer_path)!r} does not exist")
    run_record = None
    run_json = checkpoint.parent.parent.parent / "run.json"  # <run>/checkpoints/step-N/model.safetensors
    if checkpoint.parent.parent.name == "checkpoints" and run_json.is_file():
        try:
            run_record = json.loads(run_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RosettaError(f"{run_json}: cannot read the run's settings: {e}") from None
    return checkpoint, tokenizer_path, run_record


def run_pair(run_record: dict[str, Any] | None, pair: str | None) -> str:
    """The language pair to evaluate: `pair`, which must be the run's if the run records one; by
    default the run's, else de-en. A run of a synthetic task is refused."""
    args = (run_record or {}).get("args") or {}
    task, trained = args.get("task"), args.get("pair")
    if task is not None and task != "multi30k":
        raise RosettaError(f"the run was trained on the synthetic task {task!r}, not on Multi30k")
    if pair is not None and trained is not None and pair != trained:
        raise RosettaError(f"--pair {pair}: the run was trained on {trained}")
    return pair or trained or "de-en"


def evaluate_split(model: BackendModel, tokenizer: Tokenizer, split: str, pair: str,
                   data_dir: str | os.PathLike[str] | None = None, limit: int | None = None,
                   **search: Any) -> dict[str, Any]:
    """`evaluate_model` on a Multi30k split (rosetta/harness/data.py), its first `limit` pairs
    if given; `search` holds evaluate_model's beam, alpha, max_len_margin, batch_size, length_rule."""
    from rosetta.harness.data import load_multi30k
    from rosetta.harness.tasks import parse_pair

    src_lang, tgt_lang = parse_pair(pair)
    pairs = load_multi30k(split, src_lang, tgt_lang, data_dir)
    if limit is not None:
        pairs = pairs[:limit]
    return evaluate_model(model, tokenizer, [s for s, _ in pairs], [t for _, t in pairs], **search)


def write_report(path: str | os.PathLike[str], report: dict[str, Any]) -> Path:
    """The JSON report, atomically (a temporary file, then a rename)."""
    path = Path(path)
    atomic_write_bytes(path, (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return path


def write_hypotheses(path: str | os.PathLike[str], hypotheses: Sequence[str]) -> Path:
    """One hypothesis a line, UTF-8, atomically. A line break inside one is refused: it would
    shift every line after it (evaluate_model's hypotheses have none)."""
    bad = [i for i, h in enumerate(hypotheses, 1) if _LINE_BREAKS.search(h)]
    if bad:
        raise RosettaError(f"hypothesis {bad[0]} holds a line break: cannot write one a line")
    path = Path(path)
    atomic_write_bytes(path, "".join(h + "\n" for h in hypotheses).encode("utf-8"))
    return path
