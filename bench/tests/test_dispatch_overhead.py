"""``python -m bench.dispatch_overhead`` runs on the CPU and leaves the patch's state as it found it: the device
types it treats as eligible and the kernel's entry point it swaps for a replaying one."""
from bench import dispatch_overhead
from wan_sage.attention import kernels, policy
from wan_sage.attention.state import STATE


def test_the_overhead_measurement_runs_on_the_cpu_and_leaves_everything_as_it_was(capsys):
    devices, entry = policy.ACCEL_DEVICE_TYPES, kernels.entry_point("sage2_sm90")
    try:
        r = dispatch_overhead.dispatch_overhead("cpu", (1, 2, 64, 64, 32), n=20, rounds=1)
        assert {"sdpa_us", "settled_sdpa_us", "settled_sdpa_overhead_us", "decision_us", "settled_kernel_us"} <= set(r)
        assert r["sdpa_us"] > 0 and r["settled_sdpa_us"] > 0
        assert policy.ACCEL_DEVICE_TYPES == devices and kernels.entry_point("sage2_sm90") is entry
        assert dispatch_overhead.main(["--device", "cpu", "--shape", "1,2,64,64,32", "--calls", "10"]) == 0
        assert "plain SDPA" in capsys.readouterr().out
    finally:
        STATE.reset()
