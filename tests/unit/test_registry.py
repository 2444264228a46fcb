"""The kernel registry: auto orders, archs, formulas and runners all derive from one entry per kernel."""
import subprocess
import sys
from pathlib import Path

import pytest

from wan_sage.attention import kernel_bytes, registry

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cc,order", [
    (90, ("sage2_sm90", "ck_int8", "sage1")),
    (89, ("sage2_fp8_cuda", "ck_int8", "sage2_fp16_cuda", "sage1")),
    (120, ("sage2_fp8_cuda", "sage2_fp16_cuda", "ck_int8", "sage1")),
    (121, ("sage2_fp8_cuda", "sage2_fp16_cuda", "ck_int8", "sage1")),
    (80, ("sage2_fp16_cuda", "ck_int8", "sage1")),
    (86, ("sage2_fp16_triton", "ck_int8", "sage1")),
    (87, ("sage2_fp16_triton", "ck_int8", "sage1")),
    (75, ("ck_int8",)),
    (100, ("ck_int8",)),
    (70, ()),
])
def test_auto_order_per_arch(cc, order):
    assert registry.auto_order(cc) == order


def test_every_kernel_has_a_formula_a_runner_and_a_package():
    for spec in registry.KERNELS.values():
        assert spec.package in registry.PACKAGES
        assert callable(spec.call)
        for cc in registry.KNOWN_ARCHS:
            if spec.runs_on(cc):
                assert spec.memory_path(cc) in kernel_bytes.MEMORY_PATHS, (spec.name, cc)
        assert set(spec.layouts) <= {"NHD", "HND"} and spec.layouts


def test_memory_path_is_arch_specific_where_declared():
    assert registry.memory_path("sage2_fp8_cuda", 89) == "sage2_fp8_cuda"
    assert registry.memory_path("sage2_fp8_cuda", 120) == "sage2_fp8_cuda_perwarp"
    assert registry.memory_path("sdpa", 90) == "sdpa"


def test_auto_only_picks_kernels_that_run_on_the_arch():
    for cc in registry.KNOWN_ARCHS:
        for name in registry.auto_order(cc):
            assert registry.KERNELS[name].runs_on(cc)


@pytest.mark.parametrize("text,cc", [("sm90", 90), ("SM_89", 89), ("120", 120), (86, 86), (" sm75 ", 75)])
def test_parse_arch_accepts_known_archs(text, cc):
    assert registry.parse_arch(text) == cc


@pytest.mark.parametrize("text", ["sm-90", "sm0", "", "sm", "sm91", "sm²", "90.0", None, True, 10 ** 30, "x" * 10000])
def test_parse_arch_rejects_unknown_archs_with_a_short_message(text):
    with pytest.raises(ValueError) as e:
        registry.parse_arch(text)
    msg = str(e.value)
    assert "sm90" in msg and len(msg) < 300


class _Fake:
    def __init__(self):
        self.seen = None

    def __call__(self, q, k, v, **kw):
        self.seen = (q, k, v, kw)
        return q


def test_runner_gives_mutating_kernels_a_private_k_and_transposes_to_native_layout():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    fake = _Fake()
    registry.KERNELS["sage1"].run(fake, q, k, v, "NHD", None, 90)
    assert fake.seen[1] is not k and torch.equal(fake.seen[1], k)
    fake = _Fake()
    out = registry.KERNELS["ck_int8"].run(fake, q, k, v, "NHD", 0.5, 90)
    assert fake.seen[0].shape == (1, 2, 8, 4) and fake.seen[3] == {"scale": 0.5}
    assert out.shape == q.shape


def test_registry_memory_and_plan_import_no_torch():
    code = ("import sys, importlib.util; sys.modules['torch'] = None\n"
            f"spec = importlib.util.spec_from_file_location('wan_sage', {str(ROOT / '__init__.py')!r}, "
            f"submodule_search_locations=[{str(ROOT)!r}])\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['wan_sage'] = m; spec.loader.exec_module(m)\n"
            "import wan_sage.attention.registry, wan_sage.memory.estimate, wan_sage.memory.request, wan_sage.cli\n"
            "sys.exit(wan_sage.cli.main(['plan', '--preset', 'wan2.2-a14b', '--vram', '24', '--attention', 'sage-auto', '--json']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"tokens": 75600' in p.stdout
