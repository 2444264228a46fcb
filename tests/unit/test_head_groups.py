"""The memory mode's head-group rule (torch-free), against the H200 reference numbers."""
import subprocess
import sys
from pathlib import Path

import pytest

from wan_sage.attention import head_groups
from wan_sage.attention.kernel_bytes import AttnShape, extra_bytes

ROOT = Path(__file__).resolve().parents[2]
A14B_720P = AttnShape(1, 40, 75600, 75600, 128)
GB = 1e9


def test_group_counts_list_each_heads_per_group_once():
    assert head_groups.group_counts(40) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 14, 20, 40)
    assert head_groups.group_counts(1) == (1,)
    assert head_groups.group_counts(12) == (1, 2, 3, 4, 6, 12)


def test_split_bytes_match_the_h200_group_probe():
    # group_probe.py on the H200: 1 group with the output copy 4.27 GB, 2: 2.52, 4: 1.65, 8: 1.21.
    assert extra_bytes("sage2_sm90", A14B_720P) / GB == pytest.approx(3.49, abs=0.01)
    out = 2 * 40 * 75600 * 128
    assert (out + extra_bytes("sage2_sm90", A14B_720P)) / GB == pytest.approx(4.27, abs=0.01)
    for groups, measured in ((2, 2.52), (4, 1.65), (8, 1.21), (10, 1.12)):
        assert head_groups.split_bytes("sage2_sm90", A14B_720P, groups) / GB == pytest.approx(measured, abs=0.01)


def test_sdpa_mode_picks_the_fewest_groups_within_sdpa_plus_half_a_gib():
    hg = head_groups.head_groups("sage2_sm90", A14B_720P, "sdpa")
    limit = extra_bytes("sdpa", A14B_720P) + head_groups.SDPA_SLACK_BYTES
    assert hg.groups == 7 and hg.heads_per_group == 6
    assert hg.extra_bytes <= limit < head_groups.split_bytes("sage2_sm90", A14B_720P, 6)
    assert hg.ungrouped_bytes == extra_bytes("sage2_sm90", A14B_720P)
    assert hg.sdpa_bytes == extra_bytes("sdpa", A14B_720P)


def test_fastest_mode_and_calls_already_within_the_limit_run_ungrouped():
    assert head_groups.head_groups("sage2_sm90", A14B_720P, "fastest").groups == 1
    cross = AttnShape(1, 40, 75600, 512, 128)  # text cross-attention: small K, within SDPA + 0.5 GiB
    assert head_groups.head_groups("sage2_sm90", cross, "sdpa").groups == 1


def test_one_head_per_group_when_no_count_gets_within_the_limit():
    huge = AttnShape(1, 2, 2_000_000, 2_000_000, 128)
    hg = head_groups.head_groups("sage2_sm90", huge, "sdpa")
    assert hg.groups == 2 and hg.extra_bytes > hg.sdpa_bytes + head_groups.SDPA_SLACK_BYTES


def test_output_copy_counts_a_second_output_after_the_kernel():
    small = AttnShape(1, 4, 4096, 512, 128)
    out = 2 * 4 * 4096 * 128
    direct = extra_bytes("ck_int8", small)
    assert head_groups.split_bytes("ck_int8", small, 1, output_copy=True) == max(direct, 2 * out)
    grouped = head_groups.split_bytes("ck_int8", small, 2)
    assert head_groups.split_bytes("ck_int8", small, 2, output_copy=True) == grouped


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="memory mode"):
        head_groups.head_groups("sage2_sm90", A14B_720P, "smallest")


def test_head_groups_imports_without_torch():
    code = (
        "import sys, importlib.util\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"spec = importlib.util.spec_from_file_location('wan_sage', {str(ROOT / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(ROOT)!r}])\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['wan_sage'] = mod; spec.loader.exec_module(mod)\n"
        "from wan_sage.attention import head_groups\n"
        "from wan_sage.attention.kernel_bytes import AttnShape\n"
        "print(head_groups.head_groups('sage2_sm90', AttnShape(1, 40, 75600, 75600, 128)).groups)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "7"
