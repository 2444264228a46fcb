"""Host tier: the pack's saved Wan 2.1 I2V 14B 480p template as whole prompts (``python -m bench.whole_prompt
--workflow`` driving ``python -m bench.e2e --whole-prompt --workflow``) at --scale tiny on the CPU through real
ComfyUI: each variant (the template, stock ComfyUI, the template plus Wan Compile Blocks) in a fresh process, two
prompts through one PromptExecutor, the start image written into ComfyUI's input folder; and the generated I2V 14B
and CLIP vision H against ComfyUI's own detection and loader."""
import hashlib
from pathlib import Path

import pytest

from bench.tests.whole_prompt_checks import (SIZE, VARIANTS, compile_blocks_ran_once, of_type, pack_nodes_by_variant,
                                             run_variants, saved_workflow_or_skip, variant_prompts_ok)

TEMPLATE, GGUF = saved_workflow_or_skip("Wan 2.1 image to video 480p.json")
# what the repeat prompt (a new seed) is served from ComfyUI's cache: the loaders, the start image and every
# encode, the image-to-video conditioning included
SERVED = {"UNETLoader", "CLIPLoader", "CLIPVisionLoader", "VAELoader", "LoadImage", "CLIPTextEncode",
          "CLIPVisionEncode", "WanImageToVideo"}
GENERATED = ["random-clip-vision-h-fp16.safetensors", "random-umt5-tiny-bf16.safetensors",
             "random-wan2.1-i2v-tiny-fp8_e4m3fn.safetensors", "random-wan2.1-vae-bf16.safetensors"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("i2v")
    return (*run_variants(tmp, TEMPLATE, GGUF, "--work-dir", tmp / "work"), tmp)


def test_each_variant_runs_two_prompts_from_the_written_start_image(run):
    from bench import e2e
    recs, err, tmp = run
    assert set(recs) == set(VARIANTS)
    pixels = hashlib.sha256(e2e.start_image_pixels(64, 64).tobytes()).hexdigest()[:16]
    for variant, r in recs.items():
        variant_prompts_ok(r, SERVED)
        assert r["run"] == f"{TEMPLATE.stem}/{variant}@{SIZE}" and r["workflow"] == TEMPLATE.name
        c = r["config"]
        assert (c["width"], c["height"], c["frames"], c["steps"], c["cfg"], c["sampler"], c["weights"]) == (
            64, 64, 5, 2, 6.0, "uni_pc", "fp8")
        assert sorted(new for _old, new in r["models"].values()) == GENERATED
        assert {"clip_vision_h.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                "wan2.1_i2v_480p_14B_fp8_e4m3fn.safetensors"} <= {old for old, _new in r["models"].values()}
        # the start image: written at the video's size into the process's input folder, not ComfyUI's checkout
        (image,) = r["inputs"].values()
        assert image == {"image": "example.png", "width": 64, "height": 64, "sha256": pixels}
        assert of_type(r["prompts"][0], "LoadImage") in r["inputs"]
        assert r["caches"]["mode"] == "none" and r["process"] == {"index": 1, "count": 1}
    assert (tmp / "work" / "input" / "example.png").is_file()
    assert err.count("e2e start image node") == 3


def test_the_packs_nodes_are_in_the_template_and_out_of_stock_comfyui(run):
    recs, _err, _tmp = run
    # the patch on the CPU, every call on SDPA: 2 steps x 2 blocks x (self, text and image cross-attention)
    pack_nodes_by_variant(recs, 12)


def test_wan_compile_blocks_ran_its_blocks_compiled_and_the_repeat_compiled_nothing(run):
    recs, err, _tmp = run
    compile_blocks_ran_once(recs, err)


def test_full_scale_i2v_14b_is_detected_by_comfyui_as_wan21_i2v_at_its_real_size(comfy):
    import torch
    import comfy.model_detection
    import comfy.supported_models
    from bench import e2e_models as EM
    full = EM.wan_i2v_specs("full")
    # 16.65 GB: ComfyUI's repackaged file is 16.4 GB (the stand-in keeps the matrices outside the blocks in BF16)
    assert 16.3e9 < sum(s.nbytes for s in full) < 16.8e9
    store = {s.name: s.store for s in full}
    shapes = {s.name: s.shape for s in full}
    assert store["blocks.39.cross_attn.k_img.weight"] == store["blocks.0.cross_attn.v_img.weight"] == "F8_E4M3"
    assert store["blocks.0.cross_attn.norm_k_img.weight"] == "F32" and store["img_emb.proj.1.weight"] == "BF16"
    assert shapes["img_emb.proj.1.weight"] == (1280, 1280) and shapes["img_emb.proj.3.weight"] == (5120, 1280)
    assert shapes["patch_embedding.weight"][:2] == (5120, 36) and shapes["head.head.weight"] == (16 * 4, 5120)
    for scale, dims in (("full", (5120, 40, 40, 13824)), ("tiny", (256, 2, 2, 512))):
        sd = {s.name: torch.empty(s.shape, device="meta") for s in EM.wan_i2v_specs(scale)}
        cfg = comfy.model_detection.model_config_from_unet(sd, "")
        assert type(cfg) is comfy.supported_models.WAN21_I2V, type(cfg)
        u = cfg.unet_config
        assert (u["model_type"], u["in_dim"], u["out_dim"]) == ("i2v", 36, 16)
        assert (u["dim"], u["num_heads"], u["num_layers"], u["ffn_dim"]) == dims


def test_clip_vision_h_is_loaded_by_comfyui_with_vit_h_and_every_key(comfy, run, monkeypatch):
    import comfy.clip_vision
    from bench import e2e_models as EM
    specs = EM.clip_vision_specs()
    assert 1.25e9 < sum(s.nbytes for s in specs) < 1.28e9 and {s.store for s in specs} == {"F16"}   # 1.26 GB
    names = {s.name for s in specs}
    assert "vision_model.encoder.layers.31.mlp.fc2.weight" in names           # 32 layers, as ComfyUI's ViT-H
    assert "vision_model.encoder.layers.32.mlp.fc2.weight" not in names
    # ComfyUI's own loader on the generated file (full size at every scale): the config it picked, and what
    # its load_state_dict left missing or unused
    seen = {}

    class Recorded(comfy.clip_vision.ClipVisionModel):
        def __init__(self, json_config):
            seen["config"] = Path(json_config).name
            super().__init__(json_config)

        def load_sd(self, sd):
            seen["missing"], seen["unexpected"] = super().load_sd(sd)
            return seen["missing"], seen["unexpected"]
    monkeypatch.setattr(comfy.clip_vision, "ClipVisionModel", Recorded)
    _recs, _err, tmp = run
    clip = comfy.clip_vision.load(str(tmp / "models" / "clip_vision" / "random-clip-vision-h-fp16.safetensors"))
    assert clip is not None and seen == {"config": "clip_vision_config_h.json", "missing": [], "unexpected": []}
    assert len(clip.model.vision_model.encoder.layers) == 32 and clip.image_size == 224
