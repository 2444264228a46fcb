"""bench/e2e_h200.sh, the device-side driver: its usage names every sub-command it runs, and ``gpu-tier`` keeps
pytest's exit code and writes its log without the checkout's path (the form of bench/records/gpu-tier/), each line
as it comes, so that a tier the call's time limit cuts short leaves what it ran."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "bench" / "e2e_h200.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def _fake(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/usr/bin/env bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def _env(tmp_path: Path, pytest_rc: int, then: str = "") -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # python3: pip and the setup's import check succeed; "-m pytest" prints a line naming a file by its absolute
    # path, as pytest's tracebacks do, and its arguments, then exits with pytest_rc
    _fake(bin_dir, "python3", f"""for a in "$@"; do
  if [ "$a" = pytest ]; then
    echo "{ROOT}/tests/gpu/test_x.py:12: AssertionError"
    echo "rootdir: {ROOT}"
    echo "args: $*"
    {then}
    exit {pytest_rc}
  fi
done
cat >/dev/null
exit 0
""")
    _fake(bin_dir, "nvidia-smi", 'echo "NVIDIA H200"\n')
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", OUT=str(tmp_path / "out"), E2E_MODELS=str(tmp_path / "m"),
               E2E_SITE=str(tmp_path / "site"), WAN_SAGE_COMMIT="abc1234")
    return env


def test_the_usage_names_every_sub_command():
    r = subprocess.run(["bash", str(DRIVER)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    text = DRIVER.read_text()
    case = text[text.rindex('case "$cmd" in'):]
    commands = re.findall(r"^\s+([a-z-]+)\)", case, flags=re.M)
    assert "gpu-tier" in commands and "whole" in commands
    for c in commands:
        assert f"bash bench/e2e_h200.sh {c}" in r.stdout, c
    assert "set -uo pipefail" not in r.stdout  # the usage stops at the comment block's end


@pytest.mark.parametrize("rc", [0, 1])
def test_gpu_tier_keeps_pytest_s_exit_code_and_logs_without_the_checkout_path(tmp_path, rc):
    env = _env(tmp_path, rc)
    r = subprocess.run(["bash", str(DRIVER), "gpu-tier", "-k", "accuracy"], capture_output=True, text=True,
                       cwd=ROOT, env=env)
    assert r.returncode == rc, r.stdout + r.stderr
    log = (tmp_path / "out" / "gpu-tier.log").read_text()
    assert log.splitlines()[0] == "gpu tier: NVIDIA H200, commit abc1234"
    assert "tests/gpu/test_x.py:12: AssertionError" in log and "rootdir: .\n" in log  # pytest -v's rootdir line
    assert str(ROOT) not in log
    assert "-m pytest tests/gpu -v -rs -p no:cacheprovider -k accuracy" in log


def test_a_gpu_tier_cut_short_by_a_time_limit_leaves_the_lines_written_before(tmp_path):
    if shutil.which("timeout") is None:
        pytest.skip("coreutils' timeout is not installed")
    # pytest -v's line for the first test, then a tier that outlives the limit
    env = _env(tmp_path, 0, then='echo "tests/gpu/test_a.py::test_one PASSED"; sleep 30')
    r = subprocess.run(["timeout", "5", "bash", str(DRIVER), "gpu-tier"], capture_output=True, text=True, cwd=ROOT,
                       env=env)
    assert r.returncode == 124, r.stdout + r.stderr
    assert "tests/gpu/test_a.py::test_one PASSED" in (tmp_path / "out" / "gpu-tier.log").read_text()
