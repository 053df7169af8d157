"""The Flax example's baseline and tools/step_breakdown.py on one GPU: the
baseline takes cuDNN attention where cuDNN takes the shapes (and trains like
pk), the cuDNN ring on 2 GPUs with a sharded sequence, and the profile of a
real step has GPU events in the attention, GEMM and (with 2 GPUs)
communication categories."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from conftest import gpus

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


example = _load("flax_transformer", ROOT / "examples" / "flax_transformer.py")
tool = _load("step_breakdown", ROOT / "tools" / "step_breakdown.py")

# Small, but shaped for the fused kernels and cuDNN: bf16, head dim 128,
# S_local a multiple of 128.
CFG = dataclasses.replace(example.Config(), d_model=256, num_heads=4, num_kv_heads=2,
                          head_dim=128, hidden=512, batch=2, seq_len=512, dtype="bfloat16")


def _mesh(sp: int, tp: int):
    if len(gpus()) < sp * tp:
        pytest.skip(f"needs {sp * tp} GPUs, found {len(gpus())}")
    return example.make_mesh(sp, tp)


@pytest.mark.parametrize("sp, tp, name", [(1, 1, "xla+cudnn"), (1, 2, "xla+cudnn"),
                                          (2, 1, "xla+cudnn_ring")])
def test_baseline_is_cudnn_and_trains_like_pk(sp, tp, name):
    mesh = _mesh(sp, tp)
    attention = example.baseline_attention(CFG, mesh)
    assert attention.name == name, attention.note
    pk = example.train(4, "pk", CFG, mesh, log=lambda s: None)
    base = example.train(4, "xla", CFG, mesh, log=lambda s: None, attention=attention)
    assert np.all(np.isfinite(pk)) and np.all(np.isfinite(base))
    np.testing.assert_allclose(pk, base, rtol=3e-2)


def test_float32_baseline_says_why_not_cudnn():
    mesh = _mesh(1, 1)
    attention = example.baseline_attention(dataclasses.replace(CFG, dtype="float32"), mesh)
    assert attention.name == "xla" and "float32" in attention.note


@pytest.mark.parametrize("collectives", ["pk", "xla"])
def test_breakdown_of_a_gpu_step(collectives, tmp_path):
    n = min(len(gpus()), 2)
    mesh = _mesh(1, max(n, 1))
    name, trace = tool.profile_step(example, collectives, CFG, mesh, str(tmp_path), warmup=1)
    by_device = tool.device_events(tool.read_trace(trace))
    assert sorted(by_device) == [f"GPU {d.id}" for d in mesh.devices.flat], sorted(by_device)
    b = tool.breakdown(by_device)
    cats = b["categories"]
    for c in ("attention fwd", "attention bwd", "GEMM"):
        assert cats[c]["events"] > 0 and cats[c]["ms"] > 0, (name, c, cats)
    if n > 1:  # tensor parallel: some communication is visible
        assert b["comm_ms"] > 0, (name, cats)
    assert 0 <= b["exposed_comm_ms"] <= b["comm_ms"] + 1e-9
    assert 0 < b["busy_ms"] <= b["span_ms"] + 1e-9
    print(tool.markdown({name: b}))
