"""docs/training_diff.md's two loops (PyTorch, JAX + optax), run as the page writes them: fed the
reference run's initial weights and batches, each gives a trace that `rosetta diff` finds equal to
the reference's. The independent source is `rosetta train`'s own trace; the loops are the page's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rosetta.cli import main

ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "training_diff.md"


def recipe(heading: str) -> str:
    """The first ```python block after `heading` on the page."""
    text = PAGE.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)[1]


def run_loop(code: str, heading: str) -> None:
    """The page's PyTorch loop, run as a script in this process (it changes no global setting, and a
    fresh interpreter would import torch again). The JAX ones run in a process of their own
    (run_jax_loops): the page switches JAX to 64-bit for the whole process."""
    assert "PyTorch" in heading
    exec(compile(code, PAGE.name, "exec"), {"__name__": "__main__"})


def run_jax_loops(scripts: dict[str, str], folder: Path) -> dict[str, str]:
    """Each of the page's JAX loops (as edited) run as a script, all of them in ONE fresh interpreter
    that 64-bit JAX is switched on in anyway (importing JAX and Flax once, not once a loop), each in
    a namespace of its own; returns each loop's traceback, or "" where it ran through."""
    runner = folder / "run_loops.py"
    runner.write_text(
        "import json, sys, traceback\n"
        "scripts, errors = json.load(open(sys.argv[1])), {}\n"
        "for name, code in scripts.items():\n"
        "    try:\n"
        f"        exec(compile(code, {PAGE.name!r}, 'exec'), {{'__name__': '__main__'}})\n"
        "        errors[name] = ''\n"
        "    except BaseException:\n"
        "        errors[name] = traceback.format_exc()\n"
        "json.dump(errors, open(sys.argv[2], 'w'))\n")
    (folder / "scripts.json").write_text(json.dumps(scripts))
    done = subprocess.run([sys.executable, "-W", "ignore", str(runner), str(folder / "scripts.json"),
                           str(folder / "errors.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((folder / "errors.json").read_text())


def traced_run(out, *flags) -> Path:
    # One bucket and 1024 tokens: every step's batch [64, 16] (the defaults gave [512, 8] twice, then
    # [256, 16]), so each JAX loop compiles its step once, not twice, and each --diagnose replay and
    # loop step computes a quarter of the tokens; the loops and mistakes do not depend on the size.
    assert main(["train", "--task", "copy", "--preset", "tiny", "--backend", "torch", "--steps", "3",
                 "--trace", "3", "--set", "dropout=0", "--dtype", "float64", "--eval-every", "0",
                 "--checkpoint-every", "0", "--bleu-samples", "4", "--buckets", "16", "--max-tokens", "1024",
                 "--no-progress", "--out", str(out), *flags]) == 0
    return out / "torch"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return traced_run(tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory):
    """The reference clipped at 0.1, below its gradients' norms: the gradient clip acts at every step."""
    return traced_run(tmp_path_factory.mktemp("clipped"), "--clip-norm", "0.1")


@pytest.mark.parametrize("heading", ["**Your PyTorch loop**", "**Your JAX + optax loop**"])
def test_the_pages_loop_agrees_with_the_reference(heading, reference, tmp_path, capsys, request):
    if heading == JAX_LOOP:
        mine = jax_loop_trace(request, "as written")
    else:
        mine = tmp_path / "mine"
        run_loop(recipe(heading).replace('"runs/ref/torch"', repr(str(reference))).replace(
            '"mine"', repr(str(mine))), heading)
    capsys.readouterr()
    assert main(["diff", str(mine), str(reference)]) == 0, capsys.readouterr().out
    assert "no difference at any of 3 steps" in capsys.readouterr().out


# The page's PyTorch loop with one common mistake each, written into it as a user would: named by
# `rosetta diff --diagnose` (rosetta/diff/training/catalogue.py), on loops that are not the
# project's own loop helpers (parity_tests/training_loops.py). no_label_smoothing, made with the same
# edit by docs/journeys.md's own sed line, is run there (parity_tests/test_journeys.py).
STEPS = "optimizer.step(); scheduler.step()"
MISTAKES = {
    "pad_in_loss": ("ignore_index=cfg.pad_id, ", ""),
    "loss_summed": ("label_smoothing=0.1)", 'label_smoothing=0.1, reduction="sum")'),
    "scheduler_before_optimizer": (STEPS, "scheduler.step(); optimizer.step()"),
    "clip_where_none": (STEPS, "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); " + STEPS),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_in_the_pages_loop_is_named(mistake, reference, tmp_path, capsys):
    old, new = MISTAKES[mistake]
    code = recipe("**Your PyTorch loop**")
    assert old in code
    code = code.replace(old, new).replace('"runs/ref/torch"', repr(str(reference))).replace(
        '"mine"', repr(str(tmp_path / "mine")))
    run_loop(code, "**Your PyTorch loop**")
    capsys.readouterr()
    out_json = tmp_path / "d.json"
    assert main(["diff", str(tmp_path / "mine"), str(reference), "--diagnose", "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert json.loads(out_json.read_text())["diagnosis"]["explained_by"] == [mistake], out


# The page's JAX + optax loop with a mistake edited in as a user would. Issue 48: eq. 3 without the
# + 1 crashed the page's former rate line (a Python int: 0.0 ** -0.5); the rate optax used, read from
# optax.inject_hyperparams' state, is 0 at step 1, and the mistake is named.
JAX_LOOP = "**Your JAX + optax loop**"
# constant_rate and clip_after_adam (issue 48's two optax orderings the catalogue lacked): the rate
# as a constant, and the chain's clip after adam, the optimizer state indexed as the chain's first.
ADAM = 'optax.inject_hyperparams(optax.adam)(  # keeps the rate it uses'
JAX_MISTAKES = {
    "schedule_from_zero": [("jnp.minimum((n + 1) ** -0.5, (n + 1) * warmup**-1.5)",
                            "jnp.minimum(n ** -0.5, n * warmup**-1.5)")],
    "constant_rate": [("learning_rate=schedule", "learning_rate=1e-3")],
    "clip_after_adam": [(ADAM, "optax.chain(" + ADAM),
                        ("eps=1e-9), wrt", "eps=1e-9), optax.clip_by_global_norm(0.1)), wrt"),
                        ("opt_state.hyperparams", "opt_state[0].hyperparams")],
}


@pytest.fixture(scope="module")
def jax_loops(reference, clipped_reference, tmp_path_factory):
    """The page's JAX loop as written (against the reference) and with each of JAX_MISTAKES edited
    in (clip_after_adam against the clipped reference), all run in one process (run_jax_loops): name
    -> (its trace, its reference, its traceback or "")."""
    folder = tmp_path_factory.mktemp("jax_loops")
    scripts, against = {}, {}
    for name in ("as written", *sorted(JAX_MISTAKES)):
        against[name] = clipped_reference if name == "clip_after_adam" else reference
        code = recipe(JAX_LOOP)
        for old, new in JAX_MISTAKES.get(name, []):
            assert old in code, name
            code = code.replace(old, new)
        code = code.replace('"runs/ref/torch"', repr(str(against[name])))
        scripts[name] = code.replace('"mine"', repr(str(folder / name.replace(" ", "_"))))
    errors = run_jax_loops(scripts, folder)
    return {name: (folder / name.replace(" ", "_"), against[name], errors[name]) for name in scripts}


def jax_loop_trace(request, name: str) -> Path:
    """The trace of one of jax_loops' loops, after checking that loop ran through."""
    trace, _, error = request.getfixturevalue("jax_loops")[name]
    assert not error, error[-2000:]
    return trace


@pytest.mark.parametrize("mistake", sorted(JAX_MISTAKES))
def test_a_mistake_in_the_pages_jax_loop_is_named(mistake, jax_loops, tmp_path, capsys):
    mine, against, error = jax_loops[mistake]
    assert not error, error[-2000:]
    capsys.readouterr()
    out_json = tmp_path / "d.json"
    assert main(["diff", str(mine), str(against), "--diagnose", "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert json.loads(out_json.read_text())["diagnosis"]["explained_by"] == [mistake], out
