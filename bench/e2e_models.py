"""Random-weight model files at real sizes and key names for the end-to-end benchmark, written one tensor at a time.

Files (under ``<models-dir>/<ComfyUI folder>/``), deterministic for a seed and generator device:

* ``diffusion_models/``: the two Wan 2.2 T2V A14B experts (high and low noise) as GGUF Q4_K_M
  (``general.architecture = "wan"``), or as fp8 e4m3fn safetensors.  GGUF tensor types follow
  what ComfyUI-GGUF's patched ``llama-quantize`` makes of a bf16 Wan file for Q4_K_M
  (``tools/lcpp.patch``): block matrices Q4_K, except ``*.v.weight`` and ``*.ffn.2.weight``,
  which are Q6_K; ``modulation``, 1-D tensors and the 5-D ``patch_embedding`` in F32 (as
  ``convert.py`` and ``fix_5d_tensors.py`` leave them); the other 2-D tensors (text/time
  embeddings, time projection, head) unquantised, BF16.  About 9.6 GB per expert at full size.
* ``text_encoders/``: UMT5-XXL with the key names of ComfyUI's ``CLIPLoader`` type "wan"
  (bf16 by default, 11.4 GB, about the size of the 10.8 GB encoder Wan workflows load; fp16 optional), including the ``spiece_model`` tokenizer
  tensor that ComfyUI reads from the file.  The tokenizer is a small SentencePiece model trained
  here on fixed text; ids stay below its size, and the encoder always sees 512 tokens.
* ``vae/``: the Wan 2.1 VAE (ComfyUI key names, bf16, 254 MB).  ComfyUI fixes its dims, so
  ``--scale tiny`` keeps it full size.
* the TI2V-5B set (``model_set="ti2v-5b"``, what the pack's 5B template loads): the Wan 2.2 TI2V-5B diffusion
  model in fp16 safetensors (``diffusion_models/``: dim 3072, FFN 14336, 30 blocks, 24 heads, in and out dim
  48, 10.0 GB; ComfyUI detects it as ``WAN22_T2V`` from ``head.head.weight``'s out dim 48), the same UMT5-XXL
  and the Wan 2.2 VAE (``vae/``: ComfyUI's ``comfy.ldm.wan.vae2_2.WanVAE`` key names, bf16, 1.4 GB; ComfyUI
  detects it from ``decoder.upsamples.0.upsamples.0.residual.2.weight`` and fixes its dims, so ``--scale tiny``
  keeps it full size).  At ``--scale tiny`` the 5B is dim 256, FFN 512, 2 blocks, still in and out dim 48.
* the Wan 2.1 I2V 14B set (``model_set="i2v-14b"``, what the pack's Wan 2.1 image-to-video template loads): the
  Wan 2.1 I2V 14B 480p diffusion model as fp8 e4m3fn safetensors (``diffusion_models/``: the A14B's dims and
  fp8 layout with in dim 36, the noise's 16 channels plus the start image's mask (4) and latent (16), the image
  embedding ``img_emb.*`` and each block's image cross-attention ``k_img``/``v_img``/``norm_k_img``; 16.7 GB,
  ComfyUI's repackaged file 16.4 GB, see :func:`wan_i2v_specs`; ComfyUI detects it as ``WAN21_I2V`` from
  ``img_emb.proj.0.bias`` and the in dim 36), the same UMT5-XXL, the Wan 2.1 VAE, and CLIP ViT-H/14 (``clip_vision/``: ComfyUI's ``comfy.clip_model.CLIPVisionModelProjection``
  key names from its ``clip_vision_config_h.json``, fp16, 1.26 GB).  At ``--scale tiny`` the diffusion model
  is dim 256, FFN 512, 2 blocks, still in dim 36; CLIP vision stays full size, since ComfyUI builds it from
  its own config file (chosen by ``vision_model.encoder.layers.30``) and Wan's image embedding takes its
  width, 1280.
* ``loras/``: a rank-r LoRA per expert (``diffusion_model.<key>.lora_down/lora_up/alpha`` on every
  Linear of the blocks: self/cross q, k, v, o and both FFN layers), standing in for the
  Lightning LoRAs.

Key names and shapes come from ComfyUI's own modules built on the meta device, so they match the
ComfyUI tree in use.  Values: matrices N(0, 1/fan_in), norm scales 1, biases 0, modulation
N(0, 0.02), embeddings N(0, 1); each tensor has its own generator seeded from (seed, file role,
key), and large tensors are made and written in row chunks, so memory stays at a few hundred MB
whatever the file size.  ``--scale tiny`` makes a miniature Wan (dim 256, FFN 512, 2 blocks)
and UMT5 (24 blocks of width 4096, as ComfyUI's detection needs, but 1 head, FFN 64, vocab
512; the harness passes that config to ComfyUI's loader), with the same key names and dtypes.

A ``manifest.json`` records what was written; files whose manifest entry matches are not
written again.
"""
from __future__ import annotations

import io
import json
import math
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .kquants import QK_K, quantize, row_bytes

FORMAT_VERSION = 1
MiB = 1 << 20

SCALES = {
    "full": dict(wan=dict(dim=5120, ffn_dim=13824, num_layers=40), wan5b=dict(dim=3072, ffn_dim=14336, num_layers=30),
                 te=None, label="a14b", label5b="5b"),
    "tiny": dict(wan=dict(dim=256, ffn_dim=512, num_layers=2), wan5b=dict(dim=256, ffn_dim=512, num_layers=2),
                 te=dict(num_heads=1, d_kv=64, d_ff=64, vocab_size=512), label="tiny", label5b="tiny"),
}
# the A14B experts, LoRAs and Wan 2.1 VAE; the TI2V-5B and the Wan 2.2 VAE; the Wan 2.1 I2V 14B, CLIP vision H
# and the Wan 2.1 VAE
MODEL_SETS = ("a14b", "ti2v-5b", "i2v-14b")
WAN5B_IO_DIM = 48                     # the TI2V-5B's in and out channels: the Wan 2.2 VAE's 48 latent channels
WAN21_LATENT = 16                     # the Wan 2.1 VAE's latent channels
WAN21_I2V_IN_DIM = 36                 # the I2V's input: noise (16), the start image's mask (4) and latent (16)
# The diffusion model of a one-model set (its role) and the weights its file always has, whatever --weights says.
SINGLE_MODEL_WEIGHTS = {"unet_5b": "fp16", "unet_i2v": "fp8"}
EXPERTS = ("high", "low")
SUBDIRS = {"unet": "diffusion_models", "te": "text_encoders", "vae": "vae", "lora": "loras",
           "clipvision": "clip_vision"}
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}


@dataclass
class Spec:
    name: str
    shape: tuple
    store: str          # Q4_K, Q6_K, F32, BF16, F16, F8_E4M3, U8
    init: str           # matrix, ones, zeros, modulation, embed, small, lora_up, const:<v>, bytes
    payload: bytes | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.store in ("Q4_K", "Q6_K"):
            return math.prod(self.shape[:-1]) * row_bytes(self.store, self.shape[-1])
        return self.numel * torch.empty((), dtype=ST_DTYPES[self.store]).element_size()


# --------------------------------------------------------------------------- names and sizes

def file_names(scale: str, weights: str, te_dtype: str, lora_rank: int, model_set: str = "a14b") -> dict:
    """{role: file name} of a model set (:data:`MODEL_SETS`); the 5B set's roles are ``unet_5b``, ``te`` and
    ``vae_22``, the I2V 14B set's ``unet_i2v``, ``te``, ``clipvision`` and ``vae``."""
    lab = SCALES[scale]["label"]
    te = f"random-umt5-{'xxl' if scale == 'full' else 'tiny'}-{te_dtype}.safetensors"
    if model_set == "ti2v-5b":
        return {"unet_5b": f"random-wan2.2-ti2v-{SCALES[scale]['label5b']}-fp16.safetensors", "te": te,
                "vae_22": "random-wan2.2-vae-bf16.safetensors"}
    if model_set == "i2v-14b":
        return {"unet_i2v": f"random-wan2.1-i2v-{'14b-480p' if scale == 'full' else 'tiny'}-fp8_e4m3fn.safetensors",
                "te": te, "clipvision": "random-clip-vision-h-fp16.safetensors",
                "vae": "random-wan2.1-vae-bf16.safetensors"}
    if model_set != "a14b":
        raise ValueError(f"unknown model set {model_set!r}: expected one of {', '.join(MODEL_SETS)}")
    n = {}
    for e in EXPERTS:
        if weights == "gguf":
            n[f"unet_{e}"] = f"random-wan2.2-t2v-{lab}-{e}-noise-Q4_K_M.gguf"
        else:
            n[f"unet_{e}"] = f"random-wan2.2-t2v-{lab}-{e}-noise-fp8_e4m3fn.safetensors"
        n[f"lora_{e}"] = f"random-wan2.2-{lab}-{e}-noise-lora-r{lora_rank}.safetensors"
    n["te"] = te
    n["vae"] = "random-wan2.1-vae-bf16.safetensors"
    return n


def role_dir(role: str) -> str:
    return SUBDIRS[role.split("_")[0]]


def file_weights(role: str, weights: str) -> str | None:
    """The weights of a diffusion model file: a one-model set's own (:data:`SINGLE_MODEL_WEIGHTS`), else
    ``weights``; None for the other roles."""
    if not role.startswith("unet"):
        return None
    return SINGLE_MODEL_WEIGHTS.get(role, weights)


def te_config(scale: str) -> dict | None:
    """The UMT5 config overrides ComfyUI must get for this scale (None: its own XXL config)."""
    return SCALES[scale]["te"]


# --------------------------------------------------------------------------- specs from ComfyUI modules

def _wan_state_shapes(dims: dict, io_dim: int, in_dim: int | None = None, model_type: str = "t2v") -> dict:
    """{key: shape} of ComfyUI's ``WanModel`` (``model_type`` t2v or i2v) with these dims, built on the meta device;
    ``in_dim``: the input channels where they differ from the output's ``io_dim``."""
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    kw = dict(model_type=model_type, patch_size=(1, 2, 2), text_len=512, in_dim=in_dim or io_dim, dim=dims["dim"],
              ffn_dim=dims["ffn_dim"], freq_dim=256, text_dim=4096, out_dim=io_dim, num_heads=dims["dim"] // 128,
              num_layers=dims["num_layers"], window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    with torch.device("meta"):
        m = comfy_wan.WanModel(**kw, device="meta", dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    return {k: tuple(t.shape) for k, t in m.state_dict().items()}


def wan_specs(scale: str, weights: str) -> list[Spec]:
    """A Wan 2.2 A14B expert: GGUF Q4_K_M or fp8 layout."""
    return [Spec(k, shape, _wan_store(k, shape, weights), _wan_init(k, shape))
            for k, shape in _wan_state_shapes(SCALES[scale]["wan"], 16).items()]


def wan5b_specs(scale: str) -> list[Spec]:
    """The Wan 2.2 TI2V-5B in fp16, every tensor F16 as in ComfyUI's repackaged ``wan2.2_ti2v_5B_fp16``."""
    return [Spec(k, shape, "F16", _wan_init(k, shape))
            for k, shape in _wan_state_shapes(SCALES[scale]["wan5b"], WAN5B_IO_DIM).items()]


def wan_i2v_specs(scale: str) -> list[Spec]:
    """The Wan 2.1 I2V 14B 480p as fp8 e4m3fn safetensors: the A14B's dims and fp8 layout (:func:`_wan_store`, the
    i2v-only keys by the same rule: the blocks' ``k_img``/``v_img`` matrices fp8, the image embedding's matrices
    BF16, vectors F32), in dim 36 (:data:`WAN21_I2V_IN_DIM`).  16.65 GB, 0.25 GB over the 16.4 GB of ComfyUI's
    repackaged file: about what the BF16 matrices outside the blocks (text and time embeddings, time projection,
    head, image embedding: 0.24 G parameters) would save in fp8."""
    return [Spec(k, shape, _wan_store(k, shape, "fp8"), _wan_init(k, shape))
            for k, shape in _wan_state_shapes(SCALES[scale]["wan"], WAN21_LATENT, WAN21_I2V_IN_DIM, "i2v").items()]


def _wan_init(k: str, shape) -> str:
    leaf = k.rsplit(".", 1)[-1]
    if "modulation" in k:
        return "modulation"
    if len(shape) >= 2:
        return "matrix"
    if leaf == "weight" and ("norm" in k or len(shape) == 1):   # norm scales (the image embedding's LayerNorms too)
        return "ones"
    return "zeros"


def _wan_store(k: str, shape, weights: str) -> str:
    in_block = k.startswith("blocks.")
    if weights == "fp8":
        return "F8_E4M3" if in_block and len(shape) == 2 else ("F32" if len(shape) != 2 or "modulation" in k else "BF16")
    if "modulation" in k or len(shape) != 2:
        return "F32"                    # hiprec / 1-D / the 5-D patch embedding (fix_5d_tensors: F32)
    if not in_block:
        return "BF16"                   # embeddings, time projection, head: not quantised
    if shape[-1] % QK_K:
        return "F16"                    # lcpp.patch fallback for rows not divisible by 256
    if k.endswith(".v.weight") or k.endswith(".ffn.2.weight"):
        return "Q6_K"                   # Q4_K_M: attn v and FFN down get Q6_K
    return "Q4_K"


def lora_specs(scale: str, rank: int) -> list[Spec]:
    specs = []
    for s in wan_specs(scale, "gguf"):
        if not s.name.startswith("blocks.") or len(s.shape) != 2 or not s.name.endswith(".weight"):
            continue
        base = "diffusion_model." + s.name[:-len(".weight")]
        out_f, in_f = s.shape
        specs.append(Spec(f"{base}.lora_down.weight", (rank, in_f), "BF16", "matrix"))
        specs.append(Spec(f"{base}.lora_up.weight", (out_f, rank), "BF16", "lora_up"))
        specs.append(Spec(f"{base}.alpha", (), "F32", f"const:{float(rank)}"))
    return specs


def umt5_specs(scale: str, te_dtype: str, tokenizer: bytes) -> list[Spec]:
    import comfy.ops
    import comfy.text_encoders.t5 as T5
    with open(os.path.join(os.path.dirname(T5.__file__), "umt5_config_xxl.json")) as f:
        cfg = json.load(f)
    cfg.update(te_config(scale) or {})
    t = T5.T5(cfg, torch.bfloat16, "meta", comfy.ops.manual_cast)
    store = {"bf16": "BF16", "fp16": "F16"}[te_dtype]   # ComfyUI takes the TE dtype from final_layer_norm
    specs = []
    for k, v in t.state_dict().items():
        shape = tuple(v.shape)
        init = ("embed" if k == "shared.weight" else "small" if "relative_attention_bias" in k
                else "matrix" if len(shape) == 2 else "ones")
        specs.append(Spec(k, shape, store, init))
    specs.append(Spec("spiece_model", (len(tokenizer),), "U8", "bytes", payload=tokenizer))
    return specs


def clip_vision_specs() -> list[Spec]:
    """CLIP ViT-H/14 as ComfyUI's ``CLIPVisionLoader`` builds it: ``comfy.clip_model.CLIPVisionModelProjection`` from
    ``clip_vision_config_h.json`` (the config ``comfy.clip_vision.load_clipvision_from_sd`` picks where
    ``vision_model.encoder.layers.30`` exists and layer 47 does not), every tensor F16 as in ComfyUI's repackaged
    ``clip_vision_h``."""
    import comfy.clip_model
    import comfy.ops
    with open(os.path.join(os.path.dirname(comfy.clip_model.__file__), "clip_vision_config_h.json")) as f:
        cfg = json.load(f)
    with torch.device("meta"):
        m = comfy.clip_model.CLIPVisionModelProjection(cfg, torch.float16, "meta", comfy.ops.manual_cast)
    specs = []
    for k, v in m.state_dict().items():
        shape = tuple(v.shape)
        leaf = k.rsplit(".", 1)[-1]
        init = "matrix" if len(shape) >= 2 else ("ones" if leaf == "weight" else "zeros")   # 1-D weights: LayerNorms
        specs.append(Spec(k, shape, "F16", init))
    return specs


def vae_specs() -> list[Spec]:
    """The Wan 2.1 VAE, with the dims ComfyUI's ``VAE`` builds it with."""
    import comfy.ldm.wan.vae as comfy_wan_vae
    with torch.device("meta"):
        vae = comfy_wan_vae.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                       temperal_downsample=[False, True, True], dropout=0.0)
    return _vae_specs(vae)


def vae22_specs() -> list[Spec]:
    """The Wan 2.2 VAE, with the dims ComfyUI's ``VAE`` builds it with (48 latent channels)."""
    import comfy.ldm.wan.vae2_2 as comfy_wan_vae22
    with torch.device("meta"):
        vae = comfy_wan_vae22.WanVAE(dim=160, z_dim=WAN5B_IO_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)
    return _vae_specs(vae)


def _vae_specs(vae) -> list[Spec]:
    specs = []
    for k, v in vae.state_dict().items():
        shape = tuple(v.shape)
        leaf = k.rsplit(".", 1)[-1]
        init = "ones" if leaf == "gamma" else ("matrix" if len(shape) >= 2 else "zeros")
        specs.append(Spec(k, shape, "BF16", init))
    return specs


def train_tokenizer(vocab_size: int = 1000) -> bytes:
    """A small SentencePiece unigram model with UMT5's special ids (pad 0, eos 1, unk 2).

    Trained on fixed synthetic text with one thread: the same bytes on every machine that has
    the same sentencepiece version."""
    import sentencepiece as spm
    words = ("a cinematic shot of red fox running through snowy forest at golden hour camera slowly pans "
             "left detailed fur soft light shallow depth of field wind blows the trees the river flows "
             "over stones a city street at night neon signs reflect on wet asphalt people walk with "
             "umbrellas blurred background low quality worst quality static frame overexposed").split()
    rng = np.random.default_rng(1234)
    lines = [" ".join(rng.choice(words, size=int(rng.integers(6, 24)))) for _ in range(4000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   num_threads=1, hard_vocab_limit=False, minloglevel=2,
                                   character_coverage=1.0)
    return buf.getvalue()


# --------------------------------------------------------------------------- values

def _seed(seed: int, role: str, key: str) -> int:
    return zlib.crc32(f"{seed}:{role}:{key}".encode()) & 0x7FFFFFFF


def _chunk_rows(spec: Spec, budget_elems: int = 32 * MiB) -> int:
    if len(spec.shape) < 2:
        return 1
    row = math.prod(spec.shape[1:])
    return max(1, min(spec.shape[0], budget_elems // max(row, 1)))


def value_chunks(spec: Spec, seed: int, role: str, device: torch.device):
    """float32 chunks of the tensor along dim 0 (the whole tensor when it has < 2 dims)."""
    if spec.init.startswith("const:"):
        yield torch.full(spec.shape, float(spec.init[6:]), device=device)
        return
    if spec.init in ("ones", "zeros"):
        fill = 1.0 if spec.init == "ones" else 0.0
        if len(spec.shape) < 2:
            yield torch.full(spec.shape, fill, device=device)
            return
        rows = _chunk_rows(spec)
        for r in range(0, spec.shape[0], rows):
            yield torch.full((min(rows, spec.shape[0] - r), *spec.shape[1:]), fill, device=device)
        return
    std = {"modulation": 0.02, "embed": 1.0, "small": 0.1, "lora_up": 1e-3}.get(spec.init)
    if spec.init == "matrix":
        std = math.prod(spec.shape[1:]) ** -0.5
    g = torch.Generator(device=device).manual_seed(_seed(seed, role, spec.name))
    if len(spec.shape) < 2:
        yield torch.randn(spec.shape, generator=g, device=device).mul_(std)
        return
    rows = _chunk_rows(spec)
    for r in range(0, spec.shape[0], rows):
        n = min(rows, spec.shape[0] - r)
        yield torch.randn((n, *spec.shape[1:]), generator=g, device=device).mul_(std)


def encoded_chunks(spec: Spec, seed: int, role: str, device: torch.device):
    """numpy uint8 / float32 arrays holding the stored bytes, in file order."""
    if spec.init == "bytes":
        yield np.frombuffer(spec.payload, dtype=np.uint8)
        return
    for x in value_chunks(spec, seed, role, device):
        if spec.store in ("Q4_K", "Q6_K"):
            out = quantize(x, spec.store)
        elif spec.store == "F32":
            out = x.contiguous()
        else:
            out = x.to(ST_DTYPES[spec.store]).contiguous().view(torch.uint8)
        yield out.cpu().numpy()


# --------------------------------------------------------------------------- writers

def write_safetensors(path: Path, specs: list[Spec], seed: int, role: str, device, metadata: dict) -> int:
    """Stream a .safetensors file: header with every offset first, then each tensor's bytes."""
    header, off = {"__metadata__": {k: str(v) for k, v in metadata.items()}}, 0
    for s in specs:
        header[s.name] = {"dtype": s.store, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for s in specs:
            write_tensor_data(f, s, seed, role, device)
    os.replace(tmp, path)
    return 8 + len(hb) + off


def write_tensor_data(f, s: Spec, seed: int, role: str, device) -> None:
    """Append one tensor's bytes to ``f``, chunk by chunk, and check the count against its spec."""
    n = 0
    for arr in encoded_chunks(s, seed, role, device):
        arr.tofile(f)
        n += arr.nbytes
    if n != s.nbytes:
        raise RuntimeError(f"{s.name}: wrote {n} bytes, expected {s.nbytes}")


def write_gguf(path: Path, specs: list[Spec], seed: int, role: str, device, name: str) -> int:
    """Stream a GGUF file with gguf-py's GGUFWriter: tensor infos first, then data per tensor."""
    import gguf
    qt = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path=None, arch="wan")
    w.add_name(name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_string("wan_sage.e2e", json.dumps({"seed": seed, "role": role, "format": FORMAT_VERSION,
                                            "note": "random weights for benchmarking, not a trained model"}))
    for s in specs:
        if s.store == "F32":
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes)
        elif s.store in ("Q4_K", "Q6_K"):
            byte_shape = (*s.shape[:-1], row_bytes(s.store, s.shape[-1]))
            w.add_tensor_info(s.name, byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=getattr(qt, s.store))
        elif s.store in ("BF16", "F16"):
            byte_shape = (*s.shape[:-1], s.shape[-1] * 2)
            w.add_tensor_info(s.name, byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=getattr(qt, s.store))
        else:
            raise ValueError(f"{s.name}: {s.store} is not a GGUF type here")
    tmp = path.with_name(path.name + ".part")
    w.write_header_to_file(path=tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    for s in specs:                      # what GGUFWriter.write_tensor_data does, one chunk at a time
        w.write_padding(fout, fout.tell())
        write_tensor_data(fout, s, seed, role, device)
        w.write_padding(fout, s.nbytes)
    size = fout.tell()
    w.close()
    os.replace(tmp, path)
    return size


# --------------------------------------------------------------------------- the set

def ensure_models(models_dir, scale: str = "full", weights: str = "gguf", te_dtype: str = "bf16",
                  lora_rank: int = 64, seed: int = 0, device: str = "auto", log=print, only=None,
                  model_set: str = "a14b") -> dict:
    """Write whatever of the file set is missing (``only``: just these roles, e.g. ``("unet_high",)``;
    ``model_set``: :data:`MODEL_SETS`); return {role: path} plus the miniature TE config and the file names."""
    root = Path(models_dir)
    dev = torch.device("cuda" if (device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if device == "auto" else device))
    names = file_names(scale, weights, te_dtype, lora_rank, model_set)
    man_path = root / "manifest.json"
    manifest = json.loads(man_path.read_text()) if man_path.exists() else {"files": {}}
    out = {}
    for role, fname in names.items():
        if only is not None and role not in only:
            continue
        path = root / role_dir(role) / fname
        path.parent.mkdir(parents=True, exist_ok=True)
        want = {"role": role, "scale": scale, "seed": seed, "format": FORMAT_VERSION,
                "weights": file_weights(role, weights),
                "te_dtype": te_dtype if role == "te" else None,
                "lora_rank": lora_rank if role.startswith("lora") else None}
        have = manifest["files"].get(fname)
        if have and path.exists() and path.stat().st_size == have.get("bytes") and \
                all(have.get(k) == v for k, v in want.items()):
            out[role] = path
            continue
        t0 = time.perf_counter()
        meta = {"wan_sage_e2e": json.dumps({**want, "gen_device": dev.type}),
                "note": "random weights for benchmarking, not a trained model"}
        if role == "unet_5b":
            size = write_safetensors(path, wan5b_specs(scale), seed, role, dev, meta)
        elif role == "unet_i2v":
            size = write_safetensors(path, wan_i2v_specs(scale), seed, role, dev, meta)
        elif role == "clipvision":
            size = write_safetensors(path, clip_vision_specs(), seed, role, dev, meta)
        elif role.startswith("unet"):
            specs = wan_specs(scale, weights)
            if weights == "gguf":
                size = write_gguf(path, specs, seed, role, dev, f"random Wan2.2 T2V {SCALES[scale]['label']} {role[5:]} noise")
            else:
                size = write_safetensors(path, specs, seed, role, dev, meta)
        elif role.startswith("lora"):
            size = write_safetensors(path, lora_specs(scale, lora_rank), seed, role, dev, meta)
        elif role == "te":
            size = write_safetensors(path, umt5_specs(scale, te_dtype, train_tokenizer()), seed, role, dev, meta)
        else:
            size = write_safetensors(path, vae22_specs() if role == "vae_22" else vae_specs(), seed, role, dev, meta)
        dt = time.perf_counter() - t0
        log(f"e2e models: wrote {path.name} ({size / 1e9:.2f} GB) in {dt:.1f} s on {dev.type}")
        manifest["files"][fname] = {**want, "bytes": size, "gen_device": dev.type, "seconds": round(dt, 1)}
        man_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        out[role] = path
    out["te_config"] = te_config(scale)
    out["names"] = names
    return out
