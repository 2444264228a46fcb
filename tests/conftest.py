"""Load the repository as the package ``wan_sage`` whatever its folder is called, so the tests
import exactly the files in this checkout (relative imports, as ComfyUI loads the pack)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the helpers every tier shares (fake_device)

if "wan_sage" not in sys.modules or Path(sys.modules["wan_sage"].__file__).resolve().parent != ROOT:
    spec = importlib.util.spec_from_file_location("wan_sage", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wan_sage"] = mod
    spec.loader.exec_module(mod)
