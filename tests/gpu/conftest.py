import gc

import pytest
import torch

def pytest_report_header(config):
    if not torch.cuda.is_available():
        return "gpu tier: skipped (no CUDA device)"
    return f"gpu tier: {torch.cuda.get_device_name()} torch {torch.__version__}"


@pytest.fixture
def ballast():
    """Hold device memory so that only ``free_bytes`` stay free (driver free + torch cache)."""
    held = []

    def leave(free_bytes: int):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        n = free - free_bytes
        if n > 0:
            held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        return n
    yield leave
    held.clear()
    gc.collect()
    torch.cuda.empty_cache()
