"""Per-patch run statistics: the window a sampling run opens and closes, and its summary."""
from wan_sage.attention import stats


def test_stats_window_and_summary():
    stats.begin_run("p1", "test")
    stats.record("p1", kernel="sage2_sm90", saved_ms=60.0)
    stats.record("p1", kernel="sage2_sm90", split=True, saved_ms=60.0)
    stats.record("p1", reason="cross_slower")
    stats.record("p1", reason="oom", fallback="oom")
    d = stats.end_run("p1")
    assert d["sage_calls"] == 2 and d["sdpa_calls"] == 2 and d["head_split_calls"] == 1
    assert d["reasons"] == {"cross_slower": 1, "oom": 1} and d["fallbacks"] == {"oom": 1}
    assert stats.last_runs()["p1"]["saved_ms"] == 120.0
    text = stats.format_summary(d)
    assert "2/4 attention calls on Sage" in text and "cross_slower 1" in text and "0.1 s" in text
