"""The write-into-q text of docs/attention.md, read from synthetic gpu-tier logs: the split's cost per group count,
and what the calls held, only from runs whose into-q tests passed and, for what they held, that ran the groups
this checkout picks."""
from bench import render_docs

ROWS = {"a14b_720p81": (4, 650.6, 749.8), "a14b_480p81": (4, 283.2, 325.0), "a14b_7480": (5, 63.5, 74.2)}


def _log(path, cost, groups=None, failed=False):
    lines = [f"{n}: into-q {groups or g} groups, peak {p} MiB (formula 1.0), SDPA {s} MiB, ungrouped Sage formula 3329.6 MiB, "
             f"rel L2 0.0389" for n, (g, p, s) in ROWS.items()]
    lines.append(f"A14B 720p81: ungrouped 100.00 ms, write-into-q {100 + cost:.2f} ms (+{cost:.1f} %)")
    if failed:
        lines.append("tests/gpu/test_into_q_gpu.py:65: AssertionError")
    lines.append(("1 failed, 48" if failed else "49") + " passed, 1 skipped in 150.00s")
    path.write_text("\n".join(lines) + "\n")


def test_the_cost_and_the_bytes_leave_out_runs_whose_into_q_tests_failed(tmp_path, monkeypatch):
    (tmp_path / "gpu-tier").mkdir()
    _log(tmp_path / "gpu-tier" / "aaaaaaa.log", 2.0)
    _log(tmp_path / "gpu-tier" / "bbbbbbb.log", 3.0)
    _log(tmp_path / "gpu-tier" / "ccccccc.log", 0.5, groups=3, failed=True)
    monkeypatch.setattr(render_docs, "RECORDS", tmp_path)
    cost = render_docs.into_q_cost_text()
    assert "in 4 groups, 2.0–3.0 % (median 2.5 %) over 2 gpu-tier runs" in cost and "ccccccc" not in cost
    monkeypatch.setattr(render_docs, "INTO_Q_SHAPES", {"a14b_720p81": (1, 40, 75600, 128), "a14b_480p81": (1, 40, 32760, 128),
                                                       "a14b_7480": (1, 40, 7480, 128)})
    held = render_docs.into_q_measured_text()
    assert "`aaaaaaa.log` and `bbbbbbb.log`" in held and "ran in 4 groups and held 650.6 MiB" in held
    assert "0.86–0.87× SDPA's bytes" in held and "ccccccc" not in held
