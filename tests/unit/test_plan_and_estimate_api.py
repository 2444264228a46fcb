"""``wan-sage plan`` (table, JSON, bad input, a model file) and the estimate API behind the route."""
import json

import pytest

from wan_sage import cli


def test_plan_table_and_json(capsys):
    assert cli.main(["plan", "--preset", "wan2.2-a14b", "--width", "1280", "--height", "720", "--frames", "81",
                     "--vram", "24"]) == 0
    out = capsys.readouterr().out
    assert "75,600" in out and "verdict: offloads" in out and "13.61 GiB" in out
    assert cli.main(["plan", "--preset", "wan2.2-a14b", "--attention", "sage-auto", "--arch", "sm90", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["estimate"]
    assert d["tokens"] == 75600 and d["resident"]["sage_extra"] > 0


@pytest.mark.parametrize("args,msg", [
    (["--width", "-1"], "width must be between"), (["--attention", "flash9"], "attention must be"),
    (["--weights", "q1"], "--weights must be one of"), (["--arch", "x"], "--arch")])
def test_plan_bad_input(capsys, args, msg):
    assert cli.main(["plan", "--preset", "wan2.2-a14b", *args]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_path_is_refused_not_planned_as_a_preset(capsys, name):
    """``--model "$UNSET"``: one line naming the flag, not a plan of a preset the user did not ask for."""
    assert cli.main(["plan", "--model", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wan-sage plan: --model is empty") and err.count("\n") == 1


def test_plan_reads_a_model_file(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file
    sd = {"head.modulation": torch.zeros(1, 2, 1536), "patch_embedding.weight": torch.zeros(1536, 16, 1, 2, 2),
          "head.head.weight": torch.zeros(64, 1536), **{f"blocks.{i}.ffn.0.weight": torch.zeros(8960, 8) for i in range(30)}}
    p = tmp_path / "wan1.3b.safetensors"
    save_file(sd, str(p))
    assert cli.main(["plan", "--model", str(p), "--width", "832", "--height", "480", "--frames", "81"]) == 0
    assert "32,760" in capsys.readouterr().out
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 4)
    assert cli.main(["plan", "--model", str(tmp_path / "x.safetensors")]) == 2


def test_estimate_api_json_and_field_errors():
    from wan_sage.memory.errors import RequestError
    from wan_sage.memory.request import guess_preset
    from wan_sage.memory.answer import estimate_answer as estimate_from_json
    req = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "vram_gib": 24, "attention": "sage-auto",
           "arch": "sm90"}
    r = estimate_from_json({**req, "no_decode": True})
    assert r["summary"]["tokens"] == 75600 and r["summary"]["level"] == "offloads"
    assert 9.5 < r["summary"]["reservation_gib"] < 11 and r["summary"]["sage_extra_gib"] > 0.3
    assert r["summary"]["decode_room_gib"] == 0
    # A request plans the node on a GPU, whose weights keep their host copies: the model is unloaded for the
    # Wan 2.1 VAE decode ComfyUI runs next where the weights it keeps resident leave that room short, so the
    # reservation keeps none of it.  The room: its memory_used_decode for a 90 x 160 latent in bf16 (comfy/sd.py)
    # plus 1.1 x the VAE's bf16 weights, plus the workspace of its last 96-channel convolution (input
    # 6 x 722 x 1282, output 4 x 720 x 1280).
    decode_takes = (int(7000 * 90 * 160 * 64 * 2 + 1.1 * 126_892_531 * 2)
                    + 96 * (6 * 722 * 1282 + 4 * 720 * 1280) * 2) / (1 << 30)
    d = estimate_from_json(req)["summary"]
    assert abs(d["decode_unload_gib"] - decode_takes) < 1e-6 and d["decode_room_gib"] == 0
    assert d["reservation_gib"] == r["summary"]["reservation_gib"] < decode_takes
    assert d["offload_gib"] == r["summary"]["offload_gib"]
    # where the decode's room is free beside every weight, nothing is unloaded
    d = estimate_from_json({**req, "vram_gib": 64})["summary"]
    assert d["level"] == "fits" and d["decode_unload_gib"] == 0 and d["decode_room_gib"] == 0
    with pytest.raises(RequestError, match="no_decode"):
        estimate_from_json({**req, "no_decode": "yes"})
    r = estimate_from_json({"model_file": "wan2.2_t2v_high_noise_14B_Q4_K_M.gguf", "width": 832, "height": 480,
                            "frames": 81, "vram_gib": 24})
    assert r["summary"]["tokens"] == 32760 and "guessed" in r["summary"]["source"]
    assert guess_preset("wan2.2_ti2v_5B_fp16.safetensors") == "wan2.2-ti2v-5b"
    for payload, field in (({"width": "x", "height": 720, "frames": 81}, "width"),
                           ({"width": 1280, "height": -720, "frames": 81}, "height"),
                           ({"width": 1280, "height": 720}, "frames"),
                           ({"preset": "sd15", "width": 1280, "height": 720, "frames": 81}, "preset"),
                           ({"width": 1280, "height": 720, "frames": 81, "attention": "xformers"}, "attention"),
                           ({"width": 1280, "height": 720, "frames": 81, "vram_gib": -2}, "vram_gib"),
                           ({"model_file": "mystery.safetensors", "width": 1280, "height": 720, "frames": 81}, "model_file"),
                           ([1, 2], "body")):
        with pytest.raises(RequestError) as e:
            estimate_from_json(payload)
        assert e.value.field == field, (payload, e.value.field, str(e.value))


def test_route_handler_answers_400_not_500():
    from wan_sage.nodes.routes import handle_estimate, stats_body
    assert handle_estimate({"width": 1280})[0] == 400
    status, body = handle_estimate({"preset": "wan2.1-1.3b", "width": 832, "height": 480, "frames": 81})
    assert status == 200 and body["summary"]["tokens"] == 32760
    assert "runs" in stats_body()


def test_estimate_api_policies():
    from wan_sage.memory.errors import RequestError
    from wan_sage.memory.answer import estimate_answer as estimate_from_json
    base = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "vram_gib": 24, "no_decode": True}
    ours = estimate_from_json(base)["summary"]["reservation_gib"]
    assert estimate_from_json({**base, "policy": "fixed GB per row", "fixed_gib": 9.5})["summary"]["reservation_gib"] == 9.5
    assert estimate_from_json({**base, "policy": "max(wan-sage, ComfyUI)"})["summary"]["reservation_gib"] == pytest.approx(13.61, abs=0.01)
    assert ours < 11
    with pytest.raises(RequestError) as e:
        estimate_from_json({**base, "policy": "yolo"})
    assert e.value.field == "policy"


def test_api_and_cli_count_the_same_weight_transients():
    from wan_sage.memory.answer import estimate_answer as estimate_from_json
    base = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81}
    bf16 = estimate_from_json({**base, "weights": "bf16"})["estimate"]["resident"]["weight_transient"]
    fp8 = estimate_from_json({**base, "weights": "fp8"})["estimate"]["resident"]["weight_transient"]
    assert bf16 == 0 and fp8 == 2 * 5120 * 13824  # fp8 weights are cast to bf16 per call


def test_plan_json_is_the_routes_answer_with_this_machines_notes(capsys, monkeypatch):
    """``wan-sage plan --json`` prints what the route answers for the same request, and a note of its own (no GPU
    here) reaches the summary's notes as well as the text: one answer, one formatter."""
    from wan_sage.cli import plan as plan_cli
    from wan_sage.memory.answer import estimate_answer
    monkeypatch.setattr(plan_cli, "_cuda_info", lambda: (None, None, None, None))
    assert cli.main(["plan", "--preset", "wan2.2-a14b", "--width", "832", "--height", "480", "--frames", "81",
                     "--attention", "sage-auto", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    route = estimate_answer({"preset": "wan2.2-a14b", "width": 832, "height": 480, "frames": 81,
                             "attention": "sage-auto"})
    mine = ["no GPU found and no --vram given: the verdict needs --vram GiB",
            "no GPU found and no --arch given: the Sage kernels are planned for sm90; give --arch (e.g. sm89, sm120) "
            "for another GPU"]
    assert printed["summary"]["notes"] == route["summary"]["notes"] + mine
    lines = printed["text"].splitlines()
    assert all(f"note: {n}" in lines for n in mine)
    assert [x for x in lines if x[len("note: "):] not in mine] == route["text"].splitlines()
    assert {k: v for k, v in printed["summary"].items() if k != "notes"} == \
        {k: v for k, v in route["summary"].items() if k != "notes"}
    assert printed["estimate"] == json.loads(json.dumps(route["estimate"], default=str))


@pytest.mark.parametrize("cfg, uncond", [(1.0, False), (1.0 + 1e-12, False), (0.9999999999, False), (1.01, True),
                                         (6.0, True)])
def test_the_uncond_pass_is_counted_where_comfyuis_sampler_runs_it(cfg, uncond):
    """ComfyUI's sampler skips the uncond pass where ``math.isclose(cfg, 1.0)``: a cfg within that of 1 plans one
    row and prints no batched reservation, as cfg 1 does."""
    from wan_sage.memory import request
    from wan_sage.memory.estimate import plan
    est = plan(request.build({"preset": "wan2.2-a14b", "width": 832, "height": 480, "frames": 81, "cfg": cfg,
                              "vram_gib": 24}).setup)
    assert (est.rows_batched == 2 * est.rows_sequential) is uncond
    assert (est.reservation_batched_partial is not None) is uncond
