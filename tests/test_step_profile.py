"""A step's GPU time by kind (step_profile.py) and `lpoptim bench --profile`."""
from types import SimpleNamespace

import pytest
import torch

from lpoptim import bench
from lpoptim.__main__ import main
from lpoptim.stack import parse_stack
from lpoptim.step_profile import ALL_KINDS, gpu_events, kernel_kind, profile_step, summarize

# kernel names as torch.profiler reported them for one step of HF Llama-2-7B under prepare(model) and under
# FSDP2 (H100 and H200, torch 2.11, triton 3.6), and torch's fused AdamW
NAMES = {
    "_adamw_kernel": "optimizer",
    "adamw4_kernel": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, "
    "false>, float*, double, double, double, double, double, bool, float*, float*>": "optimizer",
    "nvjet_sm90_qrtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT": "gemm",
    "nvjet_sm90_tst_192x176_64x4_2x1_v_bz_coopB_splitK_NNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_align1::"
    "Params)": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x128x128_4x1x1_kernel0_0": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, float*)": "attention",
    "triton_poi_fused__scaled_mm__to_copy_clamp_clone_div_gt_mul_ones_like_1": "fp8 casts",
    "triton_red_fused__to_copy_abs_amax_eq_mul_ne_where_zeros_11": "fp8 casts",
    "_quant_rows_kernel": "fp8 casts",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "Memcpy DtoD (Device -> Device)": "copies",
    "Memset (Device)": "copies",
    "triton_poi_fused_add_view_16": "other",
    # names a first draft put in the wrong kind
    "fast_hadamard_transform_kernel": "other",  # "adam" in hadamard
    "void kOptimizerStatic8bit2StateBlockwise<float, 0, 256, 1>(float*, float*)": "optimizer",  # bitsandbytes
    "triton_tem_fused_mm_0": "gemm",  # Inductor's GEMM templates (max-autotune)
    "triton_tem_fused__scaled_mm_3": "gemm",
    "void deep_gemm::fp8_gemm_kernel<128, 128>(float*)": "gemm",
    "triton_per_fused_amax_exp_sub_sum_2": "other",  # a logsumexp's maximum, not a quantization's absmax
    "_finite_absmax_kernel": "fp8 casts",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(float)": "gemm",
    "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>(float)": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)>": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_kernels_are_told_apart_by_name(name):
    assert kernel_kind(name) == NAMES[name]


def test_summary_sums_kinds_and_finds_the_idle_time():
    # a GEMM and a collective overlapping, a gap of 2, the optimizer; the step took 12
    kernels = [("nvjet_gemm", 0.0, 4.0), ("ncclDevKernel_AllGather", 1.0, 5.0), ("_adamw_kernel", 7.0, 10.0),
               ("Memset (Device)", 10.0, 10.5)]
    t = summarize(kernels, 12.0)
    assert set(t["kernel_seconds"]) == set(ALL_KINDS)
    assert t["kernel_seconds"]["gemm"] == 4.0 and t["kernel_seconds"]["communication"] == 4.0
    assert t["kernel_seconds"]["optimizer"] == 3.0 and t["kernel_seconds"]["copies"] == 0.5
    assert t["kernel_seconds"]["attention"] == 0.0
    assert t["busy_seconds"] == 8.5 and t["idle_seconds"] == 3.5  # [0, 5] + [7, 10.5]: 12 - 8.5
    assert list(t["top_kernels"].items()) == [("nvjet_gemm", 4.0), ("ncclDevKernel_AllGather", 4.0),
                                              ("_adamw_kernel", 3.0), ("Memset (Device)", 0.5)]  # longest first
    many = summarize([(f"k{i}", 0.0, i + 1.0) for i in range(40)], 50.0)["top_kernels"]
    assert list(many) == [f"k{i}" for i in range(39, 9, -1)]  # the 30 longest
    assert summarize([], 1.0)["idle_seconds"] == 1.0
    # against an unprofiled step faster than the profiled one's busy time (the profiler's host work): no idle
    assert summarize([("nvjet", 0.0, 2.0)], 1.5)["idle_seconds"] == 0.0


def test_profile_needs_cuda_and_says_so_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--preset", "tiny", "--device", "cpu", "--profile"])
    assert e.value.code == 2 and "--profile" in capsys.readouterr().err
    with pytest.raises(ValueError, match="CUDA"):
        bench.run("tiny", ["torch"], 1, 8, 1, 1, "cpu", profile=True)


def test_table_and_plot_show_the_breakdown(tmp_path):
    gib = 2**30
    times = dict.fromkeys(ALL_KINDS, 0.0) | {"gemm": 0.060, "optimizer": 0.028, "other": 0.050}
    row = dict(recipe="prepare+bf16", peak_bytes=32 * gib, peak_reserved_bytes=33 * gib, peak_kind="allocated",
               params_bytes=gib, grads_bytes=0, states_bytes=gib, activations_bytes=gib, state_bytes_per_param=2.06,
               tokens_per_s=12000.0, time_breakdown=dict(step_seconds=0.160, kernel_seconds=times,
                                                         busy_seconds=0.138, idle_seconds=0.022))
    unprofiled = dict(row, recipe="torch+bf16", time_breakdown=None)
    failed = dict(row, recipe="lpoptim", time_breakdown={"error": "no GPU event"})
    report = dict(env=dict(gpu="GPU", torch="t", triton="t"), preset="tiny",
                  model=dict(n_layer=1, d_model=8, ffn_dim=8, n_head=1, n_kv_head=1, vocab_size=8), batch=1, seq=8,
                  compile=True, steps=1, warmup=1, peak_measured=True, results=[row, unprofiled, failed])
    lines = bench.table(report).splitlines()
    header = lines.index("| recipe | step | optimizer | gemm | other | idle |")  # kinds with no time left out
    assert lines[header + 2:] == ["| prepare+bf16 | 160.0 | 28.0 | 60.0 | 50.0 | 22.0 |",
                                  "| lpoptim | not profiled: no GPU event | | | | |"]  # no row for torch+bf16
    assert bench.plot(report, tmp_path / "bench.png") and (tmp_path / "bench.png").stat().st_size > 0


def test_profile_events_are_the_gpus_kernels_copies_and_fills():
    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [event("nvjet_gemm", cuda, 10.0, 30.0), event("Memcpy DtoD (Device -> Device)", cuda, 30.0, 35.0),
              event("aten::mm", cpu, 0.0, 40.0), event("FSDP::all_gather", cuda, 5.0, 50.0, annotation=True),
              event("empty", cuda, 40.0, 40.0)]
    assert gpu_events(events) == [("nvjet_gemm", 10e-6, 30e-6), ("Memcpy DtoD (Device -> Device)", 30e-6, 35e-6)]


def test_bench_keeps_a_recipes_figures_when_the_profiler_fails(monkeypatch):
    """The timed and memory figures stand; the breakdown says why it is missing (run on the CPU, the profiler
    itself stood in for)."""
    from lpoptim.train.llama import PRESETS

    def no_events(step, seconds):
        step()
        raise RuntimeError("torch.profiler recorded no GPU event in the step")

    monkeypatch.setattr(bench, "profile_step", no_events)
    row = bench.run_stack(parse_stack("lpoptim"), PRESETS["tiny"], 1, 16, 1, 1, "cpu", False, profile=True)
    assert row["tokens_per_s"] > 0 and row["time_breakdown"] == {"error": "torch.profiler recorded no GPU event in "
                                                                          "the step"}
    monkeypatch.setattr(bench, "profile_step", lambda step, seconds: summarize([("nvjet", 0.0, seconds / 2)], seconds))
    row = bench.run_stack(parse_stack("lpoptim"), PRESETS["tiny"], 1, 16, 1, 1, "cpu", False, profile=True)
    assert row["time_breakdown"]["step_seconds"] == row["step_seconds"]  # against the timed median


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_step_on_a_gpu():
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.empty_like(a)

    def step():
        with torch.profiler.record_function("a range the profiler marks on the GPU's timeline too"):
            b.copy_(a @ a).relu_()
            a.zero_()
            a.copy_(b)

    t = profile_step(step)
    k = t["kernel_seconds"]
    assert k["gemm"] > 0 and k["other"] > 0 and k["copies"] > 0
    assert t["step_seconds"] == t["profiled_step_seconds"] and t["idle_seconds"] >= 0
    # the range is not counted: the busy time is at most the kernels' and copies' sum
    assert 0 < t["busy_seconds"] <= sum(k.values()) * (1 + 1e-6)
    assert t["busy_seconds"] <= 1.05 * t["step_seconds"]  # two clocks: the profiler's and the events'
    t = profile_step(step, step_seconds=1.0)
    assert t["step_seconds"] == 1.0 and t["idle_seconds"] == 1.0 - t["busy_seconds"]
