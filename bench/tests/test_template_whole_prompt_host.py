"""Host tier: the pack's saved Wan 2.2 TI2V-5B template as whole prompts (``python -m bench.whole_prompt --workflow``
driving ``python -m bench.e2e --whole-prompt --workflow``) at --scale tiny on the CPU through real ComfyUI: each
variant (the template, stock ComfyUI, the template plus Wan Compile Blocks) in a fresh process, two prompts through
one PromptExecutor; and the generated 5B and Wan 2.2 VAE files against ComfyUI's own detection."""
import os
from pathlib import Path

import pytest

from bench import _host

comfy_env = _host.comfy_env()
if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)
ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "example_workflows" / "Wan 2.2 5B text to video 704p.json"
if not TEMPLATE.is_file():
    pytest.skip(f"example_workflows/{TEMPLATE.name} is not in this checkout", allow_module_level=True)
GGUF = Path(os.path.realpath(os.environ.get("COMFYUI_GGUF_PATH")
                             or os.path.join(comfy_env.comfy_path(), os.pardir, "ComfyUI-GGUF")))
if not (GGUF / "nodes.py").is_file():   # a saved workflow's process loads ComfyUI-GGUF as a custom node
    pytest.skip(f"host tier: ComfyUI-GGUF not found at {GGUF} (set COMFYUI_GGUF_PATH)", allow_module_level=True)
pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")

SIZE = "full:64x64x5:2steps"
PACK = {"WanTextEncoderHostCopy", "WanWorkingMemoryEstimator", "WanSageAttentionPatch"}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("template")
    runs = ",".join(f"{v}@{SIZE}" for v in ("template", "comfy", "compilenode"))
    p, rows = _host.run_tool("whole_prompt", ["--runs", runs, "--caches", "none", "--workflow", TEMPLATE,
                                              "--compile-backend", "eager", "--out", tmp / "records.jsonl",
                                              "--log", tmp / "processes.log", "--models-dir", tmp / "models",
                                              "--scale", "tiny", "--quiet", "--av-stub"],
                             1500, COMFYUI_GGUF_PATH=str(GGUF))
    assert p.returncode == 0, p.stderr[-4000:]
    return {r["config"]["variant"]: r for r in rows}, p.stderr


def _two_prompts_ok(r):
    assert r["schema"] == "wan-sage-whole-prompt/1" and r["status"] == "ok", r.get("error")
    first, repeat = r["prompts"]
    assert (first["prompt"], repeat["prompt"]) == ("first", "repeat")
    assert all(p["status"] == "ok" and p["error"] is None for p in r["prompts"])
    assert first["seed"] != repeat["seed"]
    for p in r["prompts"]:
        assert p["latent_finite"] is True and p["decoded"] == [5, 64, 64, 3]
        assert p["to_frames_s"] > p["to_latent_s"] > 0
        (ks,) = [k for k, t in p["node_types"].items() if t == "KSampler"]
        assert set(p["experts"]) == set(p["first_step_s"]) == {ks}
        assert len(p["experts"][ks]["step_s"]) == 2 and all(s > 0 for s in p["experts"][ks]["step_s"])
    # ComfyUI's cache: the first prompt runs every node, the repeat (a new seed) is served the loaders and the
    # text encode, and runs the sampler and the decode again
    assert first["reused"] == []
    reused = {repeat["node_types"][k] for k in repeat["reused"]}
    assert {"CLIPTextEncode", "UNETLoader", "CLIPLoader", "VAELoader"} <= reused
    assert not reused & {"KSampler", "VAEDecode"}
    return first, repeat


def test_each_variant_runs_two_prompts_in_one_fresh_process(records):
    recs, _err = records
    assert set(recs) == {"template", "comfy", "compilenode"}
    for variant, r in recs.items():
        _two_prompts_ok(r)
        assert r["run"] == f"{TEMPLATE.stem}/{variant}@{SIZE}" and r["workflow"] == TEMPLATE.name
        c = r["config"]
        assert (c["width"], c["height"], c["frames"], c["steps"], c["cfg"], c["sampler"], c["weights"]) == (
            64, 64, 5, 2, 5.0, "uni_pc", "fp16")
        # what was substituted for the template's loaders: the bf16 umt5 for its fp8 one among them
        assert sorted(new for _old, new in r["models"].values()) == [
            "random-umt5-tiny-bf16.safetensors", "random-wan2.2-ti2v-tiny-fp16.safetensors",
            "random-wan2.2-vae-bf16.safetensors"]
        assert "umt5_xxl_fp8_e4m3fn_scaled.safetensors" in {old for old, _new in r["models"].values()}
        assert r["caches"]["mode"] == "none" and r["process"] == {"index": 1, "count": 1}


def test_the_packs_nodes_are_in_the_template_and_out_of_stock_comfyui(records):
    recs, _err = records
    for variant, want in (("template", PACK), ("comfy", set()), ("compilenode", PACK | {"WanCompileBlocks"})):
        r = recs[variant]
        assert set(r["config"]["pack_nodes"]) == want
        for p in r["prompts"]:
            assert set(p["node_types"].values()) & (PACK | {"WanCompileBlocks"}) == want
    assert all(p["experts"][k]["attention"] is None for p in recs["comfy"]["prompts"] for k in p["experts"])
    sage = recs["template"]["prompts"][0]["by_expert"]
    assert [x["sdpa_calls"] for x in sage.values()] == [8]     # the patch on the CPU: every call on SDPA


def test_wan_compile_blocks_ran_its_blocks_compiled_and_the_repeat_compiled_nothing(records):
    recs, err = records
    r = recs["compilenode"]
    assert r["config"]["compile"]["backend"] == "eager"
    first, repeat = r["prompts"]
    (node,) = [k for k, t in first["node_types"].items() if t == "WanCompileBlocks"]
    assert node in repeat["reused"]                            # the compile node's model, served by the cache
    for p in (first, repeat):
        ran = p["compile"]["blocks_ran"][node]
        assert ran["blocks"]["resident"] == 2 and ran["blocks"]["eager"] == 0 and ran["why"] == {}, ran
    assert first["compile"]["unique_graphs"] >= 1 and repeat["compile"]["unique_graphs"] == 0
    assert repeat["compile"]["recompiles"] == 0
    assert "e2e compile blocks node" in err


def test_full_scale_5b_and_wan22_vae_are_detected_by_comfyui_at_their_real_sizes(comfy):
    import torch
    import comfy.model_detection
    import comfy.supported_models
    from bench import e2e_models as EM
    full = EM.wan5b_specs("full")
    assert 9.9e9 < sum(s.nbytes for s in full) < 10.1e9 and {s.store for s in full} == {"F16"}   # 10.0 GB fp16
    shapes = {s.name: s.shape for s in full}
    assert shapes["head.head.weight"] == (48 * 4, 3072) and shapes["patch_embedding.weight"][1] == 48
    assert shapes["blocks.0.ffn.0.weight"] == (14336, 3072) and "blocks.29.ffn.0.weight" in shapes
    assert "blocks.30.ffn.0.weight" not in shapes
    for scale, dim in (("full", 3072), ("tiny", 256)):
        sd = {s.name: torch.empty(s.shape, device="meta") for s in EM.wan5b_specs(scale)}
        cfg = comfy.model_detection.model_config_from_unet(sd, "")
        assert type(cfg) is comfy.supported_models.WAN22_T2V, type(cfg)
        assert (cfg.unet_config["dim"], cfg.unet_config["in_dim"], cfg.unet_config["out_dim"]) == (dim, 48, 48)
    assert cfg.unet_config["num_heads"] == 2
    full_cfg = comfy.model_detection.model_config_from_unet({s.name: torch.empty(s.shape, device="meta") for s in full}, "")
    assert (full_cfg.unet_config["num_heads"], full_cfg.unet_config["num_layers"], full_cfg.unet_config["ffn_dim"]) == (
        24, 30, 14336)
    vae = {s.name: s for s in EM.vae22_specs()}
    assert 1.35e9 < sum(s.nbytes for s in vae.values()) < 1.45e9            # about the 1.41 GB wan2.2_vae
    # the keys comfy.sd.VAE tells the Wan 2.2 VAE by, and its 48 latent channels
    assert "decoder.middle.0.residual.0.gamma" in vae and "decoder.upsamples.0.upsamples.0.residual.2.weight" in vae
    assert vae["conv2.weight"].shape[:2] == (48, 48)
