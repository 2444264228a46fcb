"""gpu tier, attention/execution.py on real kernels: the split path's bytes against the formula, grouped
against ungrouped numerics, Sage at SDPA's memory, and the failure paths forced on real kernels
(an injected raising kernel, a real out-of-memory error under a VRAM ballast, NaN appearing
later).  The decision cost is printed (``-s``), not asserted; ``wan-sage bench`` reports it."""
import logging
import time

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

from wan_sage.attention import execution, head_groups, kernel_bytes, kernels, planning, registry, stats  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride, self_attention_groups, self_test_failures  # noqa: E402
from wan_sage.cli.bench_kernels import peak_extra  # noqa: E402
from wan_sage.attention.sdpa import attention_sdpa  # noqa: E402
from wan_sage.attention.state import STATE, FailureKey, SelfTestKey  # noqa: E402


def settle(call, limit=32):
    """Run ``call()`` until no shape is being timed on its first calls: the outputs of those calls."""
    outs = [call()]
    while STATE.trials:
        assert len(outs) < limit, f"shapes still timed after {limit} calls"
        outs.append(call())
    return outs


DEV = torch.device("cuda")
CC = kernels.device_cc(DEV)
AUTO = kernels.auto_candidates(CC)
if not AUTO:
    pytest.skip("no SageAttention / comfy-kitchen kernel for this GPU in the auto order", allow_module_level=True)
KERNEL = AUTO[0]
PATH = registry.KERNELS[KERNEL].memory_path(CC)
A14B_720P = (1, 40, 75600, 75600, 128)
A14B_480P = (1, 40, 32760, 32760, 128)
GiB = 1 << 30


def make(B, H, NQ, NK, D, dtype=torch.bfloat16, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(B, n, H * D, device=DEV, dtype=dtype, generator=g) for n in (NQ, NK, NK))


class Counting:
    """Wraps the installed entry point: counts calls, and can raise or return NaN."""

    def __init__(self, real):
        self.real = real
        self.calls = 0
        self.nan_from = None
        self.error = None

    def __call__(self, q, k, v, **kw):
        self.calls += 1
        if self.error is not None:
            raise self.error
        out = self.real(q, k, v, **kw)
        if self.nan_from is not None and self.calls >= self.nan_from:
            out = torch.full_like(out, float("nan"))
        return out


pytestmark = pytest.mark.usefixtures("fresh_state")


@pytest.fixture
def counting():
    real = kernels.entry_point(KERNEL)
    wrapper = Counting(real)
    kernels.install_test_kernel(KERNEL, wrapper)
    yield wrapper
    kernels.install_test_kernel(KERNEL, real)


@pytest.mark.parametrize("groups", [1, 2, 4, 7, 8])
def test_the_split_path_allocates_what_the_formula_says(groups):
    B, H, NQ, NK, D = A14B_720P
    q, k, v = make(B, H, NQ, NK, D)
    q4, k4, v4 = (t.view(B, -1, H, D) for t in (q, k, v))
    run = lambda: execution.run_kernel(KERNEL, q4, k4, v4, "NHD", "NHD", groups, None, CC)  # noqa: E731
    run()  # warm-up (JIT, autotune)
    out, measured = peak_extra(run)
    formula = head_groups.split_bytes(PATH, kernel_bytes.AttnShape(B, H, NQ, NK, D), groups)
    assert measured <= formula * 1.01 + (8 << 20), (groups, measured, formula)
    assert measured >= formula * 0.95, (groups, measured, formula)
    assert out.shape == q.shape and out.is_contiguous()


def test_grouped_and_ungrouped_outputs_agree():
    B, H, NQ, NK, D = A14B_480P
    q, k, v = make(B, H, NQ, NK, D)
    q4, k4, v4 = (t.view(B, -1, H, D) for t in (q, k, v))
    outs = {g: execution.run_kernel(KERNEL, q4, k4, v4, "NHD", "NHD", g, None, CC) for g in (1, 5, 7, 8)}
    for g, out in outs.items():
        if CC == 90 and KERNEL == "sage2_sm90":
            assert torch.equal(out, outs[1]), g  # per-head kernel: bit-identical (group_probe.py on the H200)
        else:
            assert torch.allclose(out.float(), outs[1].float(), atol=1e-2, rtol=1e-2), g


def test_the_memory_mode_keeps_a_sage_call_within_sdpa_plus_half_a_gib(tmp_path):
    B, H, NQ, NK, D = A14B_720P
    q, k, v = make(B, H, NQ, NK, D)
    sdpa_out, sdpa_extra = peak_extra(lambda: attention_sdpa(q, k, v, H))
    del sdpa_out
    results = {}
    for mode in ("sdpa", "fastest"):
        o = SageAttentionOverride(PatchConfig(calibrate=False, memory_mode=mode, cache_dir=str(tmp_path)))
        plan = o.plan(q, k, v, H)
        assert plan.kernel == KERNEL
        o(attention_sdpa, q, k, v, heads=H)  # warm-up; its output check is one of the first calls
        stats.begin_run(o.patch_id)
        out, extra = peak_extra(lambda o=o: o(attention_sdpa, q, k, v, heads=H))
        s = stats.end_run(o.patch_id)
        assert s["by_kernel"] == {KERNEL: 1}, s
        results[mode] = (plan.groups, extra)
        del out
    expected = head_groups.head_groups(PATH, kernel_bytes.AttnShape(B, H, NQ, NK, D), "sdpa").groups
    print(f"\nA14B 720p81 self-attention extra bytes: SDPA {sdpa_extra / 1e9:.3f} GB; Sage {KERNEL} "
          f"memory mode sdpa {results['sdpa'][0]} groups {results['sdpa'][1] / 1e9:.3f} GB; "
          f"fastest {results['fastest'][0]} group {results['fastest'][1] / 1e9:.3f} GB")
    assert results["sdpa"][0] == expected > 1 and results["fastest"][0] == 1
    assert results["sdpa"][1] <= sdpa_extra + head_groups.SDPA_SLACK_BYTES + (32 << 20)
    assert results["fastest"][1] > results["sdpa"][1]


def test_the_calls_that_time_a_shape_peak_no_higher_than_a_settled_call(tmp_path):
    """A new shape is timed on its own first calls, each running one variant or SDPA for its output,
    so none holds more than a settled call of the winner: the working-memory estimate counts no
    timing term.  (Keeping SDPA's output while timing a kernel would add one output, 0.72 GiB at
    A14B 720p81.)"""
    B, H, NQ, NK, D = A14B_720P
    q, k, v = make(B, H, NQ, NK, D)
    o = SageAttentionOverride(PatchConfig(memory_mode="fastest", cache_dir=str(tmp_path)))
    timing_peaks = []
    while True:
        out, peak = peak_extra(lambda: o(attention_sdpa, q, k, v, heads=H))
        del out
        timing_peaks.append(peak)
        if not STATE.trials:
            break
        assert len(timing_peaks) < 32
    plan = o.plan(q, k, v, H)
    if plan.kernel != KERNEL:
        pytest.skip(f"{KERNEL} did not beat SDPA at A14B 720p81 here ({plan.reason}): no settled kernel call")
    settled_out, settled = peak_extra(lambda: o(attention_sdpa, q, k, v, heads=H))
    output = settled_out.numel() * settled_out.element_size()
    del settled_out
    print(f"\nA14B 720p81, {KERNEL}: the {len(timing_peaks)} calls that timed the shape at most "
          f"{max(timing_peaks) / GiB:.3f} GiB, settled call {settled / GiB:.3f} GiB above the inputs "
          f"(one output {output / GiB:.3f} GiB)")
    assert max(timing_peaks) <= settled + (64 << 20), (timing_peaks, settled, output)


def test_a_shapes_first_calls_time_the_split_and_settle_the_shape(tmp_path):
    B, H, NQ, NK, D = A14B_480P
    q, k, v = make(B, H, NQ, NK, D)
    o = SageAttentionOverride(PatchConfig(cache_dir=str(tmp_path)))
    ref = attention_sdpa(q, k, v, H)
    outs = settle(lambda: o(attention_sdpa, q, k, v, heads=H))
    errors = [((out.float() - ref.float()).norm() / ref.float().norm()).item() for out in outs]
    assert len(outs) > 1 and max(errors) < 0.1, errors  # every call's output is right
    del outs
    info = planning.device_info(DEV, kernels.device_index(DEV), "auto")
    key = planning.timing_key(info.gpu, CC, KERNEL, "bf16", H, D, NQ, NK)
    entry = STATE.timing_caches[str(tmp_path)].get(key)
    assert entry is not None and entry["repeats"] == 1 and entry["sdpa_ms"] > 0
    groups = head_groups.head_groups(PATH, kernel_bytes.AttnShape(B, H, NQ, NK, D), "sdpa").groups
    assert entry["groups"] == groups and entry["grouped_ms"] and entry["kernel_ms"]
    cost = entry["grouped_ms"] / entry["kernel_ms"] - 1
    plan = o.plan(q, k, v, H)
    print(f"\nA14B 480p81: ungrouped {entry['kernel_ms']:.2f} ms, {groups} groups {entry['grouped_ms']:.2f} ms "
          f"({100 * cost:+.1f} %), SDPA {entry['sdpa_ms']:.2f} ms; runs with {plan.groups} group(s)")
    assert plan.groups == (groups if cost <= 0.02 else 1)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        o.plan(q, k, v, H)
    print(f"decision cost of a settled shape: {(time.perf_counter() - t0) / n * 1e6:.1f} us per call")


def test_an_error_is_charged_to_the_kernel_that_raised_and_not_retried(counting, tmp_path, caplog):
    B, H, NQ, NK, D = A14B_480P
    q, k, v = make(B, H, NQ, NK, D)
    counting.error = RuntimeError("injected kernel failure")
    o = SageAttentionOverride(PatchConfig(kernel=KERNEL, self_test=False, cache_dir=str(tmp_path)))
    stats.begin_run(o.patch_id)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        for _ in range(3):
            out = o(attention_sdpa, q, k, v, heads=H)
    s = stats.end_run(o.patch_id)
    assert counting.calls == 1  # raised on the shape's first call; charged; never tried again
    assert FailureKey(kernels.device_index(DEV), KERNEL, torch.bfloat16, D) in STATE.failed
    assert any(r.getMessage().startswith(f"wan-sage: {KERNEL} raised") for r in caplog.records)
    assert s["sage_calls"] == 0 and s["reasons"] == {"error": 1, "failed": 2} and s["fallbacks"] == {"error": 1}
    assert STATE.calibration_spent_s > 0
    assert torch.equal(out, attention_sdpa(q, k, v, H))


def test_a_real_out_of_memory_is_remembered_until_free_memory_grows(counting, ballast, tmp_path):
    B, H, NQ, NK, D = A14B_720P
    q, k, v = make(B, H, NQ, NK, D)
    reported = {"free": 1 << 40}  # the memory check is told there is room, so the kernel really runs out
    o = SageAttentionOverride(PatchConfig(kernel=KERNEL, calibrate=False, memory_mode="fastest", self_test=False,
                                          cache_dir=str(tmp_path)),
                              free_memory=lambda dev: reported["free"])
    need = o.plan(q, k, v, H).need
    assert ballast(2 * q.numel() * 2 + (512 << 20)) > 0  # room for SDPA's output, not for the kernel's buffers
    stats.begin_run(o.patch_id)
    for _ in range(3):
        assert torch.equal(o(attention_sdpa, q, k, v, heads=H), attention_sdpa(q, k, v, H))
    s = stats.end_run(o.patch_id)
    assert counting.calls == 1  # remembered: not retried on every call
    assert s["fallbacks"] == {"oom": 1} and s["reasons"] == {"oom": 1, "memory": 2}
    ballast.release()
    reported["free"] += need // 2  # grown, but by less than the kernel needs
    o(attention_sdpa, q, k, v, heads=H)
    assert counting.calls == 1
    reported["free"] += need  # grown by more than it needs: tried again, and it fits now
    stats.begin_run(o.patch_id)
    o(attention_sdpa, q, k, v, heads=H)
    s = stats.end_run(o.patch_id)
    assert counting.calls == 2 and s["by_kernel"] == {KERNEL: 1}


def test_nan_appearing_later_is_caught_within_one_sampling_interval(counting, tmp_path):
    B, H, NQ, NK, D = 1, 40, 4096, 4096, 128
    q, k, v = make(B, H, NQ, NK, D)
    counting.nan_from = 20
    o = SageAttentionOverride(PatchConfig(kernel=KERNEL, calibrate=False, self_test=False, cache_dir=str(tmp_path)))
    stats.begin_run(o.patch_id)
    bad = 0
    for _ in range(200):
        bad += not bool(torch.isfinite(o(attention_sdpa, q, k, v, heads=H)).all())
    s = stats.end_run(o.patch_id)
    assert s["fallbacks"] == {"nonfinite": 1}
    assert 0 < bad <= execution.CHECK_EVERY
    assert counting.calls < 200


def test_the_real_self_test_passes_and_the_kernel_serves(tmp_path):
    B, H, NQ, NK, D = A14B_480P
    q, k, v = make(B, H, NQ, NK, D)
    o = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=str(tmp_path)))
    assert o.plan(q, k, v, H).kernel == KERNEL
    assert self_test_failures() == {}
    assert STATE.self_tests[SelfTestKey(kernels.device_index(DEV), KERNEL, torch.bfloat16)] is None
    got = o(attention_sdpa, q, k, v, heads=H)[:, :512].float()
    ref = attention_sdpa(q.float(), k.float(), v.float(), H)[:, :512]
    assert F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item() > 0.995


def test_a_new_process_plans_the_groups_its_first_call_runs_before_any_self_test(tmp_path):
    """What the estimator reads when a model loads while the patch's warm-up still tests the kernel: two
    processes timed the shape and passed the real self-test, and a third predicts its first call from the
    timing cache file alone, running nothing, and that call then runs as predicted."""
    B, H, NQ, NK, D = A14B_480P
    q, k, v = make(B, H, NQ, NK, D)
    o = SageAttentionOverride(PatchConfig(cache_dir=str(tmp_path)))
    for _ in range(2):
        settle(lambda: o(attention_sdpa, q, k, v, heads=H))
        STATE.reset()
    predicted = self_attention_groups(o, DEV, torch.bfloat16, B, H, NQ, D)
    assert STATE.self_tests == {} and not STATE.decisions  # nothing tested, run or settled for the prediction
    assert predicted is not None and predicted >= 1, predicted
    o(attention_sdpa, q, k, v, heads=H)
    assert not STATE.trials  # the first call timed nothing
    assert o.plan(q, k, v, H).groups == predicted
