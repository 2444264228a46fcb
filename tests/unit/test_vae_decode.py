"""The VAE decode after the sampling.  Where the node unloads the model for it when its sampling ends (its
weights keep their host copies, so the unload copies nothing), the reservation keeps none of its room.  Else,
on the legacy path the reservation in force keeps the room it takes (what
ComfyUI frees for it: comfy/sd.py's memory_used_decode for the latent's Wan VAE plus 1.1 x the VAE's weights;
and the workspace of its largest convolution's fast cuDNN engine), so the decode evicts none of the weights
kept resident and keeps that engine; where that room does not fit in the budget (ComfyUI then
unloads the model whole for the decode), on dynamic VRAM, under the fixed policy and with no decode, it
keeps none."""
from dataclasses import replace

import pytest

from wan_sage.memory import vae_decode
from wan_sage.memory.estimate import GiB, PLACEMENT_SLACK, POLICIES, plan
from wan_sage.memory.request import build

A14B_720P = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "attention": "sage-auto",
             "arch": "sm90", "weights": "fp8"}


def _est(by_unload: bool = False, **fields):
    """The plan for a request; ``by_unload``: the model is unloaded for the decode when its sampling ends (the
    node with its weights' host copies, as a request plans it), else kept (its unload copies the weights back)."""
    return plan(replace(build({**A14B_720P, **fields}).setup, decode_by_unload=by_unload))


def test_comfyuis_figures_for_the_two_wan_vaes():
    # comfy/sd.py: Wan 2.1 VAE 7000 x h x w x 64, Wan 2.2 VAE 8000 x h x w x 256 bytes per dtype byte;
    # frames and batch do not enter it
    assert vae_decode.comfy_figure_bytes((1, 16, 21, 90, 160)) == 7000 * 90 * 160 * 64 * 2
    assert vae_decode.comfy_figure_bytes((2, 16, 31, 90, 160)) == vae_decode.comfy_figure_bytes((1, 16, 21, 90, 160))
    assert vae_decode.comfy_figure_bytes((1, 48, 31, 44, 80), 4) == 8000 * 44 * 80 * 256 * 4
    assert vae_decode.comfy_figure_bytes((1, 36, 21, 90, 160)) is None


def test_the_largest_convolution_is_the_last_stages_at_full_resolution():
    # Wan 2.1 VAE at 1280x720: the decoder's last 96-channel convolution, input 1x96x6x722x1282 (4 frames of a
    # chunk, 2 cached, 1 pixel of padding), output 1x96x4x720x1280, bf16
    assert vae_decode.conv_workspace_bytes((1, 16, 21, 90, 160)) == 96 * (6 * 722 * 1282 + 4 * 720 * 1280) * 2
    # the 2.2 VAE's last stage runs at half its output's resolution, 256 channels: 1280x704 -> 640x352
    assert vae_decode.conv_workspace_bytes((1, 48, 31, 44, 80), 4) == 256 * (6 * 354 * 642 + 4 * 352 * 640) * 4
    assert vae_decode.conv_workspace_bytes((1, 36, 21, 90, 160)) is None


def test_the_decodes_room_is_comfyuis_plus_that_workspace():
    for latent, size, params in (((1, 16, 21, 90, 160), 2, 126_892_531), ((1, 48, 31, 44, 80), 4, 704_688_668)):
        frees = int(vae_decode.comfy_figure_bytes(latent, size) + 1.1 * params * size)
        assert vae_decode.comfy_frees_bytes(latent, size) == frees
        assert vae_decode.decode_bytes(latent, size) == frees + vae_decode.conv_workspace_bytes(latent, size)
    assert vae_decode.decode_bytes((2, 16, 31, 90, 160)) == vae_decode.decode_bytes((1, 16, 21, 90, 160))
    assert vae_decode.decode_bytes((1, 36, 21, 90, 160)) is None


def test_the_reservation_in_force_keeps_the_decodes_room_where_it_fits_beside_every_weight():
    est = _est(vram_gib=32)
    no = _est(vram_gib=32, no_decode=True)
    need = vae_decode.decode_bytes(est.setup.latent)
    assert no.reservation < need and est.decode_floor == need and est.reservation == need
    assert est.room_for_weights == 32 * GiB - est.setup.kept_free - need and est.level == "fits"
    assert "Wan 2.1 VAE decode after sampling" in _text(est) and "decode after sampling" not in _text(no)
    assert any("the room the Wan 2.1 VAE decode after the sampling takes" in n for n in est.notes)


def _offload(weights, reservation, room):
    return max(0, weights - max(0, room - reservation))


@pytest.mark.parametrize("weights", ["fp8", "fp16", "q4_k_m", "q8_0"])
@pytest.mark.parametrize("size", [(1280, 720, 81), (832, 480, 81), (960, 544, 49), (1024, 576, 121)])
def test_the_decodes_room_never_streams_a_weight_comfyui_alone_keeps_resident(weights, size):
    w, h, f = size
    for vram in (10, 13.5, 17, 19.25, 22, 26.5, 31, 37, 45, 60):
        est = _est(width=w, height=h, frames=f, weights=weights, vram_gib=vram)
        no = _est(width=w, height=h, frames=f, weights=weights, vram_gib=vram, no_decode=True)
        s = est.setup
        room, W, need = s.vram_bytes - s.kept_free, s.weights_bytes, vae_decode.decode_bytes(s.latent)
        assert no.reservation <= est.reservation and est.decode_floor <= need
        if need > room:
            assert est.decode_floor == 0
        elif W + need + PLACEMENT_SLACK <= room:
            assert est.decode_floor == need      # the whole room, where it fits beside every weight
        else:
            # never less room for the decode than after ComfyUI alone's sampling, and never a weight streamed
            # that ComfyUI alone's reservation or the sampling's own keeps resident
            assert est.decode_floor >= min(need, est.comfy_estimate)
            assert est.offload_bytes <= max(no.offload_bytes, _offload(W, est.comfy_estimate, room))
            if est.decode_floor < need:
                assert any("capped at" in n for n in est.notes)


@pytest.mark.parametrize("vram", [12, 9.5])
def test_no_room_is_kept_where_the_decode_does_not_fit_the_budget(vram):
    est = _est(vram_gib=vram)
    assert est.decode_floor == 0 and est.reservation == _est(vram_gib=vram, no_decode=True).reservation


def test_a_longer_video_keeps_its_own_reservation():
    # the decode's room does not grow with the frames; the sampling's does, and above it stays in force
    est = _est(frames=161, vram_gib=48)
    assert 0 < est.decode_floor < est.reservation == _est(frames=161, vram_gib=48, no_decode=True).reservation
    assert not any("decode after the sampling" in n for n in est.notes)


def test_dynamic_vram_and_the_fixed_policy_keep_no_room():
    s = build({**A14B_720P, "vram_gib": 24}).setup
    assert plan(replace(s, dynamic_vram=True)).decode_floor == 0
    fixed = plan(replace(s, policy=POLICIES[2], fixed_bytes=9 * GiB))
    assert fixed.decode_floor == 0 and fixed.reservation == 9 * GiB


def test_the_2_2_vae_of_ti2v_5b():
    s = build({"preset": "wan2.2-ti2v-5b", "width": 1280, "height": 704, "frames": 121, "vram_gib": 40}).setup
    est = plan(replace(s, decode_by_unload=False))
    assert est.setup.latent[1] == 48 and est.decode_floor == vae_decode.decode_bytes(est.setup.latent)
    assert "Wan 2.2 VAE decode after sampling" in _text(est)


def _text(est):
    from wan_sage.memory import report
    return report.report(est)


def test_a_room_that_fits_beside_the_weights_only_by_a_sliver_is_capped_too():
    # ComfyUI places the weights against its free memory after the estimate: a room that leaves the weights less
    # than the slack would stream the last modules once the sampling's own allocations are made
    s = replace(build({**A14B_720P, "weights": "q4_k_m", "width": 832, "height": 480, "vram_gib": 16}).setup,
                decode_by_unload=False)
    need = vae_decode.decode_bytes(s.latent)
    for spare, capped in ((PLACEMENT_SLACK // 2, True), (PLACEMENT_SLACK, False), (2 * PLACEMENT_SLACK, False)):
        est = plan(replace(s, vram_bytes=s.weights_bytes + need + s.kept_free + spare))
        assert (est.decode_floor < need) == capped and est.level == "fits"


# --- the model unloaded for the decode when its sampling ends (the node with host copies; what requests plan)

def test_a_request_plans_the_node_that_unloads_for_the_decode():
    assert build(A14B_720P).setup.decode_by_unload
    assert build({**A14B_720P, "no_decode": True}).setup.decode_dtype_size is None
    assert plan(build({**A14B_720P, "no_decode": True, "vram_gib": 16}).setup).decode_unload == 0


@pytest.mark.parametrize("weights", ["q4_k_m", "fp8", "fp16"])
@pytest.mark.parametrize("vram", [12, 16, 20, 24, 32])
def test_unloading_for_the_decode_keeps_no_room_and_never_holds_fewer_weights(weights, vram):
    kept = _est(vram_gib=vram, weights=weights)
    unload = _est(by_unload=True, vram_gib=vram, weights=weights)
    need = vae_decode.decode_bytes(unload.setup.latent)
    assert unload.decode_floor == 0
    assert unload.reservation == (unload.reservation_partial if unload.streamed else unload.reservation_resident)
    assert unload.room_for_weights >= kept.room_for_weights
    # the unload is planned exactly where the weights kept resident leave the decode's room short
    room = vram * GiB - unload.setup.kept_free
    resident = unload.setup.weights_bytes - unload.offload_bytes
    assert bool(unload.decode_unload) == (resident + need > room and need <= room)
    assert unload.decode_unload in (0, need)
    assert bool(unload.decode_unload) == ("decode after sampling" in _text(unload) and "unloaded first" in _text(unload))


def test_where_the_decode_fits_beside_every_weight_nothing_is_unloaded():
    est = _est(by_unload=True, vram_gib=64, weights="q4_k_m")
    assert est.level == "fits" and est.decode_unload == 0 and est.decode_floor == 0
    assert "decode after sampling" not in _text(est)


def test_no_unload_is_planned_on_dynamic_vram_or_without_a_decode():
    s = replace(build({**A14B_720P, "vram_gib": 16}).setup, decode_by_unload=True)
    assert plan(s).decode_unload > 0
    assert plan(replace(s, dynamic_vram=True)).decode_unload == 0
    assert plan(replace(s, decode_dtype_size=None)).decode_unload == 0
    # a decode that needs more than the whole budget: ComfyUI unloads the model for it anyway
    assert plan(replace(s, vram_bytes=8 * GiB)).decode_unload == 0
