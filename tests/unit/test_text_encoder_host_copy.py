"""Wan Text Encoder Host Copy: the CLIP it returns unloads its text encoder without copying the weights back.

The load device is ``meta`` (as in test_host_copy): an unload that copies fails, and a weight given back the
wrong tensor shows in its data pointer and values.  The CLIP mirrors ComfyUI 0.3.64's ``comfy.sd.CLIP.clone``
(a new object sharing the text encoder, with a clone of its patcher)."""
import torch

from wan_sage.nodes import text_encoder
from test_host_copy import CPU, META, Patcher, _check_given_back, _host_state


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.block = torch.nn.Linear(8, 8)


class Clip:
    def __init__(self, patcher):
        self.patcher, self.cond_stage_model = patcher, patcher.model

    def clone(self):
        return Clip(self.patcher.clone())


def test_the_clone_unloads_without_copying_and_the_input_clip_is_left_as_it_was():
    clip = Clip(Patcher(Encoder()))
    before = _host_state(clip.patcher.model)
    c, text = text_encoder.apply_text_encoder_host_copy(clip)
    assert c is not clip and c.patcher is not clip.patcher and text == text_encoder.KEPT
    assert "load" not in vars(clip.patcher) and "unpatch_model" not in vars(clip.patcher)
    for _ in range(2):  # one prompt's text, then another's: load, unload, load, unload
        c.patcher.load()
        assert all(p.device == META for p in c.patcher.model.parameters())
        c.patcher.detach()
        _check_given_back(c.patcher.model, before)


def test_the_input_clip_still_copies_so_the_test_can_fail():
    clip = Clip(Patcher(Encoder()))
    text_encoder.apply_text_encoder_host_copy(clip)
    clip.patcher.load()
    try:
        clip.patcher.detach()
    except NotImplementedError:  # a meta tensor cannot be copied back
        return
    raise AssertionError("the unpatched CLIP gave its weights back without a copy")


def test_a_clip_on_one_device_on_dynamic_vram_or_not_a_clip_passes_through_with_the_reason():
    one = Clip(Patcher(Encoder(), load_device=CPU, offload_device=CPU))
    c, text = text_encoder.apply_text_encoder_host_copy(one)
    assert c is one and text == text_encoder.NOT_KEPT and "load" not in vars(one.patcher)

    class Dynamic(Patcher):  # ComfyUI 0.38's dynamic VRAM: residency is ComfyUI's own
        def is_dynamic(self):
            return True

    dyn = Clip(Dynamic(Encoder()))
    c, text = text_encoder.apply_text_encoder_host_copy(dyn)
    assert c is dyn and text == text_encoder.NOT_KEPT and "load" not in vars(dyn.patcher)
    thing = object()
    assert text_encoder.apply_text_encoder_host_copy(thing) == (thing, text_encoder.NOT_CLIP)


def test_a_text_encoder_created_on_the_gpu_says_its_first_unload_copies():
    clip = Clip(Patcher(Encoder()))
    clip.patcher.model.to(META)  # ComfyUI created it on the load device: no host tensors yet
    c, text = text_encoder.apply_text_encoder_host_copy(clip)
    assert c is not clip and text == text_encoder.ON_GPU
