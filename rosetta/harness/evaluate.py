"""Test-set evaluation (paper §6.1: BLEU of beam search, beam 4, length penalty alpha 0.6):
decode a Multi30k split with `model.generate` through the tokenizer, then score the detokenised
hypotheses against the raw references with sacreBLEU: corpus BLEU (cased, its default 13a
tokenisation) and chrF, each reported with its signature so that a score can be reproduced.

Deviation from the paper: it reports tokenized BLEU on WMT newstest2014; we report sacreBLEU
on detokenised text (Post 2018), the comparable number, on Multi30k.

One BLEU path: `bleu` scores for `rosetta evaluate` (`evaluate_model` on any sentences,
`evaluate_split` on a Multi30k split, `write_report` the atomic JSON file) and for the training
loop (`score_batches`, on the evaluation pairs the loop has batched by length: `validation` at
its evaluation steps, `averaged` for `--average-last`).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rosetta.backends import BackendModel, from_params
from rosetta.checkpoint import load_checkpoint
from rosetta.errors import RosettaError
from rosetta.files import atomic_write_bytes
from rosetta.harness.average import resolve_checkpoints, write_average
from rosetta.harness.batching import Batch, restore_order
from rosetta.harness.out_dir import os_errors
from rosetta.harness.report import RUN_SCHEMA, read_json
from rosetta.harness.tasks import TaskData
from rosetta.harness.translate import translate_lines
from rosetta.tokenizer import TextTokenizer, no_tokenizer_at
from rosetta.training import Trainer

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


def bleu(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> dict[str, Any]:
    """sacreBLEU corpus BLEU of `hypotheses` against one reference each, with its signature
    (`tokenize="none"` for id strings, which are tokens already)."""
    if len(hypotheses) != len(references):
        raise RosettaError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    metric = _sacrebleu().metrics.BLEU(tokenize=tokenize)
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return {"score": result.score, "signature": str(metric.get_signature()), "text": str(result),
            "counts": list(result.counts), "totals": list(result.totals),
            "precisions": list(result.precisions), "bp": result.bp, "sys_len": result.sys_len,
            "ref_len": result.ref_len}


def score(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> dict[str, Any]:
    """sacreBLEU corpus BLEU (`bleu`) and chrF of `hypotheses` against one reference each, with
    the signatures."""
    chrf_metric = _sacrebleu().metrics.CHRF()
    chrf = chrf_metric.corpus_score(list(hypotheses), [list(references)])
    return {"bleu": bleu(hypotheses, references, tokenize),
            "chrf": {"score": chrf.score, "signature": str(chrf_metric.get_signature()), "text": str(chrf)}}


def score_batches(model: BackendModel, task: TaskData, batches: list[Batch], count: int, beam: int,
                  alpha: float, max_len_margin: int) -> dict[str, Any]:
    """The training loop's evaluation: decode the first `count` evaluation pairs of `task`, already
    batched by length (rosetta/harness/batching.py: eval_batches), with `model.generate`; BLEU of the
    detokenised hypotheses (`bleu`), exact-match accuracy for the synthetic tasks, one sample."""
    outputs = [model.generate(b.src, beam, alpha, max_len_margin).tokens for b in batches]
    hyp_ids = restore_order(batches, outputs, count)
    kept = [i for i, h in enumerate(hyp_ids) if h is not None]  # pairs too long for the buckets drop out
    hyps = [task.detokenize(hyp_ids[i]) for i in kept]
    refs = [task.eval_refs[i] for i in kept]
    corpus_bleu = bleu(hyps, refs, tokenize="none" if task.synthetic else "13a")["score"]
    exact = (float(np.mean([list(hyp_ids[i]) == list(task.eval_pairs[i][1]) for i in kept]))
             if task.synthetic and kept else None)
    sample = {"hyp": hyps[0], "ref": refs[0]} if kept else None
    return {"bleu": corpus_bleu, "exact_match": exact, "bleu_sentences": len(kept), "sample": sample}


def validation(trainer: Trainer, task: TaskData, loss_batches: list[Batch], gen_batches: list[Batch],
               count: int, beam: int, alpha: float, max_len_margin: int) -> dict[str, Any]:
    """An evaluation during training: the validation loss (`Trainer.eval_loss`, no dropout) and
    `score_batches` of the trainer's own model (`Trainer.backend_model`: greedy by default, beam
    search with `beam` > 1), and the seconds they took."""
    start = time.perf_counter()
    val_loss = trainer.eval_loss(loss_batches)
    scores = score_batches(trainer.backend_model(), task, gen_batches, count, beam, alpha, max_len_margin)
    return {"val_loss": val_loss, **scores, "eval_time_s": time.perf_counter() - start}


def averaged(run_dir: Path, last: int, decoder: str, dtype: str, task: TaskData, gen_batches: list[Batch],
             count: int, beam: int, alpha: float, max_len_margin: int, score: bool = True) -> dict[str, Any]:
    """`rosetta train --average-last N`: the average of the run's last `last` checkpoints (paper
    §6.1, rosetta/harness/average.py), written beside them as averaged.safetensors and, with
    `score` (a run at --eval-every 0 evaluates nothing), scored like a checkpoint, in backend
    `decoder`'s model (the registry's) at `dtype`."""
    paths = resolve_checkpoints([run_dir], last).paths
    with os_errors(run_dir, "write the averaged checkpoint in"):
        out = write_average(paths, run_dir / "averaged.safetensors")
    if not score:
        return {"checkpoints": [p.parent.name for p in paths]}
    ckpt = load_checkpoint(out)
    start = time.perf_counter()
    scores = score_batches(from_params(ckpt.config, ckpt.params, decoder, dtype), task, gen_batches, count,
                           beam, alpha, max_len_margin)
    return {"checkpoints": [p.parent.name for p in paths], **scores,
            "eval_time_s": time.perf_counter() - start}


def evaluate_model(model: BackendModel, tokenizer: TextTokenizer | None, sources: Sequence[str],
                   references: Sequence[str], beam: int = 4, alpha: float = 0.6, max_len_margin: int = 50,
                   batch_size: int = 32, length_rule: str = "wu", **constraints: Any) -> dict[str, Any]:
    """Translate `sources` (rosetta/harness/translate.py: translate_lines; `constraints` are
    model.generate's keywords) and score them against `references`: {"sentences", "hypotheses",
    "bleu": {...}, "chrf": {...}, "decode_time_s", "search": the settings used}. Without a
    tokenizer (the synthetic tasks) sources are id lines and BLEU counts ids."""
    if len(sources) != len(references):
        raise RosettaError(f"{len(sources)} sources for {len(references)} references")
    if not sources:
        raise RosettaError("nothing to evaluate: no sentences")
    if tokenizer is not None:
        tokenizer.check_fits(model.config)
    start = time.perf_counter()
    hypotheses = [_LINE_BREAKS.sub(" ", h) for h in translate_lines(
        model, tokenizer, sources, beam, alpha, max_len_margin, batch_size, length_rule, **constraints)]
    decode_time = time.perf_counter() - start
    scores = score(hypotheses, references, tokenize="13a" if tokenizer is not None else "none")
    search = {"beam": beam, "alpha": alpha, "max_len_margin": max_len_margin, "length_rule": length_rule,
              **constraints}
    return {"sentences": len(sources), "hypotheses": hypotheses, **scores, "decode_time_s": decode_time,
            "search": search}


def resolve_model(path: str | os.PathLike[str], tokenizer: str | os.PathLike[str] | None
                  ) -> tuple[Path, Path, dict[str, Any] | None]:
    """(model.safetensors, tokenizer.json, the run's run.json record or None) of a run or
    checkpoint directory (rosetta/harness/translate.py: resolve_run), or of a checkpoint file
    with `tokenizer`. A text model needs its tokenizer: a run of a synthetic task has none."""
    from rosetta.harness.translate import no_model_at, resolve_run

    path = Path(path)
    if not (path.is_file() or path.is_dir()):
        raise no_model_at(path)
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
        raise no_tokenizer_at(tokenizer_path)
    run_record = None
    run_json = checkpoint.parent.parent.parent / "run.json"  # <run>/checkpoints/step-N/model.safetensors
    if checkpoint.parent.parent.name == "checkpoints" and run_json.is_file():
        run_record = read_json(run_json, RUN_SCHEMA)
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


def evaluate_split(model: BackendModel, tokenizer: TextTokenizer, split: str, pair: str,
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
