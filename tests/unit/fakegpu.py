"""A fake accelerator for the unit tier: injected kernels on the CPU, controlled free VRAM and
timings.  Used only to test the logic of wan-sage's dispatcher; real kernels are tested in tests/gpu."""
import time

import fake_device
import torch
import torch.nn.functional as F


class FakeGPU:
    """Makes CPU tensors eligible and replaces the kernels, the device facts, free memory, the
    self-test and the timer.

    ``mode`` (all kernels) or ``modes[name]``: "ok", "oom", "raise", "nan", "noise" (finite random
    output), "gray" (every value the mean of the right output: finite, the right magnitude, no
    picture).  ``nan_from`` / ``noise_from``: every kernel call from that call number on returns
    NaN / finite noise.  ``perturb``: every output carries an error of that relative L2 (random,
    as a quantised kernel's).  ``times[name]``: ms of an ungrouped call; a call split into head
    groups takes ``1 + group_cost`` times as long."""

    def __init__(self, monkeypatch, tmp_path, candidates=("sage2_sm90",), cc=90):
        from wan_sage.attention import execution, kernels, timing
        from wan_sage.attention.state import STATE
        self.state = STATE
        STATE.reset()
        self.free = 1 << 40
        self.mode = "ok"
        self.modes = {}
        self.nan_from = None
        self.noise_from = None
        self.perturb = 0.0
        self._noise = torch.Generator().manual_seed(7)
        self.calls = []
        self.times = {"sdpa": 10.0, "sage2_sm90": 7.0, "sage1": 12.0, "ck_int8": 8.0, "sage2_fp16_cuda": 9.0}
        self.group_cost = 0.01
        self.self_test_result = None
        self.self_tests = []
        self.lock_held_in_self_test = []
        self.self_test_delay_s = 0.0
        self.output_checks = 0
        self.cache_dir = str(tmp_path / "cache")
        monkeypatch.setenv("WAN_SAGE_CACHE_DIR", self.cache_dir)  # the default folder too (a warm-up without one)
        for module, name, value in fake_device.seams(
                candidates=candidates, cc=cc, fits=lambda device, need, free_fn: need <= self.free,
                available=lambda device, free_fn: self.free, self_test=self._self_test):
            monkeypatch.setattr(module, name, value)
        monkeypatch.setattr(kernels, "run", self.run)
        monkeypatch.setattr(kernels, "run_into_q", self.run_into_q)
        self.into_q_calls = []
        monkeypatch.setattr(timing, "timer", self.timer)
        check_output = execution._check_output

        def counted_check(out, ref):
            self.output_checks += 1
            return check_output(out, ref)
        monkeypatch.setattr(execution, "_check_output", counted_check)

    def reset_state(self) -> None:
        """Forget every decision, as a new process would (the cache file stays)."""
        self.state.reset()

    def spent_s(self) -> float:
        """Seconds of shape timing (checks, host syncs) charged to the budget so far."""
        return self.state.calibration_spent_s

    def _self_test(self, name, dev, dtype, cc):
        self.self_tests.append(name)
        self.lock_held_in_self_test.append(self.state.lock.locked())
        if self.self_test_delay_s:
            time.sleep(self.self_test_delay_s)  # lets other threads reach the same shape meanwhile
        return self.self_test_result

    def run(self, name, q, k, v, layout, scale, cc):
        self.calls.append((name, tuple(q.shape)))
        mode = self.modes.get(name, self.mode)
        if mode == "oom":
            raise torch.OutOfMemoryError("fake out of memory")
        if mode == "raise":
            raise RuntimeError(f"fake failure of {name}")
        if layout == "NHD":
            q4, k4, v4 = (t.transpose(1, 2).float() for t in (q, k, v))
        else:
            q4, k4, v4 = q.float(), k.float(), v.float()
        o = F.scaled_dot_product_attention(q4, k4, v4, scale=scale)
        o = o.to(q.dtype)
        if layout == "NHD":
            o = o.transpose(1, 2).contiguous()
        if mode == "nan" or (self.nan_from is not None and len(self.calls) >= self.nan_from):
            o = o.clone()
            o.view(-1)[0] = float("nan")
        elif mode == "noise" or (self.noise_from is not None and len(self.calls) >= self.noise_from):
            o = torch.randn(o.shape, generator=self._noise).to(o.dtype)
        elif mode == "gray":
            o = torch.full_like(o, o.float().mean().item())
        elif self.perturb:
            error = torch.randn(o.shape, generator=self._noise)
            o = (o.float() + error * (self.perturb * o.float().norm() / error.norm())).to(o.dtype)
        return o

    def run_into_q(self, name, q4, k4, v4, scale, h0, h1, shared=None):
        """The write-into-q path of ``name`` on heads h0:h1 of [B, N, H, D] tensors: this fake kernel's
        output for those heads (with its mode) written into them."""
        self.into_q_calls.append((name, tuple(q4.shape), h0, h1))
        out = self.run(name, q4[:, :, h0:h1], k4[:, :, h0:h1], v4[:, :, h0:h1], "NHD", scale, 90)
        q4[:, :, h0:h1].copy_(out)

    def timer(self):
        """A timer of the fake device: the time of what ran between its start and stop, from
        ``times`` (SDPA's when no kernel ran; a split call's when the kernel ran more than once)."""
        return _FakeTimer(self)

    def settle(self, call, limit=64):
        """Run ``call()`` until no shape is being timed on its calls any more (a new shape's first
        calls): the outputs of those calls, in order."""
        outs = [call()]
        while self.state.trials:
            if len(outs) >= limit:
                raise AssertionError(f"shapes still being timed after {limit} calls: {list(self.state.trials)}")
            outs.append(call())
        return outs

    def kernel_calls(self, name=None):
        return sum(1 for n, _ in self.calls if name is None or n == name)


class _FakeTimer:
    def __init__(self, gpu):
        self._gpu, self._start, self._ms = gpu, len(gpu.calls), None

    def stop(self):
        names = [n for n, _ in self._gpu.calls[self._start:]]
        if not names:
            self._ms = self._gpu.times["sdpa"]
        else:
            base = self._gpu.times[names[-1]]
            self._ms = base * (1 + self._gpu.group_cost) if len(names) > 1 else base

    def ms(self):
        return self._ms


def qkv(B=1, N=2048, H=4, D=64, Nk=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    Nk = Nk or N
    q = torch.randn(B, N, H * D, generator=g).to(dtype)
    k = torch.randn(B, Nk, H * D, generator=g).to(dtype)
    v = torch.randn(B, Nk, H * D, generator=g).to(dtype)
    return q, k, v
