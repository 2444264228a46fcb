import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    from fakegpu import FakeGPU
    g = FakeGPU(monkeypatch, tmp_path)
    yield g
    g.reset_state()


@pytest.fixture(autouse=True)
def _no_cache_folder_from_the_shell(monkeypatch):
    """The unit tier writes into no cache folder of the machine it runs on (the timing cache, the compile files,
    the kept streamed paths): a test that wants one sets ``WAN_SAGE_CACHE_DIR`` to its own temporary folder."""
    monkeypatch.delenv("WAN_SAGE_CACHE_DIR", raising=False)
