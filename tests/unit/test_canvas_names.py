"""The Sage node's memory_mode combo: its labels say what they do, and the ids saved before them still run."""
import pytest

from wan_sage.attention.head_groups import MEMORY_MODES
from wan_sage.nodes.sage_patch import MEMORY_MODE_LABELS, memory_mode_id


def test_each_label_sets_one_mode_and_every_mode_has_a_label():
    assert sorted(memory_mode_id(label) for label in MEMORY_MODE_LABELS) == sorted(MEMORY_MODES)
    assert memory_mode_id(MEMORY_MODE_LABELS[0]) == "sdpa"  # the default keeps Sage within SDPA's memory


@pytest.mark.parametrize("saved", MEMORY_MODES)
def test_ids_of_earlier_saved_workflows_map_to_themselves(saved):
    assert memory_mode_id(saved) == saved


@pytest.mark.parametrize("bad", ["", "SDPA", "smallest", None, 3])
def test_other_values_are_refused(bad):
    assert memory_mode_id(bad) is None
