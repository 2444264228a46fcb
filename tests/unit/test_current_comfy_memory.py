"""ComfyUI 0.38's memory seams and dynamic VRAM, with stand-ins written after the real code:

* PREPARE_SAMPLING: comfy/sampler_helpers.py at 53757775fa600326922e53e61dcb5ef54e9abbe1
  (``prepare_sampling(model, noise_shape, conds, model_options=None, force_full_load=False,
  force_offload=False)`` through the wrapper executor, ``estimate_memory`` asking ``memory_required`` for
  the batch of 2 and of 1 with ``cond_shapes`` and ``memory_efficient_attention``; ``force_offload`` loads
  with 1e20);
* CALC_COND_BATCH: comfy/samplers.py at 311c01406130b2acbe8ab291043502de26cf3871
  (``executor.execute(model, conds, x_in, timestep, model_options)`` with the BaseModel; inside,
  ``current_patcher.prepare_state`` then the batching test
  ``model.memory_required(input_shape, cond_shapes=...) * 1.5 < model.current_patcher.get_free_memory(dev)``);
* ``ModelPatcher.get_free_memory`` and ``ModelPatcherDynamic`` (comfy/model_patcher.py at
  08d0e510f4e539a1db39072589817136ac6cfa7d): torch's free memory plus what comfy-aimdo can reclaim
  (``vbars_analyze``); ``is_dynamic()`` True; dynamic VRAM evicts weights on demand.

Each test fails when the pack's side of its seam breaks; docs/compatibility.md lists them."""
import collections
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from test_current_comfy_chain import Base, Patcher
from wan_sage.attention import kernels
from wan_sage.memory import report
from wan_sage.memory.estimate import plan
from wan_sage.nodes import comfy_bridge, estimator, sage_patch
from wan_sage.nodes.log_once import warned

GiB = 1 << 30
LATENT = [1, 16, 21, 90, 160]


# ------------------------------------------------------------------ stand-ins

class WrapperExecutor:
    """patcher_extension's executor: each wrapper gets the next one as ``executor``."""

    def __init__(self, fn, wrappers):
        self.fn, self.wrappers, self.class_obj = fn, list(wrappers), None

    def __call__(self, *args, **kwargs):
        if not self.wrappers:
            return self.fn(*args, **kwargs)
        nxt = WrapperExecutor(self.fn, self.wrappers[1:])
        return self.wrappers[0](nxt, *args, **kwargs)

    execute = __call__


def prepare_sampling(model, noise_shape, conds, model_options=None, force_full_load=False, force_offload=False,
                     loads=None):
    """sampler_helpers.prepare_sampling@53757775 through its PREPARE_SAMPLING wrappers."""
    def _prepare_sampling(model, noise_shape, conds, model_options=None, force_full_load=False, force_offload=False):
        if force_offload:
            memory_required, minimum = 1e20, None
        else:
            mea = model.model_options.get("optimized_attention_memory_efficient")
            memory_required = model.model.memory_required([noise_shape[0] * 2] + list(noise_shape[1:]),
                                                          cond_shapes=collections.defaultdict(list),
                                                          memory_efficient_attention=mea)
            minimum = model.model.memory_required([noise_shape[0]] + list(noise_shape[1:]), cond_shapes={},
                                                  memory_efficient_attention=mea)
        loads.append((memory_required, minimum, force_full_load))
        return model.model, conds, []
    wrappers = [w for ws in model.wrappers.get("prepare_sampling", {}).values() for w in ws]
    return WrapperExecutor(_prepare_sampling, wrappers).execute(
        model, noise_shape, conds, model_options=model_options, force_full_load=force_full_load,
        force_offload=force_offload)


def calc_cond_batch(model, patcher, conds, x_in, timestep, model_options):
    """samplers._calc_cond_batch_outer/_calc_cond_batch@311c0140, down to the batching decision: the rows
    of the first forward (2 when cond and uncond run batched)."""
    def _calc_cond_batch(model, conds, x_in, timestep, model_options):
        model.current_patcher.prepare_state(timestep, model_options)
        free_memory = model.current_patcher.get_free_memory(x_in.device)
        to_batch_temp = list(range(len(conds)))
        for i in range(1, len(to_batch_temp) + 1):
            batch_amount = to_batch_temp[:len(to_batch_temp) // i]
            input_shape = [len(batch_amount) * x_in.shape[0]] + list(x_in.shape)[1:]
            if model.memory_required(input_shape, cond_shapes=collections.defaultdict(list)) * 1.5 < free_memory:
                return len(batch_amount)
        return 1
    wrappers = [w for ws in patcher.wrappers.get("calc_cond_batch", {}).values() for w in ws]
    return WrapperExecutor(_calc_cond_batch, wrappers).execute(model, conds, x_in, timestep, model_options)


class DynamicPatcher(Patcher):
    """ModelPatcherDynamic: is_dynamic(); get_free_memory counts what comfy-aimdo can reclaim."""

    def __init__(self, torch_free=4 * GiB, aimdo_reclaimable=0):
        super().__init__()
        self.torch_free, self.aimdo_reclaimable = torch_free, aimdo_reclaimable

    def is_dynamic(self):
        return True

    def get_free_memory(self, device):
        return self.torch_free + self.aimdo_reclaimable

    def prepare_state(self, timestep, model_options):
        pass


class Fp8Base(Base):
    """Weights stored in fp8, computed in bf16: every Linear casts (comfy_bridge.weight_setup sees fp8)."""

    def __init__(self):
        super().__init__()
        self.manual_cast_dtype = torch.bfloat16

    def get_dtype(self):
        return torch.float8_e4m3fn


@pytest.fixture
def comfy(monkeypatch):
    monkeypatch.setattr(comfy_bridge, "is_wan", lambda model: True)
    monkeypatch.setattr(comfy_bridge, "capacity", lambda model: 60 * GiB)
    monkeypatch.setattr(comfy_bridge, "total_memory", lambda dev: 80 * GiB)
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 400 << 20)
    monkeypatch.setattr(comfy_bridge, "vae_dtype_size", lambda dev: 2)   # bf16, as ComfyUI decodes a Wan VAE on CUDA
    monkeypatch.setattr(comfy_bridge, "aimdo_enabled", lambda: True)
    monkeypatch.setattr(comfy_bridge, "wrappers_mp", lambda: SimpleNamespace(
        PREPARE_SAMPLING="prepare_sampling", CALC_COND_BATCH="calc_cond_batch", OUTER_SAMPLE="outer_sample"))
    monkeypatch.setattr(comfy_bridge, "raw_sdpa", lambda: None)
    monkeypatch.setattr(kernels, "any_kernel_importable", lambda: True)
    monkeypatch.setattr(sage_patch, "status_text", lambda kernel: f"kernel: {kernel}")
    warned.clear()
    yield
    warned.clear()


def _estimated(model, cfg=5.0):
    m, est, text = estimator.apply_estimator(model, estimator.Settings(), LATENT, cfg=cfg)
    return m, est, text


# ------------------------------------------------------------------ PREPARE_SAMPLING

def test_prepare_sampling_reserves_on_the_legacy_path_and_forwards_every_argument(comfy):
    m, est, _ = _estimated(Patcher())
    loads = []
    out = prepare_sampling(m, LATENT, {}, model_options=m.model_options, force_full_load=True, loads=loads)
    assert out[0] is m.model and "memory_required" not in m.model.__dict__
    fn = estimator.MemoryRequired(replace(est.setup, streamed=est.streamed))
    assert loads == [(fn([2] + LATENT[1:]), fn(LATENT), True)]
    prepare_sampling(m, LATENT, {}, model_options=m.model_options, force_offload=True, loads=loads)
    assert loads[-1] == (1e20, None, False)                                     # force_offload reaches ComfyUI


def test_prepare_sampling_moves_no_weights_on_the_dynamic_path(comfy):
    m, _est, _ = _estimated(DynamicPatcher())
    m.model.memory_required = lambda shape, cond_shapes={}, **kw: 123              # ComfyUI's own figure
    loads = []
    prepare_sampling(m, LATENT, {}, model_options=m.model_options, loads=loads)
    assert loads == [(123, 123, False)]


# ------------------------------------------------------------------ CALC_COND_BATCH and get_free_memory

def test_cond_batching_is_asked_the_reservations_figure_with_the_weights_casts(comfy):
    p = Patcher()
    p.model = Fp8Base()
    m, est, _ = _estimated(p)
    m.model.current_patcher = m
    seen = []

    def spy(executor, model, *a, **k):
        seen.append(model.__dict__["memory_required"]([2] + LATENT[1:]))
        return executor(model, *a, **k)
    m.wrappers["calc_cond_batch"]["spy"] = [spy]
    m.get_free_memory = lambda dev: 1 << 50
    m.prepare_state = lambda t, mo: None
    calc_cond_batch(m.model, m, [[{}], [{}]], torch.zeros(LATENT), torch.ones(1), m.model_options)
    assert est.setup.weights.casts_to("bf16")
    batched = est.reservation_batched_partial if est.streamed else est.reservation_batched_resident
    # the room kept for the VAE decode places the weights at load; it is not asked of the batching test
    assert seen == [batched] and est.reservation == est.decode_floor != batched


@pytest.mark.parametrize("compile_first", [True, False])
def test_cond_batching_keeps_to_the_rows_wan_compile_blocks_ran_whichever_wrapper_is_outside(comfy, compile_first):
    """Wan Compile Blocks' CALC_COND_BATCH wrapper (nodes/cond_rows.py) beside the estimator's, on 0.38's batching
    test: with room for both rows, one forward of 2 until the blocks have run compiled on 1 row, then 1."""
    from wan_sage.nodes import cond_rows

    class Block(torch.nn.Module):
        pass
    cond_rows.forget()
    p = Patcher()
    p.model = Base()
    m, _est, _ = _estimated(p)
    m.model.current_patcher = m
    held = {cond_rows.KEY: [cond_rows.wrapper(Block)]}
    own = m.wrappers["calc_cond_batch"]
    m.wrappers["calc_cond_batch"] = {**held, **own} if compile_first else {**own, **held}
    m.get_free_memory = lambda dev: 1 << 50
    m.prepare_state = lambda t, mo: None
    try:
        args = (m.model, m, [[{}], [{}]], torch.zeros(LATENT), torch.ones(1), m.model_options)
        assert calc_cond_batch(*args) == 2
        cond_rows.ran(Block, 1)
        assert calc_cond_batch(*args) == 1 and "memory_required" not in m.model.__dict__
    finally:
        cond_rows.forget()


@pytest.mark.parametrize("headroom,rows", [(1.01, 2), (0.99, 1)])
def test_dynamic_cond_batching_counts_what_aimdo_can_reclaim(comfy, headroom, rows):
    """The test is 1.5 x memory_required against get_free_memory, which on a dynamic model includes the
    weight pages comfy-aimdo can evict: the batched forward runs when 1.5 x the batched figure is free."""
    p = DynamicPatcher(torch_free=2 * GiB)
    m, est, text = _estimated(p)
    m.model.current_patcher = m
    batched = est.reservation_batched_partial if est.streamed else est.reservation_batched_resident
    m.aimdo_reclaimable = int(1.5 * batched * headroom) - m.torch_free
    got = calc_cond_batch(m.model, m, [[{}], [{}]], torch.zeros(LATENT), torch.ones(1), m.model_options)
    assert got == rows and "memory_required" not in m.model.__dict__
    assert f"cond/uncond batching gets {batched / GiB:.2f} GiB for the batched forward" in text


def test_the_sage_patch_checks_free_memory_through_the_dynamic_patcher(comfy):
    m, _ = sage_patch.apply_patch(DynamicPatcher(torch_free=3 * GiB, aimdo_reclaimable=5 * GiB))
    ov = m.model_options["transformer_options"]["optimized_attention_override"]
    m.model.current_patcher = m
    assert ov.free_memory(torch.device("cpu")) == 8 * GiB


# ------------------------------------------------------------------ what the estimate does under dynamic VRAM

def test_under_dynamic_vram_the_activations_are_checked_against_the_card(comfy, monkeypatch):
    m, est, text = _estimated(DynamicPatcher())
    assert est.setup.dynamic_vram and est.setup.vram_bytes == 80 * GiB          # the card, not free memory
    assert est.level == "fits" and est.verdict == "fits: all weights resident"
    assert ("memory path: dynamic VRAM: ComfyUI evicts weights on demand, so wan-sage reserves nothing for their "
            "placement; it checked the activations against the card (80.0 GiB less 0.4 GiB kept free): they fit "
            "with every weight resident") in text
    monkeypatch.setattr(comfy_bridge, "total_memory", lambda dev: 20 * GiB)
    _m, est, text = _estimated(DynamicPatcher())
    assert est.level == "offloads" and "weights evicted on demand (dynamic VRAM)" in est.verdict
    assert "they fit with about" in text
    monkeypatch.setattr(comfy_bridge, "total_memory", lambda dev: 4 * GiB)
    _m, est, text = _estimated(DynamicPatcher())
    assert est.level == "cannot" and est.verdict.startswith("cannot fit its activations even with every weight evicted")


def test_under_dynamic_vram_the_report_says_which_sage_memory_mode_avoids_running_out(comfy, monkeypatch):
    m, _ = sage_patch.apply_patch(DynamicPatcher(), memory_mode="fastest")
    ungrouped = plan(estimator.setup_for(m, LATENT, m.model_options, estimator.Settings()))
    grouped = plan(replace(ungrouped.setup, sage_grouped=True))
    assert ungrouped.reservation_partial > grouped.reservation_partial
    card = (ungrouped.reservation_partial + grouped.reservation_partial) // 2 + (400 << 20)
    monkeypatch.setattr(comfy_bridge, "total_memory", lambda dev: card)
    _m, est, text = _estimated(m)
    assert est.level == "cannot"
    assert est.sage_advice and "set the Sage patch's memory_mode to \"within SDPA's memory\"" in est.sage_advice
    assert est.sage_advice in text and report.summary(est)["sage_advice"] == est.sage_advice
    m2, _ = sage_patch.apply_patch(DynamicPatcher(), memory_mode="sdpa")
    _m, est2, _ = _estimated(m2)
    assert "the patch's memory_mode \"within SDPA's memory\" runs it grouped, keep it" in est2.sage_advice


def test_the_legacy_path_says_why_it_reserves(comfy, monkeypatch):
    _m, est, text = _estimated(Patcher())
    assert "memory path: legacy (this model's patcher is not dynamic): the reservation of" in text
    monkeypatch.setattr(comfy_bridge, "aimdo_enabled", lambda: False)

    class GGUFModelPatcher(Patcher):
        pass
    _m, est, text = _estimated(GGUFModelPatcher())
    assert "memory path: legacy (GGUF models stay on it)" in text
