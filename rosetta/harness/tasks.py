"""What the training harness trains on: a task's token-id pairs, its evaluation split with the
references BLEU is computed against, and (for text) the joint BPE tokenizer.

* `copy`, `reverse`: the synthetic tasks of rosetta/harness/data.py; ids are used directly, no
  tokenizer. The evaluation pairs are drawn with another seed. References are the target ids
  written as space-separated strings, so BLEU is computed on id strings.
* `multi30k`: a Multi30k language pair (default de-en). The joint BPE vocabulary (paper §5.1:
  one vocabulary shared by source and target) is trained on the training pairs used, or
  reloaded from a run's `tokenizer.json` when resuming; references are the raw target
  sentences and hypotheses are detokenised, so BLEU is sacrebleu's on real text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rosetta.config import ModelConfig, preset
from rosetta.errors import RosettaError
from rosetta.harness.data import LANGUAGES, SPLITS, SYNTHETIC_TASKS, DataError, load_multi30k, synthetic_pairs
from rosetta.tokenizer import Tokenizer

if TYPE_CHECKING:  # run_config imports this module (check_task, parse_pair): no import at run time
    from rosetta.harness.run_config import RunConfig

TASKS: tuple[str, ...] = (*SYNTHETIC_TASKS, "multi30k")
IdPair = tuple[list[int], list[int]]


@dataclass
class TaskData:
    """Token-id pairs to train and evaluate on. `eval_refs[i]` is the reference of
    `eval_pairs[i]` as BLEU sees it; `tokenizer` is None for the synthetic tasks."""

    name: str
    train_pairs: list[IdPair]
    eval_pairs: list[IdPair]
    eval_refs: list[str]
    tokenizer: Tokenizer | None
    eval_split: str

    @property
    def synthetic(self) -> bool:
        return self.tokenizer is None

    def detokenize(self, ids: Sequence[int]) -> str:
        """Model output ids as text (BPE decoded), or as an id string for the synthetic tasks."""
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(ids)


def check_task(task: str) -> None:
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def parse_pair(pair: str) -> tuple[str, str]:
    """'de-en' -> ('de', 'en'), both Multi30k languages and different."""
    parts = pair.split("-")
    if len(parts) != 2 or parts[0] == parts[1] or any(p not in LANGUAGES for p in parts):
        raise DataError(f"--pair must be two different languages of {', '.join(LANGUAGES)} joined by '-' "
                        f"(e.g. de-en), got {pair!r}")
    return parts[0], parts[1]


def load_task(
    task: str,
    *,
    vocab_size: int,
    seed: int = 0,
    train_size: int | None = None,
    eval_size: int | None = None,
    eval_split: str = "val",
    pair: str = "de-en",
    data_dir: str | os.PathLike[str] | None = None,
    bpe_vocab_size: int = 8000,
    tokenizer_path: str | os.PathLike[str] | None = None,
    synthetic_max_len: int = 16,
) -> TaskData:
    """The data of `task`. `vocab_size` bounds the synthetic ids (the model's vocabulary);
    `train_size` / `eval_size` keep the first pairs only (synthetic defaults: 10000 / 500);
    `tokenizer_path` reloads a saved tokenizer instead of training one on `bpe_vocab_size`."""
    check_task(task)
    if task in SYNTHETIC_TASKS:
        if eval_split != "val":
            raise DataError(f"the synthetic tasks have one evaluation split, 'val'; got {eval_split!r}")
        train = synthetic_pairs(task, train_size or 10000, vocab_size, 1, synthetic_max_len, seed)
        # Another seed for the evaluation pairs: the same lengths and ids, drawn afresh.
        held_out = synthetic_pairs(task, eval_size or 500, vocab_size, 1, synthetic_max_len, seed + 1)
        return TaskData(task, train, held_out, [" ".join(map(str, t)) for _, t in held_out], None, eval_split)
    src_lang, tgt_lang = parse_pair(pair)
    if eval_split not in SPLITS or eval_split == "train":
        raise DataError(f"unknown evaluation split {eval_split!r}; choose one of "
                        f"{', '.join(s for s in SPLITS if s != 'train')}")
    train_text = load_multi30k("train", src_lang, tgt_lang, data_dir)[:train_size]
    eval_text = load_multi30k(eval_split, src_lang, tgt_lang, data_dir)[:eval_size]
    if tokenizer_path is not None:
        tokenizer = Tokenizer.load(Path(tokenizer_path))
    else:  # one joint vocabulary for both languages (§5.1)
        tokenizer = Tokenizer.train([s for pair_ in train_text for s in pair_], vocab_size=bpe_vocab_size)

    def encode(pairs: list[tuple[str, str]]) -> list[IdPair]:
        src = tokenizer.encode_batch([s for s, _ in pairs])
        tgt = tokenizer.encode_batch([t for _, t in pairs])
        return list(zip(src, tgt, strict=True))

    return TaskData(task, encode(train_text), encode(eval_text), [t for _, t in eval_text], tokenizer,
                    eval_split)


# -- What `rosetta train` (rosetta/harness/loop.py) takes from a RunConfig -----------------------

def run_model_config(run: RunConfig, task: TaskData) -> ModelConfig:
    """The model `rosetta train` builds: the preset, --set, and a text task's vocabulary size."""
    overrides = dict(run.overrides)
    if task.tokenizer is not None:  # the joint BPE vocabulary sizes both tables (§5.1)
        size = task.tokenizer.vocab_size
        overrides |= {"src_vocab_size": size, "tgt_vocab_size": size}
    return preset(run.preset, **overrides)


def run_task(run: RunConfig) -> TaskData:
    """The task's data; on --resume a text task reloads the run's own tokenizer."""
    tokenizer_path = None
    if run.resume and run.task == "multi30k":
        paths = [Path(run.out) / b / "tokenizer.json" for b in run.backends]
        texts = {p.read_text(encoding="utf-8") if p.is_file() else None for p in paths}
        if None in texts or len(texts) != 1:
            raise RosettaError(f"--resume: the runs in {run.out} do not share one tokenizer.json")
        tokenizer_path = paths[0]
    base = preset(run.preset, **run.overrides)
    return load_task(run.task, vocab_size=min(base.src_vocab_size, base.tgt_vocab_size), seed=run.seed,
                     train_size=run.train_size, eval_size=run.eval_size, eval_split=run.eval_split,
                     pair=run.pair, data_dir=run.data_dir,
                     bpe_vocab_size=run.vocab_size, tokenizer_path=tokenizer_path,
                     synthetic_max_len=run.synthetic_max_len)


def run_batching(run: RunConfig, cfg: ModelConfig) -> dict[str, Any]:
    """The batching settings of `rosetta train` (rosetta/harness/batching.py's keywords) for `cfg`."""
    return dict(max_len=cfg.max_len, buckets=run.buckets, pad_id=cfg.pad_id, bos_id=cfg.bos_id,
                eos_id=cfg.eos_id)
