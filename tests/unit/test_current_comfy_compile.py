"""ComfyUI 0.38's dynamic VRAM and the pack's Wan Compile Blocks: the clone the node compiles.

Stand-in written after comfy/model_patcher.py@08d0e510 (``ModelPatcher.clone(disable_dynamic=False,
model_override=None, force_deepcopy=False)``): on a dynamic patcher (``ModelPatcherDynamic``, ``is_dynamic()``
True), ``disable_dynamic=True`` makes a plain ``ModelPatcher`` over the model its loader loads again through
``cached_patcher_init``, and raises RuntimeError where the loader registered none; on any other patcher it is an
ordinary clone.  ComfyUI's own ``TorchCompileModel`` (comfy_extras/nodes_torch_compile.py, since ComfyUI PR
#12612) compiles such a clone: dynamic VRAM casts each weight in at every call, which dynamo cannot trace as a
weight."""
from types import SimpleNamespace

import pytest

from wan_sage.nodes import comfy_bridge, compile_blocks


class ModelPatcher:
    """ComfyUI 0.38's ``ModelPatcher``: the clone signature and the dynamic delegate, nothing else."""

    def __init__(self, model):
        self.model = model
        self.cached_patcher_init = None

    def is_dynamic(self):
        return False

    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
        class_ = type(self)
        if self.is_dynamic() and disable_dynamic:
            class_ = ModelPatcher
            if model_override is None:
                if self.cached_patcher_init is None:
                    raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
                model_override = (self.cached_patcher_init[0](*self.cached_patcher_init[1],
                                                              disable_dynamic=True).model,)
        n = class_(model_override[0] if model_override else self.model)
        n.cached_patcher_init = self.cached_patcher_init
        return n


class ModelPatcherDynamic(ModelPatcher):
    def is_dynamic(self):
        return True


def _loader(loads: list):
    """A loader as ComfyUI registers it in ``cached_patcher_init``: each call loads the model again."""
    def load(path, disable_dynamic=False):
        loads.append((path, disable_dynamic))
        model = SimpleNamespace(name=f"{path} loaded again")
        return ModelPatcher(model) if disable_dynamic else ModelPatcherDynamic(model)
    return load


def test_a_dynamic_model_is_compiled_as_a_clone_without_dynamic_vram_as_comfyuis_own_compile_node_does():
    loads = []
    dynamic = ModelPatcherDynamic(SimpleNamespace(name="as first loaded"))
    dynamic.cached_patcher_init = (_loader(loads), ("wan2.2_high.safetensors",))
    clone, note = compile_blocks._clone_to_compile(dynamic)
    assert type(clone) is ModelPatcher and not clone.is_dynamic()
    assert clone.model.name == "wan2.2_high.safetensors loaded again" and loads == [("wan2.2_high.safetensors", True)]
    assert note == compile_blocks.DYNAMIC_OFF and "legacy memory path" in note
    assert dynamic.is_dynamic() and dynamic.model.name == "as first loaded"  # the input model is left as it was


def test_a_patcher_whose_clone_takes_keywords_through_kwargs_is_cloned_without_dynamic_vram():
    loads = []

    class Wrapping(ModelPatcherDynamic):  # a pack's patcher that hands every keyword on to ComfyUI's clone
        def clone(self, *args, **kwargs):
            return super().clone(*args, **kwargs)
    dynamic = Wrapping(SimpleNamespace(name="gguf"))
    dynamic.cached_patcher_init = (_loader(loads), ("wan.gguf",))
    clone, note = compile_blocks._clone_to_compile(dynamic)
    assert type(clone) is ModelPatcher and note == compile_blocks.DYNAMIC_OFF and loads == [("wan.gguf", True)]


def test_a_model_that_is_not_dynamic_gets_a_plain_clone():
    plain = ModelPatcher(SimpleNamespace(name="m"))
    clone, note = compile_blocks._clone_to_compile(plain)
    assert type(clone) is ModelPatcher and clone.model is plain.model and note is None

    class OldPatcher:  # ComfyUI 0.3.64: no is_dynamic, a clone without the keyword
        model = object()

        def clone(self):
            return SimpleNamespace(model=self.model)
    clone, note = compile_blocks._clone_to_compile(OldPatcher())
    assert clone.model is OldPatcher.model and note is None


def test_a_dynamic_model_that_cannot_be_loaded_again_passes_through_uncompiled_and_says_how(monkeypatch):
    dynamic = ModelPatcherDynamic(SimpleNamespace(name="custom loader"))  # no cached_patcher_init
    clone, note = compile_blocks._clone_to_compile(dynamic)
    assert clone is None
    assert note.startswith("not compiled: dynamic VRAM manages this model and ComfyUI could not load it again")
    assert "cached_patcher_init is not initialized" in note and note.endswith("--disable-dynamic-vram to compile it")

    class NoKeyword(ModelPatcherDynamic):
        def clone(self):
            return self
    assert compile_blocks._clone_to_compile(NoKeyword(None)) == (None, (
        "not compiled: dynamic VRAM manages this model and its patcher cannot give a copy without it; start ComfyUI "
        "with --disable-dynamic-vram to compile it"))

    class StaysDynamic(ModelPatcherDynamic):  # takes the keyword through **kwargs and ignores it
        def clone(self, *args, **kwargs):
            return ModelPatcherDynamic(self.model)
    assert compile_blocks._clone_to_compile(StaysDynamic(None))[0] is None
    # the node: the model itself comes back, with that status, and nothing is compiled
    monkeypatch.setattr(comfy_bridge, "is_wan", lambda model: True)
    out, text = compile_blocks.apply_compile_blocks(dynamic)
    assert out is dynamic and text == note
