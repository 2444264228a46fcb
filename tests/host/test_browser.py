"""Host tier: headless Chromium against a real ComfyUI server (CPU) with the frontend package:
load every example workflow and check the estimator panel shows the expected numbers."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

from comfy_server import ROOT, Server  # noqa: E402

HERE = Path(__file__).parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists() or not shutil.which("node"):
    pytest.skip("browser test: needs Debian chromium (apt-get install chromium) and node", allow_module_level=True)
if not (HERE / "browser" / "node_modules" / "playwright-core").is_dir():
    pytest.skip("browser test: run `npm install` in tests/host/browser (playwright-core)", allow_module_level=True)
try:
    import comfyui_frontend_package  # noqa: F401
except ImportError:
    pytest.skip("browser test: needs comfyui-frontend-package (tests/host/requirements-host.txt)", allow_module_level=True)

WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))
ARTIFACTS = Path(os.environ.get("WAN_SAGE_ARTIFACTS", HERE / "artifacts"))


@pytest.fixture(scope="module")
def browser_run(tmp_path_factory):
    assert WORKFLOWS, "no example workflows"
    server = Server(tmp_path_factory.mktemp("comfy"), comfy_env.comfy_path()).wait()
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(["node", str(HERE / "browser" / "panel_check.mjs"), server.url, str(ARTIFACTS),
                            *map(str, WORKFLOWS)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "CHROMIUM": CHROMIUM})
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1]), server
    finally:
        server.stop()


def _num(text):
    import re
    m = re.search(r"-?[\d,]*\.?\d+", text or "")
    return float(m.group(0).replace(",", "")) if m else None


def test_every_workflow_loads_and_shows_its_panels(browser_run):
    result, _ = browser_run
    assert not [e for e in result["errors"] if "wan_sage" in e.lower() or "wan-sage" in e.lower()], result["errors"]
    for name, wf in result["workflows"].items():
        ready = [p for p in wf["panels"] if p["tokens"] and p["level"]]
        assert len(ready) >= wf["estimators"] >= 1, (name, wf)
        assert Path(wf["screenshot"]).is_file()


def test_a14b_720p81_panel_numbers(browser_run):
    from wan_sage.memory.api import estimate_from_json
    result, _ = browser_run
    wf = next(v for k, v in result["workflows"].items() if "720p81" in k)
    expect = estimate_from_json({"model_file": "wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", "width": 1280, "height": 720,
                                 "frames": 81, "attention": "sage-auto"})["summary"]
    panel = next(p for p in wf["panels"] if p["tokens"] and _num(p["tokens"]) == 75600)
    assert abs(_num(panel["activation_gb"]) - expect["activation_gib"]) < 0.01
    assert abs(_num(panel["sage_extra_gb"]) - expect["sage_extra_gib"]) < 0.01
    assert panel["level"] in ("fits", "offloads", "cannot")
    shutil.copy(wf["closeup"] or wf["screenshot"], ARTIFACTS / "panel_a14b_720p81.png")
