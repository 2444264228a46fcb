"""Wan Compile Blocks holds ComfyUI's cond/uncond batching within the rows its blocks have run compiled
(nodes/cond_rows.py), tested against a stand-in of ComfyUI's batching test: the largest batch of the conds for
which ``memory_required(rows) * 1.5 < free``, else one cond per forward."""
import copy

import pytest
import torch

from wan_sage.nodes import comfy_bridge, compile_blocks, cond_rows


@pytest.fixture(autouse=True)
def fresh_process():
    cond_rows.forget()
    yield
    cond_rows.forget()


class Base:
    """A BaseModel's ``memory_required``: 1 GiB a row."""

    def memory_required(self, input_shape, cond_shapes={}):
        return input_shape[0] * 2**30


def comfy_batching(model, conds, free):
    """The rows of each forward ComfyUI runs for ``conds`` (each cond one row): its loop in ``_calc_cond_batch``."""
    rows, left = [], conds
    while left:
        take = left[:1]
        for i in range(1, len(left) + 1):
            amount = left[:len(left) // i]
            if model.memory_required([len(amount), 16, 2, 8, 8]) * 1.5 < free:
                take = amount
                break
        rows.append(len(take))
        left = left[len(take):]
    return rows


def step(wrapper, model, free, conds=("cond", "uncond")):
    return wrapper(lambda m, c, f: comfy_batching(m, list(c), f), model, conds, free)


class Block(torch.nn.Module):
    def forward(self, x):
        return x


def test_before_any_compiled_call_comfyui_decides_and_after_it_the_batch_stays_within_what_ran():
    base, hold = Base(), cond_rows.wrapper(Block)
    assert step(hold, base, free=10 * 2**30) == [2]  # nothing compiled yet: ComfyUI's own answer
    base2 = Base()
    cond_rows.ran(Block, 1)  # the first step ran cond and uncond apart, compiled
    assert step(hold, base2, free=10 * 2**30) == [1, 1]  # room for both: held apart all the same
    assert step(hold, base2, free=1) == [1, 1]  # and never more than ComfyUI's own answer
    assert "memory_required" not in base2.__dict__  # the class's method is back
    cond_rows.ran(Block, 2)
    assert step(hold, base2, free=10 * 2**30) == [2]  # a batch the blocks have run


def test_the_count_is_per_block_class_and_forget_clears_it():
    class Other(Block):
        pass
    cond_rows.ran(Block, 1)
    assert (cond_rows.rows_run(Block), cond_rows.rows_run(Other)) == (1, None)
    assert step(cond_rows.wrapper(Other), Base(), free=10 * 2**30) == [2]
    cond_rows.forget()
    assert cond_rows.rows_run(Block) is None


def test_a_compiled_stand_in_call_counts_its_rows_and_an_eager_one_does_not():
    class Resident(torch.nn.Module):
        def __init__(self, device="cpu"):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, device=device)

        def forward(self, x):
            return x

    compile_blocks.BlockStandIn(Resident("meta"), lambda x: x)(torch.zeros(2, 4))  # streamed: eager
    assert cond_rows.rows_run(Resident) is None
    compile_blocks.BlockStandIn(Resident(), lambda x: x)(torch.zeros(1, 4))
    assert cond_rows.rows_run(Resident) == 1


@pytest.mark.parametrize("estimator_outside", [True, False])
def test_the_estimators_memory_required_keeps_the_hold_whichever_wrapper_is_outside(estimator_outside):
    """The estimator swaps its own ``memory_required`` in around the same decision; the hold survives it."""
    base = Base()
    calls = []

    def estimate(input_shape, cond_shapes={}):  # the estimator's: 0.1 GiB a row
        calls.append(int(input_shape[0]))
        return input_shape[0] * 2**30 // 10

    def estimator_wrapper(executor, model, conds, free):  # the estimator's swap, as nodes/estimator.py makes it
        prev = comfy_bridge.swap_memory_required(model, cond_rows.keep_cap(model, estimate))
        try:
            return executor(model, conds, free)
        finally:
            comfy_bridge.restore_memory_required(model, prev)

    hold = cond_rows.wrapper(Block)
    cond_rows.ran(Block, 1)

    def inner(m, c, f):
        return comfy_batching(m, list(c), f)
    if estimator_outside:
        rows = estimator_wrapper(lambda m, c, f: hold(inner, m, c, f), base, ("c", "u"), 10 * 2**30)
    else:
        rows = hold(lambda m, c, f: estimator_wrapper(inner, m, c, f), base, ("c", "u"), 10 * 2**30)
    assert rows == [1, 1] and 1 in calls  # held, and the estimate answered the rows that may run
    assert "memory_required" not in base.__dict__
    cond_rows.forget()
    assert estimator_wrapper(inner, base, ("c", "u"), 10 * 2**30) == [2]  # without the hold: batched


def test_the_model_gets_its_memory_required_back_when_the_decision_raises():
    base = Base()
    own = lambda s, cond_shapes={}: 0  # noqa: E731
    base.memory_required = own
    cond_rows.ran(Block, 1)

    def fails(model, *args):
        assert isinstance(model.memory_required, cond_rows.RowsCap)
        raise RuntimeError("out of memory")
    with pytest.raises(RuntimeError):
        cond_rows.wrapper(Block)(fails, base)
    assert base.memory_required is own


def test_the_cap_is_immutable_and_deep_copies_to_itself_and_the_wrapper_survives_a_deep_copy():
    cap = cond_rows.RowsCap(Base().memory_required, 1)
    with pytest.raises(AttributeError):
        cap.rows = 2
    assert copy.deepcopy(cap) is cap
    hold = cond_rows.wrapper(Block)
    cond_rows.ran(Block, 1)
    assert step(copy.deepcopy(hold), Base(), free=10 * 2**30) == [1, 1]
