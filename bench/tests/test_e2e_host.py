"""Host tier: the end-to-end benchmark harness (``python -m bench.e2e``) at --scale tiny on the CPU, through
real ComfyUI and ComfyUI-GGUF, and its K-quant packer against ComfyUI-GGUF's own dequantiser."""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from bench import _host

comfy_env = _host.comfy_env()
if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
GGUF = Path(os.path.realpath(os.environ.get("COMFYUI_GGUF_PATH")
                             or os.path.join(comfy_env.comfy_path(), os.pardir, "ComfyUI-GGUF")))
if not (GGUF / "dequant.py").is_file():
    pytest.skip(f"host tier: ComfyUI-GGUF not found at {GGUF} (set COMFYUI_GGUF_PATH)", allow_module_level=True)
gguf = pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")

from bench import kquants  # noqa: E402


def _run(args, tmp_path, timeout=900):
    p, rows = _host.run_tool("e2e", ["--models-dir", tmp_path / "models", "--scale", "tiny", "--quiet", *args], timeout,
                             COMFYUI_GGUF_PATH=str(GGUF))
    assert p.returncode == 0, p.stderr[-4000:]
    return rows, p.stderr


@pytest.fixture(scope="module")
def e2e_rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    rows, err = _run(["--runs", "est+sage@full:64x64x5,comfy+sdpa@24:64x64x5", "--decode", "first",
                      "--out", str(tmp / "runs.jsonl")], tmp)
    return rows, err, tmp


@pytest.mark.needs_sage
def test_tiny_pipeline_end_to_end_through_real_loaders(e2e_rows):
    rows, err, tmp = e2e_rows
    assert len(rows) == 2
    assert [json.loads(x)["run"] for x in (tmp / "runs.jsonl").read_text().splitlines()] == [r["run"] for r in rows]
    # every file went through ComfyUI's own loaders without a key left over
    assert "lora key not loaded" not in err and "clip missing" not in err and "unet missing" not in err
    assert "ERROR UNSUPPORTED UNET" not in err
    a, b = rows
    for r in rows:
        assert r["schema"] == "wan-sage-e2e/1" and r["status"] == "ok" and r["error"] is None
        assert r["latent_finite"] is True
        assert set(r["experts"]) == {"high", "low"}
        for e in r["experts"].values():
            assert len(e["step_s"]) == 2 and all(s > 0 for s in e["step_s"])   # 4 steps: 0-2 and 2-4
            assert e["s_per_step"] > 0 and e["wall_s"] >= e["sampler_s"] > 0
            assert e["resident_frac"] == 1.0 and e["weights_gib"] > 0
            assert e["predicted_working_gib"] > 0 and e["comfy_estimate_gib"] > 0
            # sampled under torch.inference_mode(), as ComfyUI's executor runs nodes: outside it, ComfyUI-GGUF's
            # LoRA-patched quantised weights stayed on the GPU after unloading (measured on the H200)
            assert e["inference_mode"] is True
        assert r["denoise_s"] >= r["denoise_steps_s"] > 0
        assert set(r["phases"]) >= {"encode", "high", "low"}
        # the expert a phase samples is among the models ComfyUI holds as it ends (on the CPU, "loaded" with
        # --cpu), by its model class
        assert any(k.startswith("WAN") and v > 0 for k, v in r["phases"]["high"]["loaded_gib_after"].items())
        assert isinstance(r["phases"]["encode"]["loaded_gib_before"], dict)
        # the seconds a phase spent in ComfyUI's loading calls: loading the expert is inside the sampling phase
        assert r["phases"]["high"]["comfy_memory_s"].get("load_models_gpu", 0) > 0
        assert r["env"]["comfyui"] and r["env"]["device"] == "cpu" and r["env"]["weights"] == "gguf"
        assert "alloc_conf" in r["env"]             # the allocator's settings, for runs that compare allocators
        assert r["peak_alloc_gib"] is None          # no CUDA: no memory readings, no ballast
        assert r["alloc_retries"] is None and r["budget"]["inherited_alloc_gib"] is None
    # run 1: estimator + Sage patch (on the CPU every call goes to SDPA with reason "cpu"), decoded
    assert a["config"]["estimator"] and a["config"]["attention"] == "sage"
    assert a["decoded"] == [5, 64, 64, 3] and a["images_finite"] is True
    assert a["phases"]["decode"]["comfy_memory_s"].get("load_models_gpu", 0) > 0   # the VAE loaded for the decode
    for e in a["experts"].values():
        assert e["reservation_source"] == "wan-sage"
        assert e["estimator"]["tokens"] == 32
        assert e["predicted_working_gib"] == pytest.approx(e["estimator"]["reservation_gb"], abs=2e-3)
        assert e["attention"]["sage_calls"] == 0 and e["attention"]["reasons"] == {"cpu": 8}   # 2 blocks x 2 x 2 steps
    assert a["patch_status"]["high"].startswith("patched") and a["estimator_report"]["low"].startswith("Wan t2v, dim 256 x 2 layers")
    # run 2: ComfyUI alone with SDPA, budget requested on a CPU host: a no-op with a message
    assert not b["config"]["estimator"] and b["config"]["attention"] == "sdpa" and "decoded" not in b
    assert "no CUDA device" in b["budget"]["note"] and b["budget"]["ballast_gib"] == 0
    for e in b["experts"].values():
        assert e["reservation_source"] == "comfyui" and e["attention"] is None and e["estimator"] is None
        assert e["predicted_working_gib"] == pytest.approx(e["comfy_estimate_gib"], rel=1e-6)


def test_generated_files_follow_q4_k_m_layout_and_are_deterministic(e2e_rows, tmp_path):
    _, _, tmp = e2e_rows
    models = tmp / "models"
    man = json.loads((models / "manifest.json").read_text())
    gguf_set = [n for n in man["files"] if not n.endswith("fp8_e4m3fn.safetensors")]
    assert len(gguf_set) == 6       # 2 experts, 2 LoRAs, encoder, VAE
    f = next((models / "diffusion_models").glob("*high-noise-Q4_K_M.gguf"))
    r = gguf.GGUFReader(str(f))
    arch = r.get_field("general.architecture")
    assert str(arch.parts[arch.data[-1]], "utf-8") == "wan"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    for k, t in types.items():
        if k.startswith("blocks.") and k.endswith(".weight") and "norm" not in k:
            assert t == ("Q6_K" if k.endswith((".v.weight", ".ffn.2.weight")) else "Q4_K"), k
        elif "modulation" in k or k.endswith(".bias") or "norm" in k or k == "patch_embedding.weight":
            assert t == "F32", k
        else:
            assert t == "BF16", k
    # same seed -> same bytes (regenerated elsewhere)
    rows, _ = _run(["--generate-only"], tmp_path)
    g = next((tmp_path / "models" / "diffusion_models").glob("*high-noise-Q4_K_M.gguf"))
    assert g.read_bytes() == f.read_bytes()
    lora = next((tmp_path / "models" / "loras").glob("*high*"))
    assert lora.read_bytes() == next((models / "loras").glob("*high*")).read_bytes()


def test_fp8_experts_load_through_unetloader(e2e_rows):
    _, _, tmp = e2e_rows
    rows, err = _run(["--weights", "fp8", "--runs", "est+sdpa@full:64x64x5", "--decode", "none"], tmp)
    (r,) = rows
    assert r["status"] == "ok" and r["config"]["weights"] == "fp8", r["error"]
    assert "lora key not loaded" not in err and "unet missing" not in err
    assert all(len(e["step_s"]) == 2 and e["reservation_source"] == "wan-sage" for e in r["experts"].values())
    fp8 = list((tmp / "models" / "diffusion_models").glob("*fp8_e4m3fn.safetensors"))
    assert len(fp8) == 2


def test_sage_without_its_finite_check_is_a_run_of_its_own(e2e_rows):
    # --sage-check-finite off measures what the per-call NaN/Inf check costs; its record must never
    # pass for (or be skipped as) the default configuration's.
    _, _, tmp = e2e_rows
    rows, err = _run(["--runs", "est+sage@full:64x64x5,comfy+sdpa@24:64x64x5", "--decode", "none",
                      "--sage-check-finite", "off", "--skip-done", str(tmp / "runs.jsonl")], tmp)
    assert "comfy+sdpa@24:64x64x5 already recorded, skipped" in err        # SDPA: the same run as before
    (r,) = [r for r in rows if r.get("status") != "skipped"]
    assert r["run"] == "est+sage@full:64x64x5/no-finite-check" and r["config"]["check_finite"] is False
    assert r["status"] == "ok", r["error"]


def test_compiled_runs_add_comfyuis_compile_node_after_the_patch(e2e_rows):
    # +compile: ComfyUI's TorchCompileModel node (whole diffusion model) after the Sage patch, dynamo's eager
    # backend on the CPU; a run of its own for --skip-done, with what dynamo did in the record
    _, _, tmp = e2e_rows
    rows, err = _run(["--runs", "comfy+sdpa@24:64x64x5,comfy+sdpa+compile@full:64x64x5,est+sage+compile@full:64x64x5",
                      "--compile-backend", "eager", "--decode", "none", "--skip-done", str(tmp / "runs.jsonl")], tmp)
    assert "comfy+sdpa@24:64x64x5 already recorded, skipped" in err
    sdpa, sage = rows
    assert (sdpa["run"], sage["run"]) == ("comfy+sdpa+compile@full:64x64x5", "est+sage+compile@full:64x64x5")
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["config"]["compile"] == {"node": "TorchCompileModel", "backend": "eager", "keys": ["diffusion_model"]}
        c = r["compile"]
        assert c["kwargs"]["high"] == {"backend": "eager", "options": None, "mode": None, "fullgraph": False,
                                       "dynamic": None}
        assert c["unique_graphs"] >= 1 and c["frames"] >= 1 and c["recompile_limit"] >= 1
        assert all(len(e["step_s"]) == 2 for e in r["experts"].values())
    # the compiled model still carries the patch; on the CPU it declines every call statically ("cpu"),
    # and under torch.compile such calls run inside the graph uncounted (attention/stats.py)
    if sage["sage_active"]:
        assert all(s.startswith("patched") for s in sage["patch_status"].values())
        assert all(e["attention"]["sage_calls"] == e["attention"]["sdpa_calls"] == 0 for e in sage["experts"].values())
        assert sage["experts"]["high"]["reservation_source"] == "wan-sage"


def test_full_scale_file_sizes(comfy):
    from bench import e2e_models as EM
    q = sum(s.nbytes for s in EM.wan_specs("full", "gguf"))
    assert 9.3e9 < q < 9.9e9                       # Wan 2.2 A14B Q4_K_M experts are about 9.6 GB
    assert 14.0e9 < sum(s.nbytes for s in EM.wan_specs("full", "fp8")) < 15.0e9
    te = sum(s.nbytes for s in EM.umt5_specs("full", "bf16", b"x"))
    assert 11.2e9 < te < 11.5e9                    # UMT5-XXL encoder in bf16
    assert 0.24e9 < sum(s.nbytes for s in EM.vae_specs()) < 0.27e9
    lora = EM.lora_specs("full", 64)
    assert len(lora) == 40 * 10 * 3 and 0.55e9 < sum(s.nbytes for s in lora) < 0.7e9


@pytest.mark.needs_sage
def test_saved_workflow_ui_format_runs_through_prompt_executor(e2e_rows, tmp_path):
    _, _, tmp = e2e_rows
    wf = tmp_path / "wan22_tiny.json"
    wf.write_text(json.dumps(tiny_ui_workflow()))
    rows, err = _run(["--workflow", str(wf), "--res", "64x64x5"], tmp)   # reuses the generated models
    (r,) = rows
    assert r["status"] == "ok", r["error"]
    assert r["models"]["10"][1].endswith("high-noise-Q4_K_M.gguf") and r["models"]["11"][1].endswith("low-noise-Q4_K_M.gguf")
    assert r["models"]["12"][1].startswith("random-wan2.2-tiny-high") and r["models"]["13"][1].startswith("random-wan2.2-tiny-low")
    steps = r["step_s_by_node"]
    assert len(steps.get("30", [])) == 2 and len(steps.get("31", [])) == 2     # both KSamplerAdvanced, 2 steps each
    runs = r["attention"]
    assert len(runs) == 2 and all(x["reasons"] == {"cpu": 8} for x in runs)


@pytest.mark.needs_sage
@pytest.mark.parametrize("name", ["Wan 2.2 A14B GGUF T2V 720p.json"])
def test_the_packs_saved_a14b_workflow_runs_at_tiny_scale(e2e_rows, name):
    path = ROOT / "example_workflows" / name
    if not path.is_file():
        pytest.skip(f"example_workflows/{name} is not in this checkout")
    _, _, tmp = e2e_rows
    rows, err = _run(["--workflow", str(path), "--res", "64x64x5"], tmp)
    (r,) = rows
    assert r["status"] == "ok", r["error"]
    assert len(r["models"]) == 6 and "lora key not loaded" not in err
    ks = [k for k, t in r["node_types"].items() if t == "KSamplerAdvanced"]
    assert len(ks) == 2 and all(len(r["step_s_by_node"][k]) == 2 for k in ks)
    assert len(r["attention"]) == 2 and all(x["sdpa_calls"] == 8 for x in r["attention"])


def test_missing_workflow_file_is_a_clear_error(tmp_path):
    p, _rows = _host.run_tool("e2e", ["--models-dir", tmp_path, "--scale", "tiny", "--workflow", tmp_path / "nope.json"],
                              120, COMFYUI_GGUF_PATH=str(GGUF))
    assert p.returncode != 0
    assert "nope.json not found" in p.stderr and "example_workflows/" in p.stderr


# --------------------------------------------------------------------------- K-quants against ComfyUI-GGUF

def _comfy_gguf_dequant():
    spec = importlib.util.spec_from_file_location("comfyui_gguf_dequant", GGUF / "dequant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _test_values():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 1024, generator=g) * 0.02
    x[0, :256] = 0.0                                    # all-zero block
    x[1, :256] = 0.5                                    # constant positive block
    x[2, :256] = -0.25                                  # constant negative block
    x[3, 5] = 3.0                                       # outlier
    x[4, :256] = torch.rand(256, generator=g)          # positive only
    x[5, :256] = -torch.rand(256, generator=g)         # negative only
    x[6] = torch.randn(1024, generator=g) * 40          # large scale
    x[7] = torch.randn(1024, generator=g) * 1e-4        # tiny scale
    return x


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_packer_round_trips_through_comfyui_gguf_dequant(qtype):
    dq = _comfy_gguf_dequant()
    GT = getattr(gguf.GGMLQuantizationType, qtype)
    x = _test_values()
    b = kquants.quantize(x, qtype)
    assert b.dtype == torch.uint8 and b.shape == (48, 1024 // 256 * kquants.BLOCK_BYTES[qtype])
    assert gguf.GGML_QUANT_SIZES[GT] == (256, kquants.BLOCK_BYTES[qtype])
    theirs = dq.dequantize(b, GT, x.shape, dtype=torch.float32).float()
    numpy_ref = torch.from_numpy(gguf.quants.dequantize(b.numpy(), GT)).float()
    mine = (kquants.dequantize_q4_k if qtype == "Q4_K" else kquants.dequantize_q6_k)(b)
    assert torch.equal(theirs, numpy_ref) and torch.equal(mine, numpy_ref)    # one byte layout, three decoders
    # within the quantisation step of each sub-block (plus the clip at the grid's ends)
    if qtype == "Q4_K":
        blk = b.reshape(-1, 144)
        d = blk[:, 0:2].contiguous().view(torch.float16).float()
        dmin = blk[:, 2:4].contiguous().view(torch.float16).float()
        s = blk[:, 4:16].to(torch.int32)
        sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1).float()
        mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1).float()
        step, lo = (d * sc).reshape(-1, 8, 1), (-dmin * mn).reshape(-1, 8, 1)
        hi = lo + 15 * step
        xs = x.reshape(-1, 8, 32)
    else:
        blk = b.reshape(-1, 210)
        scs = blk[:, 192:208].contiguous().view(torch.int8).float()
        d = blk[:, 208:210].contiguous().view(torch.float16).float()
        dl = (d * scs).reshape(-1, 16, 1)
        step = dl.abs()
        lo, hi = torch.minimum(-32 * dl, 31 * dl), torch.maximum(-32 * dl, 31 * dl)
        xs = x.reshape(-1, 16, 16)
    err = (theirs.reshape(xs.shape) - xs).abs()
    outside = (lo - xs).clamp(min=0) + (xs - hi).clamp(min=0)
    assert bool((err <= 0.5 * step + outside + 1e-6 * xs.abs().clamp(min=1e-3)).all())
    assert float(outside.max()) <= float(step.max()) + 1e-6                 # scale rounding clips at most a step
    # the scales are sensible: Gaussian rows come back at 4-bit / 6-bit accuracy
    rows = slice(8, 48)
    rel = ((theirs[rows] - x[rows]).pow(2).mean() / x[rows].pow(2).mean()).sqrt()
    assert rel < (0.10 if qtype == "Q4_K" else 0.025)
    assert torch.equal(theirs[0, :256], torch.zeros(256))                  # zero block stays zero
    assert torch.allclose(theirs[1, :256], torch.full((256,), 0.5), atol=0.5 / 15)


def tiny_ui_workflow():
    """The harness's graph as the frontend saves it (UI format, links as lists, a Reroute, a Note,
    seed widgets followed by their control value, estimator and Sage patch on each expert)."""
    nodes, links = [], []

    def node(nid, ctype, widgets, inputs=(), outputs=(), mode=0):
        nodes.append({"id": nid, "type": ctype, "mode": mode, "widgets_values": list(widgets),
                      "inputs": [{"name": n, "type": t, "link": l} for n, t, l in inputs],
                      "outputs": [{"name": t, "type": t, "links": []} for t in outputs]})

    def link(lid, a, a_slot, b, b_slot, t):
        links.append([lid, a, a_slot, b, b_slot, t])
        return lid
    node(1, "Note", ["tiny Wan 2.2 two-expert workflow for the harness test"])
    node(2, "CLIPLoader", ["umt5_xxl_fp16.safetensors", "wan", "default"], outputs=["CLIP"])
    node(3, "CLIPTextEncode", ["a fox in the snow"], [("clip", "CLIP", link(1, 2, 0, 3, 0, "CLIP"))], ["CONDITIONING"])
    node(4, "CLIPTextEncode", ["blurry"], [("clip", "CLIP", link(2, 2, 0, 4, 0, "CLIP"))], ["CONDITIONING"])
    node(10, "UnetLoaderGGUF", ["Wan2.2-T2V-A14B-HighNoise-Q4_K_M.gguf"], outputs=["MODEL"])
    node(11, "UnetLoaderGGUF", ["Wan2.2-T2V-A14B-LowNoise-Q4_K_M.gguf"], outputs=["MODEL"])
    node(12, "LoraLoaderModelOnly", ["lightx2v_high_noise_model.safetensors", 1.0],
         [("model", "MODEL", link(3, 10, 0, 12, 0, "MODEL"))], ["MODEL"])
    node(13, "LoraLoaderModelOnly", ["lightx2v_low_noise_model.safetensors", 1.0],
         [("model", "MODEL", link(4, 11, 0, 13, 0, "MODEL"))], ["MODEL"])
    node(14, "EmptyHunyuanLatentVideo", [1280, 720, 81, 1], outputs=["LATENT"])
    node(20, "WanWorkingMemoryEstimator", [1280, 720, 81, 1, 1.0, "wan-sage estimate", 0.0, 10.0, "auto-detect"],
         [("model", "MODEL", link(5, 12, 0, 20, 0, "MODEL")), ("latent", "LATENT", link(6, 14, 0, 20, 1, "LATENT"))],
         ["MODEL", "INT", "FLOAT", "FLOAT", "FLOAT", "STRING"])
    node(21, "WanWorkingMemoryEstimator", [1280, 720, 81, 1, 1.0, "wan-sage estimate", 0.0, 10.0, "auto-detect"],
         [("model", "MODEL", link(7, 13, 0, 21, 0, "MODEL")), ("latent", "LATENT", link(8, 14, 0, 21, 1, "LATENT"))],
         ["MODEL", "INT", "FLOAT", "FLOAT", "FLOAT", "STRING"])
    node(22, "WanSageAttentionPatch", ["auto", 1024, True, 256, True],
         [("model", "MODEL", link(9, 20, 0, 22, 0, "MODEL"))], ["MODEL", "STRING"])
    node(23, "WanSageAttentionPatch", ["auto", 1024, True, 256, True],
         [("model", "MODEL", link(10, 21, 0, 23, 0, "MODEL"))], ["MODEL", "STRING"])
    node(24, "Reroute", [], [("", "*", link(11, 14, 0, 24, 0, "LATENT"))], ["LATENT"])
    node(30, "KSamplerAdvanced", ["enable", 42, "fixed", 4, 1.0, "euler", "simple", 0, 2, "enable"],
         [("model", "MODEL", link(12, 22, 0, 30, 0, "MODEL")), ("positive", "CONDITIONING", link(13, 3, 0, 30, 1, "CONDITIONING")),
          ("negative", "CONDITIONING", link(14, 4, 0, 30, 2, "CONDITIONING")),
          ("latent_image", "LATENT", link(15, 24, 0, 30, 3, "LATENT"))], ["LATENT"])
    node(31, "KSamplerAdvanced", ["disable", 42, "fixed", 4, 1.0, "euler", "simple", 2, 10000, "disable"],
         [("model", "MODEL", link(16, 23, 0, 31, 0, "MODEL")), ("positive", "CONDITIONING", link(17, 3, 0, 31, 1, "CONDITIONING")),
          ("negative", "CONDITIONING", link(18, 4, 0, 31, 2, "CONDITIONING")),
          ("latent_image", "LATENT", link(19, 30, 0, 31, 3, "LATENT"))], ["LATENT"])
    node(40, "VAELoader", ["wan_2.1_vae.safetensors"], outputs=["VAE"])
    node(41, "VAEDecode", [], [("samples", "LATENT", link(20, 31, 0, 41, 0, "LATENT")),
                               ("vae", "VAE", link(21, 40, 0, 41, 1, "VAE"))], ["IMAGE"])
    node(42, "PreviewImage", [], [("images", "IMAGE", link(22, 41, 0, 42, 0, "IMAGE"))])
    return {"last_node_id": 42, "last_link_id": 22, "nodes": nodes, "links": links, "groups": [], "config": {},
            "extra": {}, "version": 0.4}


@pytest.mark.needs_sage
def test_plot_and_table_from_the_json_lines(e2e_rows, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: only the PNG of python -m bench.plot_e2e needs it "
                                             "(pip install matplotlib)")
    _, _, tmp = e2e_rows
    from bench import plot_e2e
    runs = plot_e2e.load([tmp / "runs.jsonl"])
    assert len(runs) == 2
    png = plot_e2e.plot(runs, str(tmp_path / "e2e.png"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = plot_e2e.markdown(runs)
    assert md.count("\n") == 4 and "estimator + SAGE" in md and "0 Sage / 8 SDPA (cpu 8)" in md


def test_the_packs_compile_node_runs_after_the_patch_and_is_recorded_as_such(e2e_rows):
    # +compilenode: the pack's Wan Compile Blocks through its wiring, after the Sage patch; dynamo's eager
    # backend on the CPU; every weight resident at the full card, so the blocks run compiled
    _, _, tmp = e2e_rows
    rows, err = _run(["--runs", "est+sage+compilenode@full:64x64x5", "--compile-backend", "eager",
                      "--decode", "none"], tmp)
    (r,) = rows
    assert r["status"] == "ok", r["error"]
    assert r["run"] == "est+sage+compilenode@full:64x64x5"
    assert r["config"]["compile"] == {"node": "Wan Compile Blocks", "backend": "eager",
                                      "keys": ["diffusion_model.blocks.N"], "streamed_blocks": "lifted or staged"}
    assert r["compile"]["kwargs"]["high"]["how"] == "Wan Compile Blocks (streamed blocks staged)"
    by = r["compile"]["by_expert"]
    assert by["high"]["unique_graphs"] >= 1 and by["low"]["unique_graphs"] == 0, by
    assert r["compile"]["recompiles"] == 0
    for e in ("high", "low"):  # the node's own count of how each expert's blocks ran
        ran = r["compile"]["blocks_ran"][e]
        assert ran["blocks"]["resident"] >= 1 and ran["blocks"]["eager"] == 0 and ran["why"] == {}, ran


def test_per_block_compiled_runs_compile_each_block_after_the_patch(e2e_rows):
    # +compileblocks: set_torch_compile_wrapper with one key per transformer block (as per-block compile
    # nodes do), after the Sage patch; dynamo's eager backend on the CPU
    _, _, tmp = e2e_rows
    rows, err = _run(["--runs", "est+sage+compileblocks@full:64x64x5", "--compile-backend", "eager",
                      "--decode", "none"], tmp)
    (r,) = rows
    assert r["status"] == "ok", r["error"]
    assert r["run"] == "est+sage+compileblocks@full:64x64x5"
    assert r["config"]["compile"]["keys"] == ["diffusion_model.blocks.N"]
    c = r["compile"]
    assert c["kwargs"]["high"]["blocks"] >= 1 and c["kwargs"]["high"]["backend"] == "eager"
    assert c["unique_graphs"] >= 1 and c["recompile_limit"] == 64
    assert all(len(e["step_s"]) == 2 for e in r["experts"].values())
    # each expert's share: the low-noise expert reuses the high one's graphs (same options, same keys)
    by = c["by_expert"]
    assert by["high"]["unique_graphs"] >= 1 and by["low"]["unique_graphs"] == 0, by
    assert by["high"]["unique_graphs"] + by["low"]["unique_graphs"] == c["unique_graphs"]
    assert by["low"]["guard_causes"] == {} and "e2e compile low: 0 graphs" in err
    if r["sage_active"]:   # declined statically on the CPU, so uncounted under compile (attention/stats.py)
        assert all(s.startswith("patched") for s in r["patch_status"].values())
        assert all(e["attention"]["sage_calls"] == e["attention"]["sdpa_calls"] == 0 for e in r["experts"].values())
