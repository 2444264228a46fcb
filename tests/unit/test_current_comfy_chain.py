"""Other nodes on the same model on ComfyUI 0.38, with stand-ins written after the real code:

* core "Model Sparse Attention" (comfy_extras/nodes_sparse_attention.py and
  comfy_extras/sparse_attention_history.py at cf3103c5221f22fd6535b5db2a857d7151e2e2d7:
  ``make_attention_override``, ``mark_attention_override``, ``install_override`` and the ON_PREPARE_STATE
  callback that re-installs it every step; the closure-only form of 01dafad3aa6ccf46e7b6f8b7b61a8138cd8b0261);
  its sigma window through ``ModelSamplingDiscreteFlow.percent_to_sigma`` (comfy/model_sampling.py at
  38a99a826e14dd509ef32cfb68aa981ba782ec41);
* ``ModelPatcher.set_model_optimized_attention`` (comfy/model_patcher.py at
  08d0e510f4e539a1db39072589817136ac6cfa7d), from test_current_comfy_attention;
* KJNodes' "WanVideo Mem Eff Sage Attention Patch" (kijai/ComfyUI-KJNodes nodes/ltxv_nodes.py at
  26a68660b290d54fcc92e45e12045e56e14f3b63: object patches of ``diffusion_model.blocks.N.self_attn.forward``
  with ``wan_sageattn_forward``) and its ``TorchCompileModelAdvanced`` (nodes/model_optimization_nodes.py at
  fadde42973faa83b50cb73c8cd7d584d3744febb: the module-level ``_kj_apply_torch_compile_wrapper`` under the
  "torch.compile" key, its compiled modules in a dict by BaseModel).

Each test fails when the pack's side of its seam breaks; docs/compatibility.md lists them."""
import copy
import logging
from types import SimpleNamespace

import pytest
import torch

from fakegpu import qkv
from test_current_comfy_attention import AttentionTensorContainer, optimized_attention, set_model_optimized_attention
from test_current_comfy_patcher import Base as PatcherBase
from wan_sage.attention import kernels, stats
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.memory.estimate import plan
from wan_sage.nodes import comfy_bridge, estimator, sage_patch
from wan_sage.nodes.log_once import warned

GiB = 1 << 30
SHAPE = [1, 16, 21, 90, 160]  # 1280x720x81 for Wan 2.1/A14B: 75,600 tokens


# ------------------------------------------------------------------ stand-ins

def time_snr_shift(alpha, t):
    if alpha == 1.0:
        return t
    return alpha * t / (1 + (alpha - 1) * t)


class ModelSamplingDiscreteFlow:
    """``percent_to_sigma`` as model_sampling.py@38a99a82 has it (Wan's shift 8 here)."""

    def __init__(self, shift=8.0):
        self.shift = shift

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return time_snr_shift(self.shift, 1.0 - percent)


class SparseAttnPatch:
    """The options BlockSparseAttention keeps (nodes_sparse_attention.py@cf3103c5, ``SparseAttnPatch``)."""

    def __init__(self, model_sampling, start_percent=0.2, end_percent=1.0, min_tokens=12288, dense_blocks=(),
                 vsa=False):
        self.vsa = vsa
        self.sigma_start = float(model_sampling.percent_to_sigma(start_percent))
        self.sigma_end = float(model_sampling.percent_to_sigma(end_percent))
        self.min_tokens = min_tokens
        self.dense_blocks = set(dense_blocks)
        self.installed = set()
        self.sparse_calls = 0

    def dense_reason(self, transformer_options, tokens, block_index):
        sigmas = transformer_options.get("sigmas")
        if sigmas is not None:
            sigma = float(sigmas[0])
            if sigma > self.sigma_start or sigma < self.sigma_end:
                return "sigma outside the start/end window"
        if tokens < self.min_tokens:
            return "short"
        if block_index in self.dense_blocks:
            return "dense block"
        return None


def make_attention_override(patch, previous, marked=True):
    """BSA's override: dense calls go to ``previous`` (or ``func``); the rest run its sparse kernel (here a
    counted SDPA).  ``marked``: publish ``_block_sparse_attention_patch/_previous`` as cf3103c5 does
    (mark_attention_override); unmarked, the previous override is only in the closure (01dafad3)."""
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        transformer_options = kwargs.get("transformer_options") or {}

        def dense():
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
        if mask is not None or patch.vsa:
            return dense()
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        if patch.dense_reason(transformer_options, tokens, transformer_options.get("block_index")) is not None:
            return dense()
        if q.shape != k.shape:  # _ineligible: cross-attention stays dense
            return dense()
        patch.sparse_calls += 1
        return func(q, k, v, heads, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    if marked:
        override._block_sparse_attention_patch = patch
        override._block_sparse_attention_previous = previous
    return override


def install_override(patch, transformer_options, marked=True):
    """``install_override``: on top of whatever is in the slot; a no-op once one of its own is on top."""
    current = transformer_options.get("optimized_attention_override")
    if current in patch.installed:
        return
    override = make_attention_override(patch, current, marked)
    patch.installed.add(override)
    transformer_options["optimized_attention_override"] = override


def prepare_state(patch, model_options, marked=True):
    """The ON_PREPARE_STATE callback BSA adds: runs before every step (samplers.py's prepare_state)."""
    install_override(patch, model_options["transformer_options"], marked)


def wan_sageattn_forward(self, x, freqs, transformer_options={}):
    """Stands in for KJNodes' replacement self-attention forward (its own Sage call, no ComfyUI attention)."""
    raise AssertionError("not run in these tests")


wan_sageattn_forward.__module__ = "custom_nodes.ComfyUI-KJNodes.nodes.ltxv_nodes"


def _kj_apply_torch_compile_wrapper(executor, *args, **kwargs):
    """KJNodes' compile wrapper: module level, no closure; its compiled modules live in a dict by BaseModel."""
    return executor(*args, **kwargs)


_kj_apply_torch_compile_wrapper.__module__ = "custom_nodes.ComfyUI-KJNodes.nodes.model_optimization_nodes"


class Base(PatcherBase):
    """The Wan 14B BaseModel stand-in of the patcher tests, with the flow model sampling BSA reads."""

    def __init__(self):
        super().__init__()
        self.model_sampling = ModelSamplingDiscreteFlow()


class Patcher:
    def __init__(self):
        self.model = Base()
        self.load_device = torch.device("cpu")
        self.model_options = {"transformer_options": {}}
        self.object_patches = {}
        self.wrappers = {}

    def clone(self):
        c = copy.copy(self)
        c.model_options = copy.deepcopy(self.model_options)
        c.object_patches = dict(self.object_patches)
        c.wrappers = copy.deepcopy(self.wrappers)
        return c

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    def add_object_patch(self, key, obj):
        self.object_patches[key] = obj

    def model_size(self):
        return 16 * GiB

    def is_dynamic(self):
        return False

    def get_model_object(self, name):
        return self.object_patches.get(name) or getattr(self.model, name)


@pytest.fixture
def comfy(monkeypatch):
    """What apply_patch and setup_for need from ComfyUI, stood in."""
    monkeypatch.setattr(comfy_bridge, "is_wan", lambda model: True)
    monkeypatch.setattr(kernels, "any_kernel_importable", lambda: True)
    monkeypatch.setattr(comfy_bridge, "wrappers_mp", lambda: SimpleNamespace(OUTER_SAMPLE="outer_sample"))
    monkeypatch.setattr(comfy_bridge, "raw_sdpa", lambda: None)
    monkeypatch.setattr(comfy_bridge, "capacity", lambda model: 200 * GiB)
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 400 << 20)
    monkeypatch.setattr(comfy_bridge, "vae_dtype_size", lambda dev: 2)   # bf16, as ComfyUI decodes a Wan VAE on CUDA
    monkeypatch.setattr(sage_patch, "status_text", lambda kernel: f"kernel: {kernel}")
    warned.clear()
    yield
    warned.clear()


def _patched(model=None, **kw):
    m, text = sage_patch.apply_patch(model or Patcher(), **kw)
    return m, text


def _estimate(m, settings=estimator.Settings(count_sage="always")):
    return plan(estimator.setup_for(m, SHAPE, m.model_options, settings))


def _guider(m):
    return SimpleNamespace(class_obj=SimpleNamespace(model_options=m.model_options, model_patcher=m))


def _outer(m):
    (fn,) = m.wrappers["outer_sample"][sage_patch.OUTER_KEY]
    return fn


class Exec:
    def __init__(self, m):
        self.class_obj = SimpleNamespace(model_options=m.model_options, model_patcher=m)

    def __call__(self, *a, **k):
        return "sampled"


# ------------------------------------------------------------------ Model Sparse Attention

@pytest.mark.parametrize("marked", [True, False], ids=["cf3103c5", "closure-only"])
def test_the_patch_is_found_under_block_sparse_attention_and_its_reinstalls(comfy, marked, caplog):
    m, _ = _patched()
    ours = m.model_options["transformer_options"]["optimized_attention_override"]
    patch = SparseAttnPatch(m.model.model_sampling)
    install_override(patch, m.model_options["transformer_options"], marked)   # BSA after the Sage patch
    assert sage_patch.find_override(m.model_options["transformer_options"]) is ours
    for _step in range(3):
        prepare_state(patch, m.model_options, marked)                           # every step: idempotent on top
        assert sage_patch.find_override(m.model_options["transformer_options"]) is ours
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        assert _outer(m)(Exec(m)) == "sampled"
    messages = [r.getMessage() for r in caplog.records]
    assert not any("replaced the Sage attention override" in t for t in messages)
    if marked:
        assert any("Model Sparse Attention (BlockSparseAttention) over the Sage patch" in t for t in messages)


def test_a_sparse_attention_node_before_the_patch_reinstalls_itself_on_top_and_dense_calls_run_on_sage(
        comfy, fake_gpu, caplog):
    base = Patcher()
    patch = SparseAttnPatch(base.model.model_sampling)
    install_override(patch, base.model_options["transformer_options"])          # BSA first, then the Sage patch
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        m, _ = _patched(base)
    assert not any("already has an attention override" in r.getMessage() for r in caplog.records)
    assert any("puts itself back on top at every step" in r.getMessage() for r in caplog.records)
    ours = m.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(ours, SageAttentionOverride)
    prepare_state(patch, m.model_options)                                       # step 1: BSA wraps Sage now
    to = m.model_options["transformer_options"]
    assert to["optimized_attention_override"] is not ours
    assert sage_patch.find_override(to) is ours
    q, k, v = qkv(N=12288, H=2, D=64)
    stats.begin_run(ours.patch_id)
    for sigma in (1.0, 0.5):                                                    # before start_percent: dense
        opts = dict(to, sigmas=torch.tensor([sigma]), block_index=0)
        optimized_attention(*(AttentionTensorContainer(t) for t in (q, k, v)), heads=2, transformer_options=opts)
    s = stats.end_run(ours.patch_id)
    assert s["sage_calls"] == 1 and patch.sparse_calls == 1                    # the dense one on Sage


def test_the_estimate_under_sparse_attention_counts_the_sage_bytes_and_says_the_dense_share(comfy):
    m, _ = _patched()
    alone = _estimate(m)
    patch = SparseAttnPatch(m.model.model_sampling, start_percent=0.2, dense_blocks=range(4))
    install_override(patch, m.model_options["transformer_options"])
    under = _estimate(m)
    assert under.setup.attention.kernel == alone.setup.attention.kernel is not None
    assert under.sage_extra == alone.sage_extra > 0 and under.reservation == alone.reservation
    (note,) = [n for n in under.notes if "Model Sparse Attention" in n]
    assert "28% of self-attention calls stay dense" in note                     # 1 - 0.8 x (1 - 4/40)
    assert "counted in full" in note
    every = SparseAttnPatch(m.model.model_sampling, start_percent=0.0, min_tokens=1024)
    m2, _ = _patched()
    install_override(every, m2.model_options["transformer_options"])
    (note,) = [n for n in _estimate(m2).notes if "Model Sparse Attention" in n]
    assert "runs every self-attention call sparse" in note and "not measured" in note
    short = SparseAttnPatch(m.model.model_sampling, min_tokens=100_000)
    assert comfy_bridge.bsa_dense_share(short, m, 40, 75_600, 128)[0] == 1.0


def test_head_groups_under_sparse_attention_are_counted_as_the_patch_runs_them(comfy, monkeypatch):
    from wan_sage.attention import override as override_module
    m, _ = _patched(memory_mode="sdpa")
    L = 75_600
    monkeypatch.setattr(override_module, "settled_shapes", lambda: [
        {"kernel": "sage2_sm90", "groups": 4, "Nq": L, "Nk": L, "H": 40, "D": 128}])
    install_override(SparseAttnPatch(m.model.model_sampling), m.model_options["transformer_options"])
    est = _estimate(m)
    assert est.setup.sage_grouped and est.sage_head_groups > 1


# ------------------------------------------------------------------ set_model_optimized_attention

def test_set_model_optimized_attention_after_the_patch_is_named_as_displacing_it(comfy, caplog):
    m, _ = _patched()

    def attention_pytorch(*a, **k):
        return None
    set_model_optimized_attention(m.model_options, attention_pytorch)
    to = m.model_options["transformer_options"]
    assert sage_patch.find_override(to) is None
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        _outer(m)(Exec(m))
    (msg,) = [r.getMessage() for r in caplog.records if "replaced the Sage attention override" in r.getMessage()]
    assert "set_model_optimized_attention" in msg and "attention_pytorch" in msg
    est = _estimate(m, estimator.Settings())
    assert est.setup.attention.kernel is None
    assert any("set_model_optimized_attention" in n and "does not hand calls on" in n for n in est.notes)


# ------------------------------------------------------------------ KJNodes

def _with_kj_sage(model):
    m = model.clone()
    for idx in range(len(m.model.diffusion_model.blocks)):
        m.add_object_patch(f"diffusion_model.blocks.{idx}.self_attn.forward",
                           wan_sageattn_forward.__get__(SimpleNamespace(), SimpleNamespace))
    return m


def test_kjnodes_sage_patch_on_the_model_is_said_to_bypass_wan_sage(comfy, caplog):
    m, status = _patched(_with_kj_sage(Patcher()))                              # KJNodes before the Sage patch
    assert sage_patch.KJ_BYPASS in status and "40 blocks" in status
    after = _with_kj_sage(_patched()[0])                                         # KJNodes after it
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        _outer(after)(Exec(after))
    assert any(sage_patch.KJ_BYPASS in r.getMessage() for r in caplog.records)
    est = _estimate(after)
    assert any(n.startswith(sage_patch.KJ_BYPASS) for n in est.notes)
    assert est.setup.attention.self_path == "sdpa" and est.setup.attention.self_by == "KJNodes' Mem Eff Sage"
    from wan_sage.memory import report
    text = report.report(est)
    assert "KJNodes' Mem Eff Sage for self-attention" in text and f"note: {sage_patch.KJ_BYPASS}" in text


def test_kjnodes_compile_wrapper_is_planned_as_eager_with_its_scope_unknown(comfy):
    m, _ = _patched()
    m.add_wrapper_with_key("apply_model", "torch.compile", _kj_apply_torch_compile_wrapper)
    m.model_options["torch_compile_kwargs"] = {"backend": "inductor", "fullgraph": False}
    assert comfy_bridge.compile_scope(m) == (comfy_bridge.UNKNOWN_SCOPE, "KJNodes' TorchCompileModelAdvanced")
    est = _estimate(m)
    assert not est.setup.compiled
    assert any(n.startswith("compile scope unknown: planned as eager") for n in est.notes)


# ------------------------------------------------------------------ Raylight's inner-attention slot

def test_patch_installs_the_inner_attention_processor_on_the_clone(comfy):
    from wan_sage.attention.inner_attention import INNER_ATTENTION_KEY, InnerAttention
    model = Patcher()
    m, _text = _patched(model)
    p = m.model_options["transformer_options"][INNER_ATTENTION_KEY]
    assert isinstance(p, InnerAttention) and p.prev is None
    assert p.override is m.model_options["transformer_options"][comfy_bridge.OVERRIDE_KEY]
    assert INNER_ATTENTION_KEY not in model.model_options["transformer_options"]
    assert m.clone().model_options["transformer_options"][INNER_ATTENTION_KEY] is p  # deepcopy keeps it


def test_patch_chains_another_processor_and_replaces_its_own(comfy):
    from wan_sage.attention.inner_attention import INNER_ATTENTION_KEY

    class Other:
        supports_ring = False
    other = Other()
    model = Patcher()
    model.model_options["transformer_options"][INNER_ATTENTION_KEY] = other
    m, _ = _patched(model)
    again, _ = _patched(m)
    p = again.model_options["transformer_options"][INNER_ATTENTION_KEY]
    assert isinstance(p.prev, Other) and not isinstance(p.prev.__dict__.get("prev"), Other)
    assert p is not m.model_options["transformer_options"][INNER_ATTENTION_KEY]


def test_patch_leaves_raylight_ring_attention_alone(comfy, monkeypatch):
    import sys
    from wan_sage.attention.inner_attention import INNER_ATTENTION_KEY
    from wan_sage.nodes import raylight_bridge
    xd = SimpleNamespace(model_parallel_is_initialized=lambda: True, get_ulysses_parallel_world_size=lambda: 2,
                         get_ring_parallel_world_size=lambda: 2, get_classifier_free_guidance_world_size=lambda: 1)
    monkeypatch.setitem(sys.modules, raylight_bridge.XFUSER_MODULE, xd)
    m, text = _patched()
    assert INNER_ATTENTION_KEY not in m.model_options["transformer_options"]
    assert "ring degree 2" in text


def test_patch_registers_its_factory_when_raylight_is_loaded(comfy, monkeypatch):
    import sys
    from wan_sage.attention.inner_attention import PROCESSOR_NAME, InnerAttention
    from wan_sage.nodes import raylight_bridge
    registered = {}

    class Registry:
        @classmethod
        def available(cls):
            return tuple(registered)

    def register_inner_attention(name):
        def deco(factory):
            assert name not in registered
            registered[name] = factory
            return factory
        return deco
    fake = SimpleNamespace(InnerAttentionRegistry=Registry, register_inner_attention=register_inner_attention)
    monkeypatch.setitem(sys.modules, raylight_bridge.RAYLIGHT_REGISTRY_MODULE, fake)
    _patched()
    _patched()
    assert isinstance(registered[PROCESSOR_NAME](min_tokens=2048), InnerAttention)


def test_estimator_reads_raylight_degrees_from_the_xfuser_runtime(comfy, monkeypatch):
    import sys
    from wan_sage.nodes import raylight_bridge
    assert _estimate(Patcher()).per_rank is None  # one GPU: no xFuser runtime, no FSDP
    xd = SimpleNamespace(model_parallel_is_initialized=lambda: True, get_ulysses_parallel_world_size=lambda: 2,
                         get_ring_parallel_world_size=lambda: 1, get_classifier_free_guidance_world_size=lambda: 2)
    monkeypatch.setitem(sys.modules, raylight_bridge.XFUSER_MODULE, xd)
    r = _estimate(Patcher()).per_rank
    assert (r["ulysses"], r["ring"], r["cfg_parallel"], r["fsdp"]) == (2, 1, True, False)
    assert r["heads_per_rank"] == 20
