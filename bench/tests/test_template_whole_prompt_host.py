"""Host tier: the pack's saved Wan 2.2 TI2V-5B template as whole prompts (``python -m bench.whole_prompt --workflow``
driving ``python -m bench.e2e --whole-prompt --workflow``) at --scale tiny on the CPU through real ComfyUI: each
variant (the template, stock ComfyUI, the template plus Wan Compile Blocks) in a fresh process, two prompts through
one PromptExecutor; and the generated 5B and Wan 2.2 VAE files against ComfyUI's own detection."""
import pytest

from bench.tests.whole_prompt_checks import (SIZE, VARIANTS, compile_blocks_ran_once, pack_nodes_by_variant,
                                             run_variants, saved_workflow_or_skip, variant_prompts_ok)

TEMPLATE, GGUF = saved_workflow_or_skip("Wan 2.2 5B text to video 704p.json")
# what the repeat prompt (a new seed) is served from ComfyUI's cache: the loaders and the text encode
SERVED = {"CLIPTextEncode", "UNETLoader", "CLIPLoader", "VAELoader"}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return run_variants(tmp_path_factory.mktemp("template"), TEMPLATE, GGUF)


def test_each_variant_runs_two_prompts_in_one_fresh_process(records):
    recs, _err = records
    assert set(recs) == set(VARIANTS)
    for variant, r in recs.items():
        variant_prompts_ok(r, SERVED)
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
    pack_nodes_by_variant(recs, 8)     # the patch on the CPU: every call on SDPA (2 steps x 2 blocks x 2)


def test_wan_compile_blocks_ran_its_blocks_compiled_and_the_repeat_compiled_nothing(records):
    compile_blocks_ran_once(*records)


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
    # (dim, heads, layers, FFN) ComfyUI reads from each scale's keys and shapes
    for scale, dims in (("full", (3072, 24, 30, 14336)), ("tiny", (256, 2, 2, 512))):
        sd = {s.name: torch.empty(s.shape, device="meta") for s in EM.wan5b_specs(scale)}
        cfg = comfy.model_detection.model_config_from_unet(sd, "")
        assert type(cfg) is comfy.supported_models.WAN22_T2V, type(cfg)
        u = cfg.unet_config
        assert (u["in_dim"], u["out_dim"]) == (48, 48)
        assert (u["dim"], u["num_heads"], u["num_layers"], u["ffn_dim"]) == dims
    vae = {s.name: s for s in EM.vae22_specs()}
    assert 1.35e9 < sum(s.nbytes for s in vae.values()) < 1.45e9            # about the 1.41 GB wan2.2_vae
    # the keys comfy.sd.VAE tells the Wan 2.2 VAE by, and its 48 latent channels
    assert "decoder.middle.0.residual.0.gamma" in vae and "decoder.upsamples.0.upsamples.0.residual.2.weight" in vae
    assert vae["conv2.weight"].shape[:2] == (48, 48)
