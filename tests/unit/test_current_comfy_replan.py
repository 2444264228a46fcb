"""The re-plan's load budget on ComfyUI 0.38's legacy memory path (GGUF, ``--disable-dynamic-vram``), with a
stand-in written after the real code: ``ModelPatcher._load_list`` and ``ModelPatcher.load`` in
comfy/model_patcher.py at 08d0e510f4e539a1db39072589817136ac6cfa7d.

0.38's load list entries are (offload bytes, bytes, name, module, parameter names), sorted by offload bytes, size
then name; a module's offload bytes are its own bytes plus, where it casts per call, the cast copy of a weight
whose dtype is not the compute dtype (or twice that with a LoRA patch).  The load keeps an offload buffer inside
its budget: a module fits where the loaded bytes, its bytes and the larger of the buffer so far and its offload
bytes plus the bytes of the ``NUM_STREAMS`` modules after it stay under the budget; a module that does not fit
raises the buffer to that figure.  Each test fails when the pack's side of the seam breaks."""
import copy

from test_replan import GiB, KEPT_FREE, UNIT, Module, Patcher, dev  # noqa: F401  (dev: the fixture)
from wan_sage.nodes import replan

STREAMS = 2  # 0.38's NUM_STREAMS on NVIDIA and AMD unless --disable-async-offload


def _load_038(loading, budget, streams=STREAMS):
    """0.38's ``ModelPatcher.load`` choice, for the test: the modules of ``loading`` (0.38's load list) that it
    loads, streams, or sets to stream where they lie on the device.  Returns the bytes it counts as loaded."""
    loading = sorted(loading, key=lambda x: (x[0], x[1], x[2]), reverse=True)
    counter, buffer = 0, 0
    for i, (offload, size, _name, m, _params) in enumerate(loading):
        potential = max(buffer, offload + sum(x[1] for x in loading[i + 1:i + 1 + streams]))
        fits = counter + size + potential < budget
        if hasattr(m, "comfy_cast_weights") and not fits:
            buffer = potential
            if not hasattr(m, "prev_comfy_cast_weights"):
                m.prev_comfy_cast_weights, m.set_to_stream = False, True
            continue
        m.__dict__.pop("prev_comfy_cast_weights", None)
        if fits:
            counter += size
        else:
            buffer = potential
    return counter


class Patcher038(Patcher):
    """The test's patcher with 0.38's load list: its equal modules of ``UNIT`` bytes, cast per call with nothing to
    cast (offload bytes = bytes)."""

    def __init__(self, device, loaded, size):
        super().__init__(device, loaded, size)
        n = len(self.modules)
        self.entries = [(UNIT, UNIT, f"m.{n - i:04d}", m, ["weight"]) for i, m in enumerate(self.modules)]

    def _load_list(self):
        return list(self.entries)


class Listing:
    """A patcher of which only the load list is read: 0.38's entries for ``rows`` [(offload bytes, bytes, name)],
    each module streamed (not on the device)."""

    def __init__(self, rows):
        self.entries = [(off, b, name, Module(), ["weight"]) for off, b, name in rows]

    def _load_list(self):
        return list(self.entries)


def _wan_fp8():
    """Wan 2.2 A14B's Linears and norms in fp8 with bf16 compute, a rank-64 LoRA on the attention Linears of the
    first 20 blocks: (offload bytes, bytes, name)."""
    ffn, attn, lora = 5120 * 13824, 5120 * 5120, 5120 * 5120 * 2 * 2
    rows = [(3 * ffn, ffn, f"blocks.{i}.ffn.{j}") for i in range(40) for j in (0, 2)]
    rows += [(attn + (lora if i < 20 else 2 * attn), attn, f"blocks.{i}.{a}.{q}")
             for i in range(40) for a in ("self_attn", "cross_attn") for q in "qkvo"]
    rows += [(4096 * 5120 * 3, 4096 * 5120, "text_embedding.0"), (256 * 5120 * 3, 256 * 5120, "time_embedding.0")]
    rows += [(5120 * 6, 5120 * 4, f"blocks.{i}.norm{k}") for i in range(40) for k in range(3)]
    return rows


def _placed(start):
    """The fp8 model placed by 0.38's load for ``start`` bytes from nothing on the device: (patcher, bytes loaded)."""
    p = Listing(_wan_fp8())
    return p, _load_038(p.entries, start)


def test_the_load_budget_keeps_every_module_on_the_device_under_the_offload_buffer(dev):
    """For partial loads of 3 to 11 GiB and every room from 0.2 to 6 GiB above them: the budget the re-plan picks
    from 0.38's load list keeps every module on the device where 0.38's load puts it, and loads at least ComfyUI's
    smallest partial load more wherever it loads.  The whole room would set a module on the device to stream, and
    so would a budget that left the offload buffer out."""
    dev.mm.NUM_STREAMS = STREAMS
    whole_room_streams = buffer_left_out_streams = False
    rooms = moved = 0
    for start_gib in (3.0, 5.0, 7.5, 11.0):
        for tenth in range(2, 61, 3):
            p, before = _placed(int(start_gib * GiB))
            target = before + tenth * GiB // 10

            naive = copy.deepcopy(p.entries)
            _load_038(naive, target)
            whole_room_streams |= any(getattr(x[3], "set_to_stream", False) for x in naive)

            plain = [(size, m, 0) for size, m, _ in replan.load_order(p)]
            budget = replan.safe_budget(plain, target, replan.MIN_MOVE_BYTES)
            if budget is not None:
                trial = copy.deepcopy(p.entries)
                _load_038(trial, budget)
                buffer_left_out_streams |= any(getattr(x[3], "set_to_stream", False) for x in trial)

            rooms += 1
            budget = replan.safe_budget(replan.load_order(p), target, replan.MIN_MOVE_BYTES)
            if budget is None:
                continue
            assert budget <= target
            loaded = _load_038(p.entries, budget)
            assert not any(getattr(x[3], "set_to_stream", False) for x in p.entries)
            assert loaded - before >= replan.MIN_MOVE_BYTES
            moved += 1
    assert whole_room_streams and buffer_left_out_streams  # the cases the budget is for
    assert moved >= rooms * 3 // 4, (moved, rooms)  # and most rooms still load weights


def test_the_offload_room_counts_the_next_streams_modules(dev):
    """Each module's room is its offload bytes and the bytes of the NUM_STREAMS modules after it in 0.38's order;
    with async offload off (NUM_STREAMS 0), its offload bytes alone."""
    p = Listing([(5 * GiB, 2 * GiB, "a"), (4 * GiB, 3 * GiB, "b"), (1 * GiB, 1 * GiB, "c"), (2 * GiB, 1 * GiB, "d")])
    dev.mm.NUM_STREAMS = 2
    assert [(s, r) for s, _, r in replan.load_order(p)] == [(2 * GiB, 9 * GiB), (3 * GiB, 6 * GiB),
                                                           (1 * GiB, 3 * GiB), (1 * GiB, 1 * GiB)]
    dev.mm.NUM_STREAMS = 0
    assert [r for _, _, r in replan.load_order(p)] == [5 * GiB, 4 * GiB, 2 * GiB, 1 * GiB]


def test_a_lower_plan_loads_weights_on_the_038_load_list(dev):
    """Between model calls a plan that fell loads what the room holds on 0.38's legacy path too, as on 0.3.64."""
    dev.mm.NUM_STREAMS = STREAMS
    dev.free = 8 * GiB
    p = Patcher038(dev, 6 * GiB, 10 * GiB)
    replan.begin(p, [1, 16, 21, 90, 160], lambda *a: int(5.5 * GiB), int(7.9 * GiB))
    assert replan.before_call(p.model) == 0 and p.calls == []
    moved = replan.before_call(p.model)
    room = 8 * GiB - (int(5.5 * GiB) + KEPT_FREE)
    assert p.calls == [("load", "cuda:0", room)] and moved == room


def test_a_load_list_of_another_form_moves_nothing(dev):
    """A load list this cannot follow (a patcher's own): a lowered plan leaves the weights where they are."""
    dev.mm.NUM_STREAMS = STREAMS
    dev.free = 8 * GiB
    p = Patcher038(dev, 6 * GiB, 10 * GiB)
    p.entries = [(x[1], x[2], x[3], x[4], "extra") + (0,) for x in p.entries]
    replan.begin(p, [1, 16, 21, 90, 160], lambda *a: int(5.5 * GiB), int(7.9 * GiB))
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0 and p.calls == []
