"""The reservation planned again between model calls (nodes/replan.py), with stand-ins for the patcher and for
ComfyUI's free memory: what is loaded or unloaded, and when nothing moves."""
import logging
import sys
import types

import pytest

from wan_sage.nodes import comfy_bridge, replan
from wan_sage.nodes.log_once import warned

GiB = 1 << 30
MiB = 1 << 20
KEPT_FREE = int(0.4 * GiB)  # what ComfyUI keeps free (extra_reserved_memory) in these tests


class Base:
    def __init__(self, lowvram=True):
        self.model_lowvram = lowvram
        self.current_patcher = None


class ModelPatcher:
    """Stands in for ``comfy.model_patcher.ModelPatcher``: its partial load and unload move bytes between the device
    and the host."""

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        self.calls.append(("load", device_to, extra_memory))
        if self.fail:
            e, self.fail = self.fail, None
            if not isinstance(e, KeyboardInterrupt) and type(e).__name__ != "InterruptProcessingException":
                self.device.free += self.loaded  # ComfyUI detaches a model it fails to load
                self.loaded = 0
            raise e
        moved = min(extra_memory, self.size - self.loaded)
        self.loaded += moved
        self.device.free -= moved
        self.model.model_lowvram = self.loaded < self.size
        if self.on_load is not None:
            self.on_load(self)
        return moved

    def detach(self):
        self.calls.append(("detach",))
        self.device.free += self.loaded
        self.loaded = 0

    def partially_unload(self, device_to, memory_to_free=0):
        self.calls.append(("unload", device_to, memory_to_free))
        if self.fail:
            e, self.fail = self.fail, None
            raise e
        moved = min(memory_to_free, self.loaded)
        self.loaded -= moved
        self.device.free += moved
        self.model.model_lowvram = True
        return moved


class Module:
    """A module ComfyUI loads: it casts per call, and streams where ``prev_comfy_cast_weights`` is set;
    ``set_to_stream``: a load set it to stream where it lay (:func:`_comfy_load`)."""

    def __init__(self, on_device=False):
        self.comfy_cast_weights = False
        self.set_to_stream = False
        if not on_device:
            self.prev_comfy_cast_weights = False


UNIT = 64 * MiB  # the size of each module of the stand-in model: ComfyUI's load keeps a prefix of equal modules


class Patcher(ModelPatcher):
    """A patcher of a model of ``size`` bytes with ``loaded`` of them on the device, moved with ComfyUI's methods
    (as ComfyUI-GGUF's patcher keeps them)."""

    def __init__(self, device, loaded, size, lowvram=True):
        self.model = Base(lowvram)
        self.model.current_patcher = self
        self.load_device, self.offload_device = "cuda:0", "cpu"
        self.device = device
        self.loaded, self.size = loaded, size
        self.modules = [Module(i * UNIT < loaded) for i in range(size // UNIT)]
        self.calls = []
        self.fail = None
        self.on_load = None  # called after each partial load: a ComfyUI whose load does more than this one's

    def _load_list(self):
        n = len(self.modules)  # the modules on the device come first in ComfyUI's order (size, then name)
        return [(UNIT, f"m.{n - i:04d}", m, ["weight"]) for i, m in enumerate(self.modules)]

    def is_dynamic(self):
        return False

    def model_patches_to(self, device):
        self.calls.append(("patches to", device))

    def model_dtype(self):
        return "bf16"

    def loaded_size(self):
        return self.loaded


class Device:
    def __init__(self, free):
        self.free = free
        self.trims = 0


@pytest.fixture
def dev(monkeypatch):
    d = Device(free=0)
    mm = types.ModuleType("comfy.model_management")
    mm.minimum_inference_memory = lambda: 0.8 * GiB + KEPT_FREE
    mm.VRAMState = types.SimpleNamespace(DISABLED=0, NO_VRAM=1, LOW_VRAM=2, NORMAL_VRAM=3, HIGH_VRAM=4, SHARED=5)
    mm.vram_state, mm.lowvram_available = mm.VRAMState.NORMAL_VRAM, True
    mp = types.ModuleType("comfy.model_patcher")
    mp.ModelPatcher = ModelPatcher
    comfy = types.ModuleType("comfy")
    comfy.model_management, comfy.model_patcher = mm, mp
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.model_patcher", mp)
    monkeypatch.setattr(comfy_bridge, "free_memory", lambda device: d.free)
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: KEPT_FREE)

    def trim(device, when):
        d.trims += 1
    monkeypatch.setattr(comfy_bridge, "trim_allocator", trim)
    d.mm = mm
    warned.clear()
    return d


def _sampling(dev, plans, start, loaded=6 * GiB, size=10 * GiB, lowvram=True):
    """A patcher whose sampling began against ``start`` bytes, and whose later plans are ``plans`` in turn."""
    p = Patcher(dev, loaded, size, lowvram)
    queue = list(plans)

    def plan(patcher, shape):
        assert patcher is p and shape == (1, 16, 21, 90, 160)
        return queue.pop(0) if len(queue) > 1 else queue[0]
    replan.begin(p, [1, 16, 21, 90, 160], plan, start)
    return p


def test_a_lower_plan_loads_what_the_room_holds(dev):
    """The first call is planned at the start's reservation; once the plan falls, the weights the room freed
    holds are loaded, as load_models_gpu sizes a partial load: free memory less the plan and what is kept free."""
    dev.free = 8 * GiB  # the first step's working memory, back in the allocator's free blocks
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB))
    assert replan.before_call(p.model) == 0 and p.calls == []  # the first call: nothing shown yet
    moved = replan.before_call(p.model)
    room = 8 * GiB - (int(5.5 * GiB) + KEPT_FREE)
    assert p.calls == [("load", "cuda:0", room)] and moved == room
    assert dev.free == int(5.5 * GiB) + KEPT_FREE  # the next call has exactly its plan free
    assert replan.moves(p.model) == [(2, int(7.9 * GiB), int(5.5 * GiB), room)]
    assert dev.trims == 2  # the free blocks handed back before sizing the load, and after it
    assert replan.before_call(p.model) == 0 and len(p.calls) == 1  # the plan holds: nothing more moves


def test_a_higher_plan_unloads_what_the_free_memory_lacks(dev):
    """A block that ran eagerly brings the eager floor back: weights are unloaded until the plan is free."""
    dev.free = int(6 * GiB)
    p = _sampling(dev, [int(7.9 * GiB)], start=int(5.5 * GiB))
    replan.before_call(p.model)
    moved = replan.before_call(p.model)
    short = int(7.9 * GiB) + KEPT_FREE - 6 * GiB
    assert p.calls == [("unload", "cpu", short)] and moved == -short
    assert dev.free == int(7.9 * GiB) + KEPT_FREE


def test_a_higher_plan_unloads_no_further_than_comfyuis_floor_of_loaded_weights(dev):
    """Where ComfyUI keeps a share of the free memory for weights whatever the reservation (MIN_WEIGHT_MEMORY_RATIO,
    0.4 off NVIDIA GPUs), the unload stops there, as load_models_gpu would have placed the model."""
    dev.mm.MIN_WEIGHT_MEMORY_RATIO = 0.4
    dev.free = 1 * GiB
    p = _sampling(dev, [int(7.9 * GiB)], start=int(5.5 * GiB))
    replan.before_call(p.model)
    moved = replan.before_call(p.model)
    floor = int(0.4 * (1 * GiB + 6 * GiB))  # of the free memory with this model's weights counted free
    assert p.calls == [("unload", "cpu", 6 * GiB - floor)] and moved == floor - 6 * GiB


def test_a_higher_plan_that_is_free_already_moves_nothing(dev):
    dev.free = 12 * GiB
    p = _sampling(dev, [int(7.9 * GiB)], start=int(5.5 * GiB))
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == []
    assert replan.moves(p.model) == [(2, int(5.5 * GiB), int(7.9 * GiB), 0)]


@pytest.mark.parametrize("change", [-(MiB * 127), MiB * 127])
def test_a_change_under_comfyuis_smallest_partial_load_moves_nothing(dev, change):
    dev.free = 3 * GiB
    p = _sampling(dev, [6 * GiB + change], start=6 * GiB)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == [] and dev.trims == 0


def test_a_lower_plan_with_every_weight_resident_moves_nothing(dev):
    dev.free = 8 * GiB
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB), loaded=10 * GiB, lowvram=False)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == [] and dev.trims == 0


def test_too_little_room_for_a_partial_load_moves_nothing(dev):
    dev.free = int(5.5 * GiB) + KEPT_FREE + 100 * MiB
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB))
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == []


def test_the_load_is_sized_within_comfyuis_minimum_inference_memory(dev):
    """A plan under ComfyUI's minimum inference memory leaves that minimum free, as load_models_gpu does."""
    dev.free = 4 * GiB
    p = _sampling(dev, [100 * MiB], start=3 * GiB)
    replan.before_call(p.model)
    replan.before_call(p.model)
    assert p.calls == [("load", "cuda:0", 4 * GiB - int(0.8 * GiB + KEPT_FREE))]


def test_a_failing_load_loads_the_model_again_for_the_larger_plan_and_moves_nothing_more(dev, caplog):
    """ComfyUI's partially_load detaches a model it fails to load: the model is loaded again for the larger of the
    two plans, as load_models_gpu places it, and the sampling moves nothing more."""
    dev.free = 8 * GiB
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB))
    p.fail = RuntimeError("CUDA out of memory")
    replan.before_call(p.model)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        replan.before_call(p.model)
    free_then = 8 * GiB + 6 * GiB  # the detached model's bytes back
    assert p.calls[-3:] == [("patches to", "cuda:0"), ("patches to", "bf16"),
                            ("load", "cuda:0", free_then - (int(7.9 * GiB) + KEPT_FREE))]
    assert dev.free == int(7.9 * GiB) + KEPT_FREE
    assert "loading weights between steps failed (RuntimeError: CUDA out of memory)" in caplog.text
    n = len(p.calls)
    assert replan.before_call(p.model) == 0 and len(p.calls) == n


def test_a_failing_unload_places_the_model_again_for_the_larger_plan_and_moves_nothing_more(dev, caplog):
    """ComfyUI's partially_unload stops midway without counting what it moved: the model is marked as streaming
    (so that ComfyUI's detach takes every per-call patch off), detached and loaded again for the larger plan."""
    dev.free = 6 * GiB
    p = _sampling(dev, [int(7.9 * GiB)], start=int(5.5 * GiB), lowvram=False)
    p.fail = RuntimeError("a hook")
    p.model.marked_at_detach = None
    detach = p.detach

    def detach_noting_the_mark():
        p.model.marked_at_detach = p.model.model_lowvram
        detach()
    p.detach = detach_noting_the_mark
    replan.before_call(p.model)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        moved = replan.before_call(p.model)
    free_then = 6 * GiB + 6 * GiB  # the detached model's bytes back
    assert [c[0] for c in p.calls] == ["unload", "detach", "patches to", "patches to", "load"]
    assert p.calls[-1] == ("load", "cuda:0", free_then - (int(7.9 * GiB) + KEPT_FREE))
    assert p.model.marked_at_detach is True
    assert moved == p.loaded - 6 * GiB < 0 and dev.free == int(7.9 * GiB) + KEPT_FREE
    assert "unloading weights between steps failed (RuntimeError: a hook)" in caplog.text
    n = len(p.calls)
    assert replan.before_call(p.model) == 0 and len(p.calls) == n


def test_a_cancel_during_the_move_goes_on_up(dev):
    class InterruptProcessingException(Exception):
        pass
    dev.free = 8 * GiB
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB))
    p.fail = InterruptProcessingException()
    replan.before_call(p.model)
    with pytest.raises(InterruptProcessingException):
        replan.before_call(p.model)
    assert [c[0] for c in p.calls] == ["load"]


def test_a_failing_plan_leaves_the_weights_with_one_warning(dev, caplog):
    dev.free = 8 * GiB
    p = Patcher(dev, 6 * GiB, 10 * GiB)

    def plan(patcher, shape):
        raise ValueError("no dims")
    replan.begin(p, [1, 16, 21, 90, 160], plan, 7 * GiB)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        for _ in range(3):
            assert replan.before_call(p.model) == 0
    assert p.calls == [] and caplog.text.count("planning the reservation again between steps failed") == 1


def test_another_patcher_sampling_the_same_model_is_left_alone(dev):
    """Two clones share one BaseModel: only the patcher whose sampling began is planned again."""
    dev.free = 8 * GiB
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB))
    p.model.current_patcher = object()
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == []


def test_an_ended_sampling_and_a_dynamic_model_are_not_planned_again(dev):
    dev.free = 8 * GiB
    p = _sampling(dev, [int(5.5 * GiB)], start=int(7.9 * GiB))
    replan.end(p.model)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == []
    q = Patcher(dev, 6 * GiB, 10 * GiB)
    q.is_dynamic = lambda: True
    replan.begin(q, [1, 16, 21, 90, 160], lambda *a: int(5.5 * GiB), int(7.9 * GiB))
    replan.before_call(q.model)
    assert replan.before_call(q.model) == 0 and q.calls == [] and replan.moves(q.model) == []


def test_a_patcher_with_moves_of_its_own_is_not_planned_again(dev):
    """Another pack's patcher that loads and unloads in part its own way (a multi-GPU or sharded one) is left
    alone."""
    class OwnMoves(Patcher):
        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            self.calls.append(("own load", extra_memory))
            return 0
    dev.free = 8 * GiB
    p = OwnMoves(dev, 6 * GiB, 10 * GiB)
    replan.begin(p, [1, 16, 21, 90, 160], lambda *a: int(5.5 * GiB), int(7.9 * GiB))
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == [] and replan.moves(p.model) == []


def _comfy_load(order, budget):
    """ComfyUI 0.3.64's ``ModelPatcher.load`` choice, for the test: a module that does not fit streams (one on the
    device is set to stream where it lies), one that fits is loaded.  Returns the bytes loaded."""
    counter = 0
    for size, m, _ in order:
        if counter + size >= budget:
            if not hasattr(m, "prev_comfy_cast_weights"):
                m.prev_comfy_cast_weights, m.set_to_stream = False, True
            continue
        m.__dict__.pop("prev_comfy_cast_weights", None)
        counter += size
    return counter


def _wan_order():
    """A14B's modules in ComfyUI's load order (bf16 sizes): 80 FFN Linears, 320 attention Linears, the embeddings,
    120 norms."""
    ffn, attn = 5120 * 13824 * 2, 5120 * 5120 * 2
    items = ([(ffn, f"blocks.{i}.ffn.{j}") for i in range(40) for j in (0, 2)]
             + [(attn, f"blocks.{i}.{a}.{q}") for i in range(40) for a in ("self_attn", "cross_attn") for q in "qkvo"]
             + [(4096 * 5120 * 2, "text_embedding.0"), (256 * 5120 * 2, "time_embedding.0")]
             + [(5120 * 4, f"blocks.{i}.norm{k}") for i in range(40) for k in range(3)])
    return [(size, Module(), 0) for size, _ in sorted(items, reverse=True)], ffn


@pytest.mark.parametrize("start_ffns, room_gib", [(30.7, 2.9), (10.3, 1.36)])
def test_the_load_budget_keeps_every_module_on_the_device_where_comfyui_would_set_one_to_stream(start_ffns,
                                                                                               room_gib):
    """ComfyUI's greedy load with the whole room would load more FFN Linears and set an attention Linear that filled
    the gap before to stream where it lies (its merged LoRA applied again at each call); the budget stops short of
    that, and loads all but at most one FFN Linear of the room."""
    order, ffn = _wan_order()
    before = _comfy_load(order, int(start_ffns * ffn))
    target = before + int(room_gib * GiB)
    naive = [(size, Module(on_device=not hasattr(m, "prev_comfy_cast_weights")), 0) for size, m, _ in order]
    _comfy_load(naive, target)
    assert any(n.set_to_stream for _, n, _ in naive)  # the case the budget is for
    budget = replan.safe_budget(order, target, replan.MIN_MOVE_BYTES)
    assert budget is not None and budget <= target
    loaded = _comfy_load(order, budget)
    assert not any(m.set_to_stream for _, m, _ in order)
    assert loaded - before > target - before - ffn


def test_no_budget_keeps_the_modules_on_the_device_then_nothing_moves():
    """A module on the device after a larger streaming one: every budget that loads the larger one sets it to
    stream, and the smaller streaming one after it never fits beside it."""
    order = [(3 * GiB, Module(), 0), (2 * GiB, Module(on_device=True), 0), (1 * GiB, Module(), 0)]
    assert replan.safe_budget(order, 4 * GiB, replan.MIN_MOVE_BYTES) is None
    assert replan.safe_budget(order, 4 * GiB, 0) == 3 * GiB  # keeps it, and loads nothing


@pytest.mark.parametrize("state, load, offload", [("HIGH_VRAM", "cuda:0", "cpu"), ("NO_VRAM", "cuda:0", "cpu"),
                                                  ("NORMAL_VRAM", "cpu", "cpu"), ("NORMAL_VRAM", "cuda:0", "cuda:0"),
                                                  ("LOW_VRAM", "cuda:0", "cuda:0")])
def test_weights_move_only_where_comfyui_places_a_model_in_part(dev, state, load, offload):
    """--highvram and --gpu-only load whole (the offload device is the GPU: an unload would free nothing),
    --novram loads nothing, and a model on the CPU is not placed in part."""
    dev.mm.vram_state = getattr(dev.mm.VRAMState, state)
    dev.free = 8 * GiB
    p = Patcher(dev, 6 * GiB, 10 * GiB)
    p.load_device, p.offload_device = load, offload
    replan.begin(p, [1, 16, 21, 90, 160], lambda *a: int(5.5 * GiB), int(7.9 * GiB))
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == [] and replan._get(p.model) is None


def test_a_load_that_sets_a_module_on_the_device_to_stream_loads_the_model_again(dev, caplog):
    """Where ComfyUI's load sets a module on the device to stream all the same (a load this does not follow), the
    model is detached and loaded again for the larger plan, and nothing more moves."""
    dev.free = 8 * GiB
    p = Patcher(dev, 6 * GiB, 10 * GiB)
    p.on_load = lambda p: setattr(p.modules[0], "prev_comfy_cast_weights", False) if len(p.calls) == 1 else None
    replan.begin(p, [1, 16, 21, 90, 160], lambda *a: int(5.5 * GiB), int(7.9 * GiB))
    replan.before_call(p.model)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        replan.before_call(p.model)
    assert [c[0] for c in p.calls] == ["load", "detach", "patches to", "patches to", "load"]
    assert dev.free == int(7.9 * GiB) + KEPT_FREE  # placed for the larger plan
    assert "1 module(s) on the device were set to stream" in caplog.text
    n = len(p.calls)
    assert replan.before_call(p.model) == 0 and len(p.calls) == n


class Pool:
    """PyTorch's CUDA pool as :func:`replan._pool` reads it: allocated and reserved bytes, retries, OOM errors.
    What is allocated is the patcher's weights on the device and ``other`` bytes (latents, conds)."""

    def __init__(self, other):
        self.other, self.patcher, self.reserved, self.retries, self.ooms = other, None, 0, 0, 0

    @property
    def allocated(self):
        return self.other + (self.patcher.loaded if self.patcher is not None else 0)

    def read(self, dev):
        self.reserved = max(self.reserved, self.allocated)
        return (self.allocated, self.reserved, self.retries, self.ooms)

    def call(self, held):
        """A model call that held ``held`` bytes above what was allocated as it began: the pool keeps them."""
        self.reserved = max(self.reserved, self.allocated + held)


@pytest.fixture
def pool(dev, monkeypatch):
    p = Pool(other=1 * GiB)
    monkeypatch.setattr(replan, "_pool", p.read)

    def trim(device, when):  # the pool's cached blocks handed back
        dev.trims += 1
        p.reserved = p.allocated
    monkeypatch.setattr(comfy_bridge, "trim_allocator", trim)
    return p


def _second_call(dev, pool, plan, held):
    """A sampling started at 7.9 GiB with 8 GiB free, whose later plans are ``plan``: its first call holds ``held``
    bytes, and its second is planned.  Returns (patcher, bytes moved before the second call)."""
    dev.free = 8 * GiB
    p = pool.patcher = _sampling(dev, [plan], start=int(7.9 * GiB))
    replan.before_call(p.model)
    pool.call(held)
    return p, replan.before_call(p.model)


def test_the_measured_figure_lowers_a_plan_that_reserves_more_than_the_calls_held(dev, pool):
    """The estimate keeps 7.9 GiB for the casts' holes at their largest; the first call held 4 GiB: the weights
    that the rest holds are loaded, leaving that figure and its margin free."""
    p, moved = _second_call(dev, pool, int(7.9 * GiB), 4 * GiB)
    shown = replan.measured_reservation(4 * GiB)
    assert 4 * GiB + replan.MEASURED_FLOOR <= shown <= int(4 * GiB * 1.15)
    room = 8 * GiB - (shown + KEPT_FREE)
    assert p.calls == [("load", "cuda:0", room)] and moved == room
    assert replan.moves(p.model) == [(2, int(7.9 * GiB), shown, room)] and replan.lowered_by_measure(p.model)


def test_the_plan_stands_where_the_calls_held_more_than_it(dev, pool):
    p, _ = _second_call(dev, pool, int(5.5 * GiB), int(6.5 * GiB))
    assert replan.moves(p.model)[0][2] == int(5.5 * GiB) and not replan.lowered_by_measure(p.model)


def test_a_call_that_held_more_after_the_move_unloads_weights_again(dev, pool):
    """What the calls hold is read again once the weights moved: a call that then held more raises the
    reservation, and weights are unloaded to it."""
    p, loaded = _second_call(dev, pool, int(7.9 * GiB), 4 * GiB)
    assert loaded > 0
    pool.call(4 * GiB)
    assert replan.before_call(p.model) == 0  # the call after the move is read against the pool as it began
    pool.call(5 * GiB)
    moved = replan.before_call(p.model)
    shown = replan.measured_reservation(5 * GiB)
    assert moved < 0 and p.calls[-1] == ("unload", "cpu", -moved)
    assert replan.moves(p.model)[-1][1:3] == (replan.measured_reservation(4 * GiB), shown)


@pytest.mark.parametrize("what", ["retries", "ooms", "unreadable"])
def test_a_call_the_allocator_retried_or_that_ran_out_of_memory_leaves_the_plan_alone(dev, pool, monkeypatch, what):
    """A call whose allocation was retried (the allocator emptied its cache for it) or that ran out of memory shows
    less than it needed, and a pool that cannot be read shows nothing: the plan decides, and a lowered placement
    goes back to it."""
    p, loaded = _second_call(dev, pool, int(7.9 * GiB), 4 * GiB)
    assert loaded > 0
    if what == "unreadable":
        monkeypatch.setattr(replan, "_pool", lambda dev: None)
    else:
        setattr(pool, what, 1)
    pool.call(3 * GiB)
    moved = replan.before_call(p.model)
    assert moved < 0 and replan.moves(p.model)[-1][2] == int(7.9 * GiB) and not replan.lowered_by_measure(p.model)
    pool.call(2 * GiB)
    assert replan.before_call(p.model) == 0  # nothing measured lowers it again in this sampling


def test_off_cuda_nothing_is_measured(dev):
    """On the CPU (and in the tests above the pool fixture) the pool is not read, and the plan alone decides."""
    dev.free = 8 * GiB
    p = _sampling(dev, [int(7.9 * GiB)], start=int(7.9 * GiB))
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == []


def test_running_out_of_memory_after_a_measured_lowering_places_the_weights_for_the_plan(dev, pool, caplog):
    p, loaded = _second_call(dev, pool, int(7.9 * GiB), 4 * GiB)
    assert loaded > 0
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert replan.after_out_of_memory(p.model, "OutOfMemoryError: CUDA out of memory")
    assert p.calls[-1][0] == "unload" and dev.free == int(7.9 * GiB) + KEPT_FREE  # the plan's room free again
    assert not replan.lowered_by_measure(p.model)
    assert "ran out of memory with the weights placed for what the earlier calls held" in caplog.text
    assert not replan.after_out_of_memory(p.model, "again")  # a second one is ComfyUI's to report


def test_running_out_of_memory_without_a_measured_lowering_is_left_to_comfyui(dev, pool):
    p, _ = _second_call(dev, pool, int(5.5 * GiB), int(6.5 * GiB))
    n = len(p.calls)
    assert not replan.after_out_of_memory(p.model, "OutOfMemoryError") and len(p.calls) == n


@pytest.mark.parametrize("lowered", [True, False])
def test_the_cond_batch_wrapper_runs_a_call_again_only_after_a_measured_lowering(monkeypatch, lowered):
    """The estimator's model-call wrapper: an out-of-memory error with the weights placed for the measured figure
    runs the call again once they are placed for the plan; any other goes up as it came."""
    import torch
    from wan_sage.nodes import estimator
    monkeypatch.setattr(estimator, "batching_setup", lambda *a, **k: None)
    monkeypatch.setattr(replan, "before_call", lambda base: 0)
    monkeypatch.setattr(replan, "lowered_by_measure", lambda base: lowered)
    placed = []
    monkeypatch.setattr(replan, "after_out_of_memory", lambda base, what: placed.append(what) or True)
    calls = []

    def executor(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "sampled"
    wrapper = estimator._cond_batch_wrapper(estimator.Settings())
    base = types.SimpleNamespace()
    if lowered:
        assert wrapper(executor, base, [], torch.zeros(1), 0, {}) == "sampled"
        assert len(calls) == 2 and placed == ["OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    else:
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            wrapper(executor, base, [], torch.zeros(1), 0, {})
        assert len(calls) == 1 and placed == []
    assert "memory_required" not in base.__dict__  # the model's own memory_required is back


def test_a_call_for_another_patcher_between_is_not_read_against_a_stale_start(dev, pool):
    """Where a call for another patcher of the same BaseModel came between, the next call of the sampling has no
    start of its own: it is not read (the weights may have moved meanwhile), and the one after it is."""
    dev.free = 8 * GiB
    p = pool.patcher = _sampling(dev, [int(7.9 * GiB)], start=int(7.9 * GiB))
    replan.before_call(p.model)
    pool.call(4 * GiB)
    p.model.current_patcher = object()
    assert replan.before_call(p.model) == 0
    p.model.current_patcher = p
    pool.other -= 2 * GiB  # the other patcher's call freed what this one had allocated
    assert replan.before_call(p.model) == 0 and p.calls == []  # the call before it had no start: nothing read
    pool.call(4 * GiB)
    assert replan.before_call(p.model) > 0 and replan.lowered_by_measure(p.model)


@pytest.fixture
def kept(monkeypatch, tmp_path):
    """The kept figures (nodes/held_record.py) in a fresh cache folder, as in a new process."""
    from wan_sage.nodes import held_record
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(held_record, "_here", {})
    monkeypatch.setattr(held_record._file, "read", {})
    return held_record


def _keyed(dev, pool, start, planned, key="k"):
    """A sampling of ``key`` started at ``start`` bytes against a plan of ``planned``, with 8 GiB free and the
    pool's cached blocks handed back after its load."""
    dev.free = 8 * GiB
    p = pool.patcher = Patcher(dev, 6 * GiB, 10 * GiB)
    pool.reserved = 0
    replan.begin(p, [1, 16, 21, 90, 160], lambda patcher, shape: planned, start, key=key, planned=planned)
    return p


def test_a_sampling_starts_from_what_the_last_one_of_its_key_held(dev, pool, kept):
    """The most the high-noise expert's calls held is kept; the low-noise expert's sampling of the same setup
    places its weights for it with the margin, below the plan, and counts as lowered from its first call."""
    plan = int(7.9 * GiB)
    assert replan.starting_reservation(["k"], plan) == plan  # nothing kept yet: the plan
    p = _keyed(dev, pool, plan, plan)
    replan.before_call(p.model)
    pool.call(4 * GiB)
    replan.before_call(p.model)  # read: the first call held 4 GiB
    pool.call(3 * GiB)
    replan.before_call(p.model)  # a call that held less does not lower the kept figure
    assert kept.recorded("k") == 4 * GiB and kept.recorded("other") is None
    start = replan.starting_reservation(["k"], plan)
    assert start == replan.measured_reservation(4 * GiB) < plan
    assert replan.starting_reservation(["k"], 4 * GiB) == 4 * GiB  # never above the plan
    q = _keyed(dev, pool, start, plan)
    assert replan.lowered_by_measure(q.model)
    assert not replan.lowered_by_measure(_keyed(dev, pool, plan, plan).model)


def test_the_latest_sampling_of_a_key_replaces_its_figure(dev, pool, kept):
    plan = int(7.9 * GiB)
    for held in (4 * GiB, 3 * GiB, 5 * GiB):
        p = _keyed(dev, pool, plan, plan)
        replan.before_call(p.model)
        pool.call(held)
        replan.before_call(p.model)
        assert kept.recorded("k") == held


@pytest.mark.parametrize("what", ["retries", "ooms"])
def test_a_sampling_whose_figure_cannot_be_trusted_removes_its_key(dev, pool, kept, what):
    plan = int(7.9 * GiB)
    kept.keep("k", 4 * GiB)
    p = _keyed(dev, pool, replan.starting_reservation(["k"], plan), plan)
    replan.before_call(p.model)
    setattr(pool, what, 1)
    pool.call(3 * GiB)
    replan.before_call(p.model)
    assert kept.recorded("k") is None and replan.starting_reservation(["k"], plan) == plan


def test_running_out_of_memory_in_a_sampling_started_below_its_plan_places_it_for_the_plan(dev, pool, kept):
    """The first call of a sampling started from a kept figure ran out of memory: the weights are unloaded to the
    plan's room, the call may run again, and the key's figure is gone for the next sampling."""
    plan = int(7.9 * GiB)
    kept.keep("k", 4 * GiB)
    start = replan.starting_reservation(["k"], plan)
    dev.free = start + KEPT_FREE  # the load left the kept figure's room free
    p = pool.patcher = Patcher(dev, 6 * GiB, 10 * GiB)
    replan.begin(p, [1, 16, 21, 90, 160], lambda patcher, shape: plan, start, key="k", planned=plan)
    replan.before_call(p.model)
    assert replan.after_out_of_memory(p.model, "OutOfMemoryError")
    assert p.calls[-1] == ("unload", "cpu", plan - start) and dev.free == plan + KEPT_FREE
    assert kept.recorded("k") is None and not replan.lowered_by_measure(p.model)


def test_the_kept_figures_last_across_comfyui_starts(kept, tmp_path):
    kept.keep("k", 4 * GiB)
    kept.keep("gone", 2 * GiB)
    kept.keep("gone", None)
    kept._here.clear()  # a new process: only the file is left
    kept._file.read.clear()
    assert kept.recorded("k") == 4 * GiB and kept.recorded("gone") is None
    assert sorted(__import__("json").loads((tmp_path / "memory" / "held.json").read_text())["held"]) == ["k"]


@pytest.mark.parametrize("text", ["{not json", '{"format": 0, "held": {"k": 1}}', '{"format": 1, "held": []}',
                                  '{"format": 1, "held": {"k": true, "j": -5, "i": "4"}}'])
def test_a_kept_file_that_cannot_be_read_is_as_none(kept, tmp_path, caplog, text):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "held.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert kept.recorded("k") is None and replan.starting_reservation(["k"], 5 * GiB) == 5 * GiB
    kept.keep("k", 3 * GiB)  # written afresh
    kept._here.clear()
    kept._file.read.clear()
    assert kept.recorded("k") == 3 * GiB


def test_a_figure_that_cannot_be_written_is_kept_in_this_process_only(kept, tmp_path, caplog):
    (tmp_path / "memory").write_text("a file where the folder goes")
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        kept.keep("k", 4 * GiB)
    assert kept.recorded("k") == 4 * GiB
    assert "could not be kept for the next ComfyUI start" in caplog.text


def test_a_setup_key_leaves_out_only_what_decides_how_much_streams():
    """Two experts at one budget, or one at two budgets, share a key; another latent, weight format, attention or
    streaming does not."""
    from dataclasses import replace

    from wan_sage.memory.activation_model import PRESETS, WeightSetup
    from wan_sage.memory.estimate import Setup
    from wan_sage.nodes import held_record
    s = Setup(dims=PRESETS["wan2.2-a14b"], latent=(1, 16, 21, 90, 160), weights=WeightSetup("fp8", lora=True, streamed=True),
              weights_bytes=14 << 30, vram_bytes=16 << 30, streamed=True)
    key = held_record.record_key(s, "cpu")
    assert held_record.record_key(replace(s, vram_bytes=12 << 30, notes=("compiled",), source="x"), "cpu") == key
    for other in (replace(s, latent=(1, 16, 21, 72, 128)), replace(s, weights=WeightSetup("gguf", 0.6, lora=True)),
                  replace(s, streamed=False), replace(s, sage_grouped=True), replace(s, compiled=True),
                  replace(s, cfg=3.5)):
        assert held_record.record_key(other, "cpu") != key


def test_a_grouped_setup_with_no_figure_of_its_own_starts_from_the_ungrouped_ones(kept):
    """The high-noise expert's first sampling times the prompt's shapes ungrouped, which holds more; the low-noise
    one, grouped, starts from its figure until it has its own.  An ungrouped setup never takes a grouped figure."""
    from dataclasses import replace

    from wan_sage.memory.activation_model import PRESETS, WeightSetup
    from wan_sage.memory.estimate import Setup
    from wan_sage.nodes import held_record
    ungrouped = Setup(dims=PRESETS["wan2.2-a14b"], latent=(1, 16, 21, 90, 160), streamed=True,
                      weights=WeightSetup("fp8", lora=True, streamed=True))
    grouped = replace(ungrouped, sage_grouped=True)
    own, other = held_record.record_keys(grouped, "cpu")
    assert held_record.record_keys(ungrouped, "cpu") == [other] != [own]
    plan = int(7.9 * GiB)
    kept.keep(other, 5 * GiB)
    assert replan.starting_reservation([own, other], plan) == replan.measured_reservation(5 * GiB)
    kept.keep(own, 4 * GiB)
    assert replan.starting_reservation([own, other], plan) == replan.measured_reservation(4 * GiB)
    kept.keep(other, None)
    assert replan.starting_reservation([other], plan) == plan
