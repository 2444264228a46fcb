"""The write-into-q text of docs/attention.md, read from synthetic gpu-tier logs: what the calls held and what the
720p81 call cost, only from runs whose into-q tests passed and that ran the groups this checkout picks."""
from bench import render_docs
from wan_sage.attention import head_groups, kernel_bytes

SHAPES = {"a14b_720p81": (1, 40, 75600, 128), "a14b_480p81": (1, 40, 32760, 128), "a14b_7480": (1, 40, 7480, 128)}
HELD = {"a14b_720p81": (651.2, 648.2, 749.8), "a14b_480p81": (283.4, 280.9, 325.0), "a14b_7480": (51.1, 46.1, 74.2)}


def groups(name):
    B, H, N, D = SHAPES[name]
    return head_groups.into_q_groups("sage2_sm90_into_q", kernel_bytes.AttnShape(B, H, N, N, D)).groups


def _log(path, cost, shift=0, failed=False):
    lines = [f"{n}: into-q {groups(n) + shift} groups, peak {p} MiB (formula {f}), SDPA {s} MiB, ungrouped Sage formula "
             f"3329.6 MiB, rel L2 0.0389" for n, (p, f, s) in HELD.items()]
    lines.append(f"A14B 720p81: ungrouped 100.00 ms, write-into-q {100 + cost:.2f} ms ({cost:+.1f} %)")
    if failed:
        lines.append("tests/gpu/test_into_q_gpu.py:65: AssertionError")
    lines.append(("1 failed, 48" if failed else "49") + " passed, 1 skipped in 150.00s")
    path.write_text("\n".join(lines) + "\n")


def test_the_cost_and_the_bytes_come_only_from_passing_runs_of_this_checkouts_groups(tmp_path, monkeypatch):
    (tmp_path / "gpu-tier").mkdir()
    _log(tmp_path / "gpu-tier" / "aaaaaaa.log", -1.5)
    _log(tmp_path / "gpu-tier" / "bbbbbbb.log", 0.5)
    _log(tmp_path / "gpu-tier" / "ccccccc.log", -3.0, failed=True)
    _log(tmp_path / "gpu-tier" / "ddddddd.log", 3.0, shift=1)  # another group count: another path's run
    monkeypatch.setattr(render_docs, "RECORDS", tmp_path)
    monkeypatch.setattr(render_docs, "INTO_Q_SHAPES", SHAPES)
    cost = render_docs.into_q_cost_text()
    assert f"in {groups('a14b_720p81')} groups took -1.5–+0.5 % over 2 gpu-tier runs" in cost
    assert "ccccccc" not in cost and "ddddddd" not in cost
    held = render_docs.into_q_measured_text()
    assert "`aaaaaaa.log` and `bbbbbbb.log`" in held and f"ran in {groups('a14b_720p81')} groups and held 651.2 MiB" in held
    assert "0.69–0.87× SDPA's bytes" in held and "ccccccc" not in held and "ddddddd" not in held
    assert "was 5.0 MiB (a14b_7480)" in held
