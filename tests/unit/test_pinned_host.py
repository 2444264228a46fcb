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


# The host copies kept for the loaded weights (host_copy.pin_kept, on pinned_host's worker)

class ThreadLocker(FakeLocker):
    """FakeLocker noting the thread each registration ran on."""

    def __init__(self, fail=False):
        super().__init__(fail)
        self.threads = set()

    def lock(self, ptr, nbytes):
        import threading
        self.threads.add(threading.current_thread().name)
        return super().lock(ptr, nbytes)


def _loaded_with_copies(lora=()):
    """(model, patcher, host state before the load): test_host_copy's Net loaded on ``meta`` with its host copies
    kept; ``lora``: keys whose loaded object the load replaces (ComfyUI-GGUF's LoRA)."""
    from .test_host_copy import Net as HostNet, _host_state
    model = HostNet()
    p = Patcher(model)
    p.lora.update(lora)
    before = _host_state(model)
    assert host_copy.install(p)
    p.load()
    assert all(t.device == META for t in model.parameters())
    return model, p, before


def _pin(model, locker, total=64 * GiB, available=64 * GiB):
    import weakref
    return host_copy.pin_kept(weakref.ref(model), META, locker, total=total, available=lambda: available)


@pytest.mark.parametrize("lora", [(), ("q.weight",)])
def test_kept_host_copies_move_into_page_locked_buffers_and_the_unload_gives_those_back(lora):
    model, p, before = _loaded_with_copies(lora)
    locker = FakeLocker()
    kept = host_copy.kept_bytes(p)
    assert _pin(model, locker) == kept > 0
    assert len(locker.locked) == 3  # one buffer per module: a, b, q
    p.detach()  # model.to("cpu") raises on any weight left on meta: every one was given back
    for k, t in model.named_parameters():
        ptr, value = before[k]
        assert t.device == CPU and _within(t.data_ptr(), locker) and t.data_ptr() != ptr, k
        assert torch.equal(torch.Tensor.as_subclass(t, torch.Tensor), value), k
    assert isinstance(model.q.weight, QTensor) and model.q.weight.tensor_type == "Q4_K"
    p.load()  # the next load notes the page-locked copies: nothing more to lock
    assert _pin(model, locker) == 0 and len(locker.locked) == 3
    p.detach()
    assert all(_within(t.data_ptr(), locker) for t in model.parameters())


def test_a_module_unloaded_while_its_copy_was_made_keeps_its_pageable_copy_and_the_buffer_goes():
    model, p, before = _loaded_with_copies()
    locker = FakeLocker()
    group = host_copy._unpinned(model)[0]
    targets = pinned_host.pinned_copies([data for _, _, data in group], locker)
    p.detach()  # the unload comes between the worker's copy and its pointing the entries at it
    assert host_copy._repoint(model, group, targets) == 0
    del targets
    gc.collect()
    assert sorted(locker.unlocked) == sorted(locker.locked) and locker.locked
    for k, t in model.named_parameters():
        assert t.data_ptr() == before[k][0], k


def test_kept_copies_stay_pageable_past_the_ceiling_and_say_so(caplog):
    model, p, before = _loaded_with_copies()
    locker = FakeLocker()
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        assert _pin(model, locker, total=100) == 0
    assert not locker.locked and "left pageable (host memory ceiling)" in caplog.text
    assert _pin(model, locker, available=pinned_host.KEEP_AVAILABLE + 50) == 0 and not locker.locked
    p.detach()
    for k, t in model.named_parameters():
        assert t.data_ptr() == before[k][0], k


def test_the_load_gives_the_copies_to_the_worker_which_locks_them_off_the_calling_thread(monkeypatch):
    locker = ThreadLocker()
    monkeypatch.setattr(pinned_host, "CudaLocker", lambda: locker)
    model, p, _ = _loaded_with_copies()
    pinned_host.wait()
    assert len(locker.locked) == 3 and locker.threads == {"wan-sage-pin"}
    p.detach()
    assert all(_within(t.data_ptr(), locker) for t in model.parameters())


def test_without_a_cuda_runtime_the_load_gives_the_worker_nothing():
    model, p, before = _loaded_with_copies()
    assert not host_copy._pin_kept_later(p)  # the real locker: no CUDA device here
    p.detach()
    assert all(t.data_ptr() == before[k][0] for k, t in model.named_parameters())


def test_a_failing_job_is_logged_once_and_the_worker_runs_the_next_one(caplog):
    ran = []

    def fails():
        raise RuntimeError("registration refused")
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        pinned_host.later(fails)
        pinned_host.later(ran.append, 1)
        pinned_host.wait()
    assert ran == [1] and "registration refused" in caplog.text


def test_copies_made_on_the_worker_are_inference_tensors_where_comfyuis_weights_are():
    """ComfyUI loads and unloads under inference mode; the worker thread runs outside it.  A weight's ``data`` given
    a tensor of the other kind breaks it ("Inference tensors do not track version counter"), so each copy is made as
    the kind of its host tensor."""
    import threading
    import weakref
    from .test_host_copy import Net as HostNet
    with torch.inference_mode():
        model = HostNet()
        p = Patcher(model)
        assert host_copy.install(p)
        p.load()
    locker, done = FakeLocker(), []
    worker = threading.Thread(target=lambda: done.append(
        host_copy.pin_kept(weakref.ref(model), META, locker, total=64 * GiB, available=lambda: 64 * GiB)))
    worker.start()
    worker.join()
    assert done[0] > 0
    with torch.inference_mode():
        p.detach()
    for k, t in model.named_parameters():
        assert _within(t.data_ptr(), locker) and t.is_inference(), k
        t.detach().as_subclass(torch.Tensor).clone()  # raised on a weight given a non-inference tensor's data
    with torch.inference_mode():
        p.load()
        p.detach()
    assert all(_within(t.data_ptr(), locker) for t in model.parameters())


def test_the_buffer_lookup_finds_an_address_in_any_buffer_and_none_outside():
    start = pinned_host.pinned_bytes()
    spans = [(1 << 50, 4096), (1 << 50 | 1 << 20, 100), ((1 << 50) - 8192, 8192)]
    for ptr, size in spans:
        pinned_host._count(ptr, size)
    try:
        assert pinned_host.pinned_bytes() - start == sum(n for _, n in spans)
        for ptr, size in spans:
            assert pinned_host._in_buffer(ptr) and pinned_host._in_buffer(ptr + size - 1)
            assert not pinned_host._in_buffer(ptr + size) or any(p == ptr + size for p, _ in spans)
        assert not pinned_host._in_buffer((1 << 50) + 4096) and not pinned_host._in_buffer((1 << 50) - 8193)
    finally:
        for ptr, _ in spans:
            pinned_host._uncount(ptr)
    assert pinned_host.pinned_bytes() == start
    assert not pinned_host._in_buffer(1 << 50)


# The streamed weights take the room of kept copies under the ceiling (pinned_host.make_room)

def _ceiling_total(pinned: int) -> int:
    """A RAM total whose ceiling is exactly ``pinned`` bytes."""
    return -(-pinned * 10 // int(pinned_host.FRACTION * 10))


def _full_of_kept_copies(spare: int = 500):
    """(model, patcher, locker, RAM total, host state before the load): kept copies page-locked under a ceiling that
    leaves ``spare`` bytes, less than a streamed Net takes (800 and 100), more than it takes with the kept copies'
    room (496)."""
    model, p, before = _loaded_with_copies()
    locker = FakeLocker()
    gc.collect()
    start = pinned_host.pinned_bytes()
    assert _pin(model, locker) > 0
    total = _ceiling_total(pinned_host.pinned_bytes() + spare)
    assert pinned_host.ceiling(total) >= pinned_host.pinned_bytes() > start
    return model, p, locker, total, before


def test_streamed_weights_take_the_room_of_kept_copies_which_stay_where_they_are():
    kept_model, p, locker, total, before = _full_of_kept_copies()
    net = Net()
    streamed = pinned_host.pin_streamed(_patcher(net), locker, total=total, available=lambda: 64 * GiB)
    assert streamed > 0 and all(_within(getattr(net, n).weight.data_ptr(), locker) for n in ("a", "q"))
    assert pinned_host.pinned_bytes() <= pinned_host.ceiling(total)
    assert locker.unlocked  # kept copies' buffers gave their room, newest first
    given_back = list(locker.unlocked)
    p.detach()  # the unload gives the weights their kept copies: where they were, now pageable, with their bytes
    for k, t in kept_model.named_parameters():
        assert t.device == CPU and _within(t.data_ptr(), locker), k
        assert torch.equal(t.detach().as_subclass(torch.Tensor), before[k][1]), k
    yielded = [t for t in kept_model.parameters()
               if any(start <= t.data_ptr() < start + locker.locked[start] for start in given_back)]
    assert yielded and not any(pinned_host.is_pinned(t) for t in yielded)
    del kept_model, p
    gc.collect()
    assert len(locker.unlocked) == len(set(locker.unlocked))  # a buffer that gave its room is unregistered once


def test_kept_copies_never_take_the_room_of_other_kept_copies_or_of_streamed_weights():
    kept_model, p, locker, total, _ = _full_of_kept_copies(spare=0)
    other, q, _ = _loaded_with_copies()
    assert _pin(other, locker, total=total) == 0 and not locker.unlocked
    total = _ceiling_total(pinned_host.pinned_bytes() + 500)
    net = Net()
    gc.collect()
    # the streamed weights' own buffers never give way: with the kept ones gone, the next streamed model waits
    pinned_host.pin_streamed(_patcher(net), locker, total=total, available=lambda: 64 * GiB)
    held = pinned_host.pinned_bytes()
    assert pinned_host.pin_streamed(_patcher(Net()), locker, total=_ceiling_total(held),
                                    available=lambda: 64 * GiB) == 0
    assert all(_within(getattr(net, n).weight.data_ptr(), locker) for n in ("a", "q"))


def test_no_room_is_taken_where_the_hosts_available_memory_is_what_stops_it():
    kept_model, p, locker, total, _ = _full_of_kept_copies()
    assert pinned_host.pin_streamed(_patcher(Net()), locker, total=total,
                                    available=lambda: pinned_host.KEEP_AVAILABLE + 50) == 0
    assert not locker.unlocked


def test_a_weight_streaming_from_its_kept_copy_keeps_that_buffer_locked():
    """A module unloaded in part goes back to its kept copy, in a kept copy's buffer: that buffer now serves the
    streaming, and other streamed weights do not take its room."""
    kept_model, p, locker, total, _ = _full_of_kept_copies()
    p.detach()  # every weight back on its kept copy; module "a" then streams from it
    kept_model.a.comfy_cast_weights = True
    a = kept_model.a.weight
    assert pinned_host.is_pinned(a)
    assert pinned_host.pin_streamed(_patcher(kept_model), locker, total=total, available=lambda: 64 * GiB) == 0
    pinned_host.pin_streamed(_patcher(Net()), locker, total=total, available=lambda: 64 * GiB)
    assert locker.unlocked  # the other kept copies gave their room
    assert pinned_host.is_pinned(a) and not any(start <= a.data_ptr() < start + locker.locked[start]
                                                for start in locker.unlocked)


def test_a_buffer_serving_streaming_later_in_the_model_is_kept_locked_before_room_is_taken():
    """Module "q" streams from its kept copy's buffer (the newest) and module "a", before it, streams from pageable
    memory: the room "a" takes never comes from the buffer "q" streams from."""
    kept_model, p, locker, total, _ = _full_of_kept_copies(spare=0)
    p.detach()
    for name in ("a", "q"):
        getattr(kept_model, name).comfy_cast_weights = True
    held = [t.data for t in kept_model.a.parameters()]  # its kept copy's buffer stays (another clone holds it)
    for t in kept_model.a.parameters():  # "a" now streams from pageable memory
        t.data = t.data.clone()
    q = kept_model.q.weight
    ptr = q.data_ptr()
    assert pinned_host.is_pinned(q) and not pinned_host.is_pinned(kept_model.a.weight)
    pinned_host.pin_streamed(_patcher(kept_model), locker, total=total, available=lambda: 64 * GiB)
    assert locker.unlocked and pinned_host.is_pinned(q)  # the room came from other kept copies
    assert q.data_ptr() == ptr  # not copied again into a new buffer
    assert not any(start <= q.data_ptr() < start + locker.locked[start] for start in locker.unlocked)
    del held


def test_kept_copies_that_gave_their_room_are_not_page_locked_again_by_the_worker():
    kept_model, p, locker, total, _ = _full_of_kept_copies()
    pinned_host.pin_streamed(_patcher(Net()), locker, total=total, available=lambda: 64 * GiB)
    assert locker.unlocked
    p.load()  # the next load (the repeat prompt): the worker's job finds those copies in buffers that gave room
    assert _pin(kept_model, locker) == 0
    assert all(not any(pinned_host.gave_room(data) for _, _, data in group) for group in host_copy._unpinned(kept_model))


def test_no_kept_copy_gives_up_its_room_where_all_of_them_would_not_do():
    kept_model, p, locker, total, _ = _full_of_kept_copies(spare=0)
    need = pinned_host.pinned_bytes() + 1  # more than every buffer of the pack together
    assert not pinned_host.make_room(need, total=total, available=lambda: 64 * GiB)
    assert not locker.unlocked


def test_a_kept_copy_is_unregistered_while_its_finalizer_cannot_unmap_it():
    """The buffer's finalizer (another thread, when its last weight lets go) takes the pack's lock before it unmaps
    the buffer: make_room unregisters under that lock, so the memory is still mapped while it is unregistered."""
    import threading

    kept_model, p, locker, total, _ = _full_of_kept_copies()
    other_thread_could_take_the_lock = []
    unlock = locker.unlock

    def unlock_and_check(ptr):
        if ptr in pinned_host._unlocked:  # make_room's (a finalizer's own unregistering is not this test's)
            t = threading.Thread(target=lambda: other_thread_could_take_the_lock.append(
                pinned_host._lock.acquire(blocking=False) and (pinned_host._lock.release() or True)))
            t.start()
            t.join()
        return unlock(ptr)
    locker.unlock = unlock_and_check
    assert pinned_host.pin_streamed(_patcher(Net()), locker, total=total, available=lambda: 64 * GiB) > 0
    assert other_thread_could_take_the_lock and not any(other_thread_could_take_the_lock)
