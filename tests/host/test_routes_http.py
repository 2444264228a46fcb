"""Host tier: the pack's routes over HTTP on a real ComfyUI server (CPU, 127.0.0.1)."""
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


@pytest.mark.parametrize("prefix", ["", "/api"])
def test_estimate_ok(server, prefix):
    status, body = server.request("POST", prefix + "/wan_sage/estimate",
                                  {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81,
                                   "vram_gb": 24, "attention": "sage-auto", "arch": "sm90"})
    assert status == 200, body
    assert body["summary"]["tokens"] == 75600 and body["summary"]["level"] == "offloads"


def test_estimate_from_a_model_file_name(server):
    status, body = server.request("POST", "/wan_sage/estimate",
                                  {"model_file": "wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", "width": 832,
                                   "height": 480, "frames": 81, "vram_gb": 24})
    assert status == 200, body
    assert body["summary"]["tokens"] == 32760


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


def test_stats_route(server):
    status, body = server.request("GET", "/wan_sage/stats")
    assert status == 200 and "runs" in body
