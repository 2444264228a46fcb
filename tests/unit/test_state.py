"""The dispatcher's mutable state (attention/state.py): one object, every write under its lock, one device index, the
self-test report, and the registry of live patches the custom op looks up."""
import pickle

import pytest
import torch

from fakegpu import FakeGPU, qkv
from wan_sage.attention import kernels
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride, self_test_failures
from wan_sage.attention.state import STATE


def raw_func(*a, **k):
    raise AssertionError("func must not be called when there is no previous override")


class LockedWrites(dict):
    """A dict that records, for every write, whether the state lock was held."""

    def __init__(self, seen, *a):
        super().__init__(*a)
        self.seen = seen

    def _note(self):
        self.seen.append(STATE.lock.locked())

    def __setitem__(self, key, value):
        self._note()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._note()
        super().__delitem__(key)

    def pop(self, *a):
        self._note()
        return super().pop(*a)

    def setdefault(self, *a):
        self._note()
        return super().setdefault(*a)

    def clear(self):
        self._note()
        super().clear()


def test_every_write_to_the_decision_state_holds_the_lock(monkeypatch, tmp_path):
    fake = FakeGPU(monkeypatch, tmp_path, candidates=("sage2_sm90", "sage1"))
    seen = []
    for name in ("decisions", "failed", "ooms", "calls", "self_tests", "devices", "trials"):
        monkeypatch.setattr(STATE, name, LockedWrites(seen))
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(cache_dir=fake.cache_dir))
    fake.modes["sage1"] = "raise"
    fake.settle(lambda: o(raw_func, q, k, v, heads=4))  # self-test, timing, an error charged, the shape settled
    fake.modes["sage2_sm90"] = "oom"
    o(raw_func, q, k, v, heads=4)  # out of memory remembered
    fake.modes["sage2_sm90"] = "nan"
    fake.free *= 4
    o(raw_func, q, k, v, heads=4)  # retried, non-finite: the shape moves to SDPA
    assert len(seen) >= 8 and all(seen)
    fake.reset_state()


def test_state_keys_use_one_normalised_device_index(fake_gpu):
    q, k, v = qkv()  # CPU tensors: their device index is None
    assert q.device.index is None and kernels.device_index(q.device) == 0
    fake_gpu.mode = "raise"
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    o(raw_func, q, k, v, heads=4)
    indices = ({key.device_index for key in STATE.self_tests} | {key.device_index for key in STATE.failed}
               | {key.device_index for key in STATE.decisions})
    assert indices == {0}


def test_self_test_failures_name_the_rejected_kernel(fake_gpu):
    fake_gpu.self_test_result = "returned non-finite values (uninitialised output?)"
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))
    assert self_test_failures() == {}
    assert o.plan(q, k, v, 4).reason == "disabled"
    assert self_test_failures() == {"sage2_sm90": "returned non-finite values (uninitialised output?)"}
    STATE.reset()
    assert self_test_failures() == {}


def test_an_unpickled_override_is_registered_for_the_op(fake_gpu):
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, label="x"))
    assert STATE.patches[o.patch_id] is o
    copy = pickle.loads(pickle.dumps(o))
    assert copy is not o and copy.patch_id == o.patch_id and copy.config == o.config
    assert STATE.patches[o.patch_id] is copy


def test_memory_mode_is_validated():
    assert PatchConfig().memory_mode == "sdpa"
    assert PatchConfig(memory_mode="fastest").memory_mode == "fastest"
    with pytest.raises(ValueError, match="memory_mode"):
        PatchConfig(memory_mode="small")


def test_calls_that_record_gradients_stay_on_sdpa(fake_gpu):
    q, k, v = qkv()
    q.requires_grad_(True)
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))
    assert o.plan(q, k, v, 4).reason == "grad"
    with torch.no_grad():
        assert o.plan(q, k, v, 4).reason is None
