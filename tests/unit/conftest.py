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
