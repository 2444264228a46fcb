"""Tests of the benchmark apparatus and of its records.  Load the repository as the package ``wan_sage``
whatever its folder is called (as tests/conftest.py does, so the tests import exactly the files in this
checkout), and ``bench/`` as the package ``bench`` from its files, so ``from bench import e2e`` works
wherever pytest was started.

The host-tier tests here (``*_host.py``) need a ComfyUI checkout in COMFYUI_PATH and skip with the reason
without one; the others need neither ComfyUI nor a GPU."""
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, folder: Path):
    mod = sys.modules.get(name)
    if mod is not None and Path(mod.__file__).resolve().parent == folder:
        return mod
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_load("wan_sage", ROOT)
_load("bench", ROOT / "bench")



import pytest  # noqa: E402

def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_sage") is not None:
        from bench import _host
        reason = _host.comfy_env().sage_missing_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI booted in-process on the CPU (the host tier's ``tests/host/comfy_env.py``), or a skip with
    the reason when no ComfyUI checkout is in COMFYUI_PATH."""
    from bench import _host
    ce = _host.comfy_env()
    if ce.skip_reason():
        pytest.skip(f"host tier: {ce.skip_reason()}")
    return ce.boot(cpu=True)
