"""memory/headers.py on broken, foreign and hostile files: one ModelFileError naming the file, never
another exception (the fuzz is in test_fuzz_inputs.py)."""
import json
import os
import struct

import numpy as np
import pytest

from model_files import gguf_bytes, st_bytes, wan_shapes, write
from wan_sage.memory import headers
from wan_sage.memory.headers import ModelFileError, NotAWanModel, read_model_file


def test_valid_files_are_read(tmp_path):
    info = read_model_file(write(tmp_path, "ok.safetensors", st_bytes(wan_shapes())))
    assert (info.format, info.dims.dim, info.dims.num_layers, info.dims.num_heads, info.main_dtype) == \
        ("safetensors", 256, 2, 2, "F16")
    info = read_model_file(write(tmp_path, "ok.gguf", gguf_bytes(tmp_path, wan_shapes(dim=384, layers=3))))
    assert (info.format, info.dims.dim, info.dims.num_layers, info.dims.num_heads) == ("gguf", 384, 3, 3)


def test_gguf_orig_shape_metadata_gives_the_patch_embedding_its_5d_shape(tmp_path):
    # ComfyUI-GGUF's convert.py stores tensors whose last dim is not a multiple of 256 as (n/256, 256)
    # and records the real shape; in_dim (36 here, an I2V model) comes from that shape.
    shapes = wan_shapes(in_dim=36)
    real = shapes.pop("patch_embedding.weight")
    shapes["patch_embedding.weight"] = [int(np.prod(real)) // 256, 256]
    info = read_model_file(write(tmp_path, "i2v.gguf", gguf_bytes(tmp_path, shapes, {"patch_embedding.weight": real})))
    assert info.dims.in_dim == 36


@pytest.mark.parametrize("data,msg", [
    (b"GGUF", "truncated GGUF header"),
    (b"GG", "truncated GGUF header"),
    (os.urandom(64).replace(b"GGUF", b"XXXX"), "not a GGUF file"),
    (b"GGUF" + struct.pack("<I", 9) + b"\0" * 40, "unsupported GGUF version 9"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<I", 99), "unknown value type 99"),
])
def test_broken_gguf(tmp_path, data, msg):
    with pytest.raises(ModelFileError, match=msg):
        read_model_file(write(tmp_path, "x.gguf", data))


@pytest.mark.parametrize("cut", [10, 24, 60, 200, "header_end"])
def test_gguf_cut_inside_its_header_or_data(tmp_path, cut):
    full = gguf_bytes(tmp_path, wan_shapes())
    n = len(full) - 100 if cut == "header_end" else cut
    with pytest.raises(ModelFileError, match="truncated" if cut != "header_end" else "is truncated: tensor"):
        read_model_file(write(tmp_path, "cut.gguf", full[:n]))


def test_random_bytes_named_gguf_are_not_called_safetensors(tmp_path):
    with pytest.raises(ModelFileError) as e:
        read_model_file(write(tmp_path, "x.gguf", b"\x17" * 4096))
    assert "not a GGUF file" in str(e.value) and "safetensors" not in str(e.value)


BAD_SAFETENSORS = [
    (lambda: struct.pack("<Q", 2) + b"[]", "is a JSON list"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "data_offsets": [0, 0]}}),
     "header entry 'head.modulation' has no shape"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "shape": "1,2,256",
                                                                   "data_offsets": [0, 1024]}}), "not a list of sizes"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "shape": [1, -2, 256],
                                                                   "data_offsets": [0, 1024]}}), "negative size -2"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "shape": [1, 2, 10 ** 20],
                                                                   "data_offsets": [0, 1024]}}), "impossible size"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "shape": [1, 2, 256],
                                                                   "data_offsets": [1024, 0]}}), "bad data_offsets"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "shape": [1, 2, 256],
                                                                   "data_offsets": ["0", "x"]}}), "bad data_offsets"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "F16", "shape": [1, 2, 256],
                                                                   "data_offsets": [0, 7]}}), "spans 7 bytes"),
    (lambda: st_bytes(wan_shapes(), overrides={"head.modulation": {"dtype": "Q9", "shape": [1],
                                                                   "data_offsets": [0, 2]}}), "unknown dtype"),
    (lambda: st_bytes(wan_shapes(), overrides={"__metadata__": [1]}), "__metadata__"),
    (lambda: struct.pack("<Q", 5) + b"\xff\xfe{}}", "not UTF-8"),
    (lambda: struct.pack("<Q", 4) + b"{no}", "not JSON"),
    (lambda: struct.pack("<Q", 1 << 40) + b"{}", "not a safetensors file"),
    (lambda: b"\0\0\0", "too short"),
    (lambda: st_bytes(wan_shapes())[:-8], "is truncated: tensor"),
]


@pytest.mark.parametrize("make,msg", BAD_SAFETENSORS, ids=[m for _f, m in BAD_SAFETENSORS])
def test_broken_safetensors(tmp_path, make, msg):
    with pytest.raises(ModelFileError, match=msg) as e:
        read_model_file(write(tmp_path, "bad.safetensors", make()))
    assert "bad.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_a_text_file_named_safetensors_is_refused_without_echoing_its_bytes(tmp_path):
    """The route answers with this message: the first 8 bytes read as a length must not come back as a number."""
    text = b"root:x:0:0:root:/root:/bin/sh\n" * 4
    with pytest.raises(ModelFileError, match="not a safetensors file") as e:
        read_model_file(write(tmp_path, "passwd.safetensors", text))
    assert str(struct.unpack("<Q", text[:8])[0]) not in str(e.value)


def test_a_long_json_error_is_quoted_whole_words_first(tmp_path):
    """A header with a 5,000-digit number: Python's message about it is long; the quote ends on a whole word."""
    head = ('{"x": ' + "9" * 5000 + "}").encode()
    with pytest.raises(ModelFileError, match="not JSON") as e:
        read_model_file(write(tmp_path, "big.safetensors", struct.pack("<Q", len(head)) + head))
    try:
        json.loads(head)
    except ValueError as python:
        full = str(python).split()
    quoted = str(e.value).split("not JSON: ", 1)[1]
    assert quoted.endswith("...)") and len(quoted) <= 82
    words = quoted[:-4].split()
    assert 3 <= len(words) < len(full) and words[:-1] == full[:len(words) - 1]
    assert full[len(words) - 1].startswith(words[-1]) and len(full[len(words) - 1].rstrip(",;:")) == len(words[-1])


def test_truncated_safetensors_header_names_the_file(tmp_path):
    full = st_bytes(wan_shapes())
    with pytest.raises(ModelFileError, match="truncated safetensors header") as e:
        read_model_file(write(tmp_path, "half.safetensors", full[:200]))
    assert "half.safetensors" in str(e.value)


@pytest.mark.parametrize("shapes,msg", [
    ({**wan_shapes(), "head.modulation": []}, "head.modulation has shape"),
    (wan_shapes(dim=64), "dim 64 is not a Wan model"),
    (wan_shapes(dim=200), "dim 200 is not a Wan model"),
    ({**wan_shapes(), "head.head.weight": [20, 256]}, "head.head.weight has 20 outputs"),
    ({k: v for k, v in wan_shapes().items() if k != "patch_embedding.weight"}, "lacks the tensor 'patch_embedding.weight'"),
    ({"input_blocks.0.0.weight": [4, 4]}, "not a Wan diffusion model"),
])
def test_not_wan_models(tmp_path, shapes, msg):
    with pytest.raises(NotAWanModel, match=msg):
        read_model_file(write(tmp_path, "m.safetensors", st_bytes(shapes)))


def test_missing_directory_empty_fifo_and_unreadable(tmp_path, monkeypatch):
    with pytest.raises(ModelFileError, match="no such file"):
        read_model_file(str(tmp_path / "missing.safetensors"))
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ModelFileError, match="is a directory"):
        read_model_file(str(tmp_path / "dir.safetensors"))
    with pytest.raises(ModelFileError, match="is empty"):
        read_model_file(write(tmp_path, "empty.gguf", b""))
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(ModelFileError, match="not a regular file"):
        read_model_file(str(tmp_path / "pipe.safetensors"))
    path = write(tmp_path, "locked.safetensors", st_bytes(wan_shapes()))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(headers, "open", denied, raising=False)
    with pytest.raises(ModelFileError, match="cannot be read \\(permission denied\\)"):
        read_model_file(path)


def test_messages_show_the_given_name_not_the_path(tmp_path):
    with pytest.raises(ModelFileError) as e:
        read_model_file(write(tmp_path, "x.gguf", b"GGUF"), shown="x.gguf")
    assert str(tmp_path) not in str(e.value) and str(e.value).startswith("x.gguf")
