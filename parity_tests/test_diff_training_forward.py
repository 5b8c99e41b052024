"""Inside the first step two training runs part: a forward dump of that step, compared stage by stage
with the float64 reference on the run's own weights (rosetta/diff/training/trace_files.py); the loop's
evaluation records; the reader's bounded cache.

The user's side is a plain PyTorch loop written here (torch.optim.Adam, F.cross_entropy with label
smoothing, pad ignored) that records a forward dump of each whole step with capture_torch, as the
recipe in docs/training_diff.md does; the reference is our torch trainer's trace. All in float64 on
dp_case's tiny model (parity_tests/dp_case.py says why).
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from numpy_ref.model import forward as reference_forward
from parity_tests import dp_case
from parity_tests.test_diff_forward_capture import our_name_map
from parity_tests.test_diff_training import assert_refused
from parity_tests.training_loops import rate
from rosetta.checkpoint import write_safetensors
from rosetta.cli import main
from rosetta.diff.training.commands import forward_check
from rosetta.diff.training.trace import EvalRecord, Tracer, TraceWriter, batch_digest, read_trace
from rosetta.errors import CheckpointError, RosettaError

WHOLE = 2  # steps the user's loop stores whole (and dumps)
FLOAT64_STAGES = 1e-10  # the forward diff's float64 tolerance (rosetta.diff.forward.sides.FLOAT64_TOLERANCE)


@pytest.fixture(scope="module")
def case():
    return dp_case.case()


def torch_impl_names(cfg) -> dict[str, str]:
    """Stage -> submodule of torch_impl's Transformer (test_diff_forward_capture.py's map, without
    attention weights)."""
    return our_name_map(cfg, weights=False)


def user_loop(case, path, mistake: str | None = None, dump: bool = True, full_steps: int = WHOLE):
    """A user's float64 PyTorch loop, traced with a forward dump of each whole step and an evaluation
    (on the last batch) before training and after every update. `mistake`: "unscaled_embeddings"
    (a port that forgets E[x]·√d_model, §3.4) or "pad_in_loss" (cross entropy without ignore_index)."""
    import torch
    import torch.nn.functional as F

    from rosetta.diff.shared.capture import capture_torch
    from torch_impl.backend import Model
    from torch_impl.convert import from_state_dict

    cfg, params, batches = case
    tc = dp_case.TRAIN
    model = Model(cfg, params, "float64", device="cpu").module.train()
    if mistake == "unscaled_embeddings":  # torch_impl multiplies the table's output by √d: undo it there
        for table in {id(t): t for t in (model.src_table, model.tgt_table)}.values():
            table.register_forward_hook(lambda _m, _args, out: out / math.sqrt(cfg.d_model))
    named = dict(model.named_parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(tc.adam_b1, tc.adam_b2), eps=tc.adam_eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: rate(step + 1, cfg.d_model, tc))
    held_out = batches[-1]

    def evaluate(step: int) -> None:  # the definition of TraceWriter.evaluation: no smoothing, dropout off
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(held_out.src), torch.from_numpy(held_out.tgt_in))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(held_out.labels)
                                   .reshape(-1), ignore_index=cfg.pad_id)
        model.train()
        trace.evaluation(step, held_out.src, held_out.tgt_in, held_out.labels, loss.item())

    with TraceWriter(path, cfg, full_steps) as trace:
        trace.start(from_state_dict(cfg, model.state_dict(), np.float64))
        evaluate(0)
        for k, batch in enumerate(batches, 1):
            # Before the update: the weights step k's loss and gradients are computed on.
            stages = capture_torch(model, batch.src, batch.tgt_in, torch_impl_names(cfg)) \
                if dump and k <= full_steps else None
            src, tgt_in, labels = (torch.from_numpy(x) for x in (batch.src, batch.tgt_in, batch.labels))
            for p in model.parameters():
                p.grad = None
            logits = model(src, tgt_in).reshape(-1, cfg.tgt_vocab_size)
            ignore = -100 if mistake == "pad_in_loss" else cfg.pad_id  # -100: no label is ignored
            loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore,
                                   label_smoothing=tc.label_smoothing)
            loss.backward()
            grads = from_state_dict(cfg, {n: p.grad.clone() for n, p in named.items()}, np.float64)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            trace.step(k, src, tgt_in, labels, loss.item(), lr, grads,
                       from_state_dict(cfg, model.state_dict(), np.float64))
            if stages is not None:
                trace.forward(k, stages)
            evaluate(k)
    return path


@pytest.fixture(scope="module")
def runs(case, tmp_path_factory):
    """Our torch trainer's trace (5 steps, all whole) and the user's loops."""
    from torch_impl.train import Trainer

    root = tmp_path_factory.mktemp("runs")
    cfg, params, batches = case
    trainer = Trainer(cfg, params, dp_case.TRAIN, device="cpu", dtype="float64")
    tracer = Tracer(root / "reference", cfg, 5, dp_case.TRAIN.to_dict(), "rosetta torch trainer", trainer)
    for batch in batches:
        tracer.record(trainer, batch, trainer.step(batch, keep_grads=True))
    return {"reference": root / "reference", "clean": user_loop(case, root / "clean"),
            "unscaled": user_loop(case, root / "unscaled", "unscaled_embeddings")}


def diff(a, b, tmp_path, *flags) -> tuple[int, dict]:
    out_json = tmp_path / "diff.json"
    code = main(["diff", str(a), str(b), "--json", str(out_json), *flags])
    return code, json.loads(out_json.read_text())


# -- the forward inside a step ------------------------------------------------------------------------

def test_a_clean_loop_with_forward_dumps_agrees(case, runs, tmp_path, capsys):
    cfg, _, batches = case
    code, record = diff(runs["clean"], runs["reference"], tmp_path)
    out = capsys.readouterr().out
    assert code == 0 and record["forward"] is None, out
    assert "no difference at any of 5 steps" in out and "inside step" not in out
    trace = read_trace(runs["clean"])
    for k in range(1, WHOLE + 1):
        assert np.array_equal(trace.forward(k).src, batches[k - 1].src)
        check = forward_check(trace, k, "A")
        assert check.first is None and check.tolerance == FLOAT64_STAGES, check.rows
        assert {r.stage for r in check.rows} == set(torch_impl_names(cfg))
    assert trace.forward(WHOLE + 1) is None  # past the whole steps: none kept


def test_a_forward_mistake_is_located_at_its_stage_and_named(case, runs, tmp_path, capsys):
    """Embeddings not multiplied by √d_model: E[x] instead of E[x]·√d is the first thing the encoder
    computes, so src_embed is the first stage over, and the forward catalogue names the entry."""
    code, record = diff(runs["unscaled"], runs["reference"], tmp_path, "--diagnose")
    out = capsys.readouterr().out
    assert code == 1 and record["first_difference"] == 1, out
    assert "inside step 1: A's forward dump against the float64 reference on A's weights before step 1" in out
    assert "the stage table below compares A's forward pass" in out
    assert "first difference at src_embed (relative error" in out
    assert "forward diagnosis: src_embed diverges" in out and "[embeddings_unscaled]" in out, out
    forward = record["forward"]
    assert forward["step"] == 1 and forward["side"] == "A" and forward["first_stage"] == "src_embed"
    assert forward["diagnosis"]["explained_by"] == ["embeddings_unscaled"]
    rows = {r["stage"]: r for r in forward["rows"]}
    assert rows["src_embed"]["over"] and rows["tgt_embed"]["over"] and rows["logits"]["over"]
    # One error, one number: the diagnosis's is the table's (both relative to the reference).
    assert f"forward diagnosis: src_embed diverges (rel {rows['src_embed']['rel']:.1e})" in out, out
    # Its size from the float64 reference alone: the reference without the √d (scale_embeddings off)
    # against the reference, at the non-pad source positions, on the initial weights and batch 1.
    cfg, params, batches = case
    got, want = {}, {}
    reference_forward(params, cfg.replace(scale_embeddings=False), batches[0].src, batches[0].tgt_in, got)
    reference_forward(params, cfg, batches[0].src, batches[0].tgt_in, want)
    real = batches[0].src != cfg.pad_id
    expected = np.linalg.norm(got["src_embed"][real] - want["src_embed"][real]) / np.linalg.norm(
        want["src_embed"][real])
    assert rows["src_embed"]["rel"] == pytest.approx(expected, rel=1e-9)


def test_a_loss_mistake_has_a_forward_that_agrees(case, runs, tmp_path, capsys):
    user_loop(case, tmp_path / "pad", "pad_in_loss")
    code, record = diff(tmp_path / "pad", runs["reference"], tmp_path)
    out = capsys.readouterr().out
    assert code == 1 and record["first_difference"] == 1, out
    assert record["forward"]["first_stage"] is None
    assert ("the forward passes agree: the difference is after the forward (the loss, the backward or the "
            "optimizer): the losses differ on logits that agree, so the loss's definition") in out


def test_without_a_dump_the_pointer_says_how_to_record_one(case, runs, tmp_path, capsys):
    user_loop(case, tmp_path / "nodump", "unscaled_embeddings", dump=False)
    code, record = diff(tmp_path / "nodump", runs["reference"], tmp_path)
    out = capsys.readouterr().out
    assert code == 1 and record["forward"] is None and "inside step" not in out, out
    assert "TraceWriter.forward(1, stages) with capture_torch or capture_nnx on its src and tgt_in" in out


def test_a_dump_of_another_batch_is_refused_in_one_line(runs, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(runs["unscaled"], bad)
    shutil.copy(bad / "forward_000002.npz", bad / "forward_000001.npz")
    err = assert_refused(["diff", str(bad), str(runs["reference"])], "forward_000001.npz: its batch", capsys)
    assert "is not step 1's" in err, err
    with pytest.raises(CheckpointError, match="a forward dump of another batch"):
        read_trace(bad).forward(1)


def test_a_dump_that_is_a_directory_is_refused_not_read_as_no_dump(runs, tmp_path, capsys):
    """Issue 39: a forward_000001.npz that is a folder read as "no dump" without a word."""
    bad = tmp_path / "bad"
    shutil.copytree(runs["unscaled"], bad)
    (bad / "forward_000001.npz").unlink()
    (bad / "forward_000001.npz").mkdir()
    assert_refused(["diff", str(bad), str(runs["reference"])],
                   f"{bad / 'forward_000001.npz'}: a directory, not an .npz dump file", capsys)
    with pytest.raises(CheckpointError, match="forward_000001.npz: a directory, not an .npz dump file"):
        read_trace(bad).forward(1)
    (bad / "forward_000002.npz").unlink()  # absent: no dump, as before
    assert read_trace(bad).forward(2) is None


def test_the_writer_refuses_a_dump_it_cannot_place(case, tmp_path):
    cfg, params, batches = case
    b1, b2 = batches[:2]
    logits = {"logits": np.zeros((*b1.tgt_in.shape, cfg.tgt_vocab_size))}
    writer = TraceWriter(tmp_path / "t", cfg, full_steps=1)
    writer.start(params)
    with pytest.raises(RosettaError, match=r"forward\(1\) must follow step\(1\)"):
        writer.forward(1, logits)
    writer.step(1, b1.src, b1.tgt_in, b1.labels, 1.0, 1e-3, params, params)
    with pytest.raises(RosettaError, match="the src given is not step 1's"):
        writer.forward(1, logits, src=b2.src)
    with pytest.raises(RosettaError, match=r"forward\(1\): dump: stage 'logits' has shape"):
        writer.forward(1, {"logits": logits["logits"][:, 1:]})  # not the batch's length
    writer.forward(1, logits, src=b1.src, tgt_in=b1.tgt_in)
    with pytest.raises(RosettaError, match="one forward dump per step"):
        writer.forward(1, logits)
    writer.step(2, b2.src, b2.tgt_in, b2.labels, 1.0, 1e-3, params, params)
    with pytest.raises(RosettaError, match=r"kept for the steps stored whole \(1..1\), not step 2"):
        writer.forward(2, logits)


# -- evaluation records --------------------------------------------------------------------------------

def _cross_entropy(cfg, params, src, tgt_in, labels) -> float:
    """The evaluation loss's definition from the float64 reference: mean -log p(label) over non-pad labels."""
    logits = reference_forward({n: v.astype(np.float64) for n, v in params.items()}, cfg, src, tgt_in)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return float(-picked[labels != cfg.pad_id].mean())


def test_evaluation_records_round_trip(case, runs):
    cfg, _, batches = case
    trace = read_trace(runs["clean"])
    held_out = batches[-1]
    assert [r.step for r in trace.evaluations] == list(range(len(batches) + 1))
    assert all(isinstance(r, EvalRecord) for r in trace.evaluations)
    for record in trace.evaluations[:WHOLE + 1]:  # the weights after these updates are in the trace
        ids = trace.evaluation_batch(record.step)
        assert all(np.array_equal(x, y) for x, y in zip(ids, (held_out.src, held_out.tgt_in, held_out.labels),
                                                          strict=True))
        assert record.batch_sha256 == batch_digest(*ids)
        weights = trace.initial() if record.step == 0 else trace.full(record.step).params
        # A sum over <= 264 tokens in float64 in another order: ~1e-14 relative.
        assert record.loss == pytest.approx(_cross_entropy(cfg, weights, *ids), rel=1e-12)
    assert read_trace(runs["reference"]).evaluations == []  # a trace without evals.jsonl
    with pytest.raises(RosettaError, match="no evaluation after step 9"):
        trace.evaluation_batch(9)


def _nan_evaluation(path):
    lines = (path / "evals.jsonl").read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "loss": float("nan")})
    (path / "evals.jsonl").write_text("\n".join(lines) + "\n")


def test_a_nan_evaluation_loss_is_refused_in_one_line(runs, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(runs["clean"], bad)
    _nan_evaluation(bad)
    message = "evals.jsonl: line 2: the evaluation loss after step 1 is nan: the run had diverged"
    assert_refused(["diff", str(bad), str(runs["reference"])], message, capsys)


def test_a_tampered_evaluation_batch_is_refused(case, runs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(runs["clean"], bad)
    held_out = case[2][-1]
    src = held_out.src.copy()
    src[0, 0] = (src[0, 0] + 1) % case[0].src_vocab_size
    write_safetensors(bad / "eval_000001.safetensors",
                      {"src": src, "tgt_in": held_out.tgt_in, "labels": held_out.labels}, {})
    trace = read_trace(bad)  # the ids are read when asked for
    trace.evaluation_batch(2)
    with pytest.raises(CheckpointError, match="eval_000001.safetensors: its batch does not hash"):
        trace.evaluation_batch(1)


def test_the_writer_keeps_evaluations_in_order(case, tmp_path):
    cfg, params, batches = case
    b = batches[0]
    writer = TraceWriter(tmp_path / "t", cfg)
    writer.start(params)
    with pytest.raises(RosettaError, match=r"evaluation after step 1: steps 0..0 are written"):
        writer.evaluation(1, b.src, b.tgt_in, b.labels, 2.0)
    writer.evaluation(0, b.src, b.tgt_in, b.labels, 2.0)
    with pytest.raises(RosettaError, match="at most one per step"):
        writer.evaluation(0, b.src, b.tgt_in, b.labels, 2.0)
    writer.step(1, b.src, b.tgt_in, b.labels, 1.0, 1e-3, params, params)
    with pytest.raises(CheckpointError, match=r"src holds ids outside \[0, 64\)"):
        writer.evaluation(1, b.src + cfg.src_vocab_size, b.tgt_in, b.labels, 2.0)
    with pytest.raises(CheckpointError, match=r"labels \(11, 23\): expected"):
        writer.evaluation(1, b.src, b.tgt_in, b.labels[:, 1:], 2.0)


# -- the reader's memory ----------------------------------------------------------------------------------

def test_the_reader_keeps_step_0_and_two_more(runs):
    trace = read_trace(runs["reference"])
    assert trace.full_steps == 5
    trace.initial()
    for k in range(1, 6):
        trace.full(k)
        assert len(trace._cache) <= 3
    assert list(trace._cache) == [0, 4, 5]
    assert trace.full(4).params is trace.full(4).params  # still cached: not read again
    trace.full(1)
    assert list(trace._cache) == [0, 4, 1]  # 5 was the least recently used
