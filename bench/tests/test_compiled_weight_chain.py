"""The reading of inductor's wrapper code in bench.compiled_weight_chain: which buffers are alive at each line."""
from bench.compiled_weight_chain import live_buffers, weight_chains

CODE = """\
def call(args):
        buf0 = empty_strided_cuda((64, 4), (4, 1), torch.float32)
        buf1 = empty_strided_cuda((4, 8), (8, 1), torch.float32)
        buf2 = empty_strided_cuda((8, 64), (64, 1), torch.float32)
        extern_kernels.mm(buf0, buf1, out=buf2)
        del buf0
        del buf1
        buf3 = empty_strided_cuda((8, 64), (64, 1), torch.bfloat16)
        triton_poi_fused_add_dequant_0.run(arg0_1, buf2, buf3)
        del buf2
        buf4 = empty_strided_cuda((32, 8), (8, 1), torch.bfloat16)
        extern_kernels.mm(arg1_1, reinterpret_tensor(buf3, (64, 8), (1, 64), 0), out=buf4)
        del buf3
        buf5 = reinterpret_tensor(buf4, (1, 32, 8), (256, 8, 1), 0); del buf4  # reuse
        return (buf5, )
"""


def test_a_reused_buffer_keeps_its_bytes_and_a_deleted_one_frees_them():
    seen = {i: live for i, _line, live in live_buffers(CODE)}
    assert set(seen[5]) == {"buf0", "buf1", "buf2"}
    assert seen[5]["buf2"][0] == 8 * 64 * 4
    assert set(seen[9]) == {"buf2", "buf3"}
    assert set(seen[14]) == {"buf5"} and seen[14]["buf5"][0] == 32 * 8 * 2


def test_the_chain_before_a_matmul_counts_the_weight_shaped_buffers_alive_together():
    (chain,) = weight_chains(CODE, 8, 64)
    assert chain["line"] == 12
    assert chain["units"] == 6.0  # the fp32 product and the bf16 weight; the rank-4 factors are not weight-shaped
    assert sorted(b["dtype"] for b in chain["buffers"]) == ["bfloat16", "float32"]
