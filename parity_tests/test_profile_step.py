"""benchmarks/profile_step.py (issue 45, item 1): its trace reader (benchmarks/profile_trace.py) against
synthetic traces whose intervals are written out here, so the idle share, the kinds' sums, the
launches and the syncs are counted by hand (each expected value's arithmetic is in the comment beside
it), not by the code under test; its table of kinds against real kernel and operator names, each with
the kind its library documents it as; its search FLOPs against a count made term by term from the
paper's layers; and its CPU twin end to end (`--device cpu --preset tiny`, the smallest shapes),
which runs every part and writes its results file into a temporary folder.

The CPU twin compiles PyTorch's step through dynamo's aot_eager backend instead of inductor (the same
graph capture and trainer code; inductor's code generation takes minutes per graph on this project's
2-core CPU, and parity_tests/test_gpu_path.py covers it)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import profile_step as ps
from benchmarks import profile_trace as pt
from parity_tests.conftest import fail_to_build
from rosetta import preset
from rosetta.flops import training_flops


def span(name: str, ts: float, dur: float, tid: int = 7, pid: int = 0, cat: str | None = None,
         **args) -> dict:
    event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if cat is not None:
        event["cat"] = cat
    if args:
        event["args"] = args
    return event


def meta(kind: str, name: str, pid: int, tid: int | None = None) -> dict:
    event = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


# Two training steps on CUDA as torch.profiler writes them: kernels on two streams (7 and 8, the
# attention kernel overlapping the matmul), a copy, the CUDA runtime's calls and a host operator.
TORCH_CUDA = [
    span("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", 100, 10, cat="kernel"),
    span("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", 105, 10, tid=8, cat="kernel"),
    span("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", 112, 3,
         cat="kernel"),
    span("void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, 4>", 120, 5,
         cat="kernel"),
    span("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", 126, 1,
         cat="kernel"),
    span("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>", 127, 1, cat="kernel"),
    span("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 128, 1, cat="kernel"),
    span("Memcpy DtoH (Device -> Pageable)", 130, 2, cat="gpu_memcpy"),
    span("aten::mm", 0, 500, pid=1, tid=1, cat="cpu_op"),  # the host's: not device work on CUDA
    span("cudaStreamSynchronize", 131, 1, pid=1, tid=1, cat="cuda_runtime"),
    span("cudaStreamSynchronize", 140, 1, pid=1, tid=1, cat="cuda_runtime"),
    span("cudaMemcpyAsync", 129, 1, pid=1, tid=1, cat="cuda_runtime"),  # asynchronous: not a sync
    span("cudaLaunchKernel", 99, 1, pid=1, tid=1, cat="cuda_runtime"),
]


def test_torch_cuda_trace_by_hand():
    got = pt.summarize(TORCH_CUDA, "torch", "cuda", steps=2)
    # Busy: [100, 115] (the matmul, attention over it, LayerNorm inside) + [120, 125] + [126, 129]
    # + [130, 132] = 15 + 5 + 3 + 2 = 25 µs of the span 100..132 = 32 µs: idle 7/32.
    assert got["idle_share"] == pytest.approx(7 / 32)
    assert got["span_ms"] == pytest.approx(32 / 2 / 1e3) and got["busy_ms"] == pytest.approx(25 / 2 / 1e3)
    # µs over 2 steps -> ms per step: each kernel's duration / 2000.
    want = {"GEMM": 10, "attention": 10, "LayerNorm": 3, "dropout": 5, pt.OTHER: 1, "loss and softmax": 1,
            "optimizer": 1, "copies": 2}
    assert got["kinds_ms"] == pytest.approx({k: us / 2e3 for k, us in want.items()})
    assert got["device_ms"] == pytest.approx(33 / 2e3)
    assert got["launches_per_step"] == 4  # 8 device events, none nested, over 2 steps
    assert got["syncs_per_step"] == 1  # 2 cudaStreamSynchronize over 2 steps; cudaMemcpyAsync is not one
    assert [k["name"][:4] for k in got["top"][:2]] == ["sm90", "flas"]  # 10 µs each, the largest
    assert got["top"][0]["ms_per_step"] == pytest.approx(10 / 2e3) and got["top"][0]["calls_per_step"] == 0.5


def test_torch_cpu_trace_nests_operators():
    events = [
        span("aten::linear", 0, 10, tid=1, cat="cpu_op"), span("aten::addmm", 1, 8, tid=1, cat="cpu_op"),
        span("aten::layer_norm", 12, 4, tid=1, cat="cpu_op"),
        span("aten::native_layer_norm", 12.5, 3, tid=1, cat="cpu_op"),
        span("aten::item", 20, 1.5, tid=1, cat="cpu_op"),
        span("aten::_local_scalar_dense", 20.25, 1, tid=1, cat="cpu_op"),
        span("aten::copy_", 5, 2, tid=2, cat="cpu_op"),  # autograd's thread, overlapping the linear
        span("ProfilerStep#1", -5, 40, tid=1, cat="user_annotation"),  # not an operator
    ]
    got = pt.summarize(events, "torch", "cpu", steps=1)
    # Self times: linear 10 - 8 = 2 and addmm 8 (GEMM 10); layer_norm 4 - 3 = 1 and native 3 (4);
    # item 1.5 - 1 = 0.5, _local_scalar_dense 1 and copy_ 2 (a cast: other, 3.5).
    assert got["kinds_ms"]["GEMM"] == pytest.approx(0.010)
    assert got["kinds_ms"]["LayerNorm"] == pytest.approx(0.004)
    assert got["kinds_ms"][pt.OTHER] == pytest.approx(0.0035) and got["device_ms"] == pytest.approx(0.0175)
    # Busy [0, 10] (copy_ inside it) + [12, 16] + [20, 21.5] = 15.5 of the span 0..21.5.
    assert got["idle_share"] == pytest.approx(1 - 15.5 / 21.5)
    assert got["launches_per_step"] == 4  # innermost: addmm, native_layer_norm, _local_scalar_dense, copy_
    assert got["syncs_per_step"] == 1


def test_jax_gpu_trace_reads_stream_lines_and_arguments():
    events = [
        meta("process_name", "/device:GPU:0", 1), meta("thread_name", "Stream #13(Compute)", 1, 13),
        meta("thread_name", "XLA Ops", 1, 99), meta("process_name", "/host:CPU", 2),
        meta("thread_name", "python", 2, 5),
        span("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0, 20, pid=1, tid=13, hlo_op="custom-call.3"),
        # A fusion whose name says nothing: its op's path names the log-softmax (the loss).
        span("input_reduce_fusion_1", 25, 5, pid=1, tid=13, hlo_op="reduce_fusion.1",
             tf_op="jit(_train_step)/jit(main)/jvp(log_softmax)/reduce_max"),
        span("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", 40, 10, pid=1,
             tid=13),
        span("loop_add_fusion_3", 55, 5, pid=1, tid=13, hlo_op="add_fusion.3"),
        span("MemcpyD2H", 62, 3, pid=1, tid=13),  # the one read of a device array
        span("fusion.1", 0, 60, pid=1, tid=99),  # a derived line of the same kernels: not counted again
        span("np.asarray(jax.Array)", 70, 4, pid=2, tid=5),
        span("CommonPjRtBuffer::Await", 80, 1, pid=2, tid=5),
        span("CommonPjRtBuffer::Await", 82, 1, pid=2, tid=5),
        span("fusion.9", 90, 1, pid=2, tid=5, hlo_op="fusion.9"),  # a host thunk: not the GPU's work
    ]
    got = pt.summarize(events, "jax", "cuda", steps=1)
    assert got["kinds_ms"] == pytest.approx({"GEMM": 0.020, "attention": 0.010, "loss and softmax": 0.005,
                                             "LayerNorm": 0, "dropout": 0, pt.OTHER: 0.005, "optimizer": 0,
                                             "copies": 0.003})
    # Busy 20 + 5 + 10 + 5 + 3 = 43 of the span 0..65.
    assert got["idle_share"] == pytest.approx(22 / 65) and got["launches_per_step"] == 5
    assert got["syncs_per_step"] == 1  # the copy to the host; the host's events are a CPU's rule


def test_jax_gpu_lines_named_otherwise():
    """A GPU process without Stream lines: every line counts but XLA's derived ones (the same kernels)."""
    events = [meta("process_name", "/device:GPU:0", 1), meta("thread_name", "gpu 0 compute", 1, 3),
              meta("thread_name", "XLA Modules", 1, 4),
              span("loop_add_fusion", 0, 4, pid=1, tid=3), span("jit__train_step", 0, 10, pid=1, tid=4)]
    got = pt.summarize(events, "jax", "cuda", steps=1)
    assert got["device_ms"] == pytest.approx(0.004) and got["idle_share"] == 0  # 4 µs, busy all its span


def test_jax_cpu_trace_thunks_on_two_threads():
    events = [
        span("dot.3", 0, 10, tid=1, hlo_op="dot.3"), span("end: dot.3", 10, 0.1, tid=1),
        span("wrapped_exponential", 12, 2, tid=1, hlo_op="wrapped_exponential"),
        span("fusion.7", 5, 10, tid=2, hlo_op="fusion.7"),
        span("while.6", 20, 10, tid=1, hlo_op="while.6"),
        span("dynamic-update-slice_convert_fusion", 21, 3, tid=1,
             hlo_op="dynamic-update-slice_convert_fusion"),
        span("ThunkExecutor::Execute (wait for completion)", 31, 1, tid=1),
        # Host reads: jax.Array._value waiting inside it (one read), and NumPy's wait alone (another).
        span("np.asarray(jax.Array)", 40, 5, tid=3), span("CommonPjRtBuffer::Await", 41, 1, tid=3),
        span("CommonPjRtBuffer::Await", 50, 1, tid=3),
    ]
    got = pt.summarize(events, "jax", "cpu", steps=1)
    # GEMM: dot 10; copies: the cache write 3; other: exponential 2, fusion 10, the loop's own 10 - 3.
    assert got["kinds_ms"]["GEMM"] == pytest.approx(0.010)
    assert got["kinds_ms"]["copies"] == pytest.approx(0.003)
    assert got["kinds_ms"][pt.OTHER] == pytest.approx(0.019) and got["device_ms"] == pytest.approx(0.032)
    # Busy: [0, 15] (the two threads' dot and fusion) + [20, 30] = 25 of the span 0..30.
    assert got["idle_share"] == pytest.approx(5 / 30)
    assert got["launches_per_step"] == 4 and got["syncs_per_step"] == 2


def test_overlap_on_one_thread_is_not_nesting():
    a, b = span("a", 0, 10), span("b", 9, 3)  # b starts inside a and ends after it (clock rounding)
    assert sorted((e["name"], t, leaf) for e, t, leaf in pt.self_times([a, b])) == [("a", 10, True),
                                                                                    ("b", 3, True)]
    assert pt.union_length([(0, 10), (9, 12), (20, 21)]) == 13


@pytest.mark.parametrize("name,kind", [
    # cuBLAS / cuBLASLt and nvJet matmuls; PyTorch's memory-efficient and flash attention (a cutlass kernel
    # too: attention is looked up first); cuDNN's SDPA as XLA calls it.
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_kernel_cublas", "GEMM"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "GEMM"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "loss and softmax"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>", "LayerNorm"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, "
     "at::native::FusedAdamMathFunctor<float, 4, ADAM_MODE::ADAMW>>", "optimizer"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(TensorIteratorBase&)>",
     pt.OTHER),  # autocast's casts
    ("Memcpy DtoD (Device -> Device)", "copies"),
    # inductor names its kernels after the ops they fuse.
    ("triton_red_fused__log_softmax_backward_data_nll_loss_backward_0", "loss and softmax"),
    ("triton_per_fused_native_dropout_native_layer_norm_1", "LayerNorm"),  # the first kind it names
    # torch's CPU operators, our CPU dropout's draws included (torch_impl/ops.py).
    ("aten::addmm", "GEMM"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::native_layer_norm_backward", "LayerNorm"), ("aten::random_", "dropout"),
    ("aten::_fused_adam_", "optimizer"), ("aten::_to_copy", pt.OTHER), ("aten::cat", "copies"),
    ("aten::index_select", "copies"), ("aten::relu", pt.OTHER),
    # XLA's kernels and thunks.
    ("gemm_fusion_dot_3", "GEMM"), ("dot_general.188", "GEMM"), ("loop_transpose_fusion", "copies"),
    ("input_concatenate_fusion", "copies"), ("dynamic-update-slice_convert_fusion.1", "copies"),
    ("wrapped_convert.31", pt.OTHER), ("loop_threefry2x32_fusion", "dropout"),
])
def test_kinds_of_real_names(name, kind):
    assert pt.kind_of(name) == kind


def test_search_flops_counted_term_by_term():
    # d_model 2, d_ff 3, V 5, one layer each, source 2, 3 target positions, beam 2. Matmul FLOPs, 2 a
    # multiply-add (rosetta/flops.py's convention; attention over every key position):
    # encoder: 2 tokens x (q, k, v, o 4·2·2·2 = 32 + FFN 2·2·2·3 = 24) + scores and values 2·2·2·2·2 = 32
    # -> 144; cross-attention keys and values once: 2 tokens x 2·2·2·2 = 32. Per beam row: decoder
    # self-attention and FFN 3 x 56 = 168, its scores and values 2·2·3·3·2 = 72, cross q and o 3 x 16
    # = 48, cross scores and values 2·2·3·2·2 = 48, output projection 2·3·2·5 = 60 -> 396.
    cfg = SimpleNamespace(d_model=2, d_ff=3, tgt_vocab_size=5, num_encoder_layers=1, num_decoder_layers=1)
    assert ps.search_flops(cfg, 1, 2, 2, 3) == 144 + 32 + 2 * 396
    assert ps.search_flops(cfg, 3, 2, 2, 3) == 3 * (144 + 32 + 2 * 396)  # per sentence


def test_cpu_twin_end_to_end(tmp_path, capsys, monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch_impl import compilation

    monkeypatch.setattr(compilation, "BACKEND", CompileCounterWithBackend("aot_eager"))
    ps.main(["--device", "cpu", "--preset", "tiny", "--batch", "8", "--length", "16", "--sentences", "2",
             "--warmup", "1", "--steps", "1", "--profiled", "1", "--peak-tflops", "1",
             "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].startswith("profile-step_tiny-float32_cpu_"), files
    result = json.loads((tmp_path / files[0]).read_text())
    md = (tmp_path / files[1]).read_text()
    header = "| kind | PyTorch eager | PyTorch compiled | JAX | PyTorch beam 4 | JAX beam 4 |"
    assert header in out and header in md  # the one side-by-side table, printed and written
    rows = {r["part"]: r for r in result["rows"]}
    assert list(rows) == list(ps.DEFAULT_PARTS)
    for r in rows.values():
        assert r["events"] > 0 and r["launches_per_step"] > 0, r["part"]
        assert sum(r["kinds_ms"].values()) == pytest.approx(r["device_ms"])
        assert 0 <= r["idle_share"] < 1 and r["busy_ms"] <= r["span_ms"]
        assert r["load_before"] >= 0 and r["load_after"] >= 0 and r["part_s"] > 0  # issue 57
        assert 0 < len(r["top"]) <= 15
        sizes = [k["ms_per_step"] for k in r["top"]]
        assert sizes == sorted(sizes, reverse=True)
        # --peak-tflops 1: MFU is FLOP/s over 1e12; the real tokens' FLOPs at most the padded shape's.
        assert r["mfu_padded"] == pytest.approx(r["flops_padded"] / r["median_s"] / 1e12)
        assert 0 < r["flops"] <= r["flops_padded"]
    for part in ("train-eager", "train-compiled", "train-jax"):  # the padded shape: 8 x 16 a side
        assert rows[part]["flops_padded"] == training_flops(preset("tiny"), 8, 16, 16)
    # The Stepper's flush reads the loss and the gradient norm (jax.device_get: jax.Array._value).
    assert rows["train-jax"]["syncs_per_step"] >= 1
    assert rows["train-eager"]["kinds_ms"]["GEMM"] > 0 and rows["train-eager"]["kinds_ms"]["optimizer"] > 0
    assert rows["search-torch"]["kinds_ms"]["attention"] > 0  # SDPA's CPU kernel, every decoder layer


def test_a_part_that_fails_is_its_rows_error_and_the_others_are_written(tmp_path, capsys, monkeypatch):
    """On an H200 (2026-11-30) the compiled step's capture failed and the run lost every part's row: a
    part's failure is now its row's error, in one line, the other parts measured and written, and the
    run exits 1 naming the part."""
    fail_to_build(monkeypatch, ps, "torch.compile",
                  "These storage data ptrs are not allocated in pool (0, 1)\nmore lines")
    with pytest.raises(SystemExit) as stop:
        ps.main(["--device", "cpu", "--preset", "tiny", "--batch", "4", "--length", "8", "--warmup", "1",
                 "--steps", "1", "--profiled", "1", "--parts", "train-eager", "train-compiled",
                 "--out-dir", str(tmp_path)])
    assert "1 of 2 parts failed (PyTorch compiled)" in str(stop.value.code)
    out = capsys.readouterr().out
    error = "RuntimeError: These storage data ptrs are not allocated in pool (0, 1)"
    assert f"PyTorch compiled: failed: {error}\n" in out
    result = json.loads(next(tmp_path.glob("profile-step-partial_*.json")).read_text())
    eager, compiled = result["rows"]
    assert eager["part"] == "train-eager" and eager["events"] > 0 and "error" not in eager
    assert compiled == {"part": "train-compiled", "title": "PyTorch compiled", "framework": "torch",
                        "impl": "torch.compile",
                        "error": "RuntimeError: These storage data ptrs are not allocated in pool (0, 1)"}
    md = next(tmp_path.glob("profile-step-partial_*.md")).read_text()
    assert "| kind | PyTorch eager |\n" in md and "**Failed**: `RuntimeError: These storage" in md


def test_bad_flags_refused_before_measuring(capsys, monkeypatch):
    monkeypatch.setattr(ps, "profile_impl", lambda *a, **k: pytest.fail("measured before refusing"))
    for argv, says in ((["--device", "cpu", "--sentences", "0"], "argument --sentences: must be an integer"),
                       (["--device", "cpu", "--parts", "search"], "argument --parts: invalid choice")):
        with pytest.raises(SystemExit) as stop:
            ps.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err


def _row(title: str, load: float) -> dict:
    """A results row as profile_impl writes it, its figures made up (the table is what is tested)."""
    kinds = dict.fromkeys(pt.KIND_ORDER, 0.0) | {"GEMM": 2.0, pt.OTHER: 1.0}
    return {"part": title, "title": title, "framework": "torch", "median_s": 0.004, "min_s": 0.004,
            "max_s": 0.005, "warmup_s": 1.0, "mfu": None, "mfu_padded": None, "kinds_ms": kinds,
            "device_ms": 3.0, "busy_ms": 3.0, "span_ms": 4.0, "idle_share": 0.25, "launches_per_step": 40,
            "syncs_per_step": 1.0, "top": [], "part_s": 12.5, "load_before": load, "load_after": load + 0.5}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_table_labels_its_rows_for_the_device_and_records_the_load(device):
    """Issue 57: on a CPU the table says what was measured there (operator time, time in no operator,
    the host's reads), not a GPU's notions (device idle, kernel launches, host-device syncs); every
    part's own seconds and the machine's load before and after it are in the table."""
    table = ps.side_by_side([_row("PyTorch eager", 0.5), _row("JAX", 0.25)], device)
    labels = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]]
    gpu_words = ["**device time, ms**", "device idle", "kernel launches per step",
                 "host-device syncs per step"]
    cpu_words = ["**operator time, ms**", "time in no operator (Python, dispatch)",
                 "host reads of a result per step"]
    mine, other = (cpu_words, gpu_words) if device == "cpu" else (gpu_words, cpu_words)
    assert all(w in labels for w in mine) and not any(w in labels for w in other), labels
    assert "| the part's seconds (warm-up, timed, profiled) | 12.5 | 12.5 |" in table
    assert "| machine load, 1-min average, before → after | 0.50 → 1.00 | 0.25 → 0.75 |" in table
    detail = ps.details(_row("JAX", 0.25), device)
    assert ("launches" in detail) == (device == "cuda") and ("operator |" in detail) == (device == "cpu")


def test_a_load_above_the_cores_is_warned_in_the_results():
    """A part during which the 1-minute load exceeded the cores gets a warning line, printed and at the
    top of the results' markdown; a quiet part gets none."""
    rows = [_row("PyTorch eager", 5.0), _row("JAX", 0.25)]
    warnings = ps.load_warnings(rows, cores=2)
    assert len(warnings) == 1 and "load reached 5.5 around PyTorch eager, above its 2 cores" in warnings[0]
    env = {"processor": "cpu", "date": "today", "commit": "abc", "torch": "t", "jax": "j"}
    settings = {"preset": "tiny", "dtype": "float32", "device": "cpu", "batch": 2, "length": 8,
                "real_share": 0.5, "sentences": 1, "decode_len": 8, "warmup": 1, "steps": 1, "profiled": 1}
    text = ps.markdown({"environment": env, "settings": settings, "rows": rows, "wall_s": 1.0,
                        "warnings": warnings})
    assert f"**{warnings[0]}**" in text and "## Operator time by kind" in text
