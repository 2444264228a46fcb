"""The seams of wan-sage's dispatcher that a fake accelerator replaces, in one place, so that kernels run on
the CPU and only the dispatch logic is tested (real kernels are tested in tests/gpu).

:func:`seams` lists them as (module, attribute, value); the unit tier's ``FakeGPU`` (tests/unit/fakegpu.py)
sets them through pytest's ``monkeypatch``, and the scripts that run in a process of their own (the Ulysses
worker of tests/unit, the compile check of tests/host) set them for that whole process with :func:`install`.
"""


def seams(*, candidates=("sage2_sm90",), cc=90, build="test", fits=None, available=None, self_test=None) -> list:
    """(module, attribute, value) for each seam: CPU tensors eligible; the device an sm``cc`` GPU offering
    ``candidates``; the kernel build ``build``; everything fits (or ``fits``) in 1 TiB free (or ``available``);
    the self-test passes (or ``self_test``)."""
    from wan_sage.attention import execution, planning, policy, selftest
    from wan_sage.attention.state import STATE

    def device_info(device, index, choice):
        info = planning.DeviceInfo(cc, "FakeGPU", tuple(candidates), None)
        STATE.set_device((index, choice), info)  # found once per process, as the real one keeps it
        return info
    return [
        (policy, "ACCEL_DEVICE_TYPES", ("cuda", "cpu")),
        (planning, "device_info", device_info),
        (planning, "kernel_build", lambda name: build),
        (execution, "fits", fits or (lambda device, need, free_fn: True)),
        (execution, "available_bytes", available or (lambda device, free_fn: 1 << 40)),
        (selftest, "self_test", self_test or (lambda name, device, dtype, cc: None)),
    ]


def install(kernels: dict, **options) -> None:
    """Set every seam for the rest of this process and install ``kernels`` ({name: callable with
    SageAttention's signature}) as the kernels of those names."""
    from wan_sage.attention import kernels as registry
    for module, name, value in seams(**options):
        setattr(module, name, value)
    for name, kernel in kernels.items():
        registry.install_test_kernel(name, kernel)
