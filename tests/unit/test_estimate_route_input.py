"""The estimate route on hostile bodies: 4xx naming the field, never a 500, short messages, nothing
logged; and the model file read from its header (or a guess, marked as one).  The fuzz is in
test_fuzz_inputs.py."""
import json
import logging

import pytest

from model_files import st_bytes, wan_shapes
from wan_sage.memory.errors import MESSAGE_CAP
from wan_sage.nodes import routes

OK = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81}
HUGE = "x" * (1 << 20)

# (body, status, field) — each a client error the route must name.
BAD_BODIES = [
    ({**OK, "width": float("inf")}, 400, "width"),
    ({**OK, "width": float("nan")}, 400, "width"),
    ({**OK, "frames": float("nan")}, 400, "frames"),
    ({**OK, "height": 1e300}, 400, "height"),
    ({**OK, "width": "wide"}, 400, "width"),
    ({**OK, "width": 1280.5}, 400, "width"),
    ({**OK, "width": True}, 400, "width"),
    ({**OK, "batch": 0}, 400, "batch"),
    ({**OK, "cfg": float("nan")}, 400, "cfg"),
    ({**OK, "vram_gib": 1e300}, 400, "vram_gib"),
    ({**OK, "vram_gib": 0}, 400, "vram_gib"),
    ({**OK, "vram_gib": "24"}, 400, "vram_gib"),
    ({**OK, "margin_gib": float("inf")}, 400, "margin_gib"),
    ({**OK, "margin_gib": -1}, 400, "margin_gib"),
    ({**OK, "fixed_gib": -2}, 400, "fixed_gib"),
    ({**OK, "vram_gb": 24}, 400, "vram_gb"),
    ({**OK, "margin_gb": 0.5}, 400, "margin_gb"),
    ({**OK, "fixed_gb": 9.5}, 400, "fixed_gb"),
    ({**OK, "preset": ["x"]}, 400, "preset"),
    ({**OK, "preset": "sdxl"}, 400, "preset"),
    ({**OK, "dtype": ["bf16"]}, 400, "dtype"),
    ({**OK, "dtype": "int4"}, 400, "dtype"),
    ({**OK, "weights": 5}, 400, "weights"),
    ({**OK, "weights": "bogus"}, 400, "weights"),
    ({**OK, "lora": "no"}, 400, "lora"),
    ({**OK, "lora": 1}, 400, "lora"),
    ({**OK, "attention": "flash9"}, 400, "attention"),
    ({**OK, "attention": {"a": 1}}, 400, "attention"),
    ({**OK, "policy": "yolo"}, 400, "policy"),
    ({**OK, "arch": 10 ** 30}, 400, "arch"),
    ({**OK, "arch": "sm-90"}, 400, "arch"),
    ({**OK, "arch": ""}, 400, "arch"),
    ({**OK, "arch": [90]}, 400, "arch"),
    ({**OK, "model_file": {"a": 1}}, 400, "model_file"),
    ({**OK, "model_file": ["wan2.2_14B.gguf"]}, 400, "model_file"),
    ({**OK, "model_file": "wan2.2_14B\0.gguf"}, 400, "model_file"),
    ({**OK, "model_file": "wan\n14B.gguf"}, 400, "model_file"),
    ({**OK, "model_file": HUGE}, 400, "model_file"),
    ({"width": 1280, "height": 720, "frames": 81, "model_file": "mystery.safetensors"}, 400, "model_file"),
    ({**OK, "model": {"dim": 5120, "ffn_dim": 13824, "num_layers": -5}}, 400, "model"),
    ({**OK, "model": {"dim": 5120, "ffn_dim": 13824, "latent_channels": 0}}, 400, "model"),
    ({**OK, "model": {"dim": 5120, "ffn_dim": 13824, "latent_channels": 32}}, 400, "model"),
    ({**OK, "model": {"dim": 5120, "ffn_dim": 13824, "num_heads": 7}}, 400, "model"),
    ({**OK, "model": {"dim": 5120, "ffn_dim": 13824, "num_heads": 0}}, 400, "model"),
    ({**OK, "model": {"dim": -1, "ffn_dim": 13824}}, 400, "model"),
    ({**OK, "model": {"dim": 5120}}, 400, "model"),
    ({**OK, "model": {"dim": 5120, "ffn_dim": 13824, "dimm": 1}}, 400, "model"),
    ({**OK, "model": [5120]}, 400, "model"),
    ({"width": 1280, "height": 720}, 400, "frames"),
    ([1, 2], 400, "body"),
    ("text", 400, "body"),
]


@pytest.mark.parametrize("body,status,field", BAD_BODIES, ids=lambda v: str(v)[:60] if isinstance(v, dict) else None)
def test_bad_bodies_name_the_field(body, status, field, caplog):
    caplog.set_level(logging.DEBUG, logger="wan_sage")
    got, answer = routes.handle_estimate(body)
    assert (got, answer["field"]) == (status, field), answer
    assert answer["error"] and "\n" not in answer["error"] and len(answer["error"]) <= MESSAGE_CAP
    assert "Traceback" not in answer["error"] and "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx" not in answer["error"]
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_renamed_fields_name_the_new_one():
    assert "vram_gib" in routes.handle_estimate({**OK, "vram_gb": 24})[1]["error"]


def test_the_same_bodies_as_raw_json(caplog):
    caplog.set_level(logging.DEBUG, logger="wan_sage")
    for raw, field in ((b'{"preset": "wan2.2-a14b", "width": Infinity, "height": 720, "frames": 81}', "width"),
                       (b'{"preset": "wan2.2-a14b", "width": 1e999, "height": 720, "frames": 81}', "width"),
                       (b'{"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": NaN}', "frames")):
        status, answer = routes.handle_estimate_body(raw)
        assert (status, answer["field"]) == (400, field)
    assert not caplog.records


@pytest.mark.parametrize("raw,status,field", [
    (b"[" * 5000 + b"]" * 5000, 400, "body"),
    (b'{"width": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "width"),
    (b'{"preset": "wan2.2-a14b", "model": {"dim": ' + b"[" * 20 + b"]" * 20 + b"}}", 400, "model"),
    (b'{"model_file": "' + b"[" * 5000 + b'", "width": 1280, "height": 720, "frames": 81}', 400, "model_file"),
    (b"{not json", 400, "body"),
    (b"\xff\xfe{}", 400, "body"),
    (b'{"width": ' + b"1" * 5000 + b"}", 400, "body"),
    (b" " * (70 << 10) + b"{}", 413, "body"),
])
def test_raw_bodies_are_limited_before_parsing(raw, status, field, caplog):
    """Each is refused before anything uses it; a value nested too deep names its top-level field."""
    caplog.set_level(logging.DEBUG, logger="wan_sage")
    got, answer = routes.handle_estimate_body(raw)
    assert got == status and answer["field"] == field, answer
    assert len(answer["error"]) <= MESSAGE_CAP and not caplog.records


def test_a_good_body_is_answered():
    status, answer = routes.handle_estimate_body(json.dumps({**OK, "vram_gib": 24, "attention": "sage-auto",
                                                             "arch": "sm90", "lora": False}).encode())
    s = answer["summary"]
    assert status == 200 and s["tokens"] == 75600 and s["level"] == "offloads"
    assert set(s) >= {"tokens", "activation_gib", "sage_extra_gib", "reservation_gib", "comfy_gib", "weights_gib",
                      "vram_gib", "offload_gib", "verdict", "level", "dominant_phase", "notes", "source", "policy",
                      "detected"}
    assert s["detected"] == {"model": "wan2.2-a14b", "model_type": "t2v", "dim": 5120, "num_layers": 40,
                             "num_heads": 40, "weight_dtype": "bf16", "guessed": True}
    assert "GiB" in s["verdict"] and " GB " not in s["verdict"]


def test_an_estimator_fault_is_a_500_logged_once(monkeypatch, caplog):
    def broken(*a, **k):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(routes, "estimate_answer", broken)
    caplog.set_level(logging.DEBUG, logger="wan_sage")
    assert routes.handle_estimate(OK)[0] == 500
    assert routes.handle_estimate(OK)[0] == 500
    assert len([r for r in caplog.records if r.exc_info]) <= 1


# ------------------------------------------------------------------ the model file's header

def _safetensors(dim=1536, ffn=8960, layers=2):
    return st_bytes(wan_shapes(dim=dim, ffn=ffn, layers=layers), dtype="BF16")


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(routes, "resolve_model_file", lambda name: str(tmp_path / name) if (tmp_path / name).exists() else None)
    return tmp_path


def test_a_model_file_is_read_from_its_header(model_dir):
    (model_dir / "my_wan_1.3b.safetensors").write_bytes(_safetensors())
    status, answer = routes.handle_estimate({"model_file": "my_wan_1.3b.safetensors", "width": 832, "height": 480,
                                             "frames": 81})
    s = answer["summary"]
    assert status == 200 and s["source"] == "header of my_wan_1.3b.safetensors"
    assert s["detected"] == {"model": "my_wan_1.3b.safetensors", "model_type": "t2v", "dim": 1536, "num_layers": 2,
                             "num_heads": 12, "weight_dtype": "bf16", "guessed": False}


@pytest.mark.parametrize("name,data,why", [
    ("wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", b"GGUF", "truncated GGUF header"),
    ("wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", b"", "is empty"),
    ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", _safetensors(dim=64), "dim 64 is not a Wan model"),
])
def test_a_broken_file_falls_back_to_a_name_guess_without_server_paths(model_dir, name, data, why):
    (model_dir / name).write_bytes(data)
    status, answer = routes.handle_estimate({"model_file": name, "width": 832, "height": 480, "frames": 81})
    s = answer["summary"]
    assert status == 200 and s["detected"]["guessed"] is True and s["detected"]["model"] == "wan2.2-a14b"
    assert "guessed" in s["source"] and why in s["source"] and why in " ".join(s["notes"])
    text = json.dumps(answer)
    assert str(model_dir) not in text and "--preset" not in text and "--" not in s["source"]


def test_a_broken_file_with_an_unguessable_name_is_a_400_without_server_paths(model_dir):
    (model_dir / "mystery.gguf").write_bytes(b"GGUF")
    status, answer = routes.handle_estimate({"model_file": "mystery.gguf", "width": 832, "height": 480, "frames": 81})
    assert (status, answer["field"]) == (400, "model_file")
    assert "truncated GGUF header" in answer["error"] and str(model_dir) not in answer["error"]
    assert "--" not in answer["error"]


class _Body:
    """A request whose body read raises ``error`` (aiohttp raises its payload error for a body sent as gzip that
    is not gzip)."""

    content_length = None

    def __init__(self, error):
        self.error = error
        self.content = self

    async def read(self, n):
        raise self.error


def test_a_body_that_cannot_be_read_is_a_400_naming_the_body():
    import asyncio
    from wan_sage.memory.json_body import BodyError
    from wan_sage.nodes.routes import _read_capped
    with pytest.raises(BodyError) as e:
        asyncio.run(_read_capped(_Body(ValueError("400, message: Can not decode content-encoding: gzip"))))
    assert e.value.status == 400 and e.value.field == "body" and "could not be read" in str(e.value)
    assert "content-encoding: gzip" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(asyncio.CancelledError):  # a cancel is not the body's fault
        asyncio.run(_read_capped(_Body(asyncio.CancelledError())))
