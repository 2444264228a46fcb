import gc

import pytest
import torch


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return "gpu tier: skipped (no CUDA device)"
    return f"gpu tier: {torch.cuda.get_device_name()} torch {torch.__version__}"


class Ballast:
    """Holds device memory so that only ``free_bytes`` stay free (driver free + torch cache)."""

    def __init__(self):
        self.held = []

    def __call__(self, free_bytes: int) -> int:
        # Collect garbage first: tensors an earlier test left in reference cycles would otherwise be
        # freed later, into the allocator's cache, and count as free beside the ballast.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        n = free - free_bytes
        if n > 0:
            self.held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        return n

    def release(self) -> None:
        self.held.clear()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def ballast():
    b = Ballast()
    yield b
    b.release()
