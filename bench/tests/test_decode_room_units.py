"""bench.decode_room's scenarios and the harness's decode profile, without ComfyUI or a GPU."""
import pytest
import torch

from bench import decode_room, e2e


@pytest.mark.parametrize("text, want", [
    ("room:15", {"kind": "room", "room_gib": 15.0}),
    ("holes:11:1.5", {"kind": "holes", "room_gib": 11.0, "holes_gib": 1.5}),
    ("trim:11:1.5", {"kind": "trim", "room_gib": 11.0, "holes_gib": 1.5}),
    ("then:11:15", {"kind": "then", "room_gib": 11.0, "room2_gib": 15.0}),
])
def test_scenarios_parse(text, want):
    assert decode_room.parse_scenario(text) == want


@pytest.mark.parametrize("text", ["room", "room:", "holes:11", "then:11:", "free:12", "room:-1", "room:12:1"])
def test_bad_scenario_names_the_forms(text):
    with pytest.raises(ValueError, match="room:R, holes:R:H, trim:R:H or then:R1:R2"):
        decode_room.parse_scenario(text)


def test_bad_scenario_list_exits_2_before_any_process(capsys):
    assert decode_room.main(["--scenarios", "room:15,holes:1"]) == 2
    assert "--scenarios: scenario 'holes:1'" in capsys.readouterr().err


def test_profile_off_runs_no_profiler(monkeypatch):
    import torch.profiler
    monkeypatch.setattr(torch.profiler, "profile", lambda *a, **k: pytest.fail("profiled with top=0"))
    with e2e.profiled(torch, 0) as out:
        torch.ones(4).sum()
    assert out == {}


def test_profile_on_cpu_records_no_device_kernels():
    with e2e.profiled(torch, 5) as out:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert out == {"device_s": 0.0, "kernels": 0, "top": [], "convs": []}


def test_profile_counts_each_conv_shape_and_puts_conv_back():
    F = torch.nn.functional
    before = (F.conv2d, F.conv3d)
    conv = torch.nn.Conv3d(4, 8, 3)
    with e2e.profiled(torch, 5) as out:
        for _ in range(3):
            conv(torch.randn(1, 4, 5, 6, 6))
        F.conv2d(torch.randn(1, 2, 9, 9), torch.randn(3, 2, 3, 3))
    assert (F.conv2d, F.conv3d) == before
    rows = [(r["input"], r["weight"], r["calls"], r["order"]) for r in out["convs"]]
    assert rows == [([1, 4, 5, 6, 6], [8, 4, 3, 3, 3], 3, 0), ([1, 2, 9, 9], [3, 2, 3, 3], 1, 1)]
    assert all(r["first"] == {} for r in out["convs"])           # no CUDA here: no memory reading


def test_conv_probe_puts_conv_back_when_the_block_raises():
    F = torch.nn.functional
    before = F.conv3d
    with pytest.raises(ValueError):
        with e2e.ConvProbe(torch):
            assert F.conv3d is not before
            raise ValueError("decode failed")
    assert F.conv3d is before


def test_profile_failure_is_recorded_not_raised(monkeypatch):
    import torch.profiler

    def broken(*a, **k):
        raise RuntimeError("no profiler here")
    monkeypatch.setattr(torch.profiler, "profile", broken)
    with e2e.profiled(torch, 5) as out:
        pass
    assert out == {"error": "RuntimeError: no profiler here"}


def test_profile_decode_option():
    a = e2e.parse_args(["--models-dir", "m", "--runs", "est+sage@16:720p81", "--profile-decode", "12"])
    assert a.profile_decode == 12
    assert e2e.parse_args(["--models-dir", "m", "--runs", "est+sage@16:720p81"]).profile_decode == 0


def test_sage_trim_off_is_labelled_and_recorded():
    spec = e2e.RunSpec.parse("est+sage@16:720p81")
    off = e2e.parse_args(["--models-dir", "m", "--runs", spec.label, "--sage-trim", "off"])
    on = e2e.parse_args(["--models-dir", "m", "--runs", spec.label])
    assert e2e.run_label(spec, off) == spec.label + "/no-trim"
    assert e2e.run_label(spec, on) == spec.label
    # SDPA runs have no Sage patch to trim: their label stays, so --skip-done still finds them
    sdpa = e2e.RunSpec.parse("comfy+sdpa@16:720p81")
    assert e2e.run_label(sdpa, off) == sdpa.label


def test_without_sampling_trim_keeps_the_trim_after_loading():
    import types
    calls = []
    bridge = types.SimpleNamespace(trim_allocator=lambda dev, when: calls.append(when))
    original = e2e.without_sampling_trim(bridge)
    bridge.trim_allocator("cuda", "after sampling")
    bridge.trim_allocator("cuda", "after loading")
    assert calls == ["after loading"]
    original("cuda", "after sampling")
    assert calls == ["after loading", "after sampling"]


def test_conv_workspace_parses_shapes_and_names_the_fix(capsys):
    from bench import conv_workspace
    assert conv_workspace.parse_conv("1x96x6x722x1282:96x96x3x3x3") == ([1, 96, 6, 722, 1282], [96, 96, 3, 3, 3])
    assert conv_workspace.parse_conv("4x192x720x1280:96x192x3x3") == ([4, 192, 720, 1280], [96, 192, 3, 3])
    for bad in ("1x96x6x722x1282", "1x96x6:96x96x3x3x3", "1x16x6x8x8:96x96x3x3x3", "ax1:1xb"):
        with pytest.raises(ValueError, match="--conv"):
            conv_workspace.parse_conv(bad)
    assert conv_workspace.main(["--conv", "1x96x6x8x8:96x96x3x3x3", "--free-gib", "2,x"]) == 2
    assert "--free-gib '2,x'" in capsys.readouterr().err
    assert conv_workspace.main(["--conv", "1x96x6x8x8:9x96x3x3x3", "--free-gib", "0"]) == 2


def test_sweep_lines_find_where_a_convolution_turns_fast():
    from bench import render_docs
    row = lambda shape, free, ms: {"input": shape, "free_gib": free, "ms": ms}  # noqa: E731
    a, b = [1, 96, 6, 722, 1282], [1, 96, 6, 482, 834]
    sweep = [row(a, 1.0, 87.3), row(a, 2.0, 87.2), row(a, 2.5, 7.9), row(a, 7.0, 7.8),
             row(b, 0.5, 38.0), row(b, 1.5, 3.4), row(b, 5.0, 3.5)]
    got = render_docs.sweep_lines(sweep)
    assert (got[tuple(a)]["slow_gib"], got[tuple(a)]["fast_gib"]) == (2.0, 2.5)
    assert (got[tuple(b)]["slow_gib"], got[tuple(b)]["fast_gib"]) == (0.5, 1.5)
    # a shape never slow (or never fast) in the sweep draws no line
    assert render_docs.sweep_lines([row(a, 1.0, 7.9), row(a, 2.0, 7.8)]) == {}


def test_the_decode_section_names_the_slow_convolution_from_the_records():
    from bench import render_docs
    text = "\n".join(render_docs.decode_conv_lines())
    assert "input 1×96×6×722×1282, 120 calls" in text
    assert "when 2.5 GiB or more are free" in text and "with 2 GiB or less" in text


def test_decode_room_extra_is_labelled_recorded_and_put_back():
    spec = e2e.RunSpec.parse("est+sage@16:720p81")
    a = e2e.parse_args(["--models-dir", "m", "--runs", spec.label, "--decode-room-extra-gib", "2"])
    assert e2e.run_label(spec, a) == spec.label + "/decode-room+2"
    stock = e2e.RunSpec.parse("comfy+sdpa@16:720p81")    # no estimator: nothing to keep, the label stays
    assert e2e.run_label(stock, a) == stock.label
    with pytest.raises(SystemExit):
        e2e.parse_args(["--models-dir", "m", "--runs", spec.label, "--decode-room-extra-gib", "0"])
    import types
    from wan_sage.memory import vae_decode
    mod = types.SimpleNamespace(decode_bytes=vae_decode.decode_bytes)
    original = e2e.with_decode_room_extra(mod, 1.5)
    latent = (1, 16, 21, 90, 160)
    assert mod.decode_bytes(latent) == vae_decode.decode_bytes(latent) + int(1.5 * e2e.GiB)
    assert mod.decode_bytes((1, 36, 21, 90, 160)) is None        # no Wan VAE decodes it: still none
    assert original is vae_decode.decode_bytes


def test_runs_with_more_decode_room_stay_out_of_the_tables():
    from bench import render_docs
    assert render_docs.switched_off_default({"decode_room_extra_gib": 2.0})
    assert not render_docs.switched_off_default({"estimator": True, "attention": "sage"})


def test_decode_room_extra_reaches_the_estimators_reservation():
    # the switch patches the module the estimate reads at plan time: the room kept for the decode grows by G
    from wan_sage.memory import vae_decode
    from wan_sage.memory.estimate import plan
    from wan_sage.memory.request import build
    from dataclasses import replace
    req = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "attention": "sage-auto",
           "arch": "sm90", "weights": "fp8", "vram_gib": 32}

    def setups():  # the room kept (a model unloaded by ComfyUI's copy); the model unloaded for the decode at 24 GiB
        s = build(req).setup
        return (plan(replace(s, decode_by_unload=False)),
                plan(replace(s, decode_by_unload=True, vram_bytes=24 * e2e.GiB)))

    before, before_unload = setups()
    original = e2e.with_decode_room_extra(vae_decode, 2)
    try:
        after, after_unload = setups()
    finally:
        vae_decode.decode_bytes = original
    assert before.decode_floor > 0
    assert after.decode_floor == before.decode_floor + 2 * e2e.GiB
    assert after.room_for_weights == before.room_for_weights - 2 * e2e.GiB
    assert after_unload.decode_unload == before_unload.decode_unload + 2 * e2e.GiB > 2 * e2e.GiB
    assert setups()[0].decode_floor == before.decode_floor


def test_cudnn_benchmark_reaches_each_scenarios_process(monkeypatch):
    seen = []

    class Done:
        stdout, stderr = "", "no output"
    monkeypatch.setattr(decode_room.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    decode_room.main(["--scenarios", "room:15", "--cudnn-benchmark"])
    decode_room.main(["--scenarios", "room:15"])
    assert "--cudnn-benchmark" in seen[0] and "--cudnn-benchmark" not in seen[1]
