"""Whether torch.compile pays back for a sampling run: the payback model (memory/compile_payback.py), its line
(memory/report.py) and what the Sage patch's OUTER_SAMPLE wrapper reads from ComfyUI for it
(nodes/compile_advice.py), with stand-in objects written after ComfyUI 0.3.64's CFGGuider.outer_sample."""
import logging
from types import SimpleNamespace

import pytest
import torch

from wan_sage.attention import stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.memory import activation_model, compile_payback as cp, report
from wan_sage.nodes import comfy_bridge, compile_advice, sage_patch
from wan_sage.nodes.log_once import warned

A14B = activation_model.PRESETS["wan2.2-a14b"]
LATENT_720P81 = (1, 16, 21, 90, 160)
TOKENS_720P81 = activation_model.tokens(A14B, 21, 90, 160)
BLOCK_KEYS = [f"diffusion_model.blocks.{i}" for i in range(40)]


def _payback(steps, **kw):
    return cp.compile_payback(A14B, TOKENS_720P81, steps=steps, **kw)


# ------------------------------------------------------------------ the model and its line

def test_a_4_step_a14b_720p_prompt_runs_eager():
    for shared_by in (1, 2):  # 2 steps per expert, whether the experts share the graph or not
        p = _payback(2, shared_by=shared_by)
        assert p.pays_back is False and p.payback_steps > 2
        assert f"this model samples 2: run eager for one prompt; over one process's prompts of these steps it " \
               f"pays back by prompt {p.payback_prompt}" in report.compile_payback_line(p)


def test_a_30_step_prompt_pays_back():
    p = _payback(30)
    assert p.pays_back is True and p.payback_steps <= 30
    line = report.compile_payback_line(p)
    assert line.startswith(f"compile: about {p.compile_s:.0f} s to compile in a fresh process (1 graph for the blocks)")
    assert f"pays back after {p.payback_steps} steps per model" in line
    assert line.endswith("this model samples 30: compile pays back")


def test_the_payback_step_count_grows_with_the_compile_cost(monkeypatch):
    resident = _payback(20)
    streamed = _payback(20, streamed=True)
    whole = _payback(20, whole_model=True)
    assert resident.compile_s < streamed.compile_s < whole.compile_s
    assert resident.payback_steps < streamed.payback_steps < whole.payback_steps
    assert streamed.graphs == A14B.num_layers and resident.graphs == whole.graphs == 1
    monkeypatch.setattr(cp, "FIRST_GRAPH_S", 2 * cp.FIRST_GRAPH_S)
    dearer = _payback(20)
    assert dearer.compile_s == 2 * resident.compile_s and dearer.payback_steps > resident.payback_steps


def test_the_step_gain_scales_with_rows_tokens_width_and_blocks_and_the_payback_falls_with_it():
    one = _payback(10)
    assert _payback(10, rows=2).step_gain_s == pytest.approx(2 * one.step_gain_s)
    assert cp.compile_payback(A14B, TOKENS_720P81 // 2, steps=10).step_gain_s == pytest.approx(one.step_gain_s / 2)
    small = activation_model.PRESETS["wan2.1-1.3b"]
    ratio = (small.dim * small.num_layers) / (A14B.dim * A14B.num_layers)
    assert cp.compile_payback(small, TOKENS_720P81, steps=10).step_gain_s == pytest.approx(ratio * one.step_gain_s)
    assert _payback(10, rows=2).payback_steps < one.payback_steps


def test_two_experts_share_the_graph_only_with_resident_weights():
    alone, shared = _payback(10), _payback(10, shared_by=2)
    assert shared.compile_s == alone.compile_s and shared.payback_steps < alone.payback_steps
    assert "shared with the other model of this schedule" in report.compile_payback_line(shared)
    assert _payback(10, streamed=True, shared_by=2).shared_by == 1  # a streamed second expert may compile again


def test_the_prompt_that_pays_back_is_the_first_whose_steps_have_saved_the_compile():
    for steps, shared_by, kept in ((2, 2, False), (2, 2, True), (2, 1, False), (5, 1, False), (1, 2, True)):
        p = _payback(steps, shared_by=shared_by, kept=kept)
        share, per_prompt = p.compile_s / p.shared_by, p.step_gain_s * steps
        n = p.payback_prompt
        assert n * per_prompt >= share - 1e-9 and (n - 1) * per_prompt < share, (steps, shared_by, kept, n)
    assert _payback(30).payback_prompt == 1 and "pays back by prompt" not in report.compile_payback_line(_payback(30))
    assert _payback(0).payback_prompt is None and _payback(None).payback_prompt is None


def test_the_packs_compile_file_shortens_only_the_block_graph_of_resident_weights():
    fresh, kept = _payback(2, shared_by=2), _payback(2, shared_by=2, kept=True)
    assert kept.kept and kept.compile_s == cp.KEPT_GRAPH_S < fresh.compile_s == cp.FIRST_GRAPH_S
    assert kept.payback_steps < fresh.payback_steps and kept.payback_prompt < fresh.payback_prompt
    assert report.compile_payback_line(kept).startswith(
        "compile: about 5 s to compile in a fresh process with the pack's compile file of this run (1 graph")
    assert report.compile_payback_line(fresh).startswith("compile: about 20 s to compile in a fresh process (1 graph")
    for kw in ({"streamed": True}, {"whole_model": True}):  # not measured to give these back: their cost stands
        assert _payback(2, kept=True, **kw) == _payback(2, **kw)


def test_missing_step_counts_are_said_and_give_no_verdict():
    p = _payback(None)
    assert p.steps is None and p.pays_back is None
    assert report.compile_payback_line(p).endswith("the steps of this run are not known")
    s = report.compile_payback_summary(p)
    assert s["pays_back"] is None and s["steps"] is None and s["text"] == report.compile_payback_line(p)


# ------------------------------------------------------------------ what the wrapper reads from ComfyUI

def _compile_wrapper(keys):
    """Made the way ComfyUI's apply_torch_compile_factory makes it: a closure over the compiled keys' dict."""
    compiled_module_dict = {k: object() for k in keys}

    def apply_torch_compile_wrapper(executor, *args, **kwargs):
        return compiled_module_dict, executor
    return apply_torch_compile_wrapper


def _patcher(keys=BLOCK_KEYS, lowvram=False):
    dm = SimpleNamespace(dim=5120, ffn_dim=13824, num_heads=40, blocks=[0] * 40, in_dim=16, out_dim=16,
                         patch_size=(1, 2, 2), img_emb=None)
    base = SimpleNamespace(diffusion_model=dm, model_config=SimpleNamespace(unet_config={"model_type": "t2v"}),
                           latent_format=SimpleNamespace(latent_channels=16), model_lowvram=lowvram)
    wrappers = {"apply_model": {"torch.compile": [_compile_wrapper(keys)]}} if keys is not None else {}
    return SimpleNamespace(model=base, wrappers=wrappers, object_patches={},
                           model_options={"transformer_options": {}, "torch_compile_kwargs": {"backend": "inductor"}}
                           if keys is not None else {"transformer_options": {}})


def _guider(patcher, cfg=1.0):
    return SimpleNamespace(model_patcher=patcher, model_options=patcher.model_options, cfg=cfg)


SIGMAS_4 = torch.linspace(1.0, 0.0, 5)  # a 4-step schedule


def _outer_args(noise=None, sigmas=SIGMAS_4):
    noise = torch.randn(LATENT_720P81) if noise is None else noise
    return (noise, torch.zeros(LATENT_720P81), object(), sigmas)


def test_both_experts_of_a_4_step_a14b_prompt_read_as_sharing_the_graph_and_run_eager():
    high = compile_advice.payback_for(_guider(_patcher()), _outer_args(sigmas=SIGMAS_4[:3]), {})  # ends above 0
    low = compile_advice.payback_for(_guider(_patcher()), _outer_args(torch.zeros(LATENT_720P81), SIGMAS_4[2:]), {})
    for p in (high, low):
        assert (p.steps, p.shared_by, p.graphs, p.whole_model, p.pays_back) == (2, 2, 1, False, False)
        assert p == _payback(2, shared_by=2)


def test_a_whole_schedule_from_noise_is_one_model_and_counts_its_steps_rows_and_scope():
    p = compile_advice.payback_for(_guider(_patcher()), _outer_args(sigmas=torch.linspace(1.0, 0.0, 31)), {})
    assert (p.steps, p.shared_by, p.pays_back) == (30, 1, True)
    cfg = compile_advice.payback_for(_guider(_patcher(), cfg=3.5), _outer_args(), {})
    assert cfg.step_gain_s == pytest.approx(2 * p.step_gain_s)  # the uncond row
    whole = compile_advice.payback_for(_guider(_patcher(["diffusion_model"])), _outer_args(), {})
    assert whole.whole_model and whole.compile_s > p.compile_s
    streamed = compile_advice.payback_for(_guider(_patcher(lowvram=True)), _outer_args(sigmas=SIGMAS_4[:3]), {})
    assert (streamed.graphs, streamed.shared_by) == (40, 1)
    by_name = compile_advice.payback_for(_guider(_patcher()), (), {"noise": torch.randn(LATENT_720P81), "sigmas": SIGMAS_4})
    assert by_name.steps == 4


def test_a_model_without_compile_scope_or_a_video_latent_gets_no_payback():
    assert compile_advice.payback_for(_guider(_patcher(keys=None)), _outer_args(), {}) is None
    unreadable = _patcher()
    unreadable.wrappers = {"apply_model": {"torch.compile": [object()]}}  # KJNodes-style: keys not readable
    assert comfy_bridge.compile_scope(unreadable)[0] == comfy_bridge.UNKNOWN_SCOPE
    assert compile_advice.payback_for(_guider(unreadable), _outer_args(), {}) is None
    assert compile_advice.payback_for(_guider(_patcher()), _outer_args(torch.randn(1, 16, 90, 160)), {}) is None
    assert compile_advice.payback_for(SimpleNamespace(), _outer_args(), {}) is None


def test_missing_sigmas_leave_the_steps_unknown():
    p = compile_advice.payback_for(_guider(_patcher()), _outer_args(sigmas=None), {})
    assert p.steps is None and p.pays_back is None


# ------------------------------------------------------------------ the stats event and the log

class _Exec:
    def __init__(self, guider, patch_id):
        self.class_obj = guider
        self.patch_id = patch_id

    def __call__(self, *args, **kwargs):
        stats.record(self.patch_id, kernel="sage2_sm90")
        return "sampled"


@pytest.fixture
def events(monkeypatch):
    sent = []
    monkeypatch.setattr(comfy_bridge, "send_event", lambda event, data: sent.append((event, data)))
    warned.clear()
    yield sent
    warned.clear()


def _sample(patcher, events, args):
    ov = SageAttentionOverride(PatchConfig())
    patcher.model_options["transformer_options"]["optimized_attention_override"] = ov
    wrapper = sage_patch._stats_wrapper(ov.patch_id, "t", node_id="7")
    assert wrapper(_Exec(_guider(patcher), ov.patch_id), *args) == "sampled"
    (event, data), = events
    assert event == sage_patch.STATS_EVENT and data["node_id"] == "7"
    return data


def test_the_stats_event_and_the_log_carry_the_verdict_of_a_compiled_run(events, caplog):
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        data = _sample(_patcher(), events, _outer_args(sigmas=SIGMAS_4[:3]))
    assert data["compile"]["pays_back"] is False and data["compile"]["steps"] == 2
    assert "this model samples 2: run eager for one prompt" in data["compile"]["text"]
    assert data["compile"]["kept"] is False
    assert any(r.getMessage() == f"wan-sage t: {data['compile']['text']}" for r in caplog.records)


@pytest.mark.parametrize("on_disk", [True, False])
def test_the_verdict_counts_the_compile_file_the_run_leaves_for_the_next_start(events, monkeypatch, tmp_path,
                                                                               on_disk):
    from wan_sage.nodes import compile_cache
    path = tmp_path / "compile" / "torch-x-cpu-0123456789abcdef.bin"
    if on_disk:
        path.parent.mkdir()
        path.write_bytes(b"artifacts")
    monkeypatch.setattr(compile_cache, "before_sampling", lambda *a: str(path))
    monkeypatch.setattr(compile_cache, "after_sampling", lambda p: None)
    data = _sample(_patcher(), events, _outer_args(sigmas=SIGMAS_4[:3]))
    assert data["compile"]["kept"] is on_disk
    assert data["compile"]["compile_s"] == (cp.KEPT_GRAPH_S if on_disk else cp.FIRST_GRAPH_S)


class _UniPcExec(_Exec):
    """ComfyUI's uni_pc samplers: ``timesteps = sigmas[:]; timesteps[-1] = 0.001`` on a schedule ending at 0."""

    def __call__(self, *args, **kwargs):
        args[3][-1] = 0.001
        return super().__call__(*args, **kwargs)


def test_a_whole_schedule_stays_one_model_after_a_sampler_changed_its_last_sigma(events):
    patcher = _patcher()
    ov = SageAttentionOverride(PatchConfig())
    patcher.model_options["transformer_options"]["optimized_attention_override"] = ov
    wrapper = sage_patch._stats_wrapper(ov.patch_id, "t", node_id="7")
    sigmas = torch.linspace(1.0, 0.0, 21)  # 20 steps from noise to 0: one model
    assert wrapper(_UniPcExec(_guider(patcher), ov.patch_id), *_outer_args(sigmas=sigmas)) == "sampled"
    assert float(sigmas[-1]) == pytest.approx(0.001)  # as the sampler left it
    (_event, data), = events
    assert data["compile"]["shared_by"] == 1 and data["compile"]["steps"] == 20
    assert "other model of this schedule" not in data["compile"]["text"]


def test_an_eager_run_sends_no_compile_line(events, caplog):
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        data = _sample(_patcher(keys=None), events, _outer_args())
    assert data["compile"] is None
    assert not any("compile:" in r.getMessage() for r in caplog.records)


def test_a_failure_to_read_the_payback_is_logged_once_and_sampling_goes_on(events, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("unreadable")
    monkeypatch.setattr(compile_advice, "payback_for", broken)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        data = _sample(_patcher(), events, _outer_args())
        events.clear()
        _sample(_patcher(), events, _outer_args())
    assert data["compile"] is None
    assert sum("compile payback" in r.getMessage() for r in caplog.records) == 1
