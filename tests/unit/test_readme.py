"""The README: its plan example's quoted verdict is what that command prints, and it stays short."""
import re
import shlex
from pathlib import Path

from wan_sage import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_verdict_is_what_plan_prints(capsys):
    section = README.read_text().split("## Plan without ComfyUI or a GPU", 1)[1].split("\n## ", 1)[0]
    command = next(line for line in section.splitlines() if line.startswith("wan-sage plan "))
    quoted = re.search(r'a verdict, here "([^"]+)"', section.replace("\n", " ")).group(1)
    # without a GPU plan assumes sm90 (and says so in a note); --arch pins that on a machine with one
    assert cli.main(shlex.split(command)[1:] + ["--arch", "sm90"]) == 0
    verdict = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("verdict:"))
    assert verdict.strip() == f"verdict: {quoted}"


def test_the_readme_is_for_users_and_short():
    text = README.read_text()
    assert len(text.encode()) <= 8192
    for command in ("pip install .", "wan-sage plan --preset", "pip install -r tests/requirements.txt",
                    "python3 -m pytest -q -rs"):
        assert command in text, command
