"""tools/step_breakdown.py: the trace parsing and interval arithmetic on a
synthetic GPU trace (known answers), the kernel-name categories, and the
whole tool on one profiled step of the Flax example on fake CPU devices."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "step_breakdown.py"
_spec = importlib.util.spec_from_file_location("step_breakdown", _PATH)
tool = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tool
_spec.loader.exec_module(tool)


@pytest.mark.parametrize("name, op, category", [
    ("void cutlass::device_kernel<pk::ring_attention::AttentionKernel<cutlass::bfloat16_t, 128, "
     "false>>(pk::ring_attention::AttentionKernel<cutlass::bfloat16_t, 128, false>::Params)",
     "pk_ring_attention", "attention fwd"),
    ("void cutlass::device_kernel<pk::attention_bwd::BwdKernel<cutlass::bfloat16_t, 128>>(...)",
     "pk_attention_block_bwd.3", "attention bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_"
     "kernel0_0", "custom-call.4", "attention fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1_"
     "kernel0_0", "custom-call.5", "attention bwd"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "dot_general.12", "GEMM"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>", "pk_all_gather_matmul",
     "GEMM"),
    ("MemcpyD2D", "pk_all_gather_matmul.2", "pk communication"),
    ("MemcpyP2P", "", "pk communication"),
    ("void pk::signals::(anonymous namespace)::post_kernel(pk::Channel, int)", "pk_ring_attention",
     "pk communication"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-gather-start.1",
     "XLA collectives"),
    ("MemcpyD2D", "collective-permute-start.2", "XLA collectives"),
    ("MemcpyD2D", "copy.3", "copies"),
    ("MemcpyH2D", "", "other"),
    ("cudnn_generated_fort_native_sdpa_sm90_convert_dq", "dot_product_attention_bwd.2",
     "attention bwd"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<pk::sum_slots_epi>>",
     "pk_matmul_reduce_scatter", "GEMM"),
    ("loop_add_fusion", "add_fusion.7", "other"),
    ("void pk::fp8::(anonymous namespace)::tile_kernel<__nv_bfloat16, (__nv_fp8_interpretation_t)"
     "0, (pk::fp8::Granularity)1, true>(pk::fp8::Quantize, float)", "pk_fp8_quantize.3",
     "FP8 quantize"),
    ("void pk::fp8::(anonymous namespace)::amax_kernel<__nv_bfloat16>(__nv_bfloat16 const*, long, "
     "float*)", "pk_all_gather_matmul_fp8.1", "FP8 quantize"),
])
def test_categories(name, op, category):
    assert tool.classify(name, op) == category


def _gpu_trace() -> dict:
    """Two GPUs, two streams each; times in us. GPU 0: a GEMM [0, 100) on
    stream 1 and an NCCL kernel [80, 150) on stream 2 (30 us exposed), a
    P2P copy [150, 160) (exposed) and an idle gap to a fusion [200, 210).
    GPU 1: attention [0, 50) covering a copy [10, 20) (hidden)."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 8, "name": "process_name", "args": {"name": "/device:GPU:1"}},
    ] + [{"ph": "M", "pid": p, "tid": t, "name": "thread_name", "args": {"name": n}}
         for p in (7, 8) for t, n in ((1, "Stream #13(Kernel)"), (2, "Stream #20(Kernel,MemcpyP2P)"),
                                      (3, "XLA Ops"))]
    x = lambda pid, tid, ts, dur, name, op="": {"ph": "X", "pid": pid, "tid": tid, "ts": ts,
                                                "dur": dur, "name": name, "args": {"hlo_op": op}}
    events = [
        x(7, 1, 0, 100, "nvjet_tst_128x256", "dot_general.1"),
        x(7, 2, 80, 70, "ncclDevKernel_AllGather_RING_LL", "all-gather-start"),
        x(7, 2, 150, 10, "MemcpyP2P", "pk_all_gather_matmul"),
        x(7, 1, 200, 10, "loop_fusion", "add_fusion"),
        x(7, 3, 0, 210, "dot_general.1", "dot_general.1"),  # a derived line: not counted
        x(8, 1, 0, 50, "pk::ring_attention::AttentionKernel", "pk_ring_attention"),
        x(8, 2, 10, 10, "MemcpyP2P", "pk_ring_attention"),
        x(1, 5, 0, 1000, "PjitFunction(train_step)"),  # host: not counted
    ]
    return {"traceEvents": meta + events}


def test_gpu_trace_known_answers():
    by_device = tool.device_events(_gpu_trace())
    assert sorted(by_device) == ["GPU 0", "GPU 1"]
    assert len(by_device["GPU 0"]) == 4 and len(by_device["GPU 1"]) == 2
    g0 = tool.device_breakdown(by_device["GPU 0"])
    assert g0["span_ms"] == pytest.approx(0.210)
    assert g0["busy_ms"] == pytest.approx(0.170)
    assert g0["comm_ms"] == pytest.approx(0.080)
    assert g0["exposed_comm_ms"] == pytest.approx(0.060)
    cats = g0["categories"]
    assert cats["GEMM"]["ms"] == pytest.approx(0.100)
    assert cats["XLA collectives"]["ms"] == pytest.approx(0.070)
    assert cats["XLA collectives"]["exposed_ms"] == pytest.approx(0.050)
    assert cats["pk communication"]["exposed_ms"] == pytest.approx(0.010)
    assert cats["other"]["ms"] == pytest.approx(0.010)
    g1 = tool.device_breakdown(by_device["GPU 1"])
    assert g1["exposed_comm_ms"] == 0.0 and g1["comm_ms"] == pytest.approx(0.010)
    mean = tool.breakdown(by_device)
    assert mean["span_ms"] == pytest.approx((0.210 + 0.050) / 2)
    assert mean["exposed_comm_ms"] == pytest.approx(0.030)
    top = tool.top_ops(by_device, 2)
    assert [(c, label) for c, label, _, _ in top] == [
        ("GEMM", "dot_general / nvjet_tst_128x256"),
        ("XLA collectives", "all-gather-start / ncclDevKernel_AllGather_RING_LL")]
    assert top[0][2] == pytest.approx(0.050) and top[0][3] == pytest.approx(0.5)
    table = tool.markdown({"pk": mean})
    assert "| pk | XLA collectives | 0.5 | 0.04 | 26.9% | 0.03 |" in table  # mean of 1 and 0
    assert "| pk | GEMM |" in table and "attention bwd" not in table  # only categories seen


def test_subtract_and_union():
    assert tool.union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert tool.subtract([(0, 10), (20, 30)], [(2, 4), (8, 22), (25, 26)]) == \
        [(0, 2), (4, 8), (22, 25), (26, 30)]
    assert tool.subtract([(0, 1)], []) == [(0, 1)]


def test_tool_profiles_one_step_on_cpu(tmp_path, capsys):
    """The whole tool on the small model (sp=2 x tp=2): a table with rows,
    times >= 0, exposed <= total, and a picture."""
    svg = tmp_path / "step.svg"
    assert tool.main(["--collectives", "pk", "--warmup", "1", "--trace-dir", str(tmp_path),
                      "--svg", str(svg), "--sp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| pk |")]
    assert len(table) >= 2 and any("**step**" in line for line in table)
    trace = tool.find_trace(tmp_path / "pk")
    by_device = tool.device_events(tool.read_trace(trace))
    assert sorted(by_device) == [f"CPU {i}" for i in range(4)]
    b = tool.breakdown(by_device)
    assert b["span_ms"] > 0 and 0 <= b["busy_ms"] <= b["span_ms"] + 1e-9
    assert 0 <= b["exposed_comm_ms"] <= b["comm_ms"] + 1e-9
    assert b["categories"]["XLA collectives"]["events"] > 0  # the tp/sp collectives on CPUs
    for c, v in b["categories"].items():
        assert 0 <= v["ms"] <= b["span_ms"] + 1e-9, c
        if v["exposed_ms"] is not None:
            assert 0 <= v["exposed_ms"] <= v["ms"] + 1e-9, c
    rows = tool.rows("pk", b)
    json.dumps(rows)  # the --save rows are plain JSON
    assert svg.read_text().startswith("<svg") and "<rect" in svg.read_text()
