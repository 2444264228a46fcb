"""Host tier: headless Chromium against a real ComfyUI 0.3.64 server (CPU) with this pack, with
both frontends and both renderers: what a user sees on the canvas.

* frontend 1.27.10, the comfyui-frontend-package pinned in tests/host/requirements-host.txt (the
  one ComfyUI 0.3.64 serves), classic canvas;
* frontend 1.58.x, installed into a folder of its own and served with ``--front-end-root``, in the
  classic canvas and in Nodes 2.0 (the setting ``Comfy.VueNodes.Enabled``).

For every example workflow it reads the wan-sage panels and the estimate requests they send (with
the latent's channel count); on the 720p workflow it checks that the
size widgets are disabled while the latent is connected (and drive the size once it is not), that
every panel is as tall as its content and inside its node, that no wan-sage node overlaps another
node before or after a run, that the Sage panel says SageAttention is missing (where this environment
has SageAttention, the stats route answers there as on a machine without it), and that the pack
triggers no deprecation warning.  The run is simulated with the events the server sends
(``executed`` with each node's ui text, ``wan_sage.stats``).  No panel line is cut off at the node's
width.  A Wan 2.1 1.3B model file on the TI2V-5B workflow's 48-channel latent must be flagged: the
panel sends ``latent_channels``, shows the server's ``summary.problems`` red and first, and where the
server's answer names no problem the check adds one to it, so the panel side is tested either way.
With 1.58 it also opens the workflow on a server without the pack and reads which pack the frontend
names as missing.

Setting up (each missing piece skips its tests with the reason):

* ``npm install`` in tests/host/browser (playwright-core);
* Debian ``chromium`` (``apt-get install chromium``), or ``CHROMIUM=/path/to/chrome``;
* the 1.58 frontend in its own target folder, outside the Python environment::

      python -m pip install --no-deps --target tests/host/browser/frontend-1.58 comfyui-frontend-package==1.58.1

  (or point ``WAN_SAGE_FRONTEND_158`` at such a target folder); ComfyUI is started with
  ``--front-end-root <target>/comfyui_frontend_package/static``.

Screenshots go to tests/host/artifacts/ (``WAN_SAGE_ARTIFACTS``); with ``WAN_SAGE_DOCS_SCREENSHOTS=1``
the 720p close-ups are also copied to docs/screenshots/.
"""
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

from comfy_server import ROOT, Server  # noqa: E402

HERE = Path(__file__).parent
BROWSER = HERE / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists() or not shutil.which("node"):
    pytest.skip("browser test: needs Debian chromium (apt-get install chromium) and node", allow_module_level=True)
if not (BROWSER / "node_modules" / "playwright-core").is_dir():
    pytest.skip("browser test: run `npm install` in tests/host/browser (playwright-core)", allow_module_level=True)

ARTIFACTS = Path(os.environ.get("WAN_SAGE_ARTIFACTS", HERE / "artifacts"))
DOCS_SHOTS = ROOT / "docs" / "screenshots"
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))
DETAIL = "Wan 2.2 A14B GGUF T2V 720p"
MISMATCH = "Wan 2.2 5B text to video 704p"  # its Wan22ImageToVideoLatent makes 48 channels
MISMATCH_UNET = "wan2.1_t2v_1.3B_fp16.safetensors"  # a 16-channel model
CHANNEL_PROBLEM = ("the latent has 48 channels but Wan 2.1 T2V 1.3B takes 16: use a 16-channel latent node "
                   "(EmptyHunyuanLatentVideo) or a 48-channel model (TI2V-5B)")
ERROR_RED = "rgb(248, 81, 73)"  # LEVEL_COLOURS.error, #f85149
TARGET_158 = Path(os.environ.get("WAN_SAGE_FRONTEND_158", BROWSER / "frontend-1.58"))
INSTALL_158 = ("python -m pip install --no-deps --target tests/host/browser/frontend-1.58 "
               "comfyui-frontend-package==1.58.1 (or set WAN_SAGE_FRONTEND_158)")
CASES = [("1.27", "classic"), ("1.58", "classic"), ("1.58", "vue")]
SAGE_INSTALLED = importlib.util.find_spec("sageattention") is not None  # the server runs in this environment
MISSING_TEXT = "SageAttention not installed: this node passes the model through"
README_URL = "https://github.com/wan-sage/wan-sage#getting-sageattention-optional-not-installed-automatically"
STATS = {"sage_calls": 80, "sdpa_calls": 160, "by_kernel": {"sage2_sm90": 80}, "reasons": {"cross_slower": 80, "short": 80},
         "fallbacks": {}, "head_split_calls": 0, "saved_ms": 10400.0, "calibration_ms": 820.0}
INSTALLED = {"sage_version": "2.2.0", "sage_error": None, "sm90_binding_broken": False, "ck_available": False,
             "self_test_failures": {}}
# GET /wan_sage/stats's sage_status on a machine without SageAttention: the detail workflow's pages get it
# where this environment has SageAttention, so they show the missing state either way.
MISSING = {"sage_version": None, "sage_error": "ModuleNotFoundError: No module named 'sageattention'",
           "sm90_binding_broken": False, "ck_available": False, "self_test_failures": {}}


def frontend_root(fe: str) -> tuple:
    """(extra server arguments, skip reason or None) for frontend ``fe``."""
    if fe == "1.27":
        if importlib.util.find_spec("comfyui_frontend_package") is None:
            return (), "needs comfyui-frontend-package (tests/host/requirements-host.txt)"
        return (), None
    static = TARGET_158 / "comfyui_frontend_package" / "static"
    if not (static / "index.html").is_file():
        return (), f"the 1.58 frontend is not installed in {TARGET_158}: {INSTALL_158}"
    return ("--front-end-root", str(static)), None


def _run_texts() -> dict:
    """What the nodes send after a run on a 24 GiB card: the estimator's report (its verdict line is
    what the panel shows) and the Sage patch's status, without SageAttention and with it."""
    from wan_sage.memory.answer import estimate_answer as estimate_from_json
    s = estimate_from_json({"model_file": "wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", "width": 1280, "height": 720,
                            "frames": 81, "attention": "sage-auto", "vram_gib": 24.0})["summary"]
    return {"estimatorText": f"tokens: {s['tokens']:,} per row, 1 row(s) per forward\nverdict: {s['verdict']}",
            "sageText": "SageAttention not installed: passed through. Install SageAttention 2.x from source.",
            "installedText": "patched (id 5a9e01); kernel: auto; sageattention: 2.2.0; comfy-kitchen int8: no",
            "stats": STATS, "installedStatus": INSTALLED, "missingStatus": MISSING if SAGE_INSTALLED else None}


_RUNS: dict = {}


def run_frontend(fe: str, tmp_root: Path) -> dict:
    """The panel check of one frontend (all its modes, once per session)."""
    if fe in _RUNS:
        return _RUNS[fe]
    extra, reason = frontend_root(fe)
    if reason:
        pytest.skip(f"browser test, frontend {fe}: {reason}")
    assert WORKFLOWS, "no example workflows"
    out = ARTIFACTS / f"frontend-{fe}"
    cfg = {"outDir": str(out), "modes": [m for f, m in CASES if f == fe],
           "workflows": [{"name": p.stem, "path": str(p)} for p in WORKFLOWS], "detail": DETAIL, "run": _run_texts(),
           "mismatch": {"workflow": str(ROOT / "example_workflows" / f"{MISMATCH}.json"), "unetName": MISMATCH_UNET,
                        "problem": CHANNEL_PROBLEM}}
    server = Server(tmp_root / f"comfy-{fe}", comfy_env.comfy_path(), extra_args=extra).wait()
    try:
        cfg["url"] = server.url
        cfg_path = tmp_root / f"panel-check-{fe}.json"
        cfg_path.write_text(json.dumps(cfg))
        p = subprocess.run(["node", str(BROWSER / "panel_check.mjs"), str(cfg_path)], capture_output=True, text=True,
                           timeout=900, env={**os.environ, "CHROMIUM": CHROMIUM})
        assert p.returncode == 0, p.stderr[-3000:]
        _RUNS[fe] = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
    return _RUNS[fe]


@pytest.fixture(params=CASES, ids=[f"{fe}-{mode}" for fe, mode in CASES])
def case(request, tmp_path_factory):
    fe, mode = request.param
    r = run_frontend(fe, tmp_path_factory.getbasetemp())
    return fe, mode, r, r["modes"][mode]


def _num(text):
    m = re.search(r"-?[\d,]*\.?\d+", text or "")
    return float(m.group(0).replace(",", "")) if m else None


def _states(m: dict):
    """Every page state read on the detail workflow: before and after a run, framed and close up."""
    d, i = m["detail"], m["installed"]
    return {"before": d["before"], "after run": d["after"], "after run, all": d["afterAll"],
            "with Sage, before": i["before"], "with Sage, after run": i["after"], "with Sage, after run, all": i["afterAll"]}


# --------------------------------------------------------------------------- tests

def test_the_frontend_asked_for_is_served(case):
    fe, mode, r, m = case
    assert str(r["frontendVersion"]).startswith(fe + "."), r["frontendVersion"]
    assert m["workflows"][DETAIL]["vue"] is (mode == "vue")


def test_every_workflow_loads_and_shows_its_panels(case):
    _fe, _mode, r, m = case
    assert not [e for e in r["errors"] if re.search(r"wan[_-]sage", e, re.I)], r["errors"]
    for path in WORKFLOWS:
        wf = json.loads(path.read_text(encoding="utf-8"))
        state = m["workflows"][path.stem]
        n_est = sum(n["type"] == "WanWorkingMemoryEstimator" for n in wf["nodes"])
        n_sage = sum(n["type"] == "WanSageAttentionPatch" for n in wf["nodes"])
        assert len(state["estimators"]) == n_est >= 1 and len(state["sages"]) == n_sage >= 1, path.stem
        for e in state["estimators"]:
            assert e["state"] == "ok" and re.search(r"\d", e["fields"]["tokens"] or ""), (path.stem, e)
            assert e["fields"]["size"] and e["fields"]["verdict"], (path.stem, e)
        for s in state["sages"]:
            assert s["sage"] in ("missing", "rejected", "ok"), (path.stem, s)
        assert Path(state["screenshot"]).is_file()


def _disabled(w: dict, vue: bool) -> bool:
    """A size widget as the user sees it: greyed out (classic: drawn disabled; Nodes 2.0: its input
    disabled and its row dimmed)."""
    if vue:
        return w["disabled"] and w["inputDisabled"] is True and w["opacity"] < 0.6
    return w["disabled"] and w["computedDisabled"]


def _enabled(w: dict, vue: bool) -> bool:
    if vue:
        return not w["disabled"] and w["inputDisabled"] is False and w["opacity"] == 1
    return not w["disabled"] and not w["computedDisabled"]


def test_size_widgets_are_disabled_while_the_latent_sets_the_size(case):
    _fe, mode, _r, m = case
    vue = mode == "vue"
    for name, state in m["workflows"].items():
        for e in state["estimators"]:
            assert e["latentConnected"] and e["from"] == "latent", (name, e["from"])  # the shipped layout
            assert re.match(r"Size .* from the latent \(#\d+\)$", e["fields"]["size"]), (name, e["fields"]["size"])
            for w, st in e["widgets"].items():
                assert _disabled(st, vue), (name, w, st)
            assert _enabled(e["cfgWidget"], vue), (name, "cfg", e["cfgWidget"])


def test_without_the_latent_the_widgets_drive_the_size(case):
    _fe, mode, _r, m = case
    d = m["detail"]
    assert d["unlinked"]["from"] == "widgets"
    assert d["unlinked"]["fields"]["size"] == "Size 1280\u00d7720, 81 frames \u00b7 from the widgets"
    for w, st in d["unlinked"]["widgets"].items():
        assert _enabled(st, mode == "vue"), (w, st)
    assert d["edited"]["fields"]["tokens"] == "56,700", "width 960 on the widget: 60 x 45 x 21 tokens"


def test_panels_fit_their_content_and_no_node_overlaps(case):
    _fe, mode, _r, m = case
    below = 48  # canvas px between a panel and its node's bottom: the widget margin (classic), the badge row (Nodes 2.0)
    states = {**_states(m), **{f"{k}, before": v for k, v in m["workflows"].items()},
              **{f"{k}, after a run": v["after"] for k, v in m["workflows"].items() if "after" in v}}
    assert len(states) == 6 + 2 * len(WORKFLOWS) - 1
    for when, state in states.items():
        assert state["overlaps"] == [], (when, state["overlaps"])
        for p in state["estimators"] + state["sages"]:
            f = p["fit"]
            assert f["visible"], (when, p["id"], f)
            assert f["overflow"] <= 1, (when, p["id"], "clipped", f)
            assert f["box"] - f["content"] <= 2, (when, p["id"], "empty room in the panel", f)
            assert not f["outside"] and 0 <= f["below"] <= below, (when, p["id"], "panel and node disagree", f)
            assert p["cut"] == [], (when, p["id"], "lines cut off at the node's width", p["cut"])


def test_a_run_adds_its_lines_and_the_sage_table(case):
    _fe, _mode, _r, m = case
    for e in m["detail"]["after"]["estimators"]:
        assert (e["fields"]["report"] or "").startswith("Last run: "), e["fields"]
    before = {s["id"]: s["fit"]["content"] for s in m["installed"]["before"]["sages"]}
    for s in m["installed"]["after"]["sages"]:
        assert s["state"] == "ok" and s["sage"] == "ok" and s["sageCalls"] == "80 of 240 (33 %)", s
        assert s["fit"]["content"] > before[s["id"]] + 100, "the table is shown, and the node grew to hold it"


def test_the_sage_panel_says_sageattention_is_missing(case):
    _fe, _mode, _r, m = case
    for s in m["detail"]["before"]["sages"] + m["detail"]["after"]["sages"]:
        assert s["sage"] == "missing" and s["headline"] == MISSING_TEXT, s
        assert "sageattention==1.0.6" in s["hint"] and s["link"] == README_URL, s
    assert m["detail"]["before"]["sages"][0]["status"] is None, "no promise of call counts that will not come"


def test_the_templates_dialog_shows_whole_titles(case):
    """Both frontends title a pack's templates with their file names; none may be cut off."""
    _fe, _mode, r, _m = case
    assert r["templates"] == {p.stem: {"cut": False} for p in WORKFLOWS}, r["templates"]


def test_the_pack_triggers_no_deprecation_warning(case):
    _fe, _mode, r, _m = case
    assert r["deprecations"] == [], r["deprecations"][:3]


def test_a14b_720p_panel_numbers_and_model(case):
    """The panel shows the route's figures (GiB keys) for the request it sent, the verdict as the
    server words it, the model it detected, and, since the test server's model files are empty
    placeholders, that the model was guessed from its name."""
    from wan_sage.memory.answer import estimate_answer as estimate_from_json
    _fe, _mode, _r, m = case
    sent = [p for p in m["detail"]["posts"] if p and "high_noise" in p.get("model_file", "") and p["width"] == 1280]
    assert sent and "vram_gib" in sent[-1], m["detail"]["posts"]
    expect = estimate_from_json(sent[-1])["summary"]
    panel = next(e for e in m["detail"]["before"]["estimators"] if _num(e["fields"]["tokens"]) == 75600)
    assert abs(_num(panel["fields"]["activation_gib"]) - expect["activation_gib"]) < 0.01
    assert abs(_num(panel["fields"]["sage_extra_gib"]) - expect["sage_extra_gib"]) < 0.01
    assert panel["level"] in ("fits", "offloads", "cannot")
    assert panel["fields"]["verdict"] == expect["verdict"], "the verdict as the server sends it"
    detected = expect["detected"]
    assert f"{detected['num_layers']} layers" in panel["fields"]["model"]
    if detected["guessed"]:
        assert panel["fields"]["assumption"] == f"Model guessed from its name: {detected['model']}"
        assert panel["fields"]["model"].endswith("(guessed)")


def test_close_ups_are_saved(case):
    fe, mode, _r, m = case
    shots = {"before": m["installed"]["closeupBefore"], "after": m["installed"]["closeupAfter"],
             "sage-missing": m["detail"]["closeupBefore"]}
    for when, path in shots.items():
        assert Path(path).is_file() and Path(path).stat().st_size < 250_000, path
        if os.environ.get("WAN_SAGE_DOCS_SCREENSHOTS") == "1":
            DOCS_SHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, DOCS_SHOTS / f"panels-{fe}-{mode}-{when}.jpg")


def _channels(wf: dict) -> int:
    return 48 if any(n["type"] == "Wan22ImageToVideoLatent" for n in wf["nodes"]) else 16


def test_every_estimate_request_names_the_latents_channels(case):
    _fe, _mode, _r, m = case
    for path in WORKFLOWS:
        posts = [p for p in m["workflows"][path.stem]["posts"] if p]
        want = _channels(json.loads(path.read_text(encoding="utf-8")))
        sent = {p.get("latent_channels") for p in posts}
        # The detail workflow's latent is disconnected at its end: those requests name no latent.
        assert sent == ({want, None} if path.stem == DETAIL else {want}), (path.stem, sent, posts[-1:])


def test_the_panel_shows_a_wrong_channel_latent_red_and_first(case):
    """The request names the 48-channel latent and the 1.3B file; the panel shows the problem (the
    server's, or the one the check added to the server's answer) as its first line, in red, whole."""
    _fe, _mode, _r, m = case
    mm = m["mismatch"]
    assert mm["post"] and mm["post"]["latent_channels"] == 48 and mm["post"]["model_file"] == MISMATCH_UNET, mm["post"]
    want = mm["serverProblems"] or [CHANNEL_PROBLEM]
    (e,) = mm["state"]["estimators"]
    assert e["fields"]["problems"] == "".join(want), e["fields"]
    assert e["firstLine"] == "problems" and e["problemColour"] == ERROR_RED, e
    assert e["cut"] == [] and e["fit"]["overflow"] <= 1 and e["fit"]["box"] - e["fit"]["content"] <= 2, e["fit"]
    assert e["fields"]["verdict"], "the verdict still shows below the problem"
    assert Path(mm["closeup"]).is_file()


def test_the_server_flags_a_wrong_channel_latent(case):
    _fe, _mode, _r, m = case
    mm = m["mismatch"]
    assert mm["answers"] >= 1, "the estimate route answered the mismatched request"
    assert mm["serverProblems"] is not None, "the estimate route answers summary.problems"
    assert any("48 channels" in p and "16" in p for p in mm["serverProblems"]), mm["serverProblems"]


@pytest.fixture(scope="module")
def missing_pack(tmp_path_factory):
    """Frontend 1.58 on a server without this pack: the 720p workflow as shipped, and a copy whose
    nodes carry no properties.cnr_id / ver."""
    extra, reason = frontend_root("1.58")
    if reason:
        pytest.skip(f"browser test, frontend 1.58: {reason}")
    tmp = tmp_path_factory.mktemp("nopack")
    shipped = ROOT / "example_workflows" / f"{DETAIL}.json"
    bare = copy.deepcopy(json.loads(shipped.read_text(encoding="utf-8")))
    for n in bare["nodes"]:
        for k in ("cnr_id", "ver"):
            n.get("properties", {}).pop(k, None)
    (tmp / "bare.json").write_text(json.dumps(bare))
    server = Server(tmp / "comfy", comfy_env.comfy_path(), with_pack=False, extra_args=extra).wait()
    try:
        p = subprocess.run(["node", str(BROWSER / "missing_pack.mjs"), server.url, str(ARTIFACTS / "missing-pack"),
                            f"shipped={shipped}", f"bare={tmp / 'bare.json'}"],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "CHROMIUM": CHROMIUM})
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        server.stop()


def test_frontend_158_names_wan_sage_as_the_missing_pack(missing_pack):
    shipped, bare = missing_pack["workflows"]["shipped"], missing_pack["workflows"]["bare"]
    assert re.search(r"Missing Node Packs", shipped["text"]), shipped["text"][:400]
    assert re.search(r"^wan-sage$", shipped["text"], re.M), shipped["text"][:600]
    # Without properties.cnr_id the frontend cannot name the pack offline (it would ask the registry).
    assert not re.search(r"^wan-sage$", bare["text"], re.M), bare["text"][:600]
