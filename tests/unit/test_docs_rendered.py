"""The rendered docs are what bench/render_docs.py makes from the data files today: rendering a copy
of the checkout changes none of the files it writes (docs/attention-bench.md, docs/memory-calibration.md
and the README's rendered block).  A number edited by hand, or a data file changed without rendering
again, fails here."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RENDERED = ("docs/attention-bench.md", "docs/memory-calibration.md", "README.md")
COPIED = ("__init__.py", "attention", "memory", "nodes", "bench", "docs", "README.md", "cli", "pyproject.toml")


def test_rendering_again_changes_nothing(tmp_path):
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.png"))
        else:
            shutil.copy2(src, copy / name)
    p = subprocess.run([sys.executable, "render_docs.py"], cwd=copy / "bench", capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    changed = [name for name in RENDERED if (copy / name).read_text() != (ROOT / name).read_text()]
    assert not changed, f"{changed}: run `cd bench && python3 render_docs.py` and commit the result"
