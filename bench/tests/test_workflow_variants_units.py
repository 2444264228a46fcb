"""Unit tier: the variants of a saved workflow the whole-prompt benchmark runs (no ComfyUI): the pack's nodes
bypassed (``comfy``), Wan Compile Blocks added after the Sage patch (``compilenode``), the repeat prompt's seed,
the workflow's run specs and the command line's checks, on the graph of the pack's saved 5B template.

ComfyUI's node definitions are needed to convert a UI workflow's widget values (``bench.workflow_api``), so the
prompt here is the template's graph read from its links, with the sampler's seed and steps: what the variants
change.  The host tier (``test_template_whole_prompt_host.py``) runs the real conversion."""
import json
from pathlib import Path

import pytest

from bench import e2e, whole_prompt
from bench import workflow_variants as WV

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "example_workflows" / "Wan 2.2 5B text to video 704p.json"
pytestmark = pytest.mark.skipif(not TEMPLATE.is_file(), reason=f"{TEMPLATE.name} is not in this checkout")


def graph_of(wf: dict) -> dict:
    """An API-shaped prompt of a UI workflow from its links alone (every linked input), plus the KSampler's
    seed and steps from its widgets."""
    links = {ln[0]: (str(ln[1]), ln[2]) for ln in wf["links"]}
    prompt = {}
    for n in wf["nodes"]:
        if n["type"] in ("MarkdownNote", "Note"):
            continue
        inputs = {i["name"]: list(links[i["link"]]) for i in n.get("inputs") or [] if i.get("link") is not None}
        if n["type"] == "KSampler":
            inputs.update(seed=n["widgets_values"][0], steps=n["widgets_values"][2], cfg=n["widgets_values"][3])
        prompt[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return prompt


@pytest.fixture()
def template():
    return graph_of(json.loads(TEMPLATE.read_text()))


def _by_type(prompt, t):
    return [k for k, n in prompt.items() if n["class_type"] == t]


def test_the_template_has_the_packs_three_nodes_in_its_model_and_clip_paths(template):
    assert WV.pack_nodes(template) == ["WanSageAttentionPatch", "WanTextEncoderHostCopy", "WanWorkingMemoryEstimator"]
    assert WV.variant_prompt(template, "template") == template


def test_comfy_bypasses_each_pack_node_and_wires_its_consumers_to_its_input(template):
    stock = WV.variant_prompt(template, "comfy")
    assert WV.pack_nodes(stock) == [] and template != stock and WV.pack_nodes(template)   # the input is untouched
    (ks,) = _by_type(stock, "KSampler")
    (msd3,) = _by_type(stock, "ModelSamplingSD3")
    (clip,) = _by_type(stock, "CLIPLoader")
    assert stock[ks]["inputs"]["model"] == [msd3, 0]            # loader -> shift -> sampler, as stock ComfyUI
    assert all(stock[k]["inputs"]["clip"] == [clip, 0] for k in _by_type(stock, "CLIPTextEncode"))
    assert set(stock) == set(template) - {k for k, n in template.items() if n["class_type"] in WV.PACK_PASS_THROUGH}
    # every link of the stock prompt points at a node that is still there
    assert all(v[0] in stock for n in stock.values() for v in n["inputs"].values() if isinstance(v, list))


def test_a_pack_node_whose_status_is_read_cannot_be_bypassed(template):
    (patch,) = _by_type(template, "WanSageAttentionPatch")
    template["99"] = {"class_type": "PreviewAny", "inputs": {"source": [patch, 1]}}
    with pytest.raises(ValueError, match="read an output other than its model/clip"):
        WV.bypass_pack_nodes(template)


def test_compilenode_puts_wan_compile_blocks_between_the_sage_patch_and_the_sampler(template):
    c = WV.variant_prompt(template, "compilenode", backend="eager")
    (node,) = _by_type(c, "WanCompileBlocks")
    (patch,) = _by_type(c, "WanSageAttentionPatch")
    (ks,) = _by_type(c, "KSampler")
    assert node == WV.next_id(template) and node not in template
    assert c[node]["inputs"] == {"model": [patch, 0], "backend": "eager", "mode": "default"}
    assert c[ks]["inputs"]["model"] == [node, 0]
    assert WV.consumers(c, patch, 0) == [(node, "model")]          # the patch feeds the compile node only
    assert WV.pack_nodes(c) == sorted(WV.pack_nodes(template) + ["WanCompileBlocks"])
    with pytest.raises(ValueError, match="no WanSageAttentionPatch"):
        WV.insert_compile_blocks(WV.bypass_pack_nodes(template), "inductor")


def test_the_repeat_prompt_changes_the_seed_only(template):
    (ks,) = _by_type(template, "KSampler")
    repeat = WV.with_seed(template, 43)
    assert repeat[ks]["inputs"]["seed"] == 43 and template[ks]["inputs"]["seed"] == 42
    repeat[ks]["inputs"]["seed"] = 42
    assert repeat == template


def test_size_and_steps_replace_the_saved_ones(template):
    (latent,) = _by_type(template, "Wan22ImageToVideoLatent")
    (est,) = _by_type(template, "WanWorkingMemoryEstimator")
    (ks,) = _by_type(template, "KSampler")
    p = WV.spec_prompt(template, WV.WorkflowSpec.parse("comfy@full:64x64x5:2steps", str(TEMPLATE)))
    assert p[latent]["inputs"] == {**template[latent]["inputs"], "width": 64, "height": 64, "length": 5}
    assert p[ks]["inputs"]["steps"] == 2 and est not in p
    assert WV.prompt_settings(p)["steps"] == 2 and WV.prompt_settings(p)["width"] == 64
    adv = {"1": {"class_type": "KSamplerAdvanced", "inputs": {"steps": 20}}}
    with pytest.raises(ValueError, match="KSampler steps only"):
        WV.with_steps(adv, 4)


def test_a_workflow_spec_parses_back_from_its_label_and_names_the_workflow():
    s = WV.WorkflowSpec.parse("compilenode@24:64x64x5:2steps", str(TEMPLATE))
    assert (s.variant, s.budget_gib, s.res, s.steps, s.workflow) == ("compilenode", 24.0, (64, 64, 5), 2, TEMPLATE.name)
    assert WV.WorkflowSpec.parse(s.label, str(TEMPLATE)) == s
    assert s.name == "Wan 2.2 5B text to video 704p/compilenode@24:64x64x5:2steps"
    assert WV.WorkflowSpec.parse("template@full", "x.json").label == "template@full"


@pytest.mark.parametrize("bad", ["sage@24", "template", "template@24:64x64", "template@24:2steps:3steps",
                                 "comfy@24:0steps", "est+sage@24:720p81"])
def test_bad_workflow_specs_are_refused_with_the_form_and_the_variants(bad):
    with pytest.raises(SystemExit, match=r"\{template\|comfy\|compilenode\}@\{GB\|full\}"):
        WV.WorkflowSpec.parse(bad, str(TEMPLATE))


def test_the_template_loads_the_ti2v_5b_set():
    assert WV.model_set(json.loads(TEMPLATE.read_text())) == "ti2v-5b"
    assert WV.model_set({"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_t2v_high_noise_14B.safetensors"}}}) == "a14b"
    a = e2e.parse_args(["--models-dir", "m", "--workflow", str(TEMPLATE)])
    assert e2e.files_weights(a) == "fp16" and e2e.workflow_model_set(a) == "ti2v-5b"


def test_the_5b_loaders_are_pointed_at_the_generated_files():
    from bench import e2e_models as EM
    names = EM.file_names("tiny", "gguf", "bf16", 64, "ti2v-5b")
    prompt = {"2": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_ti2v_5B_fp16.safetensors"}},
              "3": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}},
              "5": {"class_type": "VAELoader", "inputs": {"vae_name": "wan2.2_vae.safetensors"}}}
    got = e2e.substitute_models(prompt, names, "gguf")
    assert got == {"2": ["wan2.2_ti2v_5B_fp16.safetensors", names["unet_5b"]],
                   "3": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", names["te"]],
                   "5": ["wan2.2_vae.safetensors", names["vae_22"]]}
    with pytest.raises(ValueError, match="unknown model set"):
        EM.file_names("tiny", "gguf", "bf16", 64, "wan2.1")


def test_the_whole_prompt_command_line_takes_a_workflow_and_its_variant(capsys):
    base = ["--models-dir", "m", "--whole-prompt", "--caches", "none", "--workflow", str(TEMPLATE)]
    a = e2e.parse_args(base + ["--runs", "compilenode@24"])
    assert isinstance(a.spec, WV.WorkflowSpec) and a.spec.variant == "compilenode"
    assert e2e.run_label(a.spec, a) == "Wan 2.2 5B text to video 704p/compilenode@24"
    with pytest.raises(SystemExit, match="expected .*variants: template, comfy, compilenode"):
        e2e.parse_args(base + ["--runs", "fastest@24"])
    with pytest.raises(SystemExit, match="--workflow: file .*nope.json not found.*example_workflows/"):
        e2e.parse_args(["--models-dir", "m", "--whole-prompt", "--caches", "none", "--workflow", "nope.json",
                        "--runs", "template@24"])


def test_the_driver_runs_each_variant_as_a_configuration_of_its_own(tmp_path):
    a = whole_prompt.parse_args(["--runs", "template@24,comfy@24,compilenode@24", "--caches", "pack", str(tmp_path),
                                 "--processes", "2", "--models-dir", "m", "--workflow", str(TEMPLATE)])
    assert [s.variant for s in a.specs] == ["template", "comfy", "compilenode"] and a.weights == "fp16"
    cmd = whole_prompt.process_command(a, a.specs[2], 1)
    assert cmd[cmd.index("--workflow") + 1] == str(TEMPLATE) and cmd[cmd.index("--runs") + 1] == "compilenode@24"
    i = cmd.index("--caches")
    assert cmd[i + 1:i + 3] == ["pack", str(tmp_path.resolve() / "fp16-Wan-2.2-5B-text-to-video-704p-compilenode-24")]
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"schema": e2e.WHOLE_SCHEMA, "run": a.specs[2].name, "status": "ok", "prompts": [{}],
                             "config": {"weights": "fp16"}, "caches": {"mode": "pack"},
                             "process": {"index": 2, "count": 2}}) + "\n")
    assert whole_prompt.done(str(f), a.specs[2], a.weights, "pack", 2)
    assert not whole_prompt.done(str(f), a.specs[0], a.weights, "pack", 2)
    with pytest.raises(SystemExit):
        whole_prompt.parse_args(["--runs", "template@24", "--caches", "pack", str(tmp_path), "--bench-first",
                                 "--models-dir", "m", "--workflow", str(TEMPLATE)])


def test_a_prompt_runs_timings_come_from_the_executors_node_messages():
    spans = e2e.node_spans([(1.0, "7"), (3.0, "12"), (9.0, "13"), (9.5, None)], 12.0)
    assert spans == {"7": (1.0, 3.0), "12": (3.0, 9.0), "13": (9.0, 9.5)}
    prompt = {"12": {"class_type": "KSampler", "inputs": {}}, "13": {"class_type": "VAEDecode", "inputs": {}}}
    assert e2e.prompt_timings(prompt, spans, 0.5) == {"to_latent_s": 8.5, "to_frames_s": 9.0,
                                                      "node_s": {"7": 2.0, "12": 6.0, "13": 0.5}}
    assert e2e.prompt_timings(prompt, {}, 0.5) == {"to_latent_s": None, "to_frames_s": None, "node_s": {}}
    assert e2e.steps_by_node([(4.0, "12"), (4.5, "12")], {"12": 3.0}, 0.0) == {"12": [1.0, 0.5]}


# --------------------------------------------------------------------------- the Wan 2.1 I2V 14B template

I2V = ROOT / "example_workflows" / "Wan 2.1 image to video 480p.json"


@pytest.fixture()
def i2v():
    if not I2V.is_file():
        pytest.skip(f"{I2V.name} is not in this checkout")
    return graph_of(json.loads(I2V.read_text()))


def test_comfy_bypasses_the_i2v_templates_pack_nodes_and_keeps_its_image_path(i2v):
    assert WV.pack_nodes(i2v) == ["WanSageAttentionPatch", "WanTextEncoderHostCopy", "WanWorkingMemoryEstimator"]
    stock = WV.variant_prompt(i2v, "comfy")
    assert WV.pack_nodes(stock) == []
    (ks,) = _by_type(stock, "KSampler")
    (msd3,) = _by_type(stock, "ModelSamplingSD3")
    (clip,) = _by_type(stock, "CLIPLoader")
    (i2v_node,) = _by_type(stock, "WanImageToVideo")
    (vision,) = _by_type(stock, "CLIPVisionEncode")
    (image,) = _by_type(stock, "LoadImage")
    assert stock[ks]["inputs"]["model"] == [msd3, 0]
    assert all(stock[k]["inputs"]["clip"] == [clip, 0] for k in _by_type(stock, "CLIPTextEncode"))
    # the image path is not the pack's: the start image to CLIP vision and to WanImageToVideo, whose
    # conditioning and latent the sampler reads
    assert stock[i2v_node] == i2v[i2v_node] and stock[vision] == i2v[vision]
    assert stock[i2v_node]["inputs"]["start_image"] == [image, 0] and stock[vision]["inputs"]["image"] == [image, 0]
    assert stock[i2v_node]["inputs"]["clip_vision_output"] == [vision, 0]
    assert [stock[ks]["inputs"][x] for x in ("positive", "negative", "latent_image")] == [
        [i2v_node, 0], [i2v_node, 1], [i2v_node, 2]]
    assert all(v[0] in stock for n in stock.values() for v in n["inputs"].values() if isinstance(v, list))


def test_compilenode_goes_between_the_i2v_templates_sage_patch_and_its_sampler(i2v):
    c = WV.variant_prompt(i2v, "compilenode", backend="eager")
    (node,) = _by_type(c, "WanCompileBlocks")
    (patch,) = _by_type(c, "WanSageAttentionPatch")
    (ks,) = _by_type(c, "KSampler")
    assert c[node]["inputs"]["model"] == [patch, 0] and c[ks]["inputs"]["model"] == [node, 0]
    assert WV.consumers(c, patch, 0) == [(node, "model")]


def test_the_i2v_templates_size_and_steps_go_to_wan_image_to_video_and_the_sampler(i2v):
    (latent,) = _by_type(i2v, "WanImageToVideo")
    (est,) = _by_type(i2v, "WanWorkingMemoryEstimator")
    (ks,) = _by_type(i2v, "KSampler")
    p = WV.spec_prompt(i2v, WV.WorkflowSpec.parse("template@full:64x64x5:2steps", str(I2V)))
    assert p[latent]["inputs"] == {**i2v[latent]["inputs"], "width": 64, "height": 64, "length": 5}
    assert p[est]["inputs"] == {**i2v[est]["inputs"], "width": 64, "height": 64, "frames": 5}
    assert p[ks]["inputs"]["steps"] == 2 and WV.with_seed(p, 7)[ks]["inputs"]["seed"] == 7
    # the record's size is WanImageToVideo's, not the estimator's, whichever comes first
    p[est]["inputs"].update(width=999, height=999, frames=999)
    first_est = {est: p[est], **{k: n for k, n in p.items() if k != est}}
    for prompt in (p, first_est):
        s = WV.prompt_settings(prompt)
        assert (s["width"], s["height"], s["frames"], s["steps"], s["cfg"]) == (64, 64, 5, 2, 6.0)


def test_the_i2v_template_loads_the_i2v_14b_set_by_its_clip_vision_loader():
    wf = json.loads(I2V.read_text()) if I2V.is_file() else None
    if wf is not None:
        assert WV.model_set(wf) == "i2v-14b"
        a = e2e.parse_args(["--models-dir", "m", "--workflow", str(I2V)])   # --weights gguf by default
        assert e2e.workflow_model_set(a) == "i2v-14b" and e2e.files_weights(a) == "fp8"
    api = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.1_i2v_720p_14B_bf16.safetensors"}},
           "2": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": "clip_vision_h.safetensors"}}}
    assert WV.model_set(api) == "i2v-14b"
    # Wan 2.2's I2V experts read no CLIP vision: an "i2v" file name alone does not make the Wan 2.1 I2V set
    del api["2"]
    api["1"]["inputs"]["unet_name"] = "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors"
    assert WV.model_set(api) == "a14b"


def test_the_one_model_sets_weights_agree_with_the_files_written():
    from bench import e2e_models as EM
    assert set(WV.MODEL_SETS) == set(EM.MODEL_SETS)
    for model_set in WV.MODEL_SETS:
        names = EM.file_names("tiny", "gguf", "bf16", 64, model_set)
        unets = [r for r in names if r.startswith("unet")]
        want = WV.MODEL_SET_WEIGHTS.get(model_set, "gguf")
        assert {EM.file_weights(r, "gguf") for r in unets} == {want}, model_set
        assert all(EM.role_dir(r) for r in names)
    assert EM.role_dir("clipvision") == "clip_vision"


def test_the_i2v_loaders_are_pointed_at_the_generated_files():
    from bench import e2e_models as EM
    names = EM.file_names("full", "gguf", "bf16", 64, "i2v-14b")
    prompt = {"2": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.1_i2v_480p_14B_fp8_e4m3fn.safetensors"}},
              "3": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}},
              "5": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": "clip_vision_h.safetensors"}},
              "6": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}},
              "7": {"class_type": "LoadImage", "inputs": {"image": "example.png", "upload": "image"}}}
    got = e2e.substitute_models(prompt, names, "gguf")    # the I2V stand-in is fp8 whatever --weights says
    assert got == {"2": ["wan2.1_i2v_480p_14B_fp8_e4m3fn.safetensors", names["unet_i2v"]],
                   "3": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", names["te"]],
                   "5": ["clip_vision_h.safetensors", names["clipvision"]],
                   "6": ["wan_2.1_vae.safetensors", names["vae"]]}
    assert names["unet_i2v"] == "random-wan2.1-i2v-14b-480p-fp8_e4m3fn.safetensors"
    assert names["vae"] == EM.file_names("full", "gguf", "bf16", 64)["vae"]          # the A14B set's Wan 2.1 VAE
    gguf = {"2": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": "wan2.1-i2v-14b-480p-Q4_K_M.gguf"}}}
    with pytest.raises(ValueError, match="node 2 is UnetLoaderGGUF: the unet_i2v stand-in is a safetensors file"):
        e2e.substitute_models(gguf, names, "gguf")
    vision = {"5": {"class_type": "CLIPVisionLoader", "inputs": {"clip_name": "clip_vision_h.safetensors"}}}
    with pytest.raises(ValueError, match=r"node 5 \(CLIPVisionLoader\) loads a file the generated set"):
        e2e.substitute_models(vision, EM.file_names("full", "gguf", "bf16", 64), "gguf")


def test_the_start_image_is_named_by_each_load_image_node_and_made_the_same_each_time():
    prompt = {"7": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
              "9": {"class_type": "WanImageToVideo", "inputs": {"width": 64, "height": 48, "length": 5}}}
    assert WV.start_images(prompt) == {"7": "example.png"}
    assert WV.start_images({"1": {"class_type": "KSampler", "inputs": {}}}) == {}
    for bad in ("../example.png", "sub/example.png", "example.png [input]", ""):
        prompt["7"]["inputs"]["image"] = bad
        with pytest.raises(ValueError, match="node 7 .LoadImage.: image .* is not a plain file name"):
            WV.start_images(prompt)
    a, b = e2e.start_image_pixels(64, 48), e2e.start_image_pixels(64, 48)
    assert a.shape == (48, 64, 3) and str(a.dtype) == "uint8" and (a == b).all()
    assert a.min() == 0 and a.max() == 255          # a full-range pattern, not a flat image


def test_the_start_image_is_written_into_the_input_folder_at_the_videos_size(tmp_path):
    pytest.importorskip("PIL", reason="Pillow (ComfyUI's dependency) is not installed here")
    from PIL import Image
    prompt = {"7": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
              "9": {"class_type": "WanImageToVideo", "inputs": {"width": 64, "height": 48, "length": 5}}}
    got = e2e.write_start_images(prompt, tmp_path / "input")
    assert got["7"]["image"] == "example.png" and (got["7"]["width"], got["7"]["height"]) == (64, 48)
    with Image.open(tmp_path / "input" / "example.png") as im:
        assert im.size == (64, 48) and im.mode == "RGB"
    assert e2e.write_start_images(prompt, tmp_path / "again") == got
    assert sorted(p.name for p in (tmp_path / "input").iterdir()) == ["example.png"]


def test_the_driver_takes_the_i2v_template_with_fp8_files(tmp_path):
    if not I2V.is_file():
        pytest.skip(f"{I2V.name} is not in this checkout")
    a = whole_prompt.parse_args(["--runs", "template@24,comfy@24,compilenode@24", "--caches", "pack", str(tmp_path),
                                 "--models-dir", "m", "--workflow", str(I2V)])
    assert [s.variant for s in a.specs] == ["template", "comfy", "compilenode"] and a.weights == "fp8"
    cmd = whole_prompt.process_command(a, a.specs[0], 1)
    i = cmd.index("--caches")
    assert cmd[i + 2] == str(tmp_path.resolve() / "fp8-Wan-2.1-image-to-video-480p-template-24")
    assert a.specs[0].name == "Wan 2.1 image to video 480p/template@24"
