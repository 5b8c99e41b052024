"""Shared fixtures: the `backend` argument, the config matrix every backend is tested on, and
the batches."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from rosetta import ModelConfig, init_params, preset
from rosetta.backends import BACKENDS, MODEL_BACKENDS, get_backend
from rosetta.device import collect_less
from rosetta.errors import RosettaError
from rosetta.parity import random_batch

# The marks that narrow the `backend` argument (pytest_generate_tests): which backends each keeps,
# read from the registry, and its description.
BACKEND_MARKS: dict[str, tuple[Callable[[str], bool], str]] = {
    "trainable": (lambda name: BACKENDS[name].trainer is not None,
                  "needs a backend that trains (PyTorch, JAX); the NumPy reference is forward-only. "
                  "On a test that takes `backend`: the model backends that also have a trainer"),
    "ported": (lambda name: BACKENDS[name].framework is not None,
               "on a test that takes `backend`: the framework ports, not the float64 NumPy reference"),
}


# The suite's XLA_FLAGS (pytest_configure says why): compile flags, and XLA's CPU runtime on one thread.
# Only "--" flags: XLA stops reading XLA_FLAGS at the first word without them, silently dropping what a
# test or benchmark appends after it (an ISA cap, a dump folder); a misspelled "--" flag aborts JAX.
# The compile flags: LLVM at -O0, XLA's older loop emitters for its fusions instead of the MLIR fusion
# emitters, and each program's LLVM module in one piece (issue 56: the numbers and what they change
# in docs/testing.md). A test that starts its own JAX process with other XLA_FLAGS adds them.
SUITE_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                       "--xla_cpu_parallel_codegen_split_count=1")
SUITE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"
SUITE_XLA_FLAGS = f"{SUITE_COMPILE_FLAGS} {SUITE_THREAD_FLAGS}"


class ExampleTooSlow(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """ExampleTooSlow raised in the block once it has run `seconds` (SIGALRM; the main thread): a
    hostile file's load past its time bound, or a FIFO opened by mistake, whose open would wait for a
    writer forever, becomes a failure (Python retries an interrupted call only when the handler returns)."""
    def expire(signum, frame):
        raise ExampleTooSlow(f"example ran past its {seconds} s deadline")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fail_to_build(monkeypatch, module, impl: str, message: str) -> None:
    """`module`'s build_trainer (a benchmark's) raising RuntimeError(message) for the implementation
    `impl` and building the others: one measurement that fails, as the compiled step did on an H200."""
    real = module.build_trainer

    def build(name, *args, **kwargs):
        if name == impl:
            raise RuntimeError(message)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(module, "build_trainer", build)


def users_environment() -> dict[str, str]:
    """os.environ with XLA's CPU runtime threaded as users run it (the suite's XLA_FLAGS without its
    one-thread flags; LLVM's -O0 kept: the same thunks, compiled sooner): for a benchmark a test runs
    that reads XLA's CPU thunks, or runs several host devices, whose collectives wait on each other
    (one runtime thread would leave them waiting). Flags added since (jax_impl/compilation.py's) stay."""
    env = dict(os.environ)
    flags = " ".join(env.pop("XLA_FLAGS", "").replace(SUITE_THREAD_FLAGS, "").split())
    return env | ({"XLA_FLAGS": flags} if flags else {})


MADE_CACHE = pytest.StashKey[str]()  # the cache folder this run made (pytest_configure)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's cache folder goes with it (every run made a new one under the temporary folder)."""
    made = config.stash.get(MADE_CACHE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    # `rosetta train` keeps JAX's compiled programs in the user's cache (rosetta/device.py: cache_dir):
    # the suite keeps its own, one for the session (xdist's workers inherit it from the controller),
    # and writes nothing under the home directory. A test of the cache itself names its own folder.
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ["ROSETTA_CACHE"] = tempfile.mkdtemp(prefix="rosetta-test-cache-")
        config.stash[MADE_CACHE] = os.environ["ROSETTA_CACHE"]  # removed when the run ends
        # JAX's persistent cache in that folder from the start, every program kept (as `rosetta train`
        # sets it: jax_impl/compilation.py's configure), read by JAX at import in the workers and
        # the subprocesses the tests start: a program compiled once per run, not once per
        # process or per new jit (a second trainer). Starts empty: a cold run stays cold.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["ROSETTA_CACHE"], "jax"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        # Unbounded in every process, `rosetta train`'s too (jax_impl/compilation.py keeps this setting):
        # a bounded writer (a test that configured the cache) failed on every entry an unbounded one had
        # written ("Error writing persistent compilation cache entry ... -atime"), so nothing more was
        # kept; and a bounded one reads every entry's access time at each write. One run stays far
        # under rosetta/device.py's CACHE_MAX_BYTES, and the folder goes when the run ends.
        os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
        # JAX's CPU programs as one_torch_thread below runs PyTorch's (issue 46: the suite in 15 minutes
        # cold): SUITE_COMPILE_FLAGS (a quarter of the JAX-heaviest modules' time was LLVM optimising
        # code that tiny models run for milliseconds) and XLA's CPU runtime on one thread. The same HLO,
        # no fast-math; the machine code rounds otherwise than users' (docs/testing.md measures by how
        # much), which every bound allows: each is derived for any order of the sums. Speed is measured
        # in benchmarks/, which compile as `rosetta train` does. A user's own XLA_FLAGS are kept.
        os.environ.setdefault("XLA_FLAGS", SUITE_XLA_FLAGS)
        # NumPy's OpenBLAS on one thread in the workers and the processes the tests start (read when
        # NumPy loads: the workers start after this), as one_torch_thread runs PyTorch's: its second
        # thread waited for work by spinning, ~16 CPU s of a cold run at 3bcbea4 (perf), for float64
        # reference matmuls of tiny models. A user's own setting is kept.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if not _xdist_controller(config):  # the processes that collect and run tests
        gc.disable()  # until collection ends (pytest_collection_finish): the test modules' imports
    registered = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for mark, (_, description) in BACKEND_MARKS.items():
        if mark not in registered:  # pyproject.toml already registers `trainable`, for -m
            config.addinivalue_line("markers", f"{mark}: {description}")


@functools.cache
def _missing(name: str) -> str | None:
    """Why backend `name` cannot run here (its framework does not import), or None."""
    try:
        get_backend(name)
    except RosettaError as e:
        return str(e)
    return None


def _parametrized(metafunc: pytest.Metafunc) -> set[str]:
    """The argument names the test's parametrize marks (its own, its class's, its module's) cover."""
    names: set[str] = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        names.update(argnames.split(",") if isinstance(argnames, str) else argnames)
    return {name.strip() for name in names}


@pytest.hookimpl(trylast=True)  # after the parametrize marks: the backend id stays last, `test_x[...-torch]`
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes `backend` (directly or through a fixture) and is not parametrized over it
    runs once per model backend of the registry, rosetta.backends.MODEL_BACKENDS, ids the names.
    `@pytest.mark.trainable` on the test keeps those that also have a trainer (torch, jax);
    `@pytest.mark.ported` keeps the framework ports (not the NumPy reference). Only the test's own
    marks narrow: a module's `pytestmark = pytest.mark.trainable` selects tests for -m, nothing else.
    A backend whose framework does not import here is skipped, naming it; nothing else is skipped."""
    if "backend" not in metafunc.fixturenames or "backend" in _parametrized(metafunc):
        return
    marks = {mark.name for mark in metafunc.definition.own_markers} & BACKEND_MARKS.keys()
    names = [name for name in MODEL_BACKENDS if all(BACKEND_MARKS[mark][0](name) for mark in marks)]
    metafunc.parametrize("backend", [
        pytest.param(name, id=name, marks=[pytest.mark.skip(reason=_missing(name))] if _missing(name) else [])
        for name in names])


# The modules whose tests took longest in a cold run (docs/testing.md; at 3003a7e, --durations),
# longest first: they run first, whole. `make test`'s --dist worksteal gives each xdist worker a
# contiguous half (a module's fixtures mostly built once) and an idle one takes the back half of the
# other's queue, so the workers meet in the first half's later tests: these modules are well under
# half the suite's time (about 700 of 2,100 worker-seconds there) so that those tests are short ones
# and both workers end together. Only the order changes; every test runs.
SLOW_FIRST = ("test_gpu_path", "test_benchmarks_smoke", "test_diff_training_recipes", "test_diff_training",
              "test_harness", "test_dtype_matrix")


# Python's cyclic garbage collector in the suite's processes (issue 56), as in `rosetta`'s
# (rosetta/device.py: GC_THRESHOLDS) and more: with torch, JAX, flax and transformers imported a worker
# holds millions of objects, and every full collection walks them all while JAX and dynamo trace. So
# collection runs with the collector off; then what the imports made is frozen (gc.freeze: left out of
# every later collection; module-level objects, never garbage) and the collector runs at `rosetta`'s
# thresholds. Cyclic garbage is still collected, later; no check reads when. Measured in docs/testing.md.
def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this process only hands tests to xdist's workers (it collects none)."""
    workers = getattr(config.option, "numprocesses", None)
    return not hasattr(config, "workerinput") and workers not in (None, 0)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
    collect_less()
    gc.enable()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test and its module fixtures' teardown: its cyclic garbage collected, then
    what is still alive frozen too. What outlives a module (the frameworks' compile caches, session
    fixtures) stays alive, and every later full collection walked it again: 24 CPU s of the workers'
    35 s in the collector in a cold run at 3bcbea4, most in collections that tests and benchmarks ask
    for (gc.collect() between trainers). Garbage is still collected at each module's end; only an object
    that outlives a module and later becomes part of a garbage cycle is never freed."""
    yield
    if getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()


PYTHON_GC_THRESHOLDS = gc.get_threshold()  # the interpreter's own (conftest is imported before collection)


@pytest.fixture(scope="module")
def python_collector():
    """Python's own collector thresholds for a module that bounds allocations: tracemalloc's peak
    counts cyclic garbage until it is collected, which at GC_THRESHOLDS waits up to 20,000 allocations
    (a JAX load's peak 1.67 MB against 1.44 MB allowed, in one cold run): a library user's process, not
    the suite's setting, is what such a bound is about. One full collection first, outside any
    measurement: lowered thresholds over counts run up at the suite's would collect everything the
    run made inside one (a refusal timed at 1.7 s against 1 s allowed when each load switched)."""
    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(*PYTHON_GC_THRESHOLDS)
    yield
    gc.set_threshold(*saved)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOW_FIRST's modules first, in its order; the rest after, in collection order (stable sort)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(SLOW_FIRST)))


# The parity matrix: adding a config variant is one line. Each is the `tiny` preset with
# the fields shown changed; together they cover every option of SPEC §1.
CONFIG_VARIANTS: dict[str, dict] = {
    "post_norm_relu": {},
    "pre_norm_gelu": dict(norm_first=True, activation="gelu"),
    "post_norm_final_norm_gelu_tanh": dict(final_norm=True, activation="gelu_tanh"),
    "pre_norm_no_final_silu": dict(norm_first=True, final_norm=False, activation="silu"),
    "concat_positions": dict(positional_encoding="sinusoidal_concat"),
    "concat_t2t_positions": dict(positional_encoding="sinusoidal_concat_t2t"),
    "share_none_unequal_vocab_output_bias": dict(
        share_embeddings="none", src_vocab_size=50, tgt_vocab_size=70, output_bias=True),
    "share_decoder": dict(share_embeddings="decoder", src_vocab_size=80, tgt_vocab_size=40),
    "share_src_tgt": dict(share_embeddings="src_tgt"),
    "no_biases_no_scale": dict(attention_bias=False, ffn_bias=False, scale_embeddings=False),
    "start_token_is_pad_eps_1e-6": dict(bos_id=0, layer_norm_eps=1e-6),
    "unequal_layers_heads_8": dict(num_encoder_layers=3, num_decoder_layers=1, num_heads=8),
    "logit_scale_flax_output_bias": dict(scale_embeddings=False, logit_scale=32 ** -0.5, output_bias=True),
    "fairseq_positions_offset_pad_plus_1": dict(norm_first=True, positional_encoding="sinusoidal_concat_t2t",
                                                pad_id=1, bos_id=0, position_offset=2),
}

# (batch, src_len, tgt_len, padded): padding in both sides, batch of 1, unequal lengths.
BATCH_SHAPES: dict[str, tuple[int, int, int, bool]] = {
    "padded": (4, 11, 9, True),
    "batch_of_one": (1, 7, 7, False),
    "tgt_longer_than_src": (3, 5, 13, True),
}


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The suite's models are tiny: PyTorch's OpenMP threads only add synchronisation, up to
    100x slower on a busy 2-core machine. Speed is measured in benchmarks/, not here."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def variant_config(name: str) -> ModelConfig:
    return preset("tiny", **CONFIG_VARIANTS[name])


@pytest.fixture(params=sorted(CONFIG_VARIANTS))
def cfg(request) -> ModelConfig:
    return variant_config(request.param)


@pytest.fixture
def params(cfg: ModelConfig) -> dict[str, np.ndarray]:
    # The canonical initializer leaves biases at zero and LayerNorm at identity; perturb every
    # tensor so that a backend that drops a bias or a scale cannot pass by luck.
    rng = np.random.default_rng(1)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in init_params(cfg, seed=0).items()}


@pytest.fixture(params=sorted(BATCH_SHAPES))
def batch(request, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    b, s, t, pad = BATCH_SHAPES[request.param]
    return random_batch(cfg, b, s, t, seed=2, pad=pad)


def _opus_mt_case(tmp_path_factory: pytest.TempPathFactory, separate: bool):
    pytest.importorskip("transformers", reason="the opus-mt case is built with transformers' MarianMTModel")
    pytest.importorskip("sentencepiece", reason="the opus-mt case's tokenizer is SentencePiece")
    from parity_tests.opus_mt_case import shared_case

    base = tmp_path_factory.getbasetemp()  # pytest-N/, or pytest-N/popen-gwK/ under pytest-xdist
    return shared_case(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base, separate)


@pytest.fixture(scope="session")
def opus_mt_dir(tmp_path_factory):
    """A directory laid out as opus-mt (parity_tests/opus_mt_case.py): joint vocabulary. Read-only."""
    return _opus_mt_case(tmp_path_factory, separate=False)


@pytest.fixture(scope="session")
def nllb_dir(tmp_path_factory):
    """`rosetta example nllb` at a few steps (parity_tests/nllb_case.py): an M2M100 directory. Read-only."""
    pytest.importorskip("transformers", reason="the nllb case is built with transformers' M2M100")
    pytest.importorskip("sentencepiece", reason="the nllb case's tokenizer is SentencePiece")
    from parity_tests.nllb_case import shared_case

    base = tmp_path_factory.getbasetemp()
    return shared_case(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session")
def opus_mt_separate_dir(tmp_path_factory):
    """The opus-mt case with separate source and target vocabularies (target_vocab.json). Read-only."""
    return _opus_mt_case(tmp_path_factory, separate=True)
