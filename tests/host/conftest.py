"""Host tier: a real ComfyUI checkout in COMFYUI_PATH, booted in-process on the CPU."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import comfy_env  # noqa: E402

REASON = comfy_env.skip_reason()
if REASON:
    collect_ignore_glob = []  # keep collection; each module skips with the reason below


@pytest.fixture(scope="session")
def comfy():
    if REASON:
        pytest.skip(f"host tier: {REASON}")
    return comfy_env.boot(cpu=True)
