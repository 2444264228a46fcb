"""``wan-sage bench`` writes where the node reads (--comfyui, --cache-dir, $WAN_SAGE_CACHE_DIR) and
says how to install torch when it is missing; no GPU needed (the comparison itself is stubbed)."""
import sys

import pytest

from wan_sage import cli
from wan_sage.cli import bench_kernels as kernel_compare


@pytest.fixture
def bench_dirs(monkeypatch):
    """The cache directory ``wan-sage bench`` hands to the comparison, one per call."""
    seen = []

    def main(a):
        seen.append(a.cache_dir)
        return 0
    monkeypatch.setattr(kernel_compare, "main", main)
    monkeypatch.delenv("WAN_SAGE_CACHE_DIR", raising=False)
    return seen


def _comfyui(tmp_path):
    root = tmp_path / "ComfyUI"
    root.mkdir()
    (root / "folder_paths.py").write_text("")
    return root


def test_comfyui_writes_into_its_user_folder(bench_dirs, tmp_path, capsys):
    root = _comfyui(tmp_path)
    assert cli.main(["bench", "--comfyui", str(root)]) == 0
    assert bench_dirs == [str(root / "user" / "wan_sage")]
    assert capsys.readouterr().err == ""


def test_cache_dir_and_the_default(bench_dirs, tmp_path):
    assert cli.main(["bench", "--cache-dir", str(tmp_path / "c")]) == 0
    assert cli.main(["bench"]) == 0
    assert bench_dirs == [str(tmp_path / "c"), None]        # None: $WAN_SAGE_CACHE_DIR, else ~/.cache/wan-sage


def test_comfyui_that_is_not_comfyui_is_one_line(bench_dirs, tmp_path, capsys):
    assert cli.main(["bench", "--comfyui", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--comfyui" in err and "is not a ComfyUI folder (it has no folder_paths.py)" in err
    assert bench_dirs == []


def test_comfyui_and_cache_dir_together_are_refused(bench_dirs, tmp_path, capsys):
    assert cli.main(["bench", "--comfyui", str(_comfyui(tmp_path)), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and err.startswith("wan-sage bench:") and len(err.splitlines()) == 1


def test_comfyui_with_the_environment_variable_set_says_which_the_node_reads(bench_dirs, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setenv("WAN_SAGE_CACHE_DIR", str(tmp_path / "env-cache"))
    root = _comfyui(tmp_path)
    assert cli.main(["bench", "--comfyui", str(root)]) == 0
    assert bench_dirs == [str(root / "user" / "wan_sage")]
    assert f"WAN_SAGE_CACHE_DIR is set; a ComfyUI started with it reads {tmp_path / 'env-cache'}" in \
        capsys.readouterr().err


def test_without_torch_bench_says_how_to_install_it(bench_dirs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)          # as if torch were not installed
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "needs PyTorch" in err and 'pip install ".[bench]"' in err and "ComfyUI's own Python" in err
    assert "wan-sage[bench]" not in err  # the pack is not on a package index under that name
    assert bench_dirs == []


def test_bench_without_gpu_names_the_alternative(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert cli.main(["bench"]) == 2
    assert "wan-sage plan" in capsys.readouterr().err


def test_the_dtypes_timed(monkeypatch, tmp_path, capsys):
    """fp16 alone by default (what ComfyUI runs Wan in), both with ``--dtype both``; no GPU: the timing is stubbed."""
    import torch
    from types import SimpleNamespace
    from wan_sage.attention import kernels, registry
    timed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    monkeypatch.setattr(kernels, "device_cc", lambda device: 90)
    monkeypatch.setattr(kernels, "probe", lambda: SimpleNamespace(sage_version="2.2.0", ck_version=None))
    monkeypatch.setattr(registry, "auto_order", lambda cc: ("sage2_sm90",))
    monkeypatch.setattr(kernel_compare, "run_bench", lambda shapes, names, dtype, *a: timed.append(dtype) or [])
    for argv, want in ((["bench"], [torch.float16]), (["bench", "--dtype", "both"], [torch.float16, torch.bfloat16]),
                       (["bench", "--dtype", "bf16"], [torch.bfloat16])):
        timed.clear()
        assert cli.main([*argv, "--cache-dir", str(tmp_path)]) == 0
        assert timed == want, argv


@pytest.fixture
def bench_args(monkeypatch):
    """The parsed arguments ``wan-sage bench`` hands to the comparison, one per call."""
    seen = []
    monkeypatch.setattr(kernel_compare, "main", lambda a: seen.append(a) or 0)
    return seen


def test_a_preset_at_a_size_times_the_calls_of_that_model(bench_args):
    assert cli.main(["bench", "--preset", "wan2.2-a14b", "--width", "1280", "--height", "720", "--frames", "81"]) == 0
    assert cli.main(["bench", "--preset", "wan2.2-ti2v-5b", "--width", "1280", "--height", "704", "--frames", "121"]) == 0
    assert cli.main(["bench", "--preset", "wan2.1-i2v-14b", "--width", "832", "--height", "480"]) == 0
    a14b, ti2v, i2v = (a.model_shapes for a in bench_args)
    # the same calls as the named shapes, which were written from ComfyUI's Wan model independently
    assert a14b == {"wan2.2-a14b_1280x720x81_self": kernel_compare.WAN_SHAPES["a14b_720p81_self"],
                    "wan2.2-a14b_1280x720x81_cross": kernel_compare.WAN_SHAPES["a14b_720p81_cross"]}
    assert list(ti2v.values()) == [kernel_compare.WAN_SHAPES["ti2v5b_704p121_self"],
                                   kernel_compare.WAN_SHAPES["ti2v5b_704p121_cross"]]
    assert i2v["wan2.1-i2v-14b_832x480x81_img_cross"] == kernel_compare.WAN_SHAPES["i2v14b_480p81_img_cross"]
    assert i2v["wan2.1-i2v-14b_832x480x81_self"] == kernel_compare.WAN_SHAPES["a14b_480p81_self"]
    assert cli.main(["bench"]) == 0 and bench_args[-1].model_shapes is None and bench_args[-1].shapes == "wan"


@pytest.mark.parametrize("argv, says", [
    (["--width", "832"], "--width sizes the shapes of --preset; add --preset MODEL"),
    (["--preset", "wan2.2-a14b", "--shapes", "wan"], "--shapes and --preset each choose the shapes"),
    (["--preset", "wan2.2-a14b", "--frames", "many"], "--frames must be an integer, got 'many'"),
    (["--preset", "wan2.2-a14b", "--height", "0"], "--height must be between"),
    (["--shapes", "a14b_720p81_self,nosuch"], "--shapes: unknown shape 'nosuch'; known: a14b_720p81_self"),
    (["--kernels", "sage2_sm90,nosuch"], "--kernels: unknown kernel 'nosuch'; give auto, all or a comma list"),
    (["--json", "."], "--json '.' is a folder"),
    (["--json", "no-such-folder/x.json"], "is in a folder that does not exist or cannot be written"),
])
def test_a_bad_flag_is_one_line_naming_it_before_any_gpu_work(bench_args, capsys, argv, says):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wan-sage bench: ") and says in err and err.count("\n") == 1, err
    assert bench_args == []
