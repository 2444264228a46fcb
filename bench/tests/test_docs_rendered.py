"""The rendered docs are what ``python -m bench.render_docs`` makes from the records today: rendering a
copy of the checkout changes none of the files it writes (docs/attention.md, docs/memory-model.md,
docs/benchmarks.md and README.md's results table, where README.md has its markers).  A number edited by
hand, or a record changed without rendering again, fails here."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RENDERED = ("docs/attention.md", "docs/memory-model.md", "docs/benchmarks.md", "README.md")
COPIED = ("__init__.py", "attention", "memory", "nodes", "cli", "bench", "docs", "README.md", "pyproject.toml")


def test_rendering_again_changes_nothing(tmp_path):
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in COPIED:
        src = ROOT / name
        if not src.exists():
            continue
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.png"))
        else:
            shutil.copy2(src, copy / name)
    p = subprocess.run([sys.executable, "-m", "bench.render_docs"], cwd=copy, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    changed = [name for name in RENDERED if (copy / name).read_text() != (ROOT / name).read_text()]
    assert not changed, f"{changed}: run `python -m bench.render_docs` and commit the result"


def test_the_results_table_goes_only_between_the_markers(tmp_path):
    """render_docs replaces README.md's results block when the file has both marker lines, and leaves a
    README.md without them as it is."""
    from bench import render_docs
    page = tmp_path / "README.md"
    page.write_text("# title\n\nno block here\n")
    assert not render_docs.replace_block(page, "results", "| a |")
    assert page.read_text() == "# title\n\nno block here\n"
    page.write_text("before\n<!-- render_docs: results -->\nold\n<!-- /render_docs: results -->\nafter\n")
    assert render_docs.replace_block(page, "results", "| a | b |\n")
    assert page.read_text() == "before\n<!-- render_docs: results -->\n| a | b |\n<!-- /render_docs: results -->\nafter\n"


def test_the_results_table_is_headline_figures_only():
    from bench import render_docs
    lines = render_docs.render()[render_docs.README_BLOCK].splitlines()
    assert lines[0] == "| measured on the H200 | result | details |" and 2 < len(lines) <= 2 + 7
    assert all("](docs/" in line for line in lines[2:]), "each row links to its docs section"
