"""attention/kernel_bytes.py: the exact extra-bytes formulas against peaks measured on an H200."""
import pytest

from wan_sage.attention.kernel_bytes import AttnShape, extra_bytes, with_margin

# (shape, path, the bytes the formula predicts, the peak measured on an H200)
H200 = [
    ((1, 40, 75600, 75600), "sdpa", 774_144_000, 774_145_536),
    ((1, 40, 75600, 75600), "sage2_sm90", 3_491_358_080, 3_493_815_808),
    ((1, 40, 75600, 75600), "sage2_fp16_triton", 2_322_725_920, 2_324_528_640),
    ((1, 40, 75600, 75600), "sage2_fp16_cuda", 2_326_224_640, 2_328_027_136),
    ((1, 40, 75600, 75600), "sage2_fp8_cuda", 2_714_074_880, 2_716_532_736),
    ((1, 40, 32760, 32760), "sage2_sm90", 1_512_622_080, 1_512_785_920),
    ((1, 40, 75600, 512), "sage2_sm90", 1_177_807_360, 1_178_708_480),
    ((1, 24, 27280, 27280), "sage2_sm90", 757_382_400, 758_495_744),
    ((2, 40, 32760, 32760), "sage2_sm90", 3_025_244_160, 3_025_571_840),
]


@pytest.mark.parametrize("shape,path,predicted,measured", H200)
def test_formula_matches_the_h200_table(shape, path, predicted, measured):
    got = extra_bytes(path, AttnShape(*shape, 128))
    assert got == predicted
    assert 0 <= measured - got <= 2.5e6  # the allocator rounds up by at most 2.5 MB
    assert with_margin(got) >= measured


def test_sage1_counts_the_private_k_copy_and_1_0_6_table():
    a = AttnShape(1, 40, 75600, 75600, 128)
    # 1.0.6's own peak (2,322,725,920 in the table) plus the k copy the dispatcher hands it
    assert extra_bytes("sage1", a) == 2_322_725_920 + 2 * 387_072_000


def test_comfy_kitchen_int8_self_attention():
    # measured 1,941,488,640 on an H200
    got = extra_bytes("ck_int8", AttnShape(1, 40, 75600, 75600, 128))
    assert 0 <= 1_941_488_640 - got <= 2.5e6


def test_padding_and_fp16_rules():
    a = AttnShape(1, 8, 4096, 4096, 96)
    b = AttnShape(1, 8, 4096, 4096, 128)
    assert extra_bytes("sage2_sm90", a) > extra_bytes("sage2_sm90", b)  # D=96 is padded to 128 with copies
    fp16 = AttnShape(1, 8, 4096, 4096, 128, bf16=False)
    assert extra_bytes("sage2_fp16_triton", fp16) < extra_bytes("sage2_fp16_triton", b)  # no fp16 V copy
    with pytest.raises(ValueError, match="head dim"):
        extra_bytes("sage2_sm90", AttnShape(1, 8, 128, 128, 256))
    with pytest.raises(ValueError, match="unknown memory path"):
        extra_bytes("nope", b)


def test_scales_linearly_in_heads_for_head_split():
    a = AttnShape(1, 40, 75600, 75600, 128)
    assert extra_bytes("sage2_sm90", a.with_heads(10)) * 4 == pytest.approx(extra_bytes("sage2_sm90", a), rel=1e-6)
