"""Host tier: Wan Text Encoder Host Copy on a real ComfyUI 0.3.64 CLIP (a miniature UMT5 through
``comfy.sd.CLIP``, Wan's own tokenizer and text-encoder classes).

As in test_host_unload, the load device is ``meta`` (the CPU is the only real device here): ComfyUI's own unload
cannot copy a meta tensor, so a weight not given its host tensor back fails the unload, and one given back the
wrong tensor shows in its data pointer and values.  The text then encodes on the CPU as it did before."""
import pytest
import torch

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

from test_host_unload import META, _state  # noqa: E402  (after the skip: it needs the same host)
TINY = {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2, "vocab_size": 1000}
TEXT = "a red fox running through a snowy forest at golden hour"


def _clip(comfy):
    """A real CLIP of Wan's text-encoder classes at miniature size, on the CPU, as CLIPLoader builds one."""
    pytest.importorskip("sentencepiece", reason="sentencepiece (a ComfyUI requirement) is not installed")
    import comfy.sd
    import comfy.supported_models_base
    import comfy.text_encoders.wan as wan
    from bench.e2e_models import train_tokenizer
    target = comfy.supported_models_base.ClipTarget(wan.WanT5Tokenizer, wan.te())
    torch.manual_seed(0)
    clip = comfy.sd.CLIP(target=target, tokenizer_data={"spiece_model": train_tokenizer()},
                         model_options={"umt5xxl_model_config": dict(TINY)})
    with torch.no_grad():
        for p in clip.cond_stage_model.parameters():
            p.normal_(0, 0.02)
    return clip


def _encode(clip):
    return clip.encode_from_tokens(clip.tokenize(TEXT))


def test_the_text_encoders_unload_copies_nothing_and_it_encodes_the_same_after(comfy):
    from wan_sage.nodes import host_copy
    from wan_sage.nodes.text_encoder import KEPT, NOT_KEPT, apply_text_encoder_host_copy
    clip = _clip(comfy)
    assert apply_text_encoder_host_copy(clip) == (clip, NOT_KEPT)  # the CPU loads and offloads: nothing to keep
    cond = _encode(clip)
    clip.patcher.load_device = META
    c, text = apply_text_encoder_host_copy(clip)
    assert text == KEPT and c is not clip and host_copy.installed(c.patcher) and not host_copy.installed(clip.patcher)
    before = _state(c.cond_stage_model)
    for _ in range(2):  # one prompt's text, then the next one's
        c.patcher.patch_model(META, lowvram_model_memory=0)
        assert all(t.device == META for t in c.cond_stage_model.parameters())
        assert host_copy.kept_bytes(c.patcher) == sum(t.numel() * t.element_size() for k, t in
                                                      [*c.cond_stage_model.named_parameters(),
                                                       *c.cond_stage_model.named_buffers()])
        c.patcher.detach()
        for k, t in [*c.cond_stage_model.named_parameters(), *c.cond_stage_model.named_buffers()]:
            assert t.device.type == "cpu" and t.data_ptr() == before[k][0], f"{k} was copied back"
            assert torch.equal(t.detach(), before[k][1]), k
    c.patcher.load_device = torch.device("cpu")
    assert torch.equal(_encode(c), cond)


def test_stock_comfyui_copies_the_text_encoder_back_so_the_test_can_fail(comfy):
    clip = _clip(comfy)
    clip.patcher.load_device = META
    clip.patcher.patch_model(META, lowvram_model_memory=0)
    with pytest.raises(NotImplementedError):
        clip.patcher.detach()


def test_the_node_returns_the_clip_and_its_status(comfy):
    from wan_sage.nodes.schemas import WanTextEncoderHostCopy
    from wan_sage.nodes.text_encoder import KEPT
    clip = _clip(comfy)
    clip.patcher.load_device = META
    out = WanTextEncoderHostCopy.execute(clip)
    c, text = out.result
    assert text == KEPT and c.cond_stage_model is clip.cond_stage_model and c.patcher is not clip.patcher
