"""Host tier: the convolutions memory/vae_decode.py's late_convs plans for the Wan VAE decode are those ComfyUI's
own Wan 2.1 VAE (comfy/sd.py's config, comfy/ldm/wan/vae.py) first runs with the second latent frame at half and
full resolution: the same shapes and padding, and no other."""
import pytest
import torch

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

# comfy/sd.py's "Wan 2.1 VAE" branch
WAN21 = {"dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
         "temperal_downsample": [False, True, True], "dropout": 0.0}


@pytest.mark.parametrize("h,w", [(2, 3), (3, 2)])
def test_late_convs_are_the_real_decoders_convolutions_first_run_with_the_second_frame(comfy, monkeypatch, h, w):
    import comfy.ldm.wan.vae as wan_vae
    from wan_sage.memory import vae_decode
    vae = wan_vae.WanVAE(**WAN21).eval()
    for p in vae.parameters():
        torch.nn.init.normal_(p, std=0.02)
    F = torch.nn.functional
    frame = [-1]
    first_seen = {}

    def probe(fn):
        def conv(x, weight, bias=None, stride=1, padding=0, *args, **kwargs):
            pad = padding[0] if isinstance(padding, (tuple, list)) else padding
            key = (tuple(x.shape), tuple(weight.shape), int(pad))
            first_seen.setdefault(key, frame[0])
            return fn(x, weight, bias, stride, padding, *args, **kwargs)
        return conv
    monkeypatch.setattr(F, "conv2d", probe(F.conv2d))
    monkeypatch.setattr(F, "conv3d", probe(F.conv3d))
    real_forward = vae.decoder.forward

    def counted(*args, **kwargs):
        frame[0] += 1
        return real_forward(*args, **kwargs)
    monkeypatch.setattr(vae.decoder, "forward", counted)
    latent = (1, 16, 3, h, w)
    with torch.inference_mode():
        out = vae.decode(torch.randn(latent))
    assert tuple(out.shape) == (1, 3, 9, 8 * h, 8 * w) and frame[0] == 2

    def out_hw(key):
        x, wt, pad = key
        return tuple(s + 2 * pad - k + 1 for s, k in zip(x[-2:], wt[-2:]))
    late = {k for k, f in first_seen.items() if f >= 1 and out_hw(k) in ((4 * h, 4 * w), (8 * h, 8 * w))}
    planned = {(c.input, c.weight, c.padding) for c in vae_decode.late_convs(latent)}
    assert planned == late
    assert all(c.output()[-2:] == out_hw((c.input, c.weight, c.padding)) for c in vae_decode.late_convs(latent))
