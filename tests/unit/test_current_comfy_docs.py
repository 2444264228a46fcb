"""docs/compatibility.md names tests that exist: every file and every ``::test`` in its table."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_compatibility_table_names_exists():
    rows = [r for r in (ROOT / "docs" / "compatibility.md").read_text().splitlines() if r.startswith("| 0.")]
    assert len(rows) >= 20
    for row in rows:
        current = None
        for ref in re.findall(r"`([^`]*test[^`]*)`", row.split("|")[4]):
            path, _, name = ref.partition("::")
            if path:
                current = ROOT / path
                assert current.exists(), ref
            if name:
                assert re.search(rf"^def {re.escape(name)}\(", current.read_text(), re.M), ref
    current_files = {p.name for p in (ROOT / "tests" / "unit").glob("test_current_comfy_*.py")}
    named = set(re.findall(r"tests/unit/(test_current_comfy_\w+\.py)", "\n".join(rows)))
    assert current_files - {"test_current_comfy_docs.py"} == named
