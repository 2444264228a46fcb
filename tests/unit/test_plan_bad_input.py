"""``wan-sage plan`` on bad input: exit 2 with one line on stderr naming the flag or file, never a
traceback; what --model read, --cfg rows, --arch and --weights rules.  The fuzz is in test_fuzz_inputs.py."""
import os

import pytest

from model_files import gguf_bytes, st_bytes, wan_shapes, write
from wan_sage import cli
from wan_sage.memory import headers

PRESET = ["plan", "--preset", "wan2.2-a14b"]


def run(capsys, args):
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wan-sage"), err
    assert "Traceback" not in err and len(lines[0]) <= 300
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("flags,needle", [
    (["--vram", "nan"], "--vram"), (["--vram", "inf"], "--vram"), (["--vram", "-1"], "--vram"), (["--vram", "0"], "--vram"),
    (["--vram", "lots"], "--vram"),
    (["--margin", "inf"], "--margin"), (["--margin", "nan"], "--margin"), (["--margin", "-1"], "--margin"),
    (["--width", "-1"], "--width must be between"), (["--width", "99999"], "--width"), (["--width", "12.5"], "--width"),
    (["--width", "abc"], "--width"), (["--height", "0"], "--height"), (["--height", "1e300"], "--height"),
    (["--frames", "0"], "--frames"), (["--frames", "5000"], "--frames"), (["--batch", "0"], "--batch"),
    (["--batch", "65"], "--batch"), (["--cfg", "nan"], "--cfg"), (["--cfg", "-1"], "--cfg"),
    (["--arch", "sm-90"], "--arch"), (["--arch", "sm0"], "--arch"), (["--arch", ""], "--arch"),
    (["--arch", "x"], "--arch"),
    (["--weights", "bogus"], "--weights must be one of"), (["--weights", "q1"], "--weights must be one of"),
    (["--attention", "flash9"], "--attention must be"),
    (["--dtype", "int4"], "--dtype"), (["--bogus-flag"], "unrecognized arguments"),
])
def test_bad_flags(capsys, flags, needle):
    code, out, err = run(capsys, PRESET + flags)
    assert_one_line(code, err, needle)
    assert out == ""


def test_a_source_is_required_and_weights_do_not_go_with_model(capsys, tmp_path):
    code, _out, err = run(capsys, ["plan"])
    assert_one_line(code, err, "--preset")
    path = write(tmp_path, "wan.safetensors", st_bytes(wan_shapes()))
    code, _out, err = run(capsys, ["plan", "--model", path, "--weights", "fp8"])
    assert_one_line(code, err, "--weights cannot be used with --model")


BAD_FILES = [
    ("cut.gguf", lambda d: gguf_bytes(d, wan_shapes())[:60], "truncated GGUF header"),
    ("magic.gguf", lambda d: b"GGUF", "truncated GGUF header"),
    ("x.gguf", lambda d: os.urandom(256).replace(b"GGUF", b"...."), "not a GGUF file"),
    ("list.safetensors", lambda d: b"\x02" + b"\0" * 7 + b"[]", "JSON list"),
    ("noshape.safetensors", lambda d: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16",
                                                                         "data_offsets": [0, 0]}}),
     "header entry 'head.modulation' has no shape"),
    ("textshape.safetensors", lambda d: st_bytes(wan_shapes(), overrides={"head.modulation": {
        "dtype": "F16", "shape": "big", "data_offsets": [0, 2]}}), "not a list of sizes"),
    ("negative.safetensors", lambda d: st_bytes(wan_shapes(), overrides={"head.modulation": {
        "dtype": "F16", "shape": [-1], "data_offsets": [0, 2]}}), "negative size"),
    ("huge.safetensors", lambda d: st_bytes(wan_shapes(), overrides={"head.modulation": {
        "dtype": "F16", "shape": [1 << 50], "data_offsets": [0, 2]}}), "impossible size"),
    ("offsets.safetensors", lambda d: st_bytes(wan_shapes(), overrides={"head.modulation": {
        "dtype": "F16", "shape": [1, 2, 256], "data_offsets": [0]}}), "bad data_offsets"),
    ("short.safetensors", lambda d: st_bytes(wan_shapes())[:100], "truncated safetensors header"),
    ("scalar.safetensors", lambda d: st_bytes({**wan_shapes(), "head.modulation": []}), "head.modulation has shape []"),
    ("dim64.safetensors", lambda d: st_bytes(wan_shapes(dim=64)), "dim 64 is not a Wan model"),
    ("dim200.safetensors", lambda d: st_bytes(wan_shapes(dim=200)), "dim 200 is not a Wan model"),
    ("sdxl.safetensors", lambda d: st_bytes({"input_blocks.0.0.weight": [4, 4]}), "--preset"),
]


@pytest.mark.parametrize("name,make,needle", BAD_FILES, ids=[n for n, _m, _x in BAD_FILES])
def test_bad_model_files(capsys, tmp_path, name, make, needle):
    path = write(tmp_path, name, make(tmp_path))
    code, out, err = run(capsys, ["plan", "--model", path])
    assert_one_line(code, err, needle, name)
    assert out == ""


def test_directory_missing_and_unreadable_files(capsys, tmp_path, monkeypatch):
    (tmp_path / "dir.safetensors").mkdir()
    assert_one_line(*run(capsys, ["plan", "--model", str(tmp_path / "dir.safetensors")])[::2], "is a directory")
    assert_one_line(*run(capsys, ["plan", "--model", str(tmp_path / "gone.gguf")])[::2], "no such file")
    path = write(tmp_path, "locked.safetensors", st_bytes(wan_shapes()))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(headers, "open", denied, raising=False)
    assert_one_line(*run(capsys, ["plan", "--model", path])[::2], "permission denied", "locked.safetensors")


def test_model_prints_what_it_read(capsys, tmp_path):
    path = write(tmp_path, "wan_i2v.safetensors", st_bytes(wan_shapes(dim=1536, ffn=8960, layers=3, in_dim=36)))
    code, out, err = run(capsys, ["plan", "--model", path, "--width", "832", "--height", "480", "--vram", "24"])
    assert code == 0 and err == ""
    line = next(x for x in out.splitlines() if x.strip().startswith("model file:"))
    for needle in ("safetensors", "Wan t2v", "dim 1536", "3 layers", "12 heads", "weights F16", "GiB in the file"):
        assert needle in line, line


def test_cfg_says_how_many_rows_and_prints_the_batched_figure(capsys):
    code, out, _err = run(capsys, PRESET + ["--cfg", "5", "--vram", "24"])
    assert code == 0
    rows = next(x for x in out.splitlines() if "rows per forward" in x)
    assert "1 assumed" in rows and "2 when ComfyUI batches them" in rows
    batched = next(x for x in out.splitlines() if "cfg batched (2 rows)" in x)
    single = next(x for x in out.splitlines() if "reservation per forward, 1 row" in x)
    first = lambda line: float(line.split("GiB")[0].split()[-1])  # noqa: E731
    assert first(batched) > 1.9 * first(single)
    code, out, _err = run(capsys, PRESET + ["--cfg", "1", "--vram", "24"])
    assert "cfg batched" not in out and "no uncond pass" in out


def test_arch_without_a_kernel_says_sdpa(capsys):
    code, out, _err = run(capsys, PRESET + ["--arch", "sm70", "--attention", "sage-auto", "--vram", "24"])
    assert code == 0 and "no kernel runs on sm70: attention stays on SDPA" in out


def test_one_unit_everywhere(capsys):
    code, out, _err = run(capsys, PRESET + ["--vram", "24"])
    assert code == 0 and " GB" not in out and "verdict: offloads" in out and "GiB of weights" in out
    code, out, _err = run(capsys, PRESET + ["--vram", "4", "--frames", "241"])
    verdict = next(x for x in out.splitlines() if "verdict" in x)
    assert "GiB of working memory (activations, weight transients, streaming, fragmentation and allocator slack)" \
        in verdict
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert "GiB the model may use" in capsys.readouterr().out


def test_plan_into_a_closed_pipe_prints_no_traceback(tmp_path):
    """``wan-sage plan | head -3``: the reader leaves early; the CLI must not print a BrokenPipeError."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('wan_sage', {str(root / '__init__.py')!r}, "
            f"submodule_search_locations=[{str(root)!r}])\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['wan_sage'] = m; spec.loader.exec_module(m)\n"
            "from wan_sage.cli import main\n"
            "sys.exit(main(['plan', '--preset', 'wan2.2-a14b', '--vram', '24', '--cfg', '5']))\n")
    p = subprocess.run(f"{sys.executable} -c {_shell_quote(code)} | head -c 10", shell=True, capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def _shell_quote(s):
    import shlex
    return shlex.quote(s)


@pytest.mark.parametrize("flags,message", [
    (["--frames", "0"], "--frames must be between 1 and 4097, got 0"),
    (["--batch", "0"], "--batch must be between 1 and 64, got 0"),
    (["--width", "8"], "--width must be between 16 and 16384, got 8"),
    (["--vram", "-1"], "--vram must be more than 0 and at most 4096 (GiB), got -1"),
    (["--vram", "0"], "--vram must be more than 0 and at most 4096 (GiB), got 0"),
    (["--vram", "0.5e4"], "--vram must be more than 0 and at most 4096 (GiB), got 5000"),
    (["--margin", "-0.5"], "--margin must be between 0 and 1024 (GiB), got -0.5"),
])
def test_a_number_out_of_range_is_shown_whole_where_it_is_with_its_whole_range(capsys, flags, message):
    code, _out, err = run(capsys, PRESET + flags)
    assert_one_line(code, err, message)


def test_the_command_line_itself(capsys):
    """No command is a usage error (status 2, the help on stderr); an unknown flag is named with its command."""
    code, out, err = run(capsys, [])
    assert code == 2 and out == "" and "wan-sage plan" in err and "{plan,bench}" in err
    assert "bench_kernels" not in err  # the package's module list is not the user's help
    code, _out, err = run(capsys, PRESET + ["--wdith", "832"])
    assert_one_line(code, err, "wan-sage plan: unrecognized arguments: --wdith 832")
    code, _out, err = run(capsys, ["--bogus", *PRESET])  # given to wan-sage itself, not to plan
    assert_one_line(code, err, "wan-sage: unrecognized arguments: --bogus")
    code, _out, err = run(capsys, ["bench", "--iters", "0"])
    assert_one_line(code, err, "--iters must be between 1 and 1000, got 0")


def test_planning_without_a_gpu_says_which_arch_it_assumed(capsys, monkeypatch):
    from wan_sage.cli import plan as plan_cli
    monkeypatch.setattr(plan_cli, "_cuda_info", lambda: (None, None, None, None))
    note = "no GPU found and no --arch given: the Sage kernels are planned for sm90"
    code, out, _err = run(capsys, PRESET + ["--vram", "24", "--attention", "sage-auto"])
    assert code == 0 and note in out
    for flags in (["--arch", "sm89"], ["--attention", "sdpa"]):
        code, out, _err = run(capsys, PRESET + ["--vram", "24", "--attention", "sage-auto", *flags])
        assert code == 0 and note not in out


def test_fp8_fast_on_a_gpu_without_fp8_compute_says_it_runs_as_plain_fp8(capsys):
    code, out, _err = run(capsys, PRESET + ["--vram", "24", "--weights", "fp8_fast", "--arch", "sm80"])
    assert code == 0 and "fp8_e4m3fn_fast multiplies in fp8 only on GPUs with fp8 compute" in out
    code, out, _err = run(capsys, PRESET + ["--vram", "24", "--weights", "fp8_fast", "--arch", "sm90"])
    assert code == 0 and "fp8_e4m3fn_fast multiplies in fp8 only" not in out
