"""benchmarks/decode_ct2.py's edges (issue 57) and its `--isa both` file (issue 55): counts bounded
by the machine and refused in one line before any work, `--quick` with `--rounds` refused instead of
silently running one round, the model directories removed on every way out, and one results file
holding a part per ISA (each part measured in a process started with that ISA's environment)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from benchmarks import decode_ct2


@pytest.mark.parametrize("args,message", [
    (["--threads", str((os.cpu_count() or 1) + 1)], f"argument --threads: must be an integer >= 1 and <= "
                                                    f"{os.cpu_count()}"),
    (["--threads", "1000000"], "argument --threads: must be an integer >= 1"),
    (["--rounds", str(10**9)], f"argument --rounds: must be an integer >= 1 and <= {decode_ct2.MAX_ROUNDS}"),
    (["--quick", "--rounds", "3"], "argument --rounds: --quick runs one round of a small model"),
    (["--isa", "avx512"], "argument --isa: invalid choice: 'avx512'"),
    (["--model", "bart"], "argument --model: invalid choice: 'bart'"),
])
def test_out_of_bounds_counts_are_refused_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(decode_ct2, "run", lambda *a, **k: pytest.fail("measured before refusing"))
    with pytest.raises(SystemExit) as stop:
        decode_ct2.main([*args, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_the_model_directories_go_on_every_way_out(monkeypatch, tmp_path):
    """The temporary folder holding the Marian and CTranslate2 models is removed after a run and after
    a failure inside it (a base-sized pair is hundreds of MB)."""
    pytest.importorskip("ctranslate2", reason="the benchmark compares with CTranslate2")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    decode_ct2.run(quick=True)
    assert not list(tmp_path.glob("decode-ct2-*"))

    def broken(*args, **kwargs):
        raise RuntimeError("a failure halfway")

    monkeypatch.setattr(decode_ct2, "convert", broken)
    with pytest.raises(RuntimeError, match="halfway"):
        decode_ct2.run(quick=True)
    assert not list(tmp_path.glob("decode-ct2-*"))


def test_isa_both_writes_one_file_with_a_part_per_isa(tmp_path, monkeypatch, capsys):
    """`--isa both` runs the benchmark once per ISA, each in a process of its own with that ISA's
    environment (its `--part` file), and writes one results file with both parts, each table under
    its own machine line. The processes are stood in for here (their own runs are the cap's test in
    test_machine.py): what is checked is the command each gets and the file the parent writes."""
    from benchmarks import common

    calls = []

    def child(command, env):
        calls.append((command, env))
        isa = command[command.index("--isa") + 1]
        block = {"cpu": {"model": "m", "vector_flags": [], "cores": 2}, "isa_cap": isa}
        row = {"engine": "torch", "tokens": 1, "median_s": 1.0, "tokens_per_s": 1.0, "tokens_per_s_min": 1.0,
               "tokens_per_s_max": 1.0, "ratio_vs_ct2_float32": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
               "ratio_range_covers_1": True, "greedy_same_as_torch": 1.0, "beam_same_as_float64": 1.0}
        settings = {"config": {"d_model": 8, "num_encoder_layers": 1, "num_decoder_layers": 1,
                               "tgt_vocab_size": 9}, "batch": 1, "src_len": 2, "tgt_len": 2, "beam": 4,
                    "threads": 1, "rounds": 1, "reference_rows": 1}
        env_block = {"date": "-", "commit": "-", "processor": "-", "machine_block": block}
        Path(command[command.index("--part") + 1]).write_text(
            json.dumps({"environment": env_block, "settings": settings, "rows": [row]}))

        class Done:
            returncode = 0
        return Done()

    monkeypatch.setattr(common.subprocess, "run", child)
    decode_ct2.main(["--isa", "both", "--rounds", "2", "--out-dir", str(tmp_path)])
    assert [c[0][c[0].index("--isa") + 1] for c in calls] == ["native", "avx2"]
    assert all("both" not in c[0] and "--rounds" in c[0] for c in calls)
    assert calls[1][1]["ONEDNN_MAX_CPU_ISA"] == "AVX2" and "ONEDNN_MAX_CPU_ISA" not in calls[0][1]
    (written,) = tmp_path.glob("decode_ct2_cpu_*.json")
    payload = json.loads(written.read_text())
    assert list(payload["isas"]) == ["native", "avx2"]
    text = written.with_suffix(".md").read_text()
    assert text.count("## native:") == text.count("## avx2:") == 1
    assert "no ISA cap" in text and "capped at avx2" in text
