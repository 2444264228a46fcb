"""Host tier: the pack's routes over HTTP on a real ComfyUI server (CPU, 127.0.0.1)."""
import json
import math
import struct

import pytest

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

from comfy_server import Server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("comfy"), comfy_env.comfy_path()).wait()
    yield s
    s.stop()


def test_pack_loaded_without_errors(server):
    log = server.log_text()
    ours = [line for line in log.splitlines() if "wan-sage" in line]
    assert ours and not any("IMPORT FAILED" in line or "Cannot import" in line for line in ours), log[-3000:]
    status, info = server.request("GET", "/object_info/WanWorkingMemoryEstimator")
    assert status == 200 and "WanWorkingMemoryEstimator" in info


def test_the_estimators_widgets_offer_what_the_validator_accepts(server):
    """Each size, cfg and GiB widget's bounds, as the server tells the frontend, are accepted by the one validator,
    and a value past either bound is refused naming its field: no widget value the node then rejects."""
    from wan_sage.memory.errors import RequestError
    from wan_sage.memory.request import check_fields
    status, info = server.request("GET", "/object_info/WanWorkingMemoryEstimator")
    assert status == 200
    widgets = info["WanWorkingMemoryEstimator"]["input"]["required"]
    fields = {"width": "width", "height": "height", "frames": "frames", "batch_size": "batch", "cfg": "cfg",
              "margin_gib": "margin_gib", "fixed_gib": "fixed_gib"}
    for widget, field in fields.items():
        spec = widgets[widget][1]
        for bound, past in ((spec["min"], spec["min"] - 1), (spec["max"], spec["max"] + 1)):
            size = {"width": 1280, "height": 720, "frames": 81}
            check_fields({**size, field: bound})
            with pytest.raises(RequestError) as e:
                check_fields({**size, field: past})
            assert e.value.field == field


@pytest.mark.parametrize("prefix", ["", "/api"])
def test_estimate_ok(server, prefix):
    status, body = server.request("POST", prefix + "/wan_sage/estimate",
                                  {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81,
                                   "vram_gib": 24, "attention": "sage-auto", "arch": "sm90"})
    assert status == 200, body
    assert body["summary"]["tokens"] == 75600 and body["summary"]["level"] == "offloads"


def test_estimate_from_a_model_file_name(server):
    status, body = server.request("POST", "/wan_sage/estimate",
                                  {"model_file": "wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", "width": 832,
                                   "height": 480, "frames": 81, "vram_gib": 24})
    assert status == 200, body
    assert body["summary"]["tokens"] == 32760
    # the placeholder file is empty: the route says so and guesses from the name
    assert body["summary"]["detected"]["guessed"] is True and "is empty" in body["summary"]["source"]


@pytest.mark.parametrize("payload,field", [
    ({"width": "wide", "height": 720, "frames": 81}, "width"),
    ({"width": 1280, "height": 720, "frames": -3}, "frames"),
    ({"width": 1280, "height": 720, "frames": 81, "attention": "flash9"}, "attention"),
    ({"preset": "sdxl", "width": 1280, "height": 720, "frames": 81}, "preset"),
    ([], "body"),
])
def test_estimate_bad_values_are_400_with_the_field(server, payload, field):
    status, body = server.request("POST", "/wan_sage/estimate", payload)
    assert status == 400 and body["field"] == field and body["error"]


def test_estimate_bad_json_is_400(server):
    status, body = server.request("POST", "/wan_sage/estimate", raw=b"{not json")
    assert status == 400 and body["field"] == "body"


def _tiny_wan_safetensors(dim=256, ffn=512, layers=2) -> bytes:
    shapes = {"head.modulation": [1, 2, dim], "patch_embedding.weight": [dim, 16, 1, 2, 2],
              "head.head.weight": [64, dim], **{f"blocks.{i}.ffn.0.weight": [ffn, dim] for i in range(layers)}}
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def test_estimate_reads_the_model_files_header(server):
    (server.work / "models" / "diffusion_models" / "tiny_wan_for_routes.safetensors").write_bytes(_tiny_wan_safetensors())
    status, body = server.request("POST", "/wan_sage/estimate", {"model_file": "tiny_wan_for_routes.safetensors",
                                                                 "width": 832, "height": 480, "frames": 81})
    assert status == 200, body
    assert body["summary"]["detected"] == {"model": "tiny_wan_for_routes.safetensors", "model_type": "t2v", "dim": 256,
                                           "num_layers": 2, "num_heads": 2, "weight_dtype": "bf16", "guessed": False}
    assert body["summary"]["source"] == "header of tiny_wan_for_routes.safetensors"


def test_a_broken_model_file_is_a_marked_guess_without_server_paths(server):
    (server.work / "models" / "diffusion_models" / "wan2.2_t2v_broken_14B.gguf").write_bytes(b"GGUF")
    status, body = server.request("POST", "/wan_sage/estimate", {"model_file": "wan2.2_t2v_broken_14B.gguf",
                                                                 "width": 832, "height": 480, "frames": 81})
    assert status == 200, body
    s = body["summary"]
    assert s["detected"]["guessed"] is True and "truncated GGUF header" in s["source"]
    assert str(server.work) not in json.dumps(body) and "--preset" not in json.dumps(body)


GOOD = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81}
HOSTILE = [
    ({**GOOD, "width": float("inf")}, "width"), ({**GOOD, "frames": float("nan")}, "frames"),
    ({**GOOD, "height": 1e300}, "height"), ({**GOOD, "vram_gib": 1e300}, "vram_gib"),
    ({**GOOD, "margin_gib": float("inf")}, "margin_gib"), ({**GOOD, "vram_gb": 24}, "vram_gb"),
    ({**GOOD, "preset": ["x"]}, "preset"), ({**GOOD, "dtype": ["bf16"]}, "dtype"), ({**GOOD, "weights": 5}, "weights"),
    ({**GOOD, "lora": "no"}, "lora"), ({**GOOD, "arch": 10 ** 30}, "arch"), ({**GOOD, "arch": "sm-90"}, "arch"),
    ({**GOOD, "model": {"dim": 5120, "ffn_dim": 13824, "num_layers": -5}}, "model"),
    ({**GOOD, "model": {"dim": 5120, "ffn_dim": 13824, "latent_channels": 0}}, "model"),
    ({**GOOD, "model_file": {"a": 1}}, "model_file"), ({**GOOD, "model_file": ["x.gguf"]}, "model_file"),
    ({**GOOD, "model_file": "x\u0000.gguf"}, "model_file"), ({**GOOD, "model_file": "x" * (1 << 20)}, "body"),
    ({**GOOD, "weights": "x" * 30000}, "weights"),
]
RAW = [
    (b"[" * 5000 + b"]" * 5000, 400, "body"), (b'{"width": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "width"),
    (b'{"width": Infinity, "height": 720, "frames": 81}', 400, "width"), (b"\xff\xfe", 400, "body"),
    (b"{not json", 400, "body"), (b" " * (80 << 10) + b"{}", 413, "body"),
]


def test_hostile_bodies_are_4xx_and_the_server_still_answers(server):
    before = len(server.log_text())
    for payload, field in HOSTILE:
        status, body = server.request("POST", "/wan_sage/estimate", payload)
        expected = 413 if field == "body" else 400
        assert (status, body["field"]) == (expected, field), (str(payload)[:80], body)
        assert len(body["error"]) <= 300 and "x" * 60 not in body["error"]
    for raw, expected, field in RAW:
        status, body = server.request("POST", "/wan_sage/estimate", raw=raw)
        assert (status, body["field"]) == (expected, field), (raw[:40], body)
    status, _ = server.request("GET", "/system_stats")
    assert status == 200
    status, body = server.request("POST", "/wan_sage/estimate", GOOD)
    assert status == 200 and body["summary"]["tokens"] == 75600
    log = server.log_text()[before:]
    assert "Traceback" not in log and "RecursionError" not in log and "wan-sage" not in log, log[-3000:]


def test_stats_route(server):
    status, body = server.request("GET", "/wan_sage/stats")
    assert status == 200 and "runs" in body
