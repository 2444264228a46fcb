"""A fake accelerator for the unit tier: injected kernels on the CPU, controlled free VRAM and
timings.  Used only to test wan-sage's dispatch logic; real kernels are tested in tests/gpu."""
import torch
import torch.nn.functional as F


class FakeGPU:
    def __init__(self, monkeypatch, tmp_path, candidates=("sage2_sm90",), cc=90):
        from wan_sage.attention import dispatch, kernels, policy, selftest, timing
        self.dispatch = dispatch
        dispatch.reset_state()
        self.free = 1 << 40
        self.mode = "ok"  # ok | oom | nan | raise | empty
        self.calls = []
        self.times = {"sdpa": 10.0, "sage2_sm90": 7.0, "sage1": 12.0, "ck_int8": 8.0}
        self.self_test_result = None
        self.cache_dir = str(tmp_path / "cache")
        self._last = {}
        monkeypatch.setattr(policy, "ACCEL_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(dispatch, "_device", lambda dev, choice: dispatch._Device(cc, "FakeGPU", tuple(candidates), None))
        monkeypatch.setattr(dispatch, "_free_bytes", lambda dev, need, fn: need <= self.free)
        monkeypatch.setattr(selftest, "self_test", lambda name, dev, dtype, cc: self.self_test_result)
        monkeypatch.setattr(kernels, "run", self.run)
        monkeypatch.setattr(timing, "time_cuda", self.time_cuda)
        monkeypatch.setattr(dispatch, "_kernel_version", lambda name: "test")

    def run(self, name, q, k, v, layout, scale, cc):
        self.calls.append((name, tuple(q.shape)))
        self._last["name"] = name
        if self.mode == "oom":
            raise torch.OutOfMemoryError("fake out of memory")
        if self.mode == "raise":
            raise RuntimeError("fake kernel failure")
        if layout == "NHD":
            q4, k4, v4 = (t.transpose(1, 2).float() for t in (q, k, v))
        else:
            q4, k4, v4 = q.float(), k.float(), v.float()
        o = F.scaled_dot_product_attention(q4, k4, v4, scale=scale)
        o = o.to(q.dtype)
        if layout == "NHD":
            o = o.transpose(1, 2).contiguous()
        if self.mode == "nan":
            o = o.clone()
            o.view(-1)[0] = float("nan")
        return o

    def time_cuda(self, fn, repeats=1):
        self._last.clear()
        fn()
        return self.times[self._last.get("name", "sdpa")]


def qkv(B=1, N=2048, H=4, D=64, Nk=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    Nk = Nk or N
    q = torch.randn(B, N, H * D, generator=g).to(dtype)
    k = torch.randn(B, Nk, H * D, generator=g).to(dtype)
    v = torch.randn(B, Nk, H * D, generator=g).to(dtype)
    return q, k, v
