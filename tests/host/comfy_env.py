"""In-process ComfyUI host for tests: boot ComfyUI on the CPU and build tiny Wan models.

Importing this module imports nothing from ComfyUI (nor torch); everything
happens lazily in :func:`boot`, so a test collector can import it even when no
ComfyUI tree is available and skip with :func:`skip_reason`.

The ComfyUI tree is found through the ``COMFYUI_PATH`` environment variable (or
an explicit argument). It is imported from that path, never copied.

Public API
----------
``comfy_path(path=None)``           resolved ComfyUI root or None
``skip_reason(path=None)``          None if :func:`boot` can work, else a message
``boot(comfy_path=None, ...)``      idempotent in-process boot, returns a namespace of modules
``init_extra_nodes(...)``           comfy_extras nodes (+ optional custom-node dirs) into ``nodes``
``load_custom_node(path)``          load one custom-node pack folder or .py file, like ComfyUI does
``tiny_wan_state_dict(...)``        seeded random state dict with Wan 2.x key names
``tiny_wan_patcher(...)``           real ModelPatcher around a real WAN21/WanModel (via comfy.sd)
``text_cond(...)``                  random CONDITIONING list of shape [B, tokens, text_dim]
``empty_wan_latent(...)``           zero latent [B, C, (frames-1)//4+1, H//8, W//8]
``sample_tiny(patcher, ...)``       run comfy.sample.sample (or nodes.common_ksampler) on CPU
``run_prompt(prompt, ...)``         validate + execute an API-format prompt without the HTTP server
"""

from __future__ import annotations

import asyncio
import json
import importlib
import os
import subprocess
import sys
import tempfile
import threading
import types
import uuid

__all__ = [
    "comfy_path",
    "skip_reason",
    "boot",
    "booted",
    "init_extra_nodes",
    "load_custom_node",
    "tiny_wan_state_dict",
    "tiny_wan_patcher",
    "text_cond",
    "empty_wan_latent",
    "sample_tiny",
    "StubServer",
    "run_prompt",
]

WAN_TEXT_DIM = 4096          # WanModel default text_dim (UMT5-XXL hidden size); not detected from weights
WAN_TEXT_TOKENS = 512        # Wan's T5 tokenizer pads to min_length=512
WAN_CLIP_TOKENS = 257        # CLIP-H penultimate tokens for I2V img_emb
WAN_CLIP_DIM = 1280

_lock = threading.RLock()
_state: dict = {"path": None, "ns": None, "extra_nodes": False, "loaded_custom": set()}
_tv_shim = None  # keeps the torch.library.Library alive if the torchvision shim was needed


# --------------------------------------------------------------------------- discovery

def run_script(script, args, cwd, timeout: float = 600, **env) -> tuple:
    """Run a bench script with this interpreter against the host tier's ComfyUI, unbuffered, from
    ``cwd``; ``env`` adds variables.  Returns the finished process and the JSON objects it printed,
    one per line."""
    full_env = dict(os.environ, COMFYUI_PATH=comfy_path(), PYTHONUNBUFFERED="1", **env)
    p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=full_env,
                       timeout=timeout, cwd=str(cwd))
    return p, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def comfy_path(path: str | os.PathLike | None = None) -> str | None:
    """Resolve the ComfyUI root: explicit *path*, else ``$COMFYUI_PATH``. None if unset."""
    p = path if path is not None else os.environ.get("COMFYUI_PATH")
    if not p:
        return None
    return os.path.realpath(os.path.expanduser(os.fspath(p)))


def skip_reason(path: str | os.PathLike | None = None) -> str | None:
    """Return None if a ComfyUI tree is usable, else a human-readable reason (for pytest.skip)."""
    p = comfy_path(path)
    if p is None:
        return "COMFYUI_PATH is not set (a ComfyUI 0.3.64 checkout: CONTRIBUTING.md, host tier)"
    for rel in ("nodes.py", "execution.py", os.path.join("comfy", "sd.py")):
        if not os.path.isfile(os.path.join(p, rel)):
            return f"COMFYUI_PATH={p} does not look like a ComfyUI tree (no {rel})"
    try:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
    except Exception as e:  # pragma: no cover
        return f"cannot probe torch: {e}"
    return None


_sage_missing: list = []  # the one answer of sage_missing_reason(), once computed


def sage_missing_reason() -> str | None:
    """None when ``sageattention`` imports (the Sage patch is then active), else why it does not: the
    reason the tests marked ``needs_sage`` skip with."""
    if not _sage_missing:
        try:
            importlib.import_module("sageattention")
            _sage_missing.append(None)
        except Exception as e:  # any import failure means the same thing here: no active patch
            _sage_missing.append(
                f"needs an active Sage patch, but sageattention is not importable ({type(e).__name__}: {e}); "
                "install the host tier's packages: tests/host/requirements-host.txt (sageattention==1.0.6)")
    return _sage_missing[0]


def booted() -> bool:
    return _state["ns"] is not None


# --------------------------------------------------------------------------- boot

def _ensure_torchvision_importable() -> None:
    """Make ``import torchvision`` work with a CPU-only torch.

    ComfyUI's ``comfy.sd`` imports torchvision (Stable Cascade / Cosmos code) at
    import time. The only torchvision wheels available for a CPU-only torch are
    the CUDA builds, whose ``_C`` extension cannot load without CUDA libraries;
    torchvision then degrades gracefully except for two unguarded
    ``register_fake("torchvision::nms"/"qnms")`` calls that raise
    "operator torchvision::nms does not exist". Defining those two schemas (no
    kernels) lets torchvision import; its C++ ops stay unavailable (ComfyUI's Wan
    path never calls them). With a matching torchvision (e.g. a CUDA host) the
    first import simply succeeds and nothing is shimmed.
    """
    global _tv_shim
    if "torchvision" in sys.modules:
        return
    import importlib.util
    if importlib.util.find_spec("torchvision") is None:
        return  # let ComfyUI raise its own ModuleNotFoundError
    try:
        import torchvision  # noqa: F401
        return
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    import torch
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    _tv_shim = lib
    import torchvision  # noqa: F401,F811


def boot(comfy_path: str | os.PathLike | None = None, *, cpu: bool = True,
         attention: str | None = None, output_dir: str | None = None,
         deterministic: bool = False, extra_args: dict | None = None,
         quiet: bool = True) -> types.SimpleNamespace:
    """Import ComfyUI in-process (no HTTP server) and return a namespace of its modules.

    Idempotent: later calls return the same namespace; keyword arguments only
    take effect on the first call (ComfyUI reads ``args`` at import time).
    Booting from two different trees in one process raises RuntimeError.

    cpu:        sets ``comfy.cli_args.args.cpu`` before ``comfy.model_management``
                is imported (vram_state DISABLED, device cpu, fp32 weights).
    attention:  None keeps ComfyUI's choice (CPU: ``attention_sub_quad``);
                "pytorch" -> ``--use-pytorch-cross-attention``, "split" ->
                ``--use-split-cross-attention``, "quad" -> ``--use-quad-cross-attention``.
    output_dir: output/temp/input/user folders; default: a fresh temp dir, so nothing
                is written into the ComfyUI tree.
    extra_args: other ``comfy.cli_args.args`` attributes to set first, e.g.
                ``{"reserve_vram": 1.0}``.
    """
    with _lock:
        path = _resolve_or_raise(comfy_path)
        if _state["ns"] is not None:
            if _state["path"] != path:
                raise RuntimeError(f"ComfyUI already booted from {_state['path']}, not {path}")
            return _state["ns"]

        if path not in sys.path:
            sys.path.insert(0, path)
        # A different tree's modules already imported would silently win.
        mod = sys.modules.get("comfy")
        if mod is not None:
            f = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", [])), "")
            if not os.path.realpath(f).startswith(path + os.sep):
                raise RuntimeError(f"a different 'comfy' package is already imported: {f}")

        import comfy.options  # noqa: F401  (args_parsing stays False: defaults, sys.argv ignored)
        import comfy.cli_args
        args = comfy.cli_args.args
        if "comfy.model_management" in sys.modules and cpu and not args.cpu:
            raise RuntimeError("comfy.model_management was imported before boot(cpu=True)")
        args.cpu = bool(cpu) or args.cpu
        if attention is not None:
            flag = {"pytorch": "use_pytorch_cross_attention",
                    "split": "use_split_cross_attention",
                    "quad": "use_quad_cross_attention"}.get(attention)
            if flag is None:
                raise ValueError(f"attention must be None, 'pytorch', 'split' or 'quad', not {attention!r}")
            setattr(args, flag, True)
        if deterministic:
            args.deterministic = True
        args.disable_api_nodes = True
        args.database_url = "sqlite:///:memory:"
        for k, v in (extra_args or {}).items():
            if not hasattr(args, k):
                raise AttributeError(f"comfy.cli_args.args has no attribute {k!r}")
            setattr(args, k, v)

        if quiet:
            import logging
            logging.getLogger().setLevel(logging.WARNING)

        _ensure_torchvision_importable()

        import folder_paths
        base = output_dir or tempfile.mkdtemp(prefix="comfyui-test-")
        for sub in ("output", "temp", "input", "user"):
            os.makedirs(os.path.join(base, sub), exist_ok=True)
        folder_paths.set_output_directory(os.path.join(base, "output"))
        folder_paths.set_temp_directory(os.path.join(base, "temp"))
        folder_paths.set_input_directory(os.path.join(base, "input"))
        folder_paths.set_user_directory(os.path.join(base, "user"))

        import comfy.model_management
        import comfy.utils
        import comfy.model_patcher
        import comfy.model_base
        import comfy.patcher_extension
        import comfy.samplers
        import comfy.sample
        import comfy.sd
        import comfy.ops
        import comfy.ldm.modules.attention
        import comfy.ldm.wan.model
        import comfy.supported_models
        # main.py imports the top-level ``utils`` package (utils.extra_config) before ``nodes``;
        # nodes.py then puts <ComfyUI>/comfy first on sys.path, after which a fresh
        # ``import utils.x`` would find comfy/utils.py instead (breaks comfy_extras/nodes_images.py).
        import utils.extra_config  # noqa: F401
        import nodes
        import execution
        for name in ("comfy", "folder_paths", "utils", "nodes", "execution"):
            m = sys.modules[name]
            f = getattr(m, "__file__", None) or next(iter(getattr(m, "__path__", [])), "")
            if not os.path.realpath(f).startswith(path + os.sep):
                raise RuntimeError(f"module {name!r} was imported from {f}, not from {path}: "
                                   "a same-named module shadows ComfyUI's (e.g. a pack folder 'nodes' "
                                   "on sys.path); import pack code through its package name instead")

        comfy.utils.PROGRESS_BAR_ENABLED = False
        ns = types.SimpleNamespace(
            path=path,
            work_dir=base,
            args=args,
            folder_paths=folder_paths,
            model_management=comfy.model_management,
            utils=comfy.utils,
            model_patcher=comfy.model_patcher,
            model_base=comfy.model_base,
            patcher_extension=comfy.patcher_extension,
            samplers=comfy.samplers,
            sample=comfy.sample,
            sd=comfy.sd,
            ops=comfy.ops,
            attention=comfy.ldm.modules.attention,
            wan_model=comfy.ldm.wan.model,
            supported_models=comfy.supported_models,
            nodes=nodes,
            execution=execution,
            torchvision_shimmed=_tv_shim is not None,
        )
        _state["path"] = path
        _state["ns"] = ns
        return ns


def _resolve_or_raise(path) -> str:
    reason = skip_reason(path)
    if reason is not None:
        raise RuntimeError(reason)
    return comfy_path(path)


def _ns() -> types.SimpleNamespace:
    ns = _state["ns"]
    return ns if ns is not None else boot()


def init_extra_nodes(custom_node_dirs=(), builtin: bool = True) -> types.SimpleNamespace:
    """Load ComfyUI's comfy_extras nodes (once) and packs found in *custom_node_dirs*.

    Each entry of *custom_node_dirs* is a folder **containing** pack folders (ComfyUI's
    ``custom_nodes`` convention). API nodes are never loaded. Returns the boot namespace.
    Raises RuntimeError if any of the given packs fails to import.
    """
    ns = _ns()
    with _lock:
        if builtin and not _state["extra_nodes"]:
            asyncio.run(ns.nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
            _state["extra_nodes"] = True
    for d in custom_node_dirs:
        d = os.path.realpath(d)
        for entry in sorted(os.listdir(d)):
            p = os.path.join(d, entry)
            if entry == "__pycache__" or entry.endswith(".disabled"):
                continue
            if os.path.isfile(p) and not entry.endswith(".py"):
                continue
            load_custom_node(p)
    return ns


def load_custom_node(path: str | os.PathLike) -> None:
    """Load one custom-node pack (folder with __init__.py, or a .py file) via nodes.load_custom_node.

    Idempotent per path. Raises RuntimeError if ComfyUI reports an import failure.
    """
    ns = _ns()
    p = os.path.realpath(os.fspath(path))
    with _lock:
        if p in _state["loaded_custom"]:
            return
        ok = asyncio.run(ns.nodes.load_custom_node(p, set(ns.nodes.NODE_CLASS_MAPPINGS.keys()),
                                                   module_parent="custom_nodes"))
        if not ok:
            raise RuntimeError(f"ComfyUI failed to import custom node {p} (see log)")
        _state["loaded_custom"].add(p)


# --------------------------------------------------------------------------- tiny Wan

def _wan_kwargs(dim, ffn_dim, num_layers, model_type, in_dim, out_dim, text_dim):
    if dim % 128 != 0 or dim < 128:
        raise ValueError("dim must be a positive multiple of 128 (detection sets num_heads = dim // 128)")
    if model_type not in ("t2v", "i2v"):
        raise ValueError("model_type must be 't2v' or 'i2v'")
    if in_dim is None:
        in_dim = 36 if model_type == "i2v" else 16
    return dict(model_type=model_type, patch_size=(1, 2, 2), text_len=WAN_TEXT_TOKENS,
                in_dim=in_dim, dim=dim, ffn_dim=ffn_dim, freq_dim=256, text_dim=text_dim,
                out_dim=out_dim, num_heads=dim // 128, num_layers=num_layers,
                window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


def tiny_wan_state_dict(dim: int = 256, ffn_dim: int = 256, num_layers: int = 2,
                        model_type: str = "t2v", in_dim: int | None = None, out_dim: int = 16,
                        text_dim: int = WAN_TEXT_DIM, seed: int = 0, prefix: str = "",
                        dtype=None) -> dict:
    """Seeded random Wan 2.x diffusion-model state dict (original Wan key names).

    Key names and shapes come from instantiating ComfyUI's own ``WanModel`` on the
    meta device, so they always match the host version. Values: Linear/Conv weights
    ~ N(0, 1/fan_in), norm weights 1, biases and modulation small noise. Same
    arguments -> bit-identical tensors. ``prefix`` e.g. "model.diffusion_model."
    """
    ns = _ns()
    import torch
    kw = _wan_kwargs(dim, ffn_dim, num_layers, model_type, in_dim, out_dim, text_dim)
    with torch.device("meta"):
        meta = ns.wan_model.WanModel(**kw, device="meta", dtype=torch.float32,
                                     operations=ns.ops.disable_weight_init)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    sd = {}
    for k, t in meta.state_dict().items():
        shape = tuple(t.shape)
        leaf = k.rsplit(".", 1)[-1]
        if "modulation" in k:
            v = torch.randn(shape, generator=gen) * dim ** -0.5
        elif "norm" in k and leaf == "weight":
            v = torch.ones(shape)
        elif leaf == "bias" or len(shape) < 2:
            v = torch.randn(shape, generator=gen) * 0.02
        else:
            fan_in = 1
            for s in shape[1:]:
                fan_in *= s
            v = torch.randn(shape, generator=gen) * fan_in ** -0.5
        sd[prefix + k] = v.to(dtype) if dtype is not None else v
    return sd


GAP_UNIT = 64 * 16 * 4  # bytes of an fp32 Linear(64, 16): gap_filled_patcher's unit


def gap_filled_patcher(load_device, force_cast: bool = False):
    """(patcher, the smallest Linear's weight with its patch, on ``load_device``): a real ModelPatcher of three
    ComfyUI Linears of 6, 5 and 4 :data:`GAP_UNIT` s, a LoRA-style ``diff`` patch on the 4, loaded for 11 units, so
    that ComfyUI's greedy load keeps the 6 and the 4 (the 4 fills the gap the 5 left) on ``load_device`` and streams
    the 5 from the CPU.  ``force_cast``: the patcher casts every module per call (ComfyUI's ModelComputeDtype)."""
    import comfy.model_patcher
    import comfy.ops
    import torch
    torch.manual_seed(0)
    model = torch.nn.Module()
    for name, units in (("a", 6), ("b", 5), ("c", 4)):
        setattr(model, name, comfy.ops.manual_cast.Linear(64, 16 * units, bias=False))
        with torch.no_grad():
            getattr(model, name).weight.normal_()  # ComfyUI's ops skip the init: the memory is as it was
    delta = torch.randn_like(model.c.weight)
    patched = (model.c.weight.detach() + delta).to(load_device)
    p = comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=torch.device("cpu"))
    p.force_cast_weights = force_cast
    p.add_patches({"c.weight": ("diff", (delta,))}, 1.0)
    p.patch_model(load_device, lowvram_model_memory=11 * GAP_UNIT)
    assert p.loaded_size() == 10 * GAP_UNIT and model.model_lowvram
    model.current_patcher = p
    return p, patched


def tiny_wan_patcher(dim: int = 256, ffn_dim: int = 256, num_layers: int = 2,
                     model_type: str = "t2v", in_dim: int | None = None, out_dim: int = 16,
                     text_dim: int = WAN_TEXT_DIM, seed: int = 0, dtype=None,
                     model_options: dict | None = None, **kw):
    """A real ``comfy.model_patcher.ModelPatcher`` around a real Wan model.

    The state dict from :func:`tiny_wan_state_dict` goes through
    ``comfy.sd.load_diffusion_model_state_dict`` so ComfyUI's own detection picks the
    config: t2v/in16/out16 -> ``supported_models.WAN21_T2V`` (``model_base.WAN21``);
    i2v/in36 -> ``WAN21_I2V``; t2v/in48/out48 -> ``WAN22_T2V`` (5B-style ``WAN22``).
    ``dtype`` forces the unet dtype (``model_options["dtype"]``); default on CPU is fp32.
    Aliases accepted: ``layers=`` for num_layers.
    """
    if "layers" in kw:
        num_layers = kw.pop("layers")
    if "heads" in kw:
        heads = kw.pop("heads")
        if heads * 128 != dim:
            raise ValueError("Wan detection fixes head_dim=128: pass dim=heads*128")
    if kw:
        raise TypeError(f"unexpected arguments: {sorted(kw)}")
    ns = _ns()
    sd = tiny_wan_state_dict(dim=dim, ffn_dim=ffn_dim, num_layers=num_layers, model_type=model_type,
                             in_dim=in_dim, out_dim=out_dim, text_dim=text_dim, seed=seed)
    opts = dict(model_options or {})
    if dtype is not None:
        opts["dtype"] = dtype
    patcher = ns.sd.load_diffusion_model_state_dict(sd, model_options=opts)
    if patcher is None:
        raise RuntimeError("ComfyUI did not detect the tiny Wan state dict")
    dm = patcher.model.diffusion_model
    if not isinstance(dm, ns.wan_model.WanModel):
        raise RuntimeError(f"unexpected diffusion model class {type(dm)}")
    return patcher


def a14b_block_and_inputs(comfy, latent_shape, device: str = "cuda", dim: int = 5120, ffn_dim: int = 13824):
    """A one-block Wan A14B at its real dims (dim 5120, ffn 13824, or those given; random weights, bf16, ComfyUI's
    ``disable_weight_init`` ops, on ``device``, in eval mode) and the exact inputs a real forward of a
    ``latent_shape`` latent gives its block: ``(model, block, args, kwargs)``."""
    import torch
    dims = dict(dim=dim, ffn_dim=ffn_dim, num_layers=1)
    state = tiny_wan_state_dict(**dims, seed=0)
    kw = _wan_kwargs(dims["dim"], dims["ffn_dim"], 1, "t2v", None, 16, WAN_TEXT_DIM)
    model = comfy.wan_model.WanModel(**kw, device=device, dtype=torch.bfloat16,
                                     operations=comfy.ops.disable_weight_init)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
    del state
    model.eval()
    captured = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tuple(latent_shape), device=device, dtype=torch.bfloat16, generator=g)
    context = 0.1 * torch.randn(1, 512, WAN_TEXT_DIM, device=device, dtype=torch.bfloat16, generator=g)
    handle = model.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(x, torch.tensor([500.0], device=device), context, transformer_options={})
    handle.remove()
    return model, model.blocks[0], captured["args"], captured["kwargs"]


def tiny_gguf_expert(gguf_dir: str | os.PathLike, models_dir: str | os.PathLike, lora_rank: int = 8):
    """A real ComfyUI-GGUF patcher around the miniature high-noise Wan 2.2 expert of ``bench.e2e_models``
    (random weights, Q4_K/Q6_K/F32/BF16 as the real file's), with its LoRA, loaded through ``UnetLoaderGGUF``
    and ``LoraLoaderModelOnly`` from files written into ``models_dir``. ComfyUI-GGUF (``gguf_dir``) is loaded
    as a custom node. Call it under ``torch.inference_mode()``, as ComfyUI runs nodes."""
    from bench import e2e_models
    load_custom_node(gguf_dir)
    files = e2e_models.ensure_models(models_dir, scale="tiny", weights="gguf", lora_rank=lora_rank, device="cpu",
                                     only=("unet_high", "lora_high"), log=lambda *a: None)
    import folder_paths
    import nodes
    folder_paths.add_model_folder_path("diffusion_models", os.path.join(os.fspath(models_dir), "diffusion_models"))
    folder_paths.add_model_folder_path("loras", os.path.join(os.fspath(models_dir), "loras"))
    (model,) = nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(os.path.basename(files["unet_high"]))
    (model,) = nodes.NODE_CLASS_MAPPINGS["LoraLoaderModelOnly"]().load_lora_model_only(
        model, os.path.basename(files["lora_high"]), 1.0)
    return model


def text_cond(batch: int = 1, tokens: int = WAN_TEXT_TOKENS, text_dim: int = WAN_TEXT_DIM,
              seed: int = 1, scale: float = 0.1, extra: dict | None = None):
    """A CONDITIONING list ``[[tensor[batch, tokens, text_dim], {...}]]`` of seeded noise."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    t = torch.randn((batch, tokens, text_dim), generator=gen) * scale
    return [[t, dict(extra or {})]]


def empty_wan_latent(patcher=None, width: int = 64, height: int = 64, frames: int = 5, batch: int = 1,
                     channels: int | None = None):
    """Zero latent like EmptyHunyuanLatentVideo / Wan22ImageToVideoLatent would give."""
    import torch
    if channels is None:
        channels = 16
        if patcher is not None:
            channels = patcher.get_model_object("latent_format").latent_channels
    sp = 16 if channels == 48 else 8
    tf = 4
    return torch.zeros([batch, channels, ((frames - 1) // tf) + 1, height // sp, width // sp])


def sample_tiny(patcher, width: int = 64, height: int = 64, frames: int = 5, steps: int = 2,
                cfg: float = 5.0, seed: int = 0, sampler_name: str = "euler",
                scheduler: str = "simple", batch: int = 1, denoise: float = 1.0,
                positive=None, negative=None, text_seed: int = 1, clip_fea=None,
                via: str = "sample", callback=None):
    """Sample a latent with the tiny model on the CPU and return it (``[B, C, T, H/8, W/8]``).

    Positive/negative default to seeded random text conditioning [1, 512, 4096]
    (seeds ``text_seed`` and ``text_seed + 1``). For i2v models ``clip_fea`` may be
    a tensor [1, 257, 1280] (fed as ``clip_vision_output.penultimate_hidden_states``).
    cfg == 1.0 skips the uncond pass (ComfyUI's optimisation), otherwise cond and
    uncond are batched, so the DiT sees batch 2*B.

    via="sample": ``comfy.sample.sample`` (noise from ``comfy.sample.prepare_noise``);
    via="ksampler": ``nodes.common_ksampler`` exactly as the KSampler node runs it.
    Same arguments -> bit-identical result.
    """
    ns = _ns()
    text_dim = patcher.model.diffusion_model.text_dim
    if positive is None:
        positive = text_cond(1, text_dim=text_dim, seed=text_seed)
    if negative is None:
        negative = text_cond(1, text_dim=text_dim, seed=text_seed + 1)
    if clip_fea is not None:
        cvo = types.SimpleNamespace(penultimate_hidden_states=clip_fea)
        positive = [[c[0], {**c[1], "clip_vision_output": cvo}] for c in positive]
        negative = [[c[0], {**c[1], "clip_vision_output": cvo}] for c in negative]
    latent = empty_wan_latent(patcher, width, height, frames, batch)
    if via == "ksampler":
        out = ns.nodes.common_ksampler(patcher, seed, steps, cfg, sampler_name, scheduler,
                                       positive, negative, {"samples": latent}, denoise=denoise)
        return out[0]["samples"]
    if via != "sample":
        raise ValueError("via must be 'sample' or 'ksampler'")
    latent = ns.sample.fix_empty_latent_channels(patcher, latent)
    noise = ns.sample.prepare_noise(latent, seed)
    return ns.sample.sample(patcher, noise, steps, cfg, sampler_name, scheduler, positive, negative,
                            latent, denoise=denoise, callback=callback, disable_pbar=True, seed=seed)


# --------------------------------------------------------------------------- prompt execution

class StubServer:
    """The attributes PromptExecutor / progress handlers use, with events recorded."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.sockets_metadata = {}
        self.events = []

    def send_sync(self, event, data, sid=None):
        self.events.append((event, data, sid))

    def queue_updated(self):  # pragma: no cover - some code paths call it
        pass


def run_prompt(prompt: dict, prompt_id: str | None = None, extra_data: dict | None = None,
               server: StubServer | None = None, executor=None):
    """Validate and execute an API-format *prompt* in-process (no HTTP).

    Must not be called from inside a running event loop (PromptExecutor.execute
    uses asyncio.run). Returns a namespace: ok, error, node_errors, success,
    outputs (history_result["outputs"]), status_messages, events, executor.
    Raises nothing for validation/execution errors; check ``ok``/``success``.
    """
    ns = _ns()
    prompt_id = prompt_id or str(uuid.uuid4())
    valid = asyncio.run(ns.execution.validate_prompt(prompt_id, prompt, None))
    ok, error, outputs, node_errors = valid[0], valid[1], valid[2], valid[3]
    server = server or StubServer()
    res = types.SimpleNamespace(ok=ok, error=error, node_errors=node_errors, success=False,
                                outputs={}, status_messages=[], events=server.events,
                                executor=executor)
    if not ok:
        return res
    ex = executor or ns.execution.PromptExecutor(server, cache_type=ns.execution.CacheType.CLASSIC)
    ex.execute(prompt, prompt_id, extra_data=extra_data or {}, execute_outputs=outputs)
    res.executor = ex
    res.success = ex.success
    res.status_messages = ex.status_messages
    res.outputs = (getattr(ex, "history_result", None) or {}).get("outputs", {})
    return res
