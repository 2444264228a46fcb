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
    assert e2e.prompt_timings(prompt, spans, 0.5) == {"to_latent_s": 8.5, "to_frames_s": 9.0}
    assert e2e.prompt_timings(prompt, {}, 0.5) == {"to_latent_s": None, "to_frames_s": None}
    assert e2e.steps_by_node([(4.0, "12"), (4.5, "12")], {"12": 3.0}, 0.0) == {"12": [1.0, 0.5]}
