"""bench.compile_cache_probe's processes: which of them find process 1's inductor and Triton folders."""
from pathlib import Path

import pytest

from bench import compile_cache_probe as ccp


def test_each_process_starts_from_the_folders_its_row_names():
    work = Path("/w")
    got = {name: ccp.folders(work, i, inductor, triton)
           for i, (name, inductor, triton, _load) in enumerate(ccp.PROCESSES, start=1)}
    first = got["empty"]
    assert got["pack's file"]["TORCHINDUCTOR_CACHE_DIR"] != first["TORCHINDUCTOR_CACHE_DIR"]
    assert got["pack's file"]["TRITON_CACHE_DIR"] != first["TRITON_CACHE_DIR"]
    assert got["pack's file, Triton kept"]["TORCHINDUCTOR_CACHE_DIR"] != first["TORCHINDUCTOR_CACHE_DIR"]
    assert got["pack's file, Triton kept"]["TRITON_CACHE_DIR"] == first["TRITON_CACHE_DIR"]
    assert got["all kept"] == first
    assert [load for *_x, load in ccp.PROCESSES] == [False, True, True, False]


def test_no_out_file_is_an_error_that_names_it(capsys):
    with pytest.raises(SystemExit) as e:
        ccp.main([])
    assert e.value.code == 2 and "--out is required" in capsys.readouterr().err
