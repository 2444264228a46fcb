"""Host tier: a real ComfyUI checkout in COMFYUI_PATH, booted in-process on the CPU.

Tests marked ``needs_sage`` need an active Sage patch, which the pack installs only when
SageAttention imports; without it they skip, naming what is missing and how to install it.
"""
import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import comfy_env  # noqa: E402

REASON = comfy_env.skip_reason()
if REASON:
    collect_ignore_glob = []  # keep collection; each module skips with the reason below

_sage_missing: list = []  # the one answer of sage_missing_reason(), once computed


def sage_missing_reason() -> str | None:
    """None when ``sageattention`` imports (the Sage patch is then active), else why it does not."""
    if not _sage_missing:
        try:
            importlib.import_module("sageattention")
            _sage_missing.append(None)
        except Exception as e:  # any import failure means the same thing here: no active patch
            _sage_missing.append(
                f"needs an active Sage patch, but sageattention is not importable ({type(e).__name__}: {e}); "
                "install the host tier's packages: tests/host/requirements-host.txt (sageattention==1.0.6)")
    return _sage_missing[0]


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_sage") is not None:
        reason = sage_missing_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def comfy():
    if REASON:
        pytest.skip(f"host tier: {REASON}")
    return comfy_env.boot(cpu=True)
