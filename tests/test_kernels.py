import functools
import gzip
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from medddpm.train.engine import Engine
from medddpm.analysis.kernels import (CATEGORIES, COLUMNS, MAX_LABEL, categorize, kernel_rows_from_trace,
                                      op_rows_from_trace, short_name, uses_tensor_cores)
from medddpm.train.profiling import profile_kernels

from conftest import random_batch

FIXTURES = Path(__file__).parent / "fixtures"
DTYPES = {"calls": "int64", "total_us": "float64", "micro_steps": "int64", "share": "float64", "tensor_cores": "bool"}


@functools.cache
def ncu_names() -> tuple[str, ...]:
    """Kernel names exactly as they ran on the H200 (Nsight Compute reports of two configurations)."""
    files = ["ncu-opt1-size32-details.csv.gz", "ncu-bf16-cl-size32-details.csv.gz"]
    names = set().union(*(pd.read_csv(FIXTURES / "h200" / f, usecols=["Kernel Name"])["Kernel Name"] for f in files))
    return tuple(sorted(names))


# (a substring that picks one H200 name, category, short name)
NCU = [
    ("random_from_to_kernel", "elementwise", "random_from_to_kernel [distribution_elementwise_grid_stri..."),
    ("normal_and_transform", "elementwise", "normal_kernel [distribution_elementwise_grid_stride_kernel]"),
    ("_scatter_gather_elementwise_kernel", "elementwise", "_scatter_gather_elementwise_kernel"),
    ("void elementwise_kernel<128, 2, void gpu_kernel_impl_nocast<BinaryFunctor", "elementwise",
     "MulFunctor [elementwise_kernel]"),
    ("CUDAFunctor_add", "elementwise", "CUDAFunctor_add [vectorized_elementwise_kernel]"),
    ("arange_cuda_out", "elementwise", "arange_cuda_out [elementwise_kernel_with_index]"),
    ("AUnaryFunctor", "elementwise", "MulFunctor [vectorized_elementwise_kernel]"),
    ("BUnaryFunctor", "elementwise", "MulFunctor [vectorized_elementwise_kernel]"),
    ("exp_kernel_cuda", "elementwise", "exp_kernel_cuda [vectorized_elementwise_kernel]"),
    ("void unrolled_elementwise_kernel<direct_copy_kernel_cuda", "layout",
     "direct_copy_kernel_cuda [unrolled_elementwise_kernel]"),
    ("void elementwise_kernel<128, 2, void gpu_kernel_impl_nocast<direct_copy", "layout",
     "direct_copy_kernel_cuda [elementwise_kernel]"),
]


@pytest.mark.parametrize("marker, category, label", NCU)
def test_h200_names_from_nsight_compute(marker, category, label):
    (name,) = [n for n in ncu_names() if marker in n]
    assert (categorize(name), short_name(name), uses_tensor_cores(name)) == (category, label, False)


def test_every_h200_name_is_covered():
    assert all(sum(marker in n for marker, *_ in NCU) == 1 for n in ncu_names())


# Well-known names from PyTorch on Hopper/Ampere: (name, category, tensor cores, short name)
KNOWN = [
    ("sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_g1_"
     "execute_segment_k_off_kernel__5x_cudnn", "convolution", True,
     "sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrs..."),
    ("sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1_"
     "execute_segment_k_off_kernel__5x_cudnn", "convolution", True, None),
    ("sm80_xmma_wgrad_implicit_gemm_indexed_f32f32_f32f32_f32_nhwckrsc_nchw_tilesize32x32x8_stage3_warpsize1x2x1_g1_"
     "ffma_aligna4_alignc4_execute_kernel__5x_cudnn", "convolution", False, None),
    ("void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int, "
     "float const*, int, float*, float const*, kernel_conv_params, unsigned long long, int, float, float, int, "
     "float const*, float const*, bool, int, int)", "convolution", False, "implicit_convolve_sgemm"),
    ("void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)2>"
     "(cudnn::ops::nchw2nhwc_params_t<float>, float const*, float*)", "layout", False, "nchwToNhwcKernel"),
    ("void cudnn::ops::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float, true, false, (cudnnKernelDataType_t)0>"
     "(cudnn::ops::nhwc2nchw_params_t<float>, __nv_bfloat16 const*, __nv_bfloat16*)", "layout", False,
     "nhwcToNchwKernel"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float, float>(long, float, float const*, "
     "float*, float*)", "normalization", False, "RowwiseMomentsCUDAKernel"),
    ("void at::native::(anonymous namespace)::ComputeFusedParamsCUDAKernel<float, float>(long, long, long, "
     "float const*, float const*, float const*, float const*, float*, float*)", "normalization", False,
     "ComputeFusedParamsCUDAKernel"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::(anonymous namespace)"
     "::GroupNorm1dForward<float>(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, "
     "at::Tensor const&, long, long, at::Tensor&)::{lambda(float, float, float, float)#1}>(at::TensorIteratorBase&, "
     "at::native::(anonymous namespace)::GroupNorm1dForward<float>(at::Tensor const&, at::Tensor const&, at::Tensor "
     "const&, at::Tensor const&, at::Tensor const&, long, long, at::Tensor&)::{lambda(float, float, float, float)#1} "
     "const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::(anonymous namespace)::"
     "GroupNorm1dForward<float>(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor "
     "const&, long, long, at::Tensor&)::{lambda(float, float, float, float)#1}>(at::TensorIteratorBase&, "
     "at::native::(anonymous namespace)::GroupNorm1dForward<float>(at::Tensor const&, at::Tensor const&, at::Tensor "
     "const&, at::Tensor const&, at::Tensor const&, long, long, at::Tensor&)::{lambda(float, float, float, float)#1} "
     "const&)::{lambda(int)#1})", "normalization", False, None),
    ("triton_per_fused_native_group_norm_silu_0", "fused", False, "triton_per_fused_native_group_norm_silu_0"),
    ("triton_poi_fused__to_copy_add_convolution_backward_mul_1", "fused", False, None),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)0, false>, float*, double, double, double, double, double, bool, float const*, "
     "float const*>(at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)0, false>, float*, double, double, double, double, double, "
     "bool, float const*, float const*)", "optimizer", False, "FusedAdamMathFunctor [multi_tensor_apply_kernel]"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
     "std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous "
     "namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float)", "optimizer", False,
     "BinaryOpListAlphaFunctor [multi_tensor_apply_kernel]"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy", False, "Memcpy HtoD (Pageable -> Device)"),
    ("Memset (Device)", "memcpy", False, "Memset (Device)"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, false, false, false, true, true, false, "
     "false>(pytorch_flash::Flash_fwd_params)", "attention", True, "flash_fwd_kernel"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80, "
     "true, 64, 64, 64, true, true>::Params)", "attention", False, "fmha_cutlassF_f32_aligned_64x64_rf_sm80"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, "
     "cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)", "attention", True, None),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(cutlass_80_tensorop_s1688gemm_64x64_"
     "16x6_tn_align4::Params)", "gemm", True, "cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nn_align1>(cutlass_80_simt_sgemm_128x128_8x4_nn_align1"
     "::Params)", "gemm", False, "cutlass_80_simt_sgemm_128x128_8x4_nn_align1"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
     "cublas", "gemm", True, None),
    ("ampere_sgemm_128x64_nn", "gemm", False, "ampere_sgemm_128x64_nn"),
    ("nvjet_tst_128x256_64x6_2x1_2cta_v_bz_TNT", "gemm", True, None),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, false, false>"
     "(cublasLt::cublasSplitKParams<float>, float const*, float const*, float*, float const*, float const*, "
     "float const*)", "gemm", False, "splitKreduce_kernel"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::"
     "sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, "
     "float, 4, 4>)", "reduction", False, "sum_functor [reduce_kernel]"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 8, false, false>(float*, float const*, "
     "int, int, int, bool const*, int, bool)", "reduction", False, "softmax_warp_forward"),
    ("void at::native::(anonymous namespace)::upsample_trilinear3d_out_frame<float, float>(int, float, float, float, "
     "bool, at::GenericPackedTensorAccessor<float const, 5ul, at::DefaultPtrTraits, long>, "
     "at::GenericPackedTensorAccessor<float, 5ul, at::DefaultPtrTraits, long>)", "elementwise", False,
     "upsample_trilinear3d_out_frame"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<4u>, "
     "unsigned int, 5, 64, 64>(at::native::(anonymous namespace)::OpaqueType<4u>*, at::native::(anonymous namespace)::"
     "CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<4u>, unsigned int, 64, 64>, "
     "at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)", "layout", False,
     "CatArrayBatchedCopy"),
    ("some_unknown_kernel", "other", False, "some_unknown_kernel"),
    # seen in torch.profiler on the H200 (torch 2.11, cuDNN 9.19)
    ("sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize256x64x8_stage3_warpsize2x2x1_g1_ffma_"
     "aligna4_alignc4_execute_kernel__5x_cudnn", "convolution", False, None),
    ("sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_g1_"
     "execute_segment_k_off_kernel__5x_cudnn", "convolution", True, None),
    ("void convolveNd_dgrad_float_engine<float, 3, 128, 6, 8, 3, 3, 5, false>(int, int, int, float const*, int, "
     "float const*, int, float*, kernel_gradNd_params, unsigned long long, int, unsigned long long, int, float, int)",
     "convolution", False, "convolveNd_dgrad_float_engine"),
    ("void wgrad_alg1_nd_float_engine<float, float, 3, 0, 5, 7, 4, 3, 5, false, true>(int, int, int, float const*, "
     "int, float*, float const*, kernel_gradNd_params, unsigned long long, int, float, float, int, int, int*, int*)",
     "convolution", False, "wgrad_alg1_nd_float_engine"),
    ("void cask_plugin__5x_cudnn::xmma__5x_cudnn::init_device_workspace_kernel<xmma__5x_cudnn::implicit_gemm::dgrad::"
     "Warp_specialized_params_nontemplate<xmma__5x_cudnn::Grid_constant_params> >(xmma__5x_cudnn::implicit_gemm::"
     "dgrad::Warp_specialized_params_nontemplate<xmma__5x_cudnn::Grid_constant_params>, bool)", "convolution", False,
     "init_device_workspace_kernel"),
    ("void tensorTransformGeneric<__nv_bfloat16, __nv_bfloat16, float, true, false, false, (cudnnKernelDataType_t)0>"
     "(cudnnTensorTransformStruct, tensorTransformParams, int, unsigned long, __nv_bfloat16 const*, __nv_bfloat16*, "
     "float, float)", "layout", False, "tensorTransformGeneric"),
    ("void nhwcAddPaddingKernel<__nv_bfloat16, __nv_bfloat16, float, true, (cudnnKernelDataType_t)0>(int, int, int, "
     "int, int, int, int, int, __nv_bfloat16 const*, __nv_bfloat16*, int, int, int, int, float, float, "
     "cudnn::reduced_divisor, cudnn::reduced_divisor, cudnn::reduced_divisor)", "layout", False,
     "nhwcAddPaddingKernel"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, float, float, false, true, "
     "false, false, 6, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >(cublasGemvParamsEx<"
     "int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float>, float>)", "gemm", False, "gemvx::kernel"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute_kernel__"
     "5x_cublas", "gemm", False, None),
    ("nvjet_sm90_tss_64x8_64x16_1x4_h_bz_TNT", "gemm", True, "nvjet_sm90_tss_64x8_64x16_1x4_h_bz_TNT"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda(float)#1}, std::array<char*, 2ul>)", "layout", False,
     "bfloat16_copy_kernel_cuda [vectorized_elementwise_kernel]"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)", "reduction", False, "MeanOps [reduce_kernel]"),
    ("triton_red_fused__safe_softmax__softmax_backward_data__to_copy_bmm_transpose_view_97", "fused", False,
     "triton_red_fused__safe_softmax__softmax_backward_data__to..."),
    # CPU operators (rows of a CPU profile)
    ("aten::slow_conv3d_forward", "convolution", None, "slow_conv3d_forward"),
    ("aten::convolution_backward", "convolution", None, "convolution_backward"),
    ("aten::bmm", "gemm", None, "bmm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention", None, None),
    ("aten::native_group_norm_backward", "normalization", None, None),
    ("aten::copy_", "layout", None, None),
    ("aten::_fused_adam_", "optimizer", None, None),
    ("aten::_softmax", "reduction", None, None),
    ("aten::l1_loss", "reduction", None, None),
    ("aten::silu_backward", "elementwise", None, None),
    ("aten::add_", "elementwise", None, None),
    ("aten::empty", "other", None, None),
]


@pytest.mark.parametrize("name, category, tensor_cores, label", KNOWN, ids=lambda v: str(v)[:40])
def test_known_names(name, category, tensor_cores, label):
    assert categorize(name) == category
    if tensor_cores is not None:
        assert uses_tensor_cores(name) is tensor_cores
    if label is not None:
        assert short_name(name) == label
    assert len(short_name(name)) <= MAX_LABEL and "void" not in short_name(name)


def test_categories_are_the_documented_ones():
    assert {categorize(n) for n, *_ in KNOWN} == set(CATEGORIES)


# ------------------------------------------------------------------------------------ traces

CONV = "sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_g1_k"
DGRAD = "sm90_xmma_dgrad_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_g1_k"
ADAM = "void multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>(TensorListMetadata<4>)"


def _x(cat, name, ts, dur, tid, correlation=None):
    args = {"External id": 1} | ({"correlation": correlation} if correlation is not None else {})
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace():
    """Main thread 1 opens the pass ranges; autograd's thread 2 launches backward kernels; the GPU
    (pid 0, stream 7) runs them later; a graph replay and a copy fall outside every range."""
    return {"schemaVersion": 1, "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
        _x("user_annotation", "forward", 100.0, 100.0, 1),
        _x("user_annotation", "backward", 200.0, 200.0, 1),
        _x("user_annotation", "optimizer", 400.0, 50.0, 1),
        _x("user_annotation", "Optimizer.step#Adam.step", 401.0, 40.0, 1),
        _x("cpu_op", "aten::convolution", 105.0, 20.0, 1),
        # autograd's thread: cuDNN's backward copies a gradient inside aten::convolution_backward
        _x("cpu_op", "autograd::engine::evaluate_function: ConvolutionBackward0", 240.0, 30.0, 2),
        _x("cpu_op", "aten::convolution_backward", 245.0, 10.0, 2),
        _x("cpu_op", "aten::copy_", 249.0, 3.0, 2),
        _x("cuda_runtime", "cudaMemcpyAsync", 50.0, 5.0, 1, 1),
        _x("cuda_runtime", "cudaLaunchKernel", 110.0, 3.0, 1, 2),
        _x("cuda_runtime", "cudaLaunchKernelExC", 150.0, 3.0, 1, 3),
        _x("cuda_driver", "cuLaunchKernel", 160.0, 3.0, 1, 4),
        _x("cuda_runtime", "cudaLaunchKernel", 250.0, 3.0, 2, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 260.0, 3.0, 2, 6),
        _x("cuda_runtime", "cudaLaunchKernel", 410.0, 3.0, 1, 7),
        _x("cuda_runtime", "cudaGraphLaunch", 500.0, 10.0, 1, 8),
        _x("cuda_runtime", "cudaStreamSynchronize", 520.0, 100.0, 1, 9),
        _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 60.0, 2.0, 7, 1),
        _x("kernel", CONV, 300.0, 40.0, 7, 2),
        _x("kernel", CONV, 340.0, 60.0, 7, 3),
        _x("kernel", "triton_per_fused_native_group_norm_silu_0", 400.0, 10.0, 7, 4),
        _x("kernel", DGRAD, 410.0, 80.0, 7, 5),
        _x("kernel", CONV, 490.0, 50.0, 7, 6),
        _x("kernel", ADAM, 540.0, 20.0, 7, 7),
        _x("kernel", CONV, 600.0, 30.0, 7, 8),
        _x("kernel", DGRAD, 630.0, 40.0, 7, 8),
        _x("gpu_memset", "Memset (Device)", 670.0, 1.0, 7, 8),
        _x("kernel", "some_unknown_kernel", 680.0, 49.0, 7, 99),  # its launch happened before profiling
        _x("gpu_user_annotation", "forward", 300.0, 110.0, 7),  # the GPU-side projection: not a range
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 2, "pid": 1, "tid": 1, "ts": 110.0},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 2, "pid": 0, "tid": 7, "ts": 300.0, "bp": "e"},
    ]}


def _check_table(df, device_type):
    assert tuple(df.columns) == COLUMNS
    for col in COLUMNS:
        want = DTYPES.get(col)
        assert (str(df[col].dtype) == want) if want else pd.api.types.is_string_dtype(df[col]), col
    assert set(df.category) <= set(CATEGORIES)
    assert set(df["pass"]) <= {"forward", "backward", "optimizer", "graph", "other"}
    assert (df.device_type == device_type).all()
    assert df.share.sum() == pytest.approx(1.0)
    assert not df.duplicated(["kernel", "pass", "op"]).any()


def test_kernel_rows_from_trace():
    df = kernel_rows_from_trace(_trace(), steps=2)
    _check_table(df, "cuda")
    got = {(r.kernel, r["pass"], r.op): (r.calls, r.total_us, r.category, r.tensor_cores) for _, r in df.iterrows()}
    bwd = "autograd::engine::evaluate_function: ConvolutionBackward0"
    assert got == {
        # the outermost aten operator around the launch; none: the innermost other range; pass ranges are not ops
        (CONV, "forward", "aten::convolution"): (1, 40.0, "convolution", True),
        (CONV, "forward", ""): (1, 60.0, "convolution", True),
        ("triton_per_fused_native_group_norm_silu_0", "forward", ""): (1, 10.0, "fused", False),
        (DGRAD, "backward", "aten::convolution_backward"): (1, 80.0, "convolution", True),
        (CONV, "backward", bwd): (1, 50.0, "convolution", True),
        (ADAM, "optimizer", "Optimizer.step#Adam.step"): (1, 20.0, "optimizer", False),
        (CONV, "graph", ""): (1, 30.0, "convolution", True),  # replayed: no operator ran
        (DGRAD, "graph", ""): (1, 40.0, "convolution", True),
        ("Memset (Device)", "graph", ""): (1, 1.0, "memcpy", False),
        ("Memcpy HtoD (Pageable -> Device)", "other", ""): (1, 2.0, "memcpy", False),
        ("some_unknown_kernel", "other", ""): (1, 49.0, "other", False),
    }
    assert list(df.total_us) == sorted(df.total_us, reverse=True)
    assert (df.micro_steps == 2).all()
    assert df.share.iloc[0] == pytest.approx(80.0 / 382.0)


def test_empty_trace_gives_an_empty_table():
    df = kernel_rows_from_trace({"traceEvents": []}, steps=1)
    assert df.empty and tuple(df.columns) == COLUMNS and str(df.calls.dtype) == "int64"


def test_op_rows_from_trace_uses_self_time():
    trace = {"traceEvents": [
        _x("user_annotation", "forward", 0.0, 100.0, 1),
        _x("user_annotation", "backward", 200.0, 100.0, 1),
        _x("cpu_op", "aten::conv3d", 10.0, 50.0, 1),
        _x("cpu_op", "aten::convolution", 10.0, 50.0, 1),
        _x("cpu_op", "aten::mkldnn_convolution", 12.0, 46.0, 1),
        _x("cpu_op", "aten::add", 70.0, 10.0, 1),
        _x("cpu_op", "autograd::engine::evaluate_function: ConvolutionBackward0", 210.0, 50.0, 2),
        _x("cpu_op", "aten::convolution_backward", 215.0, 40.0, 2),
        _x("cpu_op", "aten::add", 350.0, 5.0, 1),
    ]}
    df = op_rows_from_trace(trace, steps=1)
    _check_table(df, "cpu")
    got = {(r.kernel, r["pass"]): (r.calls, r.total_us) for _, r in df.iterrows()}
    assert got == {("aten::mkldnn_convolution", "forward"): (1, 46.0), ("aten::convolution", "forward"): (1, 4.0),
                   ("aten::convolution_backward", "backward"): (1, 40.0),  # on autograd's thread
                   ("aten::add", "forward"): (1, 10.0), ("aten::add", "other"): (1, 5.0)}
    assert not df.tensor_cores.any()
    # each operator's own time, attributed to the operator the code called
    assert dict(zip(df.kernel + "@" + df["pass"], df.op)) == {
        "aten::mkldnn_convolution@forward": "aten::conv3d", "aten::convolution@forward": "aten::conv3d",
        "aten::convolution_backward@backward": "aten::convolution_backward",
        "aten::add@forward": "aten::add", "aten::add@other": "aten::add"}


def test_profile_kernels_on_cpu(tiny_spec):
    engine = Engine(tiny_spec, "baseline", device="cpu", ema=False)
    x, c = random_batch(tiny_spec)
    df = profile_kernels(lambda: engine.step((x, c)), device=torch.device("cpu"), steps=1, warmup=1)
    _check_table(df, "cpu")
    assert {"forward", "backward", "optimizer"} <= set(df["pass"])
    assert (df.micro_steps == 1).all() and (df.total_us > 0).all() and df.kernel.str.startswith("aten::").all()
    shares = df.groupby("category").share.sum()
    # the largest category; its share is wall-clock time on a CPU, which other processes' load dilutes
    # (0.6-0.7 on an idle CPU, about 0.46 with every core busy)
    assert shares.idxmax() == "convolution" and shares["convolution"] > 0.3
    assert df[df.kernel == "aten::convolution_backward"]["pass"].tolist() == ["backward"]


def _h200_trace(config):
    with gzip.open(FIXTURES / "kernels" / f"h200-{config}-trace.json.gz") as f:
        return json.load(f)


@pytest.mark.slow
def test_real_trace_of_a_compiled_step():
    """Triton kernels are launched through the driver API (cuLaunchKernel), and about half the
    launches come from autograd's own thread: all of them must still land in a pass."""
    df = kernel_rows_from_trace(_h200_trace("compile"), steps=1)
    _check_table(df, "cuda")
    assert set(df["pass"]) == {"forward", "backward", "optimizer"}
    calls = df.groupby("pass").calls.sum()
    assert calls["backward"] > calls["forward"] > 100
    fused = df[df.category == "fused"]
    assert fused.share.sum() > 0.2 and set(fused["pass"]) == {"forward", "backward"}
    assert df[df.short_name.str.startswith("FusedAdamMathFunctor")]["pass"].tolist() == ["optimizer"]
    assert df[df.category == "convolution"].tensor_cores.mean() > 0.9  # bf16 implicit GEMM
    assert not (df.category == "other").any()


@pytest.mark.slow
def test_real_trace_of_a_graph_replay():
    df = kernel_rows_from_trace(_h200_trace("graphs"), steps=1)
    _check_table(df, "cuda")
    assert df.groupby("pass").share.sum()["graph"] > 0.99
    assert df[df["pass"] == "graph"].calls.sum() > 1000
    other = df[df["pass"] == "other"]  # the copies into the graph's static inputs
    assert set(other.category) <= {"memcpy", "elementwise"} and other.calls.sum() < 10
