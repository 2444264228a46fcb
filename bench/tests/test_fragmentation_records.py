"""memory/estimate.py's fp8 cast term against the end-to-end records of bench/records/e2e/.

The fp8 runs held up to 3.47 GiB in cudaMallocAsync's pool above the allocated peak with every weight
resident, and one of them ran out of memory at a 24 GiB budget because the estimate had no room for it
(``cast_frag_factor`` was set from those runs: bench._records.SET_FROM).  These tests replay every fp8
record against the term.
"""
from bench import _records
from wan_sage.memory import activation_model
from wan_sage.memory.estimate import COMFY_EXTRA_RESERVED, GiB, Setup, attention_plan, plan
from wan_sage.memory.weights import weights_for_key

A14B = activation_model.PRESETS["wan2.2-a14b"]


def _fp8_records():
    out = []
    for p in _records.files("e2e"):
        for r in _records.rows(p):
            if "config" in r and r["config"].get("weights") == "fp8":
                out.append(r)
    return out


def _estimate(c, vram_gib=None):
    weights = weights_for_key(A14B, "fp8", True, compute="bf16")
    return plan(Setup(dims=A14B, latent=activation_model.latent_shape(A14B, c["width"], c["height"], c["frames"]),
                      attention=attention_plan("sage-auto" if c["attention"] == "sage" else "sdpa", 90),
                      weights=weights.setup, weights_bytes=weights.nbytes,
                      vram_bytes=None if vram_gib is None else int(vram_gib * GiB)))


def test_fp8_resident_reservation_covers_every_measured_reserved_peak():
    n = 0
    for r in _fp8_records():
        est = _estimate(r["config"])
        for name, x in (r.get("experts") or {}).items():
            if x.get("resident_frac") != 1.0 or x.get("peak_reserved_gib") is None:
                continue
            need = x["peak_reserved_gib"] - x["base_alloc_gib"]   # for the OOM run: a lower bound
            assert est.reservation_resident / GiB >= need, (r["run"], name, r["status"])
            n += 1
    assert n >= 17  # 16 completed samplings and the one that ran out of memory


def test_the_fp8_run_that_ran_out_of_memory_now_offloads():
    oom = [r for r in _fp8_records() if r["status"] == "oom"]
    assert oom, "the out-of-memory record is the reason for the term"
    for r in oom:
        c = r["config"]
        est = _estimate(c, vram_gib=r["budget"]["free_seen_gib"])
        assert est.verdict.startswith("offloads"), est.verdict
        # what stays resident plus the reservation fits, with the measured shortfall inside it
        resident = est.setup.weights_bytes - est.offload_bytes
        assert resident + est.reservation_partial + COMFY_EXTRA_RESERVED <= c["budget_gib"] * GiB + 1
        high = r["experts"]["high"]
        assert est.reservation_partial / GiB > high["peak_reserved_gib"] - high["base_alloc_gib"]
