"""``wan-sage bench`` times, by default, the dtype that ComfyUI ran Wan's attention in on the H200: every
whole-prompt record whose estimator report names the compute dtype (GGUF and fp8 files, eager and compiled)
says fp16, so timings of another dtype would be cache entries the node never reads."""
import re

from bench import _records
from wan_sage import cli

def _recorded_compute_dtypes() -> dict:
    """{compute dtype named by the estimator report: record files that name it}."""
    seen = {}
    for path in _records.files("whole-prompt"):
        for row in _records.rows(path):
            for prompt in row.get("prompts") or []:
                for report in (prompt.get("estimator_report") or {}).values():
                    m = re.search(r"^compute: (\w+);", report or "", re.M)
                    if m:
                        seen.setdefault(m.group(1), set()).add(_records.name_of(path))
    return seen


def test_the_default_dtype_of_wan_sage_bench_is_the_one_comfyui_ran_wan_in():
    seen = _recorded_compute_dtypes()
    assert len(set().union(*seen.values())) >= 5, seen  # GGUF and fp8, several budgets and sizes
    default = cli.parser().parse_args(["bench"]).dtype
    assert set(seen) == {default}, seen
