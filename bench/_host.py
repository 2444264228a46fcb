"""Shared setup for the benchmark harness: load this checkout as ``wan_sage`` and boot ComfyUI
in-process from COMFYUI_PATH (no server), as ComfyUI's ``main.py`` would for the GPU.

Imported as ``bench._host`` (the tools run as ``python -m bench.<tool>``); it imports no other bench
module at import time."""
from __future__ import annotations

import dataclasses
import importlib
import json
import importlib.util
import os
import pkgutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args, env=None) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20,
                          env=env).stdout.strip()


def git_head() -> str | None:
    """The checkout's commit for a record: ``WAN_SAGE_COMMIT`` if set, else ``git rev-parse`` here,
    followed by ``+tree:<id>`` when the files here are not that commit's (a copied working tree whose git
    directory is older than its files; ``git log --format='%h %T'`` finds the commit with that tree)."""
    v = os.environ.get("WAN_SAGE_COMMIT")
    if v:
        return v
    try:
        head = _git("rev-parse", "--short", "HEAD")
        if not head:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            _git("add", "-A", ".", env=env)
            tree = _git("write-tree", env=env)
        if tree and tree != _git("rev-parse", "HEAD^{tree}"):
            return f"{head}+tree:{tree[:12]}"
        return head
    except Exception:
        return None


def load_pack():
    """This checkout as the package ``wan_sage`` (its root holds the pack's ``__init__.py``), loaded once
    from its files whatever the checkout's folder is called, as ComfyUI loads a custom node."""
    if "wan_sage" not in sys.modules:
        spec = importlib.util.spec_from_file_location("wan_sage", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["wan_sage"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["wan_sage"]


def set_allocator(kind: str) -> None:
    """'async' is what ComfyUI's main.py selects through cuda_malloc (cudaMallocAsync); 'native'
    is PyTorch's caching allocator.  Must run before torch initialises CUDA."""
    if kind == "async":
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync" if not conf else conf + ",backend:cudaMallocAsync"


def jsonl_records(paths: str | None):
    """Every JSON object in the JSON-lines files of a comma-separated list, for --skip-done: a missing
    file or a line that is not JSON (a call killed mid-write) is passed over."""
    for name in (paths or "").split(","):
        path = Path(name.strip())
        if not name.strip() or not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


class JsonLines:
    """One JSON line per result, printed and appended to ``path`` (when given) as soon as it is known,
    so a call killed at its time limit still returns what it measured."""

    def __init__(self, path: str | None):
        self._file = open(path, "a") if path else None

    def __call__(self, row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self._file:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


def alloc_retries(torch):
    """The CUDA allocator's count of allocations that succeeded only after it freed its cache (a run
    at the edge of its budget needs some), or None where the backend does not count them."""
    try:
        return torch.cuda.memory_stats().get("num_alloc_retries")
    except RuntimeError:
        return None


def boot_comfy(cpu: bool = False, pytorch_attention: bool = False):
    """``pytorch_attention``: ComfyUI's ``--use-pytorch-cross-attention``, set before
    ``comfy.ldm.modules.attention`` picks ``optimized_attention`` at import.  On the CPU ComfyUI
    otherwise picks sub-quadratic attention, which dynamo cannot trace; on CUDA it picks PyTorch's
    attention by itself."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        raise SystemExit("set COMFYUI_PATH to a ComfyUI checkout")
    # ComfyUI's modules (comfy, folder_paths, nodes, ...) are top-level modules of its own folder, which is
    # on the path when ComfyUI runs its main.py; no bench or pack module is found through this entry.
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    comfy.cli_args.args.cpu = cpu
    if pytorch_attention:
        if "comfy.ldm.modules.attention" in sys.modules:
            raise RuntimeError("comfy.ldm.modules.attention was imported before boot_comfy(pytorch_attention=True)")
        comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy.model_management  # noqa: F401  (reads args)
    import comfy.sample  # noqa: F401
    import comfy.samplers  # noqa: F401
    import comfy.patcher_extension  # noqa: F401
    return path


WAN_CONFIGS = {
    "a14b": dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_dim=16, out_dim=16),
    "ti2v5b": dict(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48),
    "1.3b": dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, in_dim=16, out_dim=16),
    # for CPU smoke runs of the harness only: the Wan 2.1 T2V layout at head dim 128, two blocks
    "tiny": dict(dim=256, ffn_dim=256, num_heads=2, num_layers=2, in_dim=16, out_dim=16),
}


def presets() -> dict:
    """The wan-sage memory preset of each model above (``tiny`` has none: see :func:`wan_dims`): the
    table the measured rows are read with, ``bench.measured_rows.ROW_PRESETS``."""
    from .measured_rows import ROW_PRESETS
    return ROW_PRESETS


def wan_dims(name: str):
    """The memory model's ``WanDims`` of a model of :data:`WAN_CONFIGS`: its preset, or for ``tiny``
    one made from the config (the TI2V-5B latent layout follows ``in_dim`` 48)."""
    from wan_sage.memory import activation_model
    preset = presets().get(name)
    if preset is not None:
        return activation_model.PRESETS[preset]
    c = WAN_CONFIGS[name]
    return activation_model.WanDims(name, c["dim"], c["ffn_dim"], c["num_heads"], c["num_layers"],
                                    in_dim=c["in_dim"], out_dim=c["out_dim"])


def unet_config(name: str) -> dict:
    c = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, freq_dim=256,
             text_dim=4096, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    c.update(WAN_CONFIGS[name])
    return c


def init_random_(module, seed: int = 0):
    """Fill weights so activations stay O(1): N(0, 1/fan_in) for matrices, ones for norm
    scales, small modulation, zero biases.  The same ``seed`` gives the same weights on the same
    kind of device (one generator per device, where the parameters live)."""
    import math
    import torch
    gens = {}

    def gen(dev):
        if dev not in gens:
            gens[dev] = torch.Generator(device=dev).manual_seed(seed)
        return gens[dev]
    for name, p in module.named_parameters():
        with torch.no_grad():
            if "modulation" in name:
                p.normal_(0, 0.02, generator=gen(p.device))
            elif p.ndim >= 2:
                fan_in = math.prod(p.shape[1:])
                p.normal_(0, fan_in ** -0.5, generator=gen(p.device))
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def build_wan(name: str, dtype, device):
    """A real ComfyUI Wan BaseModel with random weights built directly on ``device``."""
    import comfy.model_detection
    import comfy.model_patcher
    import torch
    cfg = unet_config(name)
    mc = comfy.model_detection.model_config_from_unet_config(cfg)
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, "", device=device)
    init_random_(model.diffusion_model)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))
    return patcher


# --------------------------------------------------------------------------- the Sage patch's config

# The patch's memory modes: "sdpa" splits Sage calls into head groups so that Sage needs no more memory
# than SDPA ("grouped"); "fastest" runs them whole unless VRAM is short ("ungrouped").  A checkout whose
# PatchConfig has no ``memory_mode`` field behaves as "fastest".
MEMORY_MODES = {"grouped": "sdpa", "ungrouped": "fastest"}


def patch_classes():
    """(PatchConfig, SageAttentionOverride) of the loaded pack: from whichever module of
    ``wan_sage.attention`` defines both (in name order), so the harness does not name that module."""
    load_pack()
    package = importlib.import_module("wan_sage.attention")
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__))
    for name in names:
        try:
            mod = importlib.import_module(f"wan_sage.attention.{name}")
        except ImportError:
            continue
        if hasattr(mod, "PatchConfig") and hasattr(mod, "SageAttentionOverride"):
            return mod.PatchConfig, mod.SageAttentionOverride
    raise SystemExit("wan_sage.attention defines no PatchConfig / SageAttentionOverride")


def has_memory_mode() -> bool:
    """Whether the installed dispatch's PatchConfig has the ``memory_mode`` field."""
    config_class, _ = patch_classes()
    return "memory_mode" in {f.name for f in dataclasses.fields(config_class)}


def check_memory_modes(modes) -> None:
    """Stop before any work when a requested mode needs the ``memory_mode`` field and the installed
    dispatch lacks it.  "fastest" is what a dispatch without the field does, so it runs without it."""
    missing = sorted({m for m in modes if m not in (None, "fastest")})
    if missing and not has_memory_mode():
        raise SystemExit(f"memory mode {', '.join(missing)} asked for, but this checkout's PatchConfig has no "
                         "memory_mode field. Without it only SDPA and the ungrouped Sage patch (mode 'fastest', "
                         "that checkout's behaviour) can run.")


def patch_config(memory_mode: str | None = None, **kwargs):
    """A PatchConfig with ``memory_mode`` passed straight through; None leaves PatchConfig's default.
    "fastest" is what a dispatch without the field does, so the field is left out there."""
    config_class, _ = patch_classes()
    if memory_mode is not None:
        check_memory_modes([memory_mode])
        if has_memory_mode():
            kwargs["memory_mode"] = memory_mode
    return config_class(**kwargs)


def sage_override(memory_mode: str | None = None, **kwargs):
    """The Sage patch's override as the node installs it, around ComfyUI's own PyTorch attention."""
    from comfy.ldm.modules import attention as comfy_attention
    _, override_class = patch_classes()
    sdpa = getattr(comfy_attention.attention_pytorch, "__wrapped__", comfy_attention.attention_pytorch)
    return override_class(patch_config(memory_mode, **kwargs), sdpa=sdpa)


def wan_state_dict(name: str, dtype, device="cuda", seed=0):
    """A random state dict with ComfyUI Wan key names and real sizes (built on ``device``)."""
    import math
    import torch
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops
    cfg = unet_config(name)
    kw = {k: v for k, v in cfg.items() if k not in ("image_model",)}
    with torch.device("meta"):
        m = comfy_wan.WanModel(**kw, operations=comfy.ops.disable_weight_init, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for k, t in m.state_dict().items():
        shape, dt = t.shape, (torch.float32 if k.startswith("patch_embedding") else dtype)
        if "modulation" in k:
            x = torch.randn(shape, device=device, dtype=torch.float32, generator=g).mul_(0.02)
        elif len(shape) >= 2:
            x = torch.randn(shape, device=device, dtype=torch.float32, generator=g).mul_(math.prod(shape[1:]) ** -0.5)
        elif "norm" in k and k.endswith("weight"):
            x = torch.ones(shape, device=device)
        else:
            x = torch.zeros(shape, device=device)
        sd[k] = x.to(dt)
    return sd


def comfy_env():
    """The in-process ComfyUI host shared with the host-tier tests (``tests/host/comfy_env.py``):
    one boot path (folder paths, torchvision shim, module-origin checks) for tests and bench.  Loaded
    from its file as the module ``comfy_env`` (the name the host tier imports it by), once."""
    if "comfy_env" not in sys.modules:
        spec = importlib.util.spec_from_file_location("comfy_env", ROOT / "tests" / "host" / "comfy_env.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["comfy_env"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["comfy_env"]


def run_tool(tool: str, args, timeout: float = 600, **env):
    """Run a tool of bench as ``python -m bench.TOOL ARGS`` from the repository root, as bench/README.md
    says, with this interpreter and COMFYUI_PATH as the host tier resolves it; ``env`` adds variables.
    Returns the finished process and the JSON objects it printed, one per line (the host-tier tests)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    path = comfy_env().comfy_path()
    if path:
        full_env["COMFYUI_PATH"] = path
    p = subprocess.run([sys.executable, "-m", f"bench.{tool}", *map(str, args)], capture_output=True, text=True,
                       env=full_env, timeout=timeout, cwd=str(ROOT))
    return p, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


class _Absent:
    """Stands for any PyAV class when PyAV is missing; using one raises."""

    def __init__(self, *a, **k):
        raise RuntimeError("PyAV is not installed here (bench._host.ensure_av put a stub in its place): video I/O is unavailable")


def ensure_av(allow_stub: bool) -> str:
    """ComfyUI 0.3.64's ``nodes`` imports PyAV (``av``) for its video types.  Returns "av X.Y" when
    the real package imports; otherwise, if ``allow_stub``, installs stub modules ``av``,
    ``av.container``, ``av.subtitles``, ``av.subtitles.stream`` whose attributes are classes that
    raise when used (the benchmark never reads or writes video) and returns "stub"."""
    try:
        import av
        return f"av {getattr(av, '__version__', '?')}"
    except ImportError:
        if not allow_stub:
            raise SystemExit("PyAV (av) is missing: ComfyUI's nodes import it. Install the wheel, or pass --av-stub")
    import types

    class _Mod(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Absent
    for name in ("av", "av.container", "av.subtitles", "av.subtitles.stream", "av.error", "av.logging"):
        mod = _Mod(name)
        mod.__path__ = []
        mod.__version__ = "0-stub"
        sys.modules[name] = mod
    sys.modules["av"].container = sys.modules["av.container"]
    sys.modules["av"].subtitles = sys.modules["av.subtitles"]
    sys.modules["av.subtitles"].stream = sys.modules["av.subtitles.stream"]
    return "stub"
