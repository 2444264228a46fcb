"""Unloading a model gives its loaded weights their host tensors back instead of copying them.

The load device here is ``meta``: a weight on it has no data, so ComfyUI's copy back
(``model.to("cpu")``) fails for every weight not given its host tensor back, and a weight given back the
wrong tensor shows in its values and data pointer.  The patcher mirrors ComfyUI 0.3.64's
``ModelPatcher`` where the unload touches weights (backups, hook backups, ``model.to``, clone callbacks)
and GGUF's tensor type (``detach`` returns itself, ``to`` carries the quantisation attributes)."""
import copy
import gc
import weakref

import pytest
import torch

from wan_sage.nodes import host_copy

CPU, META = torch.device("cpu"), torch.device("meta")


class QTensor(torch.Tensor):
    """ComfyUI-GGUF's GGMLTensor in the ways that matter here."""

    def __new__(cls, data, tensor_type="Q4_K"):
        return super().__new__(cls, data)

    def __init__(self, data, tensor_type="Q4_K"):
        super().__init__()
        self.tensor_type = tensor_type

    def to(self, *args, **kwargs):
        new = super().to(*args, **kwargs)
        new.tensor_type = getattr(self, "tensor_type", None)
        return new

    def detach(self, *args, **kwargs):
        return self

    @property
    def shape(self):  # GGMLTensor's shape is the logical one, not the bytes' (size())
        return torch.Size((2, 4, 4))

    def new_empty(self, size, *args, **kwargs):
        return QTensor(super().new_empty(size, *args, **kwargs), tensor_type=getattr(self, "tensor_type", None))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        self.q = torch.nn.Module()
        self.q.weight = torch.nn.Parameter(QTensor(torch.arange(64, dtype=torch.uint8)), requires_grad=False)


class Patcher:
    """ComfyUI's ModelPatcher, reduced to what loading and unloading do to the weights."""

    def __init__(self, model, load_device=META, offload_device=CPU):
        self.model, self.load_device, self.offload_device = model, load_device, offload_device
        self.backup, self.hook_backup, self.callbacks = {}, {}, {}
        self.lora = set()  # keys patched as ComfyUI-GGUF patches quantized weights: a new object on the device

    def add_callback_with_key(self, kind, key, fn):
        self.callbacks.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_callbacks_with_key(self, kind, key):
        self.callbacks.get(kind, {}).pop(key, None)

    def clone(self):
        n = type(self)(self.model, self.load_device, self.offload_device)
        n.backup, n.hook_backup = self.backup, self.hook_backup
        n.callbacks = {k: {k1: list(v1) for k1, v1 in v.items()} for k, v in self.callbacks.items()}
        for fns in self.callbacks.get(host_copy.ON_CLONE, {}).values():
            for fn in fns:
                fn(self, n)
        return n

    def load(self, backed_up=(), streamed=()):
        for key in self.lora:
            mod, name, p = host_copy._param(self.model, key)
            setattr(mod, name, torch.nn.Parameter(p.to(self.load_device), requires_grad=False))
        for key in backed_up:  # a full-precision LoRA weight: backup on the host, a patched tensor loaded
            mod, name, p = host_copy._param(self.model, key)
            self.backup[key] = p
            setattr(mod, name, torch.nn.Parameter(p.to(self.load_device) * 2, requires_grad=False))
        for name, m in self.model.named_children():
            if name not in streamed:
                m.to(self.load_device)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            for key, w in self.hook_backup.items():  # ComfyUI copies a hook's backup into the loaded weight
                host_copy._param(self.model, key)[2].data.copy_(w)
            for key, w in self.backup.items():
                mod, name, _ = host_copy._param(self.model, key)
                setattr(mod, name, w)
            self.backup.clear()
            if device_to is not None:
                self.model.to(device_to)

    def detach(self, unpatch_all=True):
        if unpatch_all:
            self.unpatch_model(self.offload_device, unpatch_weights=unpatch_all)


def _host_state(model):
    return {k: (p.data_ptr(), p.detach().clone() if not isinstance(p, QTensor) else torch.Tensor(p).clone())
            for k, p in model.named_parameters()}


def _load(p, **kw):
    p.load(**kw)  # the installed load notes the host tensors before and keeps them after
    return host_copy.kept_bytes(p)


def _check_given_back(model, before, keys=None):
    for k, p in model.named_parameters():
        if keys is not None and k not in keys:
            continue
        assert p.device == CPU, k
        ptr, value = before[k]
        assert p.data_ptr() == ptr, f"{k} was copied, not given back"
        assert torch.equal(torch.Tensor(p) if isinstance(p, QTensor) else p.detach(), value), k


def _installed_with_gguf_lora():
    """(model, patcher, host state before any load): a Net whose GGUF weight gets a LoRA at each load, the host copy
    installed on its patcher."""
    model = Net()
    p = Patcher(model)
    p.lora.add("q.weight")
    before = _host_state(model)
    assert host_copy.install(p)
    return model, p, before


def test_an_unload_gives_every_loaded_weight_its_host_tensor_and_copies_nothing():
    model, p, before = _installed_with_gguf_lora()
    kept = _load(p)
    assert kept == sum(t.numel() * t.element_size() for t in model.parameters())
    assert all(t.device == META for t in model.parameters())
    p.detach()  # model.to("cpu") would raise on any weight left on meta
    _check_given_back(model, before)
    assert model.q.weight.tensor_type == "Q4_K"


def test_without_the_host_copy_the_unload_copies_so_the_meta_check_can_fail():
    model = Net()
    p = Patcher(model)
    p.load()
    with pytest.raises(NotImplementedError):
        p.detach()


def test_it_lasts_over_repeated_loads_and_clones():
    model, p, before = _installed_with_gguf_lora()
    for _ in range(3):
        c = p.clone()
        assert host_copy.installed(c)
        _load(c)
        c.detach()
        _check_given_back(model, before)


def test_a_deep_copy_unloads_its_own_model():
    p = Patcher(Net())
    host_copy.install(p)
    q = copy.deepcopy(p)
    assert q.unpatch_model.__self__ is q
    before = _host_state(q.model)
    _load(q)
    q.detach()
    _check_given_back(q.model, before)


def test_a_backed_up_weight_comes_from_comfyuis_backup_and_streamed_weights_stay():
    model = Net()
    p = Patcher(model)
    before = _host_state(model)
    host_copy.install(p)
    _load(p, backed_up=("a.weight",), streamed=("b",))
    assert model.b.weight.device == CPU
    assert set(host_copy._KEPT[model]) == {"a.bias", "q.weight"}  # not the backed-up one, not the streamed ones
    p.detach()
    _check_given_back(model, before)


def test_a_weight_replaced_after_the_load_is_left_to_comfyuis_copy():
    model = Net()
    p = Patcher(model)
    host_copy.install(p)
    _load(p)
    model.a.weight = torch.nn.Parameter(torch.zeros(8, 8, device=META))  # another node's weight
    assert host_copy.release(p, CPU) == sum(t.numel() * t.element_size() for n, t in model.named_parameters()
                                             if n != "a.weight")
    assert model.a.weight.device == META


def test_hooked_weights_are_never_given_back():
    model = Net()
    p = Patcher(model)
    host_copy.install(p)
    _load(p)
    p.hook_backup["a.weight"] = torch.zeros(8, 8)
    assert host_copy.release(p, CPU) == 0
    assert model.a.weight.device == META  # left to ComfyUI, which restores the hook backup and copies


def test_no_device_tensor_is_kept_alive_after_the_unload():
    model = Net()
    p = Patcher(model)
    host_copy.install(p)
    _load(p)
    refs = [weakref.ref(t) for t in model.parameters()]
    p.detach()
    gc.collect()
    assert all(r() is None or r().device == CPU for r in refs)


def test_not_installed_where_load_and_offload_are_one_device_or_residency_is_comfyuis():
    assert not host_copy.install(Patcher(Net(), load_device=CPU))

    class Dynamic(Patcher):
        def is_dynamic(self):
            return True

    assert not host_copy.install(Dynamic(Net()))


def test_a_failing_release_falls_back_to_comfyuis_copy(monkeypatch):
    model = Net()
    p = Patcher(model, load_device=META)
    host_copy.install(p)
    _load(p)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(host_copy, "release", broken)
    with pytest.raises(NotImplementedError):  # ComfyUI's own copy ran (and meta cannot be copied)
        p.detach()
    assert model not in host_copy._KEPT


class PinningPatcher(Patcher):
    """ComfyUI 0.38's legacy ModelPatcher where the unload touches weights: ``unpatch_model`` ejects, restores
    hooks, unpins the host weights pinned for streaming (``unpin_all_weights``), then restores backups and
    moves the model.  The streamed weights stay on the host, pinned, while the model is loaded."""

    def load(self, backed_up=(), streamed=()):
        super().load(backed_up, streamed)
        self.pinned = {k for k, t in self.model.named_parameters() if t.device == CPU}

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            for k in self.pinned:  # unpinning: the streamed weight must still be the one pinned, on the host
                assert host_copy._param(self.model, k)[2].device == CPU
            self.pinned = set()
        return super().unpatch_model(device_to, unpatch_weights)


def test_on_comfyuis_pinning_unload_the_streamed_weights_stay_and_the_loaded_ones_come_back():
    model = Net()
    p = PinningPatcher(model)
    before = _host_state(model)
    host_copy.install(p)
    _load(p, streamed=("b",))
    assert p.pinned == {"b.weight", "b.bias"}
    p.detach()
    _check_given_back(model, before)


def test_a_failing_note_or_settle_never_fails_the_load(monkeypatch):
    model = Net()
    p = Patcher(model)
    host_copy.install(p)

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(host_copy, "note", broken)
    monkeypatch.setattr(host_copy, "settle", broken)
    p.load()
    assert all(t.device == META for t in model.parameters()) and model not in host_copy._KEPT


def test_a_replaced_tensor_is_interchangeable_only_when_it_carries_nothing_more():
    host = QTensor(torch.arange(8, dtype=torch.uint8))
    same = QTensor(torch.arange(8, dtype=torch.uint8))
    assert host_copy._interchangeable(same, host)
    other_type = QTensor(torch.arange(8, dtype=torch.uint8), tensor_type="Q8_0")
    assert not host_copy._interchangeable(other_type, host)
    lora = QTensor(torch.arange(8, dtype=torch.uint8))
    lora.patches = [((torch.ones(2),), "blocks.0.q.weight")]  # ComfyUI-GGUF's LoRA on the loaded tensor
    assert not host_copy._interchangeable(lora, host)
    host.patches = [((torch.zeros(2),), "blocks.0.q.weight")]  # attributes that do not compare: not the same
    assert not host_copy._interchangeable(lora, host)
    assert not host_copy._interchangeable(torch.nn.Parameter(torch.ones(2)), torch.ones(2))
    assert host_copy._interchangeable(torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2)))


class GGUFPatcher(Patcher):
    """ComfyUI-GGUF's GGUFModelPatcher where its first load takes the modules left streaming off the file's memory
    map: each goes to the load device and back (on ``meta`` that copy fails), once per patcher and its clones."""
    mmap_released = False

    def load(self, backed_up=(), streamed=()):
        super().load(backed_up, streamed)
        if not self.mmap_released:
            for name in streamed:
                getattr(self.model, name).to(self.load_device).to(self.offload_device)
            self.mmap_released = True

    def clone(self):
        n = super().clone()
        n.mmap_released = self.mmap_released
        return n


def test_a_gguf_models_streamed_modules_stay_on_their_host_tensors_from_the_first_load():
    model = Net()
    before = _host_state(model)
    base = GGUFPatcher(model)
    p = base.clone()  # the estimator's clone, made before any load
    host_copy.install(p)
    for c in (p, p.clone()):  # the clone itself, and the sampler's clone of it
        _load(c, streamed=("b",))
        assert c.mmap_released
        _check_given_back(model, before, keys={"b.weight", "b.bias"})  # left streaming, not copied
        c.detach()
        _check_given_back(model, before)
    assert base.mmap_released is False  # the model the estimator was given is left as it was


def test_without_the_host_copy_gguf_copies_its_streamed_modules_so_the_test_can_fail():
    p = GGUFPatcher(Net())
    with pytest.raises(NotImplementedError):
        p.load(streamed=("b",))


class PinningBase(Patcher):
    """A ComfyUI whose patcher pins the weights left streaming."""

    def pin_weight_to_device(self, key):
        pass


class GGUFOnPinning(PinningBase):
    mmap_released = False
    load = GGUFPatcher.load
    clone = GGUFPatcher.clone


def test_where_comfyui_pins_streamed_weights_or_the_copy_was_made_gguf_keeps_its_own_way():
    pinning = GGUFOnPinning(Net())
    host_copy.install(pinning)
    assert host_copy.skip_unmapping(pinning) is False and pinning.mmap_released is False
    released = GGUFPatcher(Net())
    released.mmap_released = True
    host_copy.install(released)
    assert host_copy.skip_unmapping(released) is False
    plain = Patcher(Net())  # not a GGUF model: nothing to skip, no attribute added
    host_copy.install(plain)
    assert host_copy.skip_unmapping(plain) is False and not hasattr(plain, "mmap_released")
    stock = GGUFPatcher(Net())  # no host copies kept: ComfyUI-GGUF's copy stays
    assert host_copy.skip_unmapping(stock) is False and stock.mmap_released is False


def test_a_loaded_tensor_that_carries_more_gets_a_twin_on_its_host_storage():
    """ComfyUI-GGUF's LoRA rides on the loaded quantized tensor (``patches``): the twin has the host tensor's
    storage and the loaded object's attributes, a list copied as ``GGMLTensor.to`` copies it, and the host object
    is left as it was."""
    host = QTensor(torch.arange(8, dtype=torch.uint8))
    cur = QTensor(torch.arange(8, dtype=torch.uint8), tensor_type="Q4_K")
    cur.patches = [((torch.ones(2),), "blocks.0.q.weight")]
    twin = host_copy._host_twin(cur, host)
    assert twin is not host and type(twin) is QTensor and twin.data_ptr() == host.data_ptr()
    assert twin.patches == cur.patches and twin.patches is not cur.patches and twin.tensor_type == "Q4_K"
    assert "patches" not in host.__dict__
    assert host_copy._host_twin(torch.ones(8), torch.ones(8)) is None  # plain tensors: nothing to carry
    assert host_copy._host_twin(torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))) is None
    off = QTensor(torch.arange(8, dtype=torch.uint8))
    off.patches = [((torch.ones(2, device="meta"),), "k")]
    off.scale = torch.ones(1, device="meta")  # a tensor attribute on another device: not this module's to keep
    assert host_copy._host_twin(off, host) is None


def test_a_partly_unloaded_gguf_lora_weight_gets_its_host_storage_with_its_lora():
    model, p, before = _installed_with_gguf_lora()
    _load(p)
    loaded = model.q.weight
    loaded.patches = [((torch.ones(2),), "q.weight")]  # as ComfyUI-GGUF's patch_weight_to_device sets it
    kept = host_copy._KEPT[model]
    freed = host_copy._give_back(model, kept, "q.weight", p.backup, CPU, same_object=True)
    assert freed == 64 and model.q.weight is not loaded
    _check_given_back(model, before, keys={"q.weight"})
    assert model.q.weight.patches == loaded.patches and model.q.weight.tensor_type == "Q4_K"
    # without the twin the module would get the host object, whose LoRA is gone: the test can fail
    assert getattr(kept["q.weight"].host, "patches", None) is None
