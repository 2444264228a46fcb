"""Host tier: a real ComfyUI checkout in COMFYUI_PATH, booted in-process on the CPU.

Tests marked ``needs_sage`` need an active Sage patch, which the pack installs only when
SageAttention imports; without it they skip, naming what is missing and how to install it.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import comfy_env  # noqa: E402

REASON = comfy_env.skip_reason()
if REASON:
    collect_ignore_glob = []  # keep collection; each module skips with the reason below

def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_sage") is not None:
        reason = comfy_env.sage_missing_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def comfy():
    if REASON:
        pytest.skip(f"host tier: {REASON}")
    return comfy_env.boot(cpu=True)
