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
        """Hold memory until the dispatcher's measure of what is free (the driver's free memory plus the
        allocator's cached-but-unused blocks, attention.execution.available_bytes) reads ``free_bytes``.
        Garbage is collected first: tensors an earlier test left in reference cycles would otherwise be
        freed later, into the cache, and count as free beside the ballast.  Cached blocks the allocator
        cannot hand back count as free as well, so the ballast takes them into account too."""
        from wan_sage.attention.execution import available_bytes
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        held = 0
        for _ in range(8):
            n = available_bytes(torch.device("cuda", torch.cuda.current_device()), None) - free_bytes
            if n <= 16 << 20:
                break
            self.held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            held += n
        return held

    def release(self) -> None:
        self.held.clear()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def ballast():
    b = Ballast()
    yield b
    b.release()


@pytest.fixture
def fresh_state():
    """Every decision of the process forgotten before and after the test, and its memory handed back."""
    from wan_sage.attention.state import STATE
    STATE.reset()
    yield
    STATE.reset()
    gc.collect()
    torch.cuda.empty_cache()
