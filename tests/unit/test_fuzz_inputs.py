"""Fuzz tests (hypothesis) of everything that reads outside input: the model-file header reader
returns a valid result or raises ModelFileError; the estimate route answers 200 or 400, never 500;
``wan-sage plan --model`` exits 0 or 2 with one line on stderr."""
import contextlib
import io
import json

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (tests/requirements.txt)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from model_files import gguf_bytes, st_bytes, wan_shapes, write  # noqa: E402
from wan_sage import cli  # noqa: E402
from wan_sage.memory.errors import MESSAGE_CAP  # noqa: E402
from wan_sage.memory.headers import ModelFileError, read_model_file  # noqa: E402
from wan_sage.nodes import routes  # noqa: E402

OK = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81}


def _check(path: str):
    """A valid result, or a one-line ModelFileError; anything else fails the test."""
    try:
        info = read_model_file(path)
    except ModelFileError as e:
        assert str(e) and "\n" not in str(e) and len(str(e)) <= 300
        return None
    d = info.dims
    assert d.dim >= 128 and d.dim % 128 == 0 and d.num_layers >= 1 and d.num_heads >= 1
    assert d.latent_channels in (16, 48) and info.weights_bytes >= 0 and info.main_dtype
    return info


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    return d, st_bytes(wan_shapes()), gguf_bytes(d, wan_shapes())


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.binary(max_size=2048), name=st.sampled_from(["f.gguf", "f.safetensors", "f.bin"]),
       magic=st.sampled_from([b"", b"GGUF", b"GGUF\x03\x00\x00\x00"]))
def test_fuzz_random_bytes(fuzz_dir, data, name, magic):
    d, _st, _gg = fuzz_dir
    _check(write(d, name, magic + data))


@FUZZ
@given(which=st.sampled_from(["st", "gguf"]), cut=st.integers(min_value=0, max_value=4096),
       flips=st.lists(st.tuples(st.integers(min_value=0, max_value=2047), st.integers(min_value=0, max_value=255)),
                      max_size=6))
def test_fuzz_truncated_and_mutated_headers(fuzz_dir, which, cut, flips):
    d, st_full, gguf_full = fuzz_dir
    data = bytearray(st_full if which == "st" else gguf_full)
    for pos, val in flips:
        if pos < len(data):
            data[pos] = val
    if cut:
        data = data[:cut]
    _check(write(d, "m.gguf" if which == "gguf" else "m.safetensors", bytes(data)))

FIELDS = ["width", "height", "frames", "batch", "cfg", "dtype", "attention", "arch", "vram_gib", "weights", "lora",
          "margin_gib", "policy", "fixed_gib", "preset", "model_file", "model"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from([1280, 720, 81, "sm90", "sage-auto", "bf16", "wan2.2-a14b", "fp8", "q4_k_m"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8))
def test_fuzz_bodies_are_answered_200_or_400(body):
    status, answer = routes.handle_estimate({**OK, **body})
    assert status in (200, 400), answer
    if status == 400:
        assert answer["field"] in FIELDS + ["body"] and len(answer["error"]) <= MESSAGE_CAP
    else:
        json.dumps(answer, allow_nan=False)

@pytest.fixture(scope="module")
def fuzz_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-fuzz")
    return d, st_bytes(wan_shapes()), gguf_bytes(d, wan_shapes())


@settings(max_examples=150, deadline=None)
@given(which=st.sampled_from(["st", "gguf", "random"]), cut=st.integers(min_value=0, max_value=3000),
       noise=st.binary(max_size=512))
def test_fuzz_the_cli_exits_0_or_2_with_one_line(fuzz_files, which, cut, noise):
    d, st_full, gguf_full = fuzz_files
    data = {"st": st_full, "gguf": gguf_full, "random": noise}[which]
    data = data[:cut] + (noise[:8] if which != "random" else b"")
    path = write(d, "f.gguf" if which == "gguf" else "f.safetensors", data)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["plan", "--model", path, "--vram", "24"])
    out, err = out.getvalue(), err.getvalue()
    assert code in (0, 2)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and out == ""
    else:
        assert err == ""
