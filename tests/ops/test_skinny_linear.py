import pytest
import torch
from torch.nn import functional as F

from hf_grpo.ops import skinny_linear

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("n, k, sms", [(4608, 3584, 132), (3584, 18944, 132), (152064, 3584, 132), (1536, 1536, 78)])
def test_chosen_settings_give_every_sm_programs_and_every_split_whole_loop_steps(n, k, sms):
    config = skinny_linear.choose(32, n, k, sms)
    programs = -(-n // config.block_n) * config.splits
    steps = k // config.block_k
    assert k % config.block_k == 0
    assert steps // config.splits >= 4  # a split long enough to pipeline its loads
    # programs at least 4 a SM where the splits allow it, and no split added past that
    assert programs >= 4 * sms or steps // (config.splits + 1) < 4
    assert config.splits == 1 or -(-n // config.block_n) * (config.splits - 1) < 4 * sms


def test_off_the_gpu_the_op_is_f_linear_and_compiles_into_a_graph():
    x, weight, bias = torch.randn(2, 3, 64), torch.randn(40, 64), torch.randn(40)
    assert not skinny_linear.usable(x, weight)
    torch.testing.assert_close(skinny_linear.skinny_linear(x, weight, bias), F.linear(x, weight, bias),
                               rtol=0, atol=0)
    compiled = torch.compile(lambda x: skinny_linear.skinny_linear(x, weight, None).relu(), fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, weight).relu())


@pytest.mark.parametrize("rows", [1, 17, 32, 64])
@pytest.mark.parametrize("n, k, bias, splits", [(4608, 3584, True, 7), (3584, 18944, False, 10), (1000, 512, True, 1),
                                                 (1000, 512, False, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@needs_gpu
def test_kernel_matches_a_float32_product_as_closely_as_cublas(rows, n, k, bias, splits, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    weight = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    assert skinny_linear.usable(x, weight)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    config = skinny_linear.SkinnyConfig(splits=splits)
    got = skinny_linear.run(x, weight, b, config)
    cublas = F.linear(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    # both round a float32 sum to the output's dtype: the same error bound, one rounding step of the output
    ulp = expected.abs().clamp_min(1.0) * torch.finfo(dtype).eps
    assert ((got.float() - expected).abs() <= ulp).all()
    assert ((cublas.float() - expected).abs() <= ulp).all()
    assert torch.equal(skinny_linear.run(x, weight, b, config), got)  # the splits summed in order: the same bits


@pytest.mark.parametrize("shape", [(32, 1, 3584), (4, 8, 3584)])
@pytest.mark.gpu
@needs_gpu
def test_the_cuda_op_takes_any_leading_shape_and_leaves_other_calls_to_cublas(shape):
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(512, 3584, device="cuda", dtype=torch.bfloat16) * 3584**-0.5
    got = skinny_linear.skinny_linear(x, weight, None)
    assert got.shape == (*shape[:-1], 512)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-2, atol=1e-2)
    many = torch.randn(skinny_linear.MAX_ROWS + 1, 3584, device="cuda", dtype=torch.bfloat16)
    assert not skinny_linear.usable(many, weight)
    assert torch.equal(skinny_linear.skinny_linear(many, weight, None), F.linear(many, weight))
