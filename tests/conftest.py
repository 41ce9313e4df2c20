import os

# Each xdist worker gets its share of the cores: a thread each when 2 workers share 2 cores. With a thread per core
# in every worker, OpenMP's threads spin while they wait and the workers take each other's CPU: tests/regions and
# tests/test_training.py took a third longer that way (README.md, "Tests"). Set before torch loads, so the
# child processes the tests start inherit it too.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    has_fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with FP8 support (compute capability >= 8.9)")
    for item in items:
        if "gpu" in item.keywords and not has_fp8_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch and starts with clean counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
