import pytest
import torch


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
