"""`rbs_bench.bench.layer_profile.family`: the FP8 kernels' names land in their families."""

from rbs_bench.kernels import fp8_gemm, fp8_moe

from rbs_bench.bench.layer_profile import family


def test_the_fp8_activation_passes_are_the_quantise_family():
    """Every pass of the FP8 layers that writes quantised activations, pass 1's store of the
    experts' quantised rows included, counts as `quantise`; the products as `gemm`."""
    passes = (
        fp8_gemm._act_quant_kernel,
        fp8_moe._scatter_quant_kernel,
        fp8_moe._padding_quant_kernel,
        fp8_moe._gated_quant_kernel,
    )
    assert [family(k.__name__) for k in passes] == ["quantise"] * len(passes)
    assert family(fp8_gemm._fp8_gemm_kernel.__name__) == "gemm"
