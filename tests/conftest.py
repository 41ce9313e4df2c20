import os
import pathlib

# Each xdist worker gets its share of the cores: a thread each when 2 workers share 2 cores. With a thread per core
# in every worker, OpenMP's threads spin while they wait and the workers take each other's CPU: tests/regions and
# tests/test_training.py took a third longer that way (docs/testing.md). Set before torch loads, so the
# child processes the tests start inherit it too.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    # Inductor compiles C++ kernels in a pool of min(32, cores) processes that every compiling process starts:
    # with 2 workers on 2 cores, 4 compilers and each fresh test process's pool start-up on top. Compiled in the
    # worker, the slowest tests ran 7-16% faster alone on one core (the GPT-2 weight-copy test 161 -> 142 s).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's C++ kernels scalar: the vectorized ones (ATen's vector templates, an instruction set's each) take
# longer to compile than the tests take to run them, and the CPU's code is a test bench here, never what a GPU
# runs (its Triton kernels are pinned for sm_90 from the fake H100's captures). Compiled scalar, GPT-2's weight
# cache test compiled its graphs in 34 s instead of 46 (2026-11-29, 2 cores). Every compiled variant a test compares
# is compiled alike; eager ATen kernels keep their vectors. Inherited by every child process.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import garbage_collection  # noqa: E402,F401  (Python's collector tuned for compiling: tests/garbage_collection.py)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n 2`` without ``--dist`` schedules as ``scripts/test`` does, with ``worksteal``: the default ``load``
    sends each worker 140 consecutive tests at the start and the suite's long tests can end up queued behind
    each other on one worker while the other runs out of work."""
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    has_fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with FP8 support (compute capability >= 8.9)")
    for item in items:
        if "gpu" in item.keywords and not has_fp8_gpu:
            item.add_marker(skip_gpu)
    if _WORKERS == 2:
        items[:] = _two_halves_slowest_first(items)


# Modules whose tests share a module-scoped fixture or a cached result: kept together on one worker, so that
# the expensive part runs once (FSDP2's ranks, the modelled MoE steps, the fp32 reference losses).
_SHARED_MODULES = {"tests/apps/test_train_distributed.py", "tests/bench/test_moe_bench.py",
                   "tests/bench/test_cost_model.py", "tests/inspection/test_report.py", "tests/test_training.py",
                   "tests/passes/test_operator_spellings.py", "tests/targets/test_activation_memory.py"}


# Tests that compile the same graphs: one unit, on one worker, in collection order, so that the later ones find the
# graphs in Inductor's on-disk caches rather than compiling them at the same time on the other worker (GPT-2's
# Inductor test took 3 s after the weight-cache test where it took 40 s alone, 2026-11-28).
_SHARED_GRAPHS = [
    ("tests/buffers/test_weight_cache.py::test_gpt2_conv1d_weights_stored_k_n_get_n_k_copies_and_train_like_uncached"
     "[inductor]", "tests/test_backend.py::test_inductor_trains_gpt2_conv1d_sites_like_eager"),
]


def _unit(item) -> str:
    """The unit a test is dealt to a worker with: its module's, its graphs' group's, the interpreter's (one
    process a worker runs every kernel's check script, ``tests/helpers.py``: dealt to both workers, both ran all of
    them, 40-45 s each, 2026-11-29), or its own."""
    module = item.nodeid.split("::")[0]
    if module in _SHARED_MODULES:
        return module
    if item.get_closest_marker("triton_interpreter"):
        return "triton_interpreter"
    return next((group[0] for group in _SHARED_GRAPHS if item.nodeid in group), item.nodeid)


def _known_seconds() -> dict[str, float]:
    """Each slow test's seconds from ``tests/slow_tests.txt`` (lines of pytest's ``--durations`` output)."""
    seconds: dict[str, float] = {}
    for line in (pathlib.Path(__file__).parent / "slow_tests.txt").read_text().splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0].endswith("s") and not line.startswith("#"):
            seconds[fields[2]] = seconds.get(fields[2], 0.0) + float(fields[0][:-1])
    return seconds


def _two_halves_slowest_first(items):
    """The collection reordered for two workers under ``worksteal``, which hands the first half of the list
    (by count) to one worker and the second half to the other, and later moves tests from the end of a
    worker's queue to a worker that ran out.

    The known slow tests are dealt to the halves, longest first, each to the half with fewer known seconds,
    and open their half: both workers start on them at once, and what is left at the end is the short tests,
    which stealing spreads evenly. The other tests fill both halves in collection order."""
    known = _known_seconds()
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)

    def seconds(unit) -> float:
        return sum(known.get(item.nodeid, 0.0) for item in unit)

    halves, loads, rest = ([], []), [0.0, 0.0], []
    for unit in sorted(units.values(), key=seconds, reverse=True):  # stable: collection order among equals
        if seconds(unit) == 0:
            rest.extend(unit)
            continue
        side = loads.index(min(loads))
        halves[side].extend(unit)
        loads[side] += seconds(unit)
    fill = len(items) // 2 - len(halves[0])
    if fill < 0:  # a run of mostly slow tests: the longest first is all that helps
        return halves[0] + halves[1] + rest
    return halves[0] + rest[:fill] + halves[1] + rest[fill:]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch and starts with clean counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def forked_children_server():
    """The tests' forkserver (``tests/forked.py``), started before any test: a test that runs a benchmark's child
    in the worker (``bench.forked``) would otherwise start the one server a process has with the benchmarks'
    preloads, and every later child of the worker would import the tests' own (gloo, the collector) again. Its
    imports run in the server's process, beside the worker's."""
    import forked

    forked.context()
