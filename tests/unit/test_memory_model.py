"""memory/: tokens, the phase model against H200 peaks, the estimate, bad input, headers."""
import json
import struct

import pytest
import torch

from wan_sage.memory import activation_model
from wan_sage.memory import request
from wan_sage.memory.errors import RequestError
from wan_sage.memory.estimate import GiB, activation_bytes, comfy_figure
from setups import estimate
from wan_sage.memory.headers import ModelFileError, NotAWanModel, read_model_file

A14B = activation_model.PRESETS["wan2.2-a14b"]


@pytest.mark.parametrize("preset,size,tokens", [
    ("wan2.2-a14b", (1280, 720, 81), 75600), ("wan2.2-a14b", (832, 480, 81), 32760),
    ("wan2.2-ti2v-5b", (1280, 704, 121), 27280), ("wan2.1-1.3b", (832, 480, 81), 32760)])
def test_tokens(preset, size, tokens):
    d = activation_model.PRESETS[preset]
    lat = activation_model.latent_shape(d, *size)
    assert activation_model.tokens(d, *lat[2:]) == tokens


def test_phase_model_reproduces_the_h200_a14b_forward_peaks():
    # A14B forward peaks measured on the H200 (cond only, bf16, weights resident): SDPA 6.57 / Sage 6.94 GiB
    # at 720p81, 2.88 / 3.04 GiB at 480p81 (the fit rows of bench/records/forward-peaks/fit.jsonl read
    # 6.58 / 6.94 and 2.85 / 3.01 GiB).
    for L, sdpa, sage in ((75600, 6.57, 6.94), (32760, 2.88, 3.04)):
        for path, measured in (("sdpa", sdpa), ("sage2_sm90", sage)):
            phase, pers, _ = activation_model.forward_peak(A14B, activation_model.Workload(L=L, self_attn=path))
            assert (phase + pers) / GiB == pytest.approx(measured, rel=0.02)
            total = activation_bytes(A14B, activation_model.Workload(L=L, self_attn=path))["total"] / GiB
            assert measured <= total <= 1.10 * measured
    t = activation_bytes(A14B, activation_model.Workload(L=75600))
    assert t["dominant_phase"] == "rope"
    t = activation_bytes(A14B, activation_model.Workload(L=75600, self_attn="sage2_sm90"))
    assert t["dominant_phase"] == "attn" and t["sage_extra"] / GiB == pytest.approx(0.37, abs=0.02)


def test_ffn_dominates_small_models():
    for p in ("wan2.1-1.3b", "wan2.2-ti2v-5b"):
        assert activation_bytes(activation_model.PRESETS[p], activation_model.Workload(L=30000))["dominant_phase"] == "ffn"


def test_comfy_estimate_matches_comfyui_formula():
    lat = activation_model.latent_shape(A14B, 1280, 720, 81)
    assert comfy_figure(A14B, lat) / GiB == pytest.approx(13.61, abs=0.01)
    assert comfy_figure(A14B, (2,) + lat[1:]) / GiB == pytest.approx(27.22, abs=0.01)


def test_partial_load_reservation_lies_between_the_measured_edges():
    # 24 GB card, A14B bf16: 8.5 GiB/row ran out of memory, 9.5 was safe; >= 13 GiB resident
    # needs a reservation of at most ~10.1 GiB.
    e = estimate(A14B, 1280, 720, 81, vram_bytes=24 * GiB, weights_bytes=int(26.6 * GiB))
    assert 9.5 <= e.reservation_partial / GiB <= 10.2
    assert e.verdict.startswith("offloads")
    assert e.reservation_resident < e.reservation_partial


def test_verdicts():
    fits = estimate(A14B, 832, 480, 81, vram_bytes=80 * GiB, weights_bytes=int(26.6 * GiB))
    assert fits.verdict.startswith("fits")
    no = estimate(A14B, 1920, 1080, 241, vram_bytes=8 * GiB, weights_bytes=int(26.6 * GiB))
    assert no.verdict.startswith("cannot fit")


def test_a_run_below_the_streamed_reservation_is_told_what_is_reserved_not_what_it_needs():
    """The streamed reservation is an upper bound: on the H200, A14B GGUF at 720p81 with an 8 GiB budget
    completed eager with Sage, holding 7.64 GiB, less than the reservation with Sage (docs/benchmarks.md).
    So the verdict below it names the reservation and the risk, and does not claim the run needs it."""
    from wan_sage.memory.weights import weights_for_key
    plan = weights_for_key(A14B, "q4_k_m", True, compute="bf16")
    e = estimate(A14B, 1280, 720, 81, attention="sage-auto", cc=90, weights=plan.setup,
                 weights_bytes=plan.nbytes, vram_bytes=8 * GiB, dtype="bf16")
    assert 7.64 * GiB < e.reservation_partial
    assert e.verdict.startswith("cannot fit its reservation even fully offloaded: reserves "
                                f"{e.reservation_partial / GiB:.1f} GiB of working memory")
    assert "needs" not in e.verdict and e.verdict.endswith("every weight streams and sampling may run out of memory")


@pytest.mark.parametrize("kw,field", [({"width": -5}, "width"), ({"height": 0}, "height"), ({"frames": 0}, "frames"),
                                      ({"batch": 100}, "batch"), ({"width": 99999}, "width"), ({"cfg": -1}, "cfg"),
                                      ({"vram_gib": -1}, "vram_gib")])
def test_bad_sizes_get_clear_errors(kw, field):
    with pytest.raises(RequestError, match=field) as e:
        request.build({"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, **kw})
    assert e.value.field == field


def test_rounding_is_explained_like_comfyui_does_it():
    e = estimate(A14B, 1283, 722, 80)
    assert e.setup.latent == (1, 16, 20, 90, 160)
    text = " ".join(e.notes)
    assert "4n+1" in text and "multiple of 8" in text
    assert estimate(A14B, 1280, 720, 81).notes == ()


def test_weight_transients():
    assert activation_model.weight_transient(A14B, activation_model.WeightSetup()) == 0
    P = 5120 * 13824
    assert activation_model.weight_transient(A14B, activation_model.WeightSetup("fp8")) == 2 * P
    assert activation_model.weight_transient(A14B, activation_model.WeightSetup(lora=True, streamed=True)) == 2 * P + 8 * P
    assert activation_model.weight_transient(A14B, activation_model.WeightSetup("gguf", gguf_bytes_per_param=0.56, streamed=True)) > 4 * P


def _wan_shapes(dim=256, ffn=512, layers=3, in_dim=16, out_dim=16, i2v=False):
    s = {"head.modulation": (1, 2, dim), "patch_embedding.weight": (dim, in_dim, 1, 2, 2),
         "head.head.weight": (out_dim * 4, dim)}
    for i in range(layers):
        s[f"blocks.{i}.ffn.0.weight"] = (ffn, dim)
        s[f"blocks.{i}.self_attn.q.weight"] = (dim, dim)
    if i2v:
        s["img_emb.proj.0.bias"] = (1280,)
    return s


def test_safetensors_header(tmp_path):
    from safetensors.torch import save_file
    shapes = _wan_shapes()
    sd = {"model.diffusion_model." + k: torch.zeros(v, dtype=torch.bfloat16) for k, v in shapes.items()}
    p = tmp_path / "wan.safetensors"
    save_file(sd, str(p))
    info = read_model_file(str(p))
    assert (info.dims.dim, info.dims.ffn_dim, info.dims.num_layers, info.dims.num_heads) == (256, 512, 3, 2)
    assert info.main_dtype == "BF16" and info.format == "safetensors"
    assert info.weights_bytes == sum(t.numel() * 2 for t in sd.values())


def test_gguf_header(tmp_path):
    import gguf
    import numpy as np
    p = tmp_path / "wan.gguf"
    w = gguf.GGUFWriter(str(p), "wan")
    for k, shape in _wan_shapes(dim=256, ffn=768, layers=2, in_dim=48, out_dim=48).items():
        w.add_tensor(k, np.zeros(shape, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = read_model_file(str(p))
    assert info.format == "gguf" and info.dims.ffn_dim == 768 and info.dims.num_layers == 2
    assert info.dims.latent_channels == 48 and info.dims.vae_stride == (4, 16, 16)


def test_non_wan_and_broken_files(tmp_path):
    from safetensors.torch import save_file
    p = tmp_path / "sdxl.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4)}, str(p))
    with pytest.raises(NotAWanModel, match="not a Wan"):
        read_model_file(str(p))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="not a safetensors"):
        read_model_file(str(bad))
    with pytest.raises(ModelFileError, match="no such file"):
        read_model_file(str(tmp_path / "missing.safetensors"))


def test_lora_transient_only_where_comfyui_applies_the_lora_per_forward():
    # GGUF (always) and streamed layers apply the LoRA in fp32 at every forward; resident fp8/bf16
    # weights have it merged at load, so `wan-sage plan --lora` must not count it there.
    P = A14B.dim * A14B.ffn_dim
    fp8 = activation_model.WeightSetup("fp8", lora=True)
    assert activation_model.weight_transient(A14B, fp8) == 2 * P
    assert activation_model.weight_transient(A14B, activation_model.WeightSetup("fp8", lora=True, streamed=True)) == 2 * P + P + 8 * P
    gguf = activation_model.WeightSetup("gguf", gguf_bytes_per_param=0.6, lora=True)
    assert activation_model.weight_transient(A14B, gguf) == 2 * 2 * P + 8 * P
    assert activation_model.weight_transient(A14B, activation_model.WeightSetup("bf16", lora=True)) == 0
