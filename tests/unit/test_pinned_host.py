"""The weights a partial load leaves streaming move into page-locked host buffers, and only those.

The page-locking itself is a fake here (a CPU machine has no CUDA runtime); it records what would be registered
and unregistered.  The GPU tier checks the real one (``tests/gpu/test_pinned_gpu.py``)."""
import gc
import logging
from types import SimpleNamespace

import pytest
import torch

from wan_sage.nodes import host_copy, pinned_host

from .test_host_copy import CPU, META, Patcher, QTensor

GiB = 2**30


class FakeLocker:
    def __init__(self, fail=False):
        self.locked, self.unlocked, self.fail = {}, [], fail

    def usable(self, device):
        return True

    def lock(self, ptr, nbytes):
        if self.fail:
            raise RuntimeError("out of page-lockable memory")
        self.locked[ptr] = nbytes
        return True

    def unlock(self, ptr):
        self.unlocked.append(ptr)


class Net(torch.nn.Module):
    """Two Linears and a GGUF-like weight; ``streamed`` names the ones a partial load left casting per call."""

    def __init__(self, streamed=("a", "q")):
        super().__init__()
        self.a = torch.nn.Linear(24, 8)
        self.b = torch.nn.Linear(8, 4)
        self.q = torch.nn.Module()
        self.q.weight = torch.nn.Parameter(QTensor(torch.arange(100, dtype=torch.uint8)), requires_grad=False)
        for name in ("a", "b", "q"):
            getattr(self, name).comfy_cast_weights = name in streamed


def _patcher(model):
    return SimpleNamespace(model=model, load_device=torch.device("cuda"), offload_device=CPU)


def _values(model):
    return {k: (p, p.data_ptr(), torch.Tensor.as_subclass(p, torch.Tensor).clone()) for k, p in model.named_parameters()}


def _within(ptr, locker):
    return any(start <= ptr < start + n for start, n in locker.locked.items())


def test_streamed_weights_move_into_page_locked_buffers_and_keep_their_objects_and_values():
    model, locker = Net(), FakeLocker()
    before = _values(model)
    start = pinned_host.pinned_bytes()
    done = pinned_host.pin_streamed(_patcher(model), locker, total=64 * GiB, available=lambda: 64 * GiB)
    assert done == sum(locker.locked.values()) > 0
    assert len(locker.locked) == 2  # one buffer per streamed module
    assert pinned_host.pinned_bytes() - start == done
    for k, p in model.named_parameters():
        obj, ptr, value = before[k]
        assert p is obj, k  # the same weight object: what rides on it (a GGUF LoRA) stays
        assert torch.equal(torch.Tensor.as_subclass(p, torch.Tensor), value), k
        moved = k.split(".")[0] in ("a", "q")
        assert _within(p.data_ptr(), locker) is moved, k
        assert (p.data_ptr() != ptr) is moved, k
    assert model.q.weight.tensor_type == "Q4_K" and isinstance(model.q.weight, QTensor)
    assert pinned_host.pin_streamed(_patcher(model), locker, total=64 * GiB, available=lambda: 64 * GiB) == 0


def test_dropping_the_model_unregisters_each_buffer_and_gives_the_count_back():
    model, locker = Net(), FakeLocker()
    start = pinned_host.pinned_bytes()
    pinned_host.pin_streamed(_patcher(model), locker, total=64 * GiB, available=lambda: 64 * GiB)
    assert pinned_host.pinned_bytes() > start and not locker.unlocked
    del model
    gc.collect()
    assert sorted(locker.unlocked) == sorted(locker.locked)
    assert pinned_host.pinned_bytes() == start


@pytest.mark.parametrize("total, available", [(200, 64 * GiB), (64 * GiB, pinned_host.KEEP_AVAILABLE + 50)])
def test_nothing_is_pinned_past_the_ceiling_or_into_the_hosts_last_free_memory(total, available):
    model, locker = Net(), FakeLocker()
    before = _values(model)
    assert pinned_host.pin_streamed(_patcher(model), locker, total=total, available=lambda: available) == 0
    assert not locker.locked
    assert all(p.data_ptr() == before[k][1] for k, p in model.named_parameters())


def test_the_ceiling_is_a_fraction_of_the_machines_ram():
    assert pinned_host.ceiling(100 * GiB) == int(100 * GiB * pinned_host.FRACTION)
    assert 0 < pinned_host.FRACTION <= 0.5


def test_a_failed_lock_leaves_the_weights_where_they_were_and_says_so(caplog):
    model, locker = Net(), FakeLocker(fail=True)
    before = _values(model)
    start = pinned_host.pinned_bytes()
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert pinned_host.pin_streamed(_patcher(model), locker, total=64 * GiB, available=lambda: 64 * GiB) == 0
    assert "page-locking streamed weights failed" in caplog.text and "out of page-lockable memory" in caplog.text
    assert pinned_host.pinned_bytes() == start
    for k, p in model.named_parameters():
        assert p.data_ptr() == before[k][1] and torch.equal(torch.Tensor.as_subclass(p, torch.Tensor), before[k][2])


def test_nothing_is_pinned_without_a_cuda_load_device_or_a_host_offload_device():
    model = Net()
    assert pinned_host.pin_streamed(SimpleNamespace(model=model, load_device=torch.device("cpu"),
                                                    offload_device=CPU), total=64 * GiB) == 0
    locker = FakeLocker()
    assert pinned_host.pin_streamed(SimpleNamespace(model=model, load_device=torch.device("cuda"),
                                                    offload_device=META), locker, total=64 * GiB) == 0
    assert not locker.locked


class StreamingPatcher(Patcher):
    """test_host_copy's patcher, marking what it leaves on the host as ComfyUI's lowvram load does."""

    def load(self, backed_up=(), streamed=()):
        super().load(backed_up=backed_up, streamed=streamed)
        for name, m in self.model.named_children():
            m.comfy_cast_weights = name in streamed


def test_the_host_copy_load_pins_what_streams_and_later_gives_the_pinned_copy_back(monkeypatch):
    locker = FakeLocker()
    monkeypatch.setattr(pinned_host, "CudaLocker", lambda: locker)
    monkeypatch.setattr(pinned_host, "_ram_available", lambda: 64 * GiB)
    model = Net(streamed=())
    p = StreamingPatcher(model)
    assert host_copy.install(p)
    p.load(streamed=("b",))
    assert _within(model.b.weight.data_ptr(), locker) and model.b.weight.device == CPU
    pinned_ptr = model.b.weight.data_ptr()
    p.detach()
    p.load()  # everything fits now: the pinned buffer is the host copy kept for the unload
    assert model.b.weight.device == META
    p.detach()
    assert model.b.weight.data_ptr() == pinned_ptr


def test_where_comfyui_pins_streamed_weights_itself_the_pack_does_not(monkeypatch):
    locker = FakeLocker()
    monkeypatch.setattr(pinned_host, "CudaLocker", lambda: locker)

    class Pinning(StreamingPatcher):
        def pin_weight_to_device(self, key):
            pass

    p = Pinning(Net(streamed=()))
    assert host_copy.install(p)
    p.load(streamed=("b",))
    assert not locker.locked


def test_the_report_says_what_is_page_locked_unless_comfyui_pins_itself():
    class Stock(StreamingPatcher):
        pass

    class Pinning(StreamingPatcher):
        def pin_weight_to_device(self, key):
            pass
    note = pinned_host.report_note(host_copy.comfy_pins_streamed_weights(Stock(Net())))
    assert note and "page-locked" in note and "40%" in note
    assert pinned_host.report_note(host_copy.comfy_pins_streamed_weights(Pinning(Net()))) is None


def test_a_module_without_bytes_is_passed_over_and_the_rest_still_pinned():
    empty, locker = torch.nn.Module(), FakeLocker()
    empty.weight = torch.nn.Parameter(torch.empty(4, 0), requires_grad=False)
    empty.comfy_cast_weights = True
    model = torch.nn.Sequential(empty, Net())  # the empty module comes first
    done = pinned_host.pin_streamed(_patcher(model), locker, total=64 * GiB, available=lambda: 64 * GiB)
    assert len(locker.locked) == 2 and done == sum(locker.locked.values())


def test_each_buffer_asks_for_huge_pages_before_its_bytes_are_copied_and_works_where_the_host_refuses(monkeypatch):
    asked, refuse = [], []

    made = []

    class Map(pinned_host.mmap.mmap):
        """An anonymous map that records how it was made, the advice it gets and whether its bytes were written by
        then."""

        def __new__(cls, *a, **k):
            made.append(k.get("flags"))
            return super().__new__(cls, *a, **k)

        def madvise(self, advice, *a):
            asked.append((advice, any(self[:])))
            if refuse:
                raise OSError(22, "Invalid argument")

    for refusing in (False, True):
        refuse[:] = [True] if refusing else []
        model, locker = Net(), FakeLocker()
        before = _values(model)
        asked.clear()
        made.clear()
        monkeypatch.setattr(pinned_host, "HUGE_PAGES", 14)
        monkeypatch.setattr(pinned_host.mmap, "mmap", Map)
        try:
            done = pinned_host.pin_streamed(_patcher(model), locker, total=64 * GiB, available=lambda: 64 * GiB)
        finally:
            monkeypatch.undo()
        assert asked == [(14, False), (14, False)]  # one buffer per streamed module, advised while still empty
        private = pinned_host.mmap.MAP_PRIVATE | pinned_host.mmap.MAP_ANONYMOUS
        assert made == [private, private]  # a shared anonymous map is shared memory: no huge pages by default
        made.clear()
        assert done == sum(locker.locked.values()) > 0
        for k, p in model.named_parameters():
            assert torch.equal(torch.Tensor.as_subclass(p, torch.Tensor), before[k][2]), k
            assert _within(p.data_ptr(), locker) is (k.split(".")[0] in ("a", "q")), k
