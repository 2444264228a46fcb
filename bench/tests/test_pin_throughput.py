"""bench.pin_throughput on the CPU with registration faked: every method copies (or not) what it says, rows carry
their parts, and a bad method name is refused with the choices."""
import json

import torch

from bench import pin_throughput as pt


class RecordingLocker(pt.FakeLocker):
    def __init__(self):
        self.locked, self.unlocked = [], []

    def lock(self, ptr, nbytes):
        self.locked.append((ptr, nbytes))
        return True

    def unlock(self, ptr):
        self.unlocked.append(ptr)


def test_each_method_registers_every_weight_once_and_lets_them_go():
    for method in ("copy", "copy-thp", "copy-populate", "threads-2", "in-place"):
        sources = pt._sources(torch, 0.01, 2)
        locker = RecordingLocker()
        row = pt.run_method(torch, method, sources, locker)
        assert row["weights"] == len(sources) == len(locker.locked) == len(locker.unlocked)
        in_place = {t.data_ptr() for t in sources} == {p for p, _ in locker.locked}
        assert in_place is (method == "in-place"), method  # the copying methods register their own buffers
        if method == "in-place":  # nothing copied; a copy's seconds round to 0 on a fast host, so only this is tested
            assert row["copy_s"] == 0
        # each figure is rounded to the millisecond on its own, so the parts' sum may differ from the total by one
        assert abs(row["total_s"] - (row["copy_s"] + row["lock_s"])) <= 0.0015, row


def test_the_copies_hold_the_sources_bytes():
    src = torch.arange(256, dtype=torch.uint8).repeat(4096)
    for huge, populate in ((True, False), (False, True)):
        buf, _keep, _ = pt._copy_one(torch, src, huge=huge, populate=populate)
        assert torch.equal(buf, src) and buf.data_ptr() != src.data_ptr()


def test_the_allocators_own_locked_buffers_are_not_registered_again():
    sources = pt._sources(torch, 0.01, 2)
    locker = RecordingLocker()
    row = pt.run_method(torch, "alloc-pinned", sources, pt.FakeLocker())
    pt.run_method(torch, "alloc-pinned", sources, locker)
    assert row["weights"] == len(sources) and row["lock_s"] == 0
    assert locker.locked == []  # a real locker is never asked: torch allocated the memory page-locked


def test_the_command_writes_one_row_per_method_and_refuses_an_unknown_one(tmp_path, capsys):
    out = tmp_path / "pin.jsonl"
    assert pt.main(["--out", str(out), "--gib", "0.01", "--mib", "2", "--methods", "copy,in-place", "--fake-lock"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["method"], r["rep"]) for r in rows] == [("copy", 0), ("in-place", 0), ("copy", 1), ("in-place", 1)]
    assert pt.main(["--out", str(out), "--methods", "copy,fast", "--fake-lock"]) == 2
    assert "--methods: unknown fast" in capsys.readouterr().err


def test_file_sources_lie_on_a_map_of_the_file_and_are_copied_whole(tmp_path):
    f = tmp_path / "src.bin"
    sources = pt._sources(torch, 0.01, 2, str(f))
    assert f.stat().st_size == len(sources) * (2 << 20)
    assert all(int(t.sum()) == t.numel() for t in sources)
    row = pt.run_method(torch, "copy-thp", sources, RecordingLocker())
    assert row["weights"] == len(sources) and row["copy_s"] > 0


def test_the_command_with_file_sources_skips_registering_in_place(tmp_path):
    out = tmp_path / "pin.jsonl"
    assert pt.main(["--out", str(out), "--gib", "0.01", "--mib", "2", "--methods", "copy,in-place", "--fake-lock",
                    "--source", "file", "--repeats", "1"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["method"], r["source"]) for r in rows] == [("copy", "file")]
    assert (tmp_path / "pin-throughput.bin").exists()
