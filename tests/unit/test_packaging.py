"""What `pip install .` and the requirement files declare: no torch at runtime, one torch floor,
package data that exists, and the same runtime requirements in pyproject.toml and requirements.txt."""
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(path: Path) -> list[str]:
    """The requirement lines of a pip requirements file (no comments, no -r/-c options)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_pip_install_does_not_pull_torch():
    assert "torch" not in [_name(r) for r in PYPROJECT["project"]["dependencies"]]


def test_one_declared_torch_floor_in_the_bench_extra():
    declared = [r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra
                if _name(r) == "torch"]
    assert declared == PYPROJECT["project"]["optional-dependencies"]["bench"] and re.fullmatch(r"torch>=2\.\d+", declared[0])
    for path in (ROOT / "requirements.txt", ROOT / "tests" / "requirements.txt", ROOT / "tests" / "host" / "requirements-host.txt"):
        assert [r for r in _requirements(path) if _name(r) == "torch"] in ([], ["torch"]), f"{path.name} pins a torch floor"


def test_runtime_requirements_match_pyproject():
    assert sorted(_requirements(ROOT / "requirements.txt")) == sorted(PYPROJECT["project"]["dependencies"])


def test_every_package_data_pattern_matches_a_file():
    for pattern in PYPROJECT["tool"]["setuptools"]["package-data"]["wan_sage"]:
        assert list(ROOT.glob(pattern)), f"package-data pattern {pattern!r} matches no file"


def test_the_host_tier_installs_sageattention_and_the_unit_tier():
    host = ROOT / "tests" / "host" / "requirements-host.txt"
    assert "sageattention==1.0.6" in _requirements(host)
    assert "-r ../requirements.txt" in host.read_text().splitlines()
