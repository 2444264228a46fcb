"""Host tier: the example workflows against the node definitions of a real ComfyUI 0.3.64.

ComfyUI boots on the CPU with its comfy_extras nodes, ComfyUI-GGUF (``$COMFYUI_GGUF_PATH``, default
``<COMFYUI_PATH>/../ComfyUI-GGUF``) and this pack. Each ``example_workflows/*.json`` is checked the
way the frontend would load it (``workflow_check.check_workflow``), converted to the API format
with the harness's converter (``bench.workflow_api.ui_to_api``) and passed through ComfyUI's own
``execution.validate_prompt`` with model-file names pointed at probe files that exist. A deliberately broken copy must be rejected with every problem named.
"""
import asyncio
import copy
import json
import os
import re
import tempfile
from pathlib import Path

import pytest

import comfy_env
import workflow_check
from bench import workflow_api as wa
from bench.make_workflows import A14B_480P, A14B_720P, A14B_FP8_480P, A14B_FP8_720P, I2V_21, TI2V_5B

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
WF_DIR = ROOT / "example_workflows"
EXPECTED = {A14B_720P: (1280, 720, 81), A14B_480P: (832, 480, 81), A14B_FP8_720P: (1280, 720, 81),
            A14B_FP8_480P: (832, 480, 81), TI2V_5B: (1280, 704, 121), I2V_21: (832, 480, 81)}
GGUF_TEMPLATES = (A14B_720P, A14B_480P)
WORKFLOWS = sorted(p.stem for p in WF_DIR.glob("*.json"))
SAMPLERS = ("KSampler", "KSamplerAdvanced")
LATENT_NODES = {"EmptyHunyuanLatentVideo": ("width", "height", "length"),
                "Wan22ImageToVideoLatent": ("width", "height", "length"),
                "WanImageToVideo": ("width", "height", "length")}
GGUF_URL = "https://github.com/city96/ComfyUI-GGUF"


@pytest.fixture(scope="module")
def host(comfy):
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(f"ComfyUI-GGUF: {reason}")
    comfy_env.init_extra_nodes()
    comfy_env.load_custom_node(workflow_check.gguf_path())
    comfy_env.load_custom_node(ROOT)
    with workflow_check.probe_file_lists(comfy.folder_paths) as probes:
        info = wa.object_info(comfy.nodes)
        yield type("Host", (), {"ns": comfy, "info": info, "files": workflow_check.file_combos(info, probes)})


def load(name: str) -> dict:
    return json.loads((WF_DIR / f"{name}.json").read_text(encoding="utf-8"))


def widgets(node: dict, info: dict) -> dict:
    return {s.name: v for (s, role), v in zip(wa.widget_layout(info[node["type"]]), node["widgets_values"])
            if role == "value"}


def upstream(wf: dict, node: dict, input_name: str) -> dict | None:
    by_id = {n["id"]: n for n in wf["nodes"]}
    links = {lk[0]: lk for lk in wf["links"]}
    inp = next((i for i in node["inputs"] if i["name"] == input_name), None)
    if inp is None or inp["link"] is None:
        return None
    return by_id[links[inp["link"]][1]]


# --------------------------------------------------------------------------- the files

def test_every_template_is_there_with_its_thumbnail():
    assert set(WORKFLOWS) == set(EXPECTED), f"missing: {sorted(set(EXPECTED) - set(WORKFLOWS))}, " \
        f"not tested: {sorted(set(WORKFLOWS) - set(EXPECTED))}"
    for name in WORKFLOWS:
        thumb = WF_DIR / f"{name}.jpg"
        assert thumb.is_file(), f"{thumb.name} is missing (python -m bench.make_workflows writes it)"
        assert thumb.read_bytes()[:3] == b"\xff\xd8\xff", f"{thumb.name} is not a JPEG"


def test_the_templates_are_what_the_generator_writes(host):
    """example_workflows/*.json as bench/make_workflows.py builds them from these node definitions
    (regenerate with ``python -m bench.make_workflows``)."""
    from bench import make_workflows
    ids = make_workflows.pack_ids(host.info, comfy_env.comfy_path(), workflow_check.gguf_path())
    built = make_workflows.build_all(host.info, ids)
    assert sorted(built) == WORKFLOWS
    stale = [name for name, wf in built.items()
             if make_workflows.dumps(wf) != (WF_DIR / f"{name}.json").read_text(encoding="utf-8")]
    assert stale == [], f"out of date, run python -m bench.make_workflows: {stale}"


def test_template_titles_are_human():
    """The Templates dialog shows a pack's template under its file name (and again as its
    description), so the names read as titles: words, no underscores, short enough for a card."""
    for name in WORKFLOWS:
        assert "_" not in name and name[0].isupper() and " " in name, name
        assert len(name) <= 31, f"{name!r} is {len(name)} characters; frontend 1.58 cuts a card title after about 31"
        assert not set(name) & set('<>:"/\\|?*'), f"{name!r} is not a portable file name"


def test_probes_find_the_model_file_combos(host):
    f = host.files
    assert ".gguf" in f[("UnetLoaderGGUF", "unet_name")].extensions
    assert ".gguf" not in f[("UNETLoader", "unet_name")].extensions
    for key in [("UNETLoader", "unet_name"), ("LoraLoaderModelOnly", "lora_name"), ("CLIPLoader", "clip_name"),
                ("VAELoader", "vae_name"), ("CLIPVisionLoader", "clip_name"), ("LoadImage", "image")]:
        assert key in f, key
    for key in [("KSampler", "sampler_name"), ("CLIPLoader", "type"), ("WanSageAttentionPatch", "kernel")]:
        assert key not in f, key


def test_file_combos_take_any_model_file_name_but_only_model_files(host):
    wf = load(I2V_21)
    vae, unet, image = _node(wf, "VAELoader"), _node(wf, "UNETLoader"), _node(wf, "LoadImage")
    for v in ("pixel_space", "wan/wan_2.1_vae.safetensors", "WAN_2.1_VAE.SFT"):
        vae["widgets_values"][0] = v
        assert workflow_check.check_workflow(wf, host.info, host.files) == [], v
    image["widgets_values"][0] = "pasted/image (3).png [input]"
    unet["widgets_values"][0] = "wan2.1_i2v_480p_14B_Q4_K_M.gguf"  # UNETLoader cannot load GGUF
    vae["widgets_values"][0] = "wan_2.1_vae"
    problems = workflow_check.check_workflow(wf, host.info, host.files)
    assert len(problems) == 2 and "UNETLoader" in problems[0] + problems[1], problems


@pytest.mark.parametrize("name", WORKFLOWS)
def test_workflow_matches_the_node_definitions(host, name):
    problems = workflow_check.check_workflow(load(name), host.info, host.files)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_workflow_passes_comfyui_validate_prompt(host, name):
    prompt = wa.ui_to_api(load(name), host.info)
    assert {n["class_type"] for n in prompt.values()} >= {"WanWorkingMemoryEstimator", "WanSageAttentionPatch"}
    ok, error, outputs, node_errors = workflow_check.validate_prompt(host.ns.execution, workflow_check.with_probe_files(prompt, host.files))
    assert ok, f"{error}\n{json.dumps(node_errors, indent=1, default=str)[:4000]}"
    assert outputs, "no output node validated"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_sampler_gets_its_model_through_estimator_then_sage_patch(host, name):
    wf = load(name)
    width, height, frames = EXPECTED[name]
    samplers = [n for n in wf["nodes"] if n["type"] in SAMPLERS]
    assert samplers
    if "A14B" in name:
        loader = "UnetLoaderGGUF" if name in GGUF_TEMPLATES else "UNETLoader"
        files = sorted(widgets(n, host.info)["unet_name"] for n in wf["nodes"] if n["type"] == loader)
        assert len(samplers) == 2 and len(files) == 2, (name, files)
        if loader == "UNETLoader":  # ComfyUI's repackaged fp8 experts
            assert files == ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                             "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"], files
    latents = [n for n in wf["nodes"] if n["type"] in LATENT_NODES]
    assert len(latents) == 1
    lw = widgets(latents[0], host.info)
    assert (lw["width"], lw["height"], lw["length"]) == (width, height, frames)
    for ks in samplers:
        sage = upstream(wf, ks, "model")
        assert sage["type"] == "WanSageAttentionPatch", f"sampler {ks['id']} model comes from {sage['type']}"
        est = upstream(wf, sage, "model")
        assert est["type"] == "WanWorkingMemoryEstimator"
        assert upstream(wf, est, "latent") is latents[0], "the estimator's latent input is not the video latent"
        ew, kw = widgets(est, host.info), widgets(ks, host.info)
        assert (ew["width"], ew["height"], ew["frames"]) == (width, height, frames)
        assert ew["cfg"] == kw["cfg"], "estimator cfg differs from the sampler's"
    if "A14B" in name:
        hi, lo = sorted(samplers, key=lambda n: widgets(n, host.info)["start_at_step"])
        h, low = widgets(hi, host.info), widgets(lo, host.info)
        assert (h["add_noise"], h["return_with_leftover_noise"], h["start_at_step"], h["end_at_step"]) == \
            ("enable", "enable", 0, 2)
        assert (low["add_noise"], low["start_at_step"], low["end_at_step"], low["steps"]) == ("disable", 2, 4, 4)
        assert upstream(wf, lo, "latent_image") is hi
        assert upstream(wf, hi, "latent_image") is latents[0]
        names = {widgets(upstream(wf, upstream(wf, upstream(wf, upstream(wf, s, "model"), "model"), "model"),
                                  "model"), host.info)["lora_name"] for s in samplers}
        assert len(names) == 2 and all("4steps" in n for n in names)


def test_every_node_names_its_pack_and_version(host):
    """properties.cnr_id / ver as the current frontend saves them: "wan-sage" with the version in
    pyproject.toml on this pack's nodes, "comfy-core" with ComfyUI's version on ComfyUI's; a
    frontend opening the workflow without the pack installed names it as the missing pack."""
    import tomllib

    import comfyui_version  # ComfyUI's own, importable once comfy_env has booted it
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    comfy = comfyui_version.__version__
    ours = set(json.loads((ROOT / "node_list.json").read_text(encoding="utf-8")))
    for name in WORKFLOWS:
        for n in load(name)["nodes"]:
            if n["type"] in wa.FRONTEND_ONLY:
                continue
            props = n["properties"]
            if n["type"] in ours:
                assert (props.get("cnr_id"), props.get("ver")) == ("wan-sage", version), (name, n["id"], props)
            elif not str(host.info[n["type"]].get("python_module", "nodes")).startswith("custom_nodes."):
                assert (props.get("cnr_id"), props.get("ver")) == ("comfy-core", comfy), (name, n["id"], props)
            else:
                assert props.get("cnr_id") == "comfyui-gguf" and props.get("ver"), (name, n["id"], props)


def test_node_list_names_the_nodes_comfyui_loads_from_the_pack(host):
    """node_list.json (for ComfyUI-Manager's missing-node lookup) against the live registry."""
    ours = {t for t, i in host.info.items()
            if i.get("category", "").startswith("model_patches/wan-sage")}
    assert set(json.loads((ROOT / "node_list.json").read_text(encoding="utf-8"))) == ours


def test_every_input_and_output_of_the_pack_has_a_tooltip(host):
    """What the frontend shows on hover, from GET /object_info: no input or output without one."""
    ours = json.loads((ROOT / "node_list.json").read_text(encoding="utf-8"))
    for node_type in ours:
        info = host.info[node_type]
        for group in ("required", "optional"):
            for name, spec in info["input"].get(group, {}).items():
                extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                assert extra.get("tooltip"), f"{node_type} input {name} has no tooltip"
        tips = info.get("output_tooltips") or []
        assert len(tips) == len(info["output"]) and all(tips), f"{node_type} outputs: {tips}"


def test_templates_are_served_like_comfyui_serves_them(host):
    """``GET /workflow_templates`` lists the pack's workflows and ``/api/workflow_templates/<pack>/`` serves them."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer
    from app.custom_node_manager import CustomNodeManager
    fp = host.ns.folder_paths
    with tempfile.TemporaryDirectory() as d:
        os.symlink(ROOT, os.path.join(d, "wan-sage"))
        saved = fp.folder_names_and_paths["custom_nodes"]
        fp.folder_names_and_paths["custom_nodes"] = ([d], saved[1])
        try:
            async def go():
                routes = web.RouteTableDef()
                app = web.Application()
                CustomNodeManager().add_routes(routes, app, [("wan-sage", os.path.join(d, "wan-sage"))])
                app.add_routes(routes)
                async with TestClient(TestServer(app)) as client:
                    listing = await (await client.get("/workflow_templates")).json()
                    r = await client.get(f"/api/workflow_templates/wan-sage/{WORKFLOWS[0]}.json")
                    return listing, r.status, await r.read()
            listing, status, body = asyncio.run(go())
        finally:
            fp.folder_names_and_paths["custom_nodes"] = saved
    assert sorted(listing.get("wan-sage", [])) == WORKFLOWS
    assert status == 200 and json.loads(body) == load(WORKFLOWS[0])


def _note(wf: dict) -> str:
    (note,) = [n for n in wf["nodes"] if n["type"] in wa.NOTE_TYPES]
    return note["widgets_values"][0]


def _files_section(text: str) -> dict:
    """{models folder: the bullet's text} of a note's "**Files** (ComfyUI/models/…)" list."""
    section = text.split("**Files**", 1)[1].split("\n\n", 1)[0]
    bullets = [b.replace("\n", " ") for b in section.split("\n- ")[1:]]
    return {b.split(":", 1)[0].strip(): b for b in bullets}


@pytest.mark.parametrize("name", WORKFLOWS)
def test_the_description_says_what_it_does_needs_and_gives(host, name):
    """The note (a template's description): what the workflow does, every file it loads under the
    models folder it goes in, the packs it needs, one speed-up line and one memory line."""
    wf = load(name)
    text = _note(wf)
    heading = text.splitlines()[0]
    assert heading.startswith("# ") and len(text.split("\n\n")[1]) > 80, "a heading, then what the workflow does"
    assert len(re.findall(r"^- \*\*Speed-up:\*\* ", text, re.M)) == 1, "one speed-up line"
    assert len(re.findall(r"^- \*\*Memory:\*\* ", text, re.M)) == 1, "one memory line"
    assert not re.search(r"\b(sessions?|issues?) #?\d|\b20\d\d-\d\d", text, re.I), "no history in a description"
    files = _files_section(text)
    folder_of = {"unet_gguf": "diffusion_models"}  # ComfyUI-GGUF lists models/diffusion_models (and unet)
    for n in wf["nodes"]:
        for (spec, role), value in zip(wa.widget_layout(host.info.get(n["type"], {})), n.get("widgets_values") or []):
            combo = host.files.get((n["type"], spec.name))
            if role != "value" or combo is None or "input" in combo.folders:
                continue
            folders = {folder_of.get(f, f) for f in combo.folders}
            hits = [f for f in folders if f in files and f"`{value}`" in files[f]]
            assert hits, f"{name}: {value} ({n['type']}) is not listed under models/{sorted(folders)} in {files}"
    uses_gguf = any(n["type"] == "UnetLoaderGGUF" for n in wf["nodes"])
    assert uses_gguf == (name in GGUF_TEMPLATES)
    if uses_gguf:
        assert "needs ComfyUI-GGUF" in heading, heading
        assert "**Needs the [ComfyUI-GGUF]" in text and GGUF_URL in text and "ComfyUI-Manager" in text, text
    else:
        assert "ComfyUI's own loaders" in heading and "wan-sage only" in text, heading
        assert {(n.get("properties") or {}).get("cnr_id") for n in wf["nodes"]} <= {"comfy-core", "wan-sage", None}


def _old_save(node: dict, info: dict) -> dict:
    """*node* as a frontend saved it before the estimator's widgets were renamed and the Sage node's
    memory_mode took labels: widget inputs named margin_gb / fixed_gb, the mode id "sdpa", the policy
    "fixed GB per row"."""
    old = copy.deepcopy(node)
    renamed = {"margin_gib": "margin_gb", "fixed_gib": "fixed_gb"}
    for inp in old["inputs"]:
        if inp["name"] in renamed:
            inp["name"] = inp["localized_name"] = inp["widget"]["name"] = renamed[inp["name"]]
    layout = [s.name for s, role in wa.widget_layout(info[old["type"]])]
    values = dict(zip(layout, old["widgets_values"]))
    if old["type"] == "WanSageAttentionPatch":
        values["memory_mode"] = "sdpa"
    else:
        values.update(policy="fixed GB per row", margin_gib=0.5, fixed_gib=9.5)
    old["widgets_values"] = [values[k] for k in layout]
    return old


@pytest.mark.parametrize("name", [A14B_720P, TI2V_5B])
def test_a_workflow_saved_with_the_old_widget_names_still_runs(host, name):
    """widgets_values are positional, so a workflow saved with the old names converts to a prompt
    whose values sit under the new names, and ComfyUI's validation accepts it."""
    wf = load(name)
    wf["nodes"] = [_old_save(n, host.info) if n["type"] in ("WanWorkingMemoryEstimator", "WanSageAttentionPatch")
                   else n for n in wf["nodes"]]
    assert "margin_gb" in json.dumps(wf) and '"sdpa"' in json.dumps(wf)
    prompt = wa.ui_to_api(wf, host.info)
    est = [n["inputs"] for n in prompt.values() if n["class_type"] == "WanWorkingMemoryEstimator"]
    sage = [n["inputs"] for n in prompt.values() if n["class_type"] == "WanSageAttentionPatch"]
    assert est and all((e["margin_gib"], e["fixed_gib"], e["policy"]) == (0.5, 9.5, "fixed GB per row") for e in est)
    assert all("margin_gb" not in e and "fixed_gb" not in e for e in est)
    assert sage and all(s["memory_mode"] == "sdpa" for s in sage)
    ok, error, outputs, node_errors = workflow_check.validate_prompt(
        host.ns.execution, workflow_check.with_probe_files(prompt, host.files))
    assert ok, f"{error}\n{json.dumps(node_errors, indent=1, default=str)[:4000]}"
    assert outputs


# --------------------------------------------------------------------------- the validator catches breakage

def _node(wf, node_type, nth=0):
    return [n for n in wf["nodes"] if n["type"] == node_type][nth]


def _relink(wf, link_id, origin_node, origin_slot):
    """Move link *link_id*'s origin to (origin_node, origin_slot), keeping every side consistent."""
    lk = next(lk for lk in wf["links"] if lk[0] == link_id)
    old = next(n for n in wf["nodes"] if n["id"] == lk[1])
    old["outputs"][lk[2]]["links"].remove(link_id)
    origin_node["outputs"][origin_slot]["links"].append(link_id)
    lk[1], lk[2], lk[5] = origin_node["id"], origin_slot, origin_node["outputs"][origin_slot]["type"]


def test_validator_reports_each_problem_of_a_broken_workflow(host):
    good = load(A14B_720P)
    assert workflow_check.check_workflow(good, host.info, host.files) == []
    wf = copy.deepcopy(good)

    # 1. a link whose recorded type is wrong (VAE -> VAEDecode labelled MODEL)
    decode = _node(wf, "VAEDecode")
    vae_link = next(i["link"] for i in decode["inputs"] if i["name"] == "vae")
    next(lk for lk in wf["links"] if lk[0] == vae_link)[5] = "MODEL"
    # 2. a real type mismatch: the CLIP output wired into the low-noise sampler's model input
    ks_low = _node(wf, "KSamplerAdvanced", 1)
    model_link = next(i["link"] for i in ks_low["inputs"] if i["name"] == "model")
    _relink(wf, model_link, _node(wf, "CLIPLoader"), 0)
    # 3. a bad combo value
    ks_high = _node(wf, "KSamplerAdvanced", 0)
    ks_high["widgets_values"][5] = "euler_typo"
    # 4. the wrong widget count (control_after_generate value dropped)
    ks_low["widgets_values"].pop(2)
    # 5. an INT outside its range, and one off the frontend's step grid
    _node(wf, "EmptyHunyuanLatentVideo")["widgets_values"][2] = 0
    est = _node(wf, "WanWorkingMemoryEstimator")
    est["widgets_values"][0] = 1288
    # 6. a model file name that is not a model file, and a GGUF name in a non-GGUF loader's slot
    _node(wf, "VAELoader")["widgets_values"][0] = "wan_2.1_vae.txt"
    _node(wf, "UnetLoaderGGUF")["widgets_values"][0] = "wan2.2_t2v_high_noise_14B.safetensors"
    # 7. an unknown node type, a bad control value and a boolean given as a string
    wf["nodes"].append({**copy.deepcopy(_node(wf, "VAEDecode")), "id": 99, "type": "NoSuchNode",
                        "inputs": [], "outputs": []})
    wf["last_node_id"] = 99
    ks_high["widgets_values"][2] = "sometimes"
    _node(wf, "WanSageAttentionPatch")["widgets_values"][2] = "true"
    # 8. link bookkeeping: an output that lists a link that does not exist, an input pointing elsewhere
    _node(wf, "CreateVideo")["outputs"][0]["links"].append(999)
    save = _node(wf, "SaveVideo")
    save_in = save["inputs"][0]["link"]
    save["inputs"][0]["link"] = vae_link
    # 9. a node without its pack id, and a core node claiming a custom pack
    del _node(wf, "VAEDecode")["properties"]["cnr_id"]
    _node(wf, "CLIPLoader")["properties"]["cnr_id"] = "wan-sage"
    # 10. a required socket left unconnected
    est2 = _node(wf, "WanWorkingMemoryEstimator", 1)
    gone = next(i for i in est2["inputs"] if i["name"] == "model")["link"]
    next(i for i in est2["inputs"] if i["name"] == "model")["link"] = None
    wf["links"] = [lk for lk in wf["links"] if lk[0] != gone]
    for n in wf["nodes"]:
        for o in n.get("outputs") or []:
            if gone in (o.get("links") or []):
                o["links"].remove(gone)

    problems = workflow_check.check_workflow(wf, host.info, host.files)
    text = "\n".join(problems)

    def has(*parts):
        return any(all(p in line for p in parts) for line in problems)

    ks_low_id, ks_high_id = ks_low["id"], ks_high["id"]
    assert has(f"link {vae_link}:", "'MODEL' differs from the type 'VAE'"), text
    assert has(f"link {model_link}:", "is 'CLIP'", "'model' takes 'MODEL'"), text
    assert has(f"node {ks_high_id} (KSamplerAdvanced)", "sampler_name", "'euler_typo' not in"), text
    assert has(f"node {ks_low_id} (KSamplerAdvanced)", "9 widgets_values", "expects 10"), text
    assert has("EmptyHunyuanLatentVideo", "widget length", "0 < min 1"), text
    assert has(f"node {est['id']} (WanWorkingMemoryEstimator)", "widget width", "grid (step 16"), text
    assert has("VAELoader", "vae_name", "'wan_2.1_vae.txt' is not a file name"), text
    assert has("UnetLoaderGGUF", "unet_name", "['.gguf']"), text
    assert has("node 99 (NoSuchNode)", "unknown node type"), text
    assert has(f"node {ks_high_id}", "noise_seed (control)", "'sometimes'"), text
    assert has("WanSageAttentionPatch", "widget calibrate", "not a boolean"), text
    assert has("CreateVideo", "link 999 is not in 'links'"), text
    assert has(f"link {save_in}:", "SaveVideo", f"has link {vae_link}, not {save_in}"), text
    assert has(f"node {est2['id']} (WanWorkingMemoryEstimator)", "required input 'model'", "not connected"), text
    assert has("(VAEDecode)", "properties['cnr_id'] missing"), text
    assert has("(CLIPLoader)", "'wan-sage'", "'comfy-core'"), text


def test_comfyui_validate_prompt_rejects_what_the_validator_rejects(host):
    """The API conversion is faithful: a bad combo / a bad link reaches ComfyUI's own validation."""
    wf = load(I2V_21)
    _node(wf, "KSampler")["widgets_values"][4] = "euler_typo"
    prompt = workflow_check.with_probe_files(wa.ui_to_api(wf, host.info), host.files)
    ok, error, _outputs, node_errors = workflow_check.validate_prompt(host.ns.execution, prompt)
    assert not ok
    ks_id = str(_node(wf, "KSampler")["id"])
    assert any(e["type"] == "value_not_in_list" for e in node_errors[ks_id]["errors"]), node_errors

    wf = load(I2V_21)
    ks = _node(wf, "KSampler")
    _relink(wf, next(i["link"] for i in ks["inputs"] if i["name"] == "model"), _node(wf, "VAELoader"), 0)
    prompt = workflow_check.with_probe_files(wa.ui_to_api(wf, host.info), host.files)
    ok, _error, _outputs, node_errors = workflow_check.validate_prompt(host.ns.execution, prompt)
    assert not ok
    assert any(e["type"] == "return_type_mismatch" for e in node_errors[str(ks["id"])]["errors"]), node_errors


def test_api_conversion_follows_reroutes_and_skips_notes(host):
    wf = load(TI2V_5B)
    decode = _node(wf, "VAEDecode")
    vae = _node(wf, "VAELoader")
    lid = next(i["link"] for i in decode["inputs"] if i["name"] == "vae")
    rr = {"id": 50, "type": "Reroute", "pos": [0, 0], "size": [75, 26], "flags": {}, "order": 0, "mode": 0,
          "inputs": [{"name": "", "type": "*", "link": 60}],
          "outputs": [{"name": "", "type": "VAE", "links": [], "slot_index": 0}], "properties": {}}
    _relink(wf, lid, rr, 0)
    vae["outputs"][0]["links"].append(60)
    wf["nodes"].append(rr)
    wf["links"].append([60, vae["id"], 0, 50, 0, "VAE"])
    wf["last_node_id"], wf["last_link_id"] = 60, 60
    assert workflow_check.check_workflow(wf, host.info, host.files) == []
    prompt = wa.ui_to_api(wf, host.info)
    assert prompt[str(decode["id"])]["inputs"]["vae"] == [str(vae["id"]), 0]
    assert not any(n["class_type"] in wa.FRONTEND_ONLY for n in prompt.values())
