"""The CUDA lowering, checked on a CPU-only machine by cross-lowering:
rank tables, channel slots, FFI attributes, and no XLA all-gather left."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _channels, groups, runtime, tuning
from conftest import cpu_mesh, ffi_attr


@pytest.mark.parametrize("names", [("x",), ("y",), ("x", "y"), ("y", "x")])
def test_groups_follow_axis_index(names):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    table = groups.axis_groups(mesh, names)
    f = jax.shard_map(lambda: lax.axis_index(names)[None], mesh=mesh, in_specs=(),
                      out_specs=P(("x", "y")), check_vma=False)
    ranks = np.asarray(jax.jit(f)())  # one entry per device, mesh order
    for device, rank in zip(mesh.devices.reshape(-1), ranks):
        row = [r for r in table if device.id in r]
        assert len(row) == 1 and row[0][rank] == device.id
    assert table.shape == (8 // table.shape[1], int(np.prod([mesh.shape[a] for a in names])))


def _collectives(hlo: str) -> list[str]:
    """XLA collectives left in a lowered module (StableHLO spelling)."""
    return re.findall(r"stablehlo\.(all_gather|reduce_scatter|all_reduce)", hlo)


def _calls(hlo):
    return re.findall(r"custom_call @pk_all_gather\(.*?\{(.*?)\}, operand_layouts", hlo)


def test_kernel_call_replaces_xla_all_gather(cuda_lowering):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    hlo = cuda_lowering(lambda a: pk_jax.all_gather(a, "x", axis=1, tiled=True), mesh,
                        P("x", "y"), (8, 12))
    assert "all_gather" not in hlo.replace("pk_all_gather", "") and "all-gather" not in hlo
    call, = _calls(hlo)
    assert ffi_attr(call, "group_ids") == "dense<[0, 4, 1, 5, 2, 6, 3, 7]>"
    assert ffi_attr(call, "group_size") == "2"
    # local shard [4, 3] f32 gathered along axis 1: 4 rows of 12 bytes
    assert ffi_attr(call, "rows") == "4" and ffi_attr(call, "row_bytes") == "12"
    assert ffi_attr(call, "mechanism") == "3"  # auto, 48 bytes: ld_st_ll (pk_jax/tuning.py)


def test_auto_takes_push_above_the_low_latency_limit(cuda_lowering):
    mesh = cpu_mesh((2,), ("x",))
    hlo = cuda_lowering(lambda a: pk_jax.all_gather(a, "x"), mesh, P("x"), (2, 8192))
    call, = _calls(hlo)
    assert ffi_attr(call, "mechanism") == "2"  # 32 KiB per rank: ld_st_push


def test_forced_low_latency_too_large_is_an_error(cuda_lowering):
    mesh = cpu_mesh((2,), ("x",))
    with pytest.raises(ValueError, match="ld_st_ll"):
        cuda_lowering(lambda a: pk_jax.all_gather(a, "x", mechanism="ld_st_ll"), mesh,
                      P("x"), (2, 8192))


def test_staged_channels_get_disjoint_regions(cuda_lowering):
    mesh = cpu_mesh((2, 4), ("x", "y"))

    def body(a):
        b = pk_jax.all_gather(a, "x", tiled=True, mechanism="copy_engine")
        return pk_jax.all_gather(b, "y", tiled=True, mechanism="copy_engine")[: a.shape[0]]

    calls = _calls(cuda_lowering(body, mesh, P("x", "y"), (8, 1024)))
    (o1, o2) = [int(ffi_attr(c, "data_offset")) for c in calls]
    # x: 2 ranks x [4, 256] f32 = 8 KiB staged; regions are 4 KiB aligned.
    assert o2 >= o1 + 2 * 4 * 256 * 4


def test_channels_per_axis(cuda_lowering):
    mesh = cpu_mesh((2, 4), ("x", "y"))

    def body(a):
        b = pk_jax.all_gather(a, "x", tiled=True)
        c = pk_jax.all_gather(b, "y", tiled=True)
        return pk_jax.all_gather(c, "x", tiled=True)[: a.shape[0]]

    calls = _calls(cuda_lowering(body, mesh, P("x", "y"), (8, 8)))
    slots = [ffi_attr(c, "slot") for c in calls]
    assert len(calls) == 3 and slots[0] == slots[2] != slots[1]


def test_groups_of_other_shapes_get_other_channels(cuda_lowering):
    """A gather over ("x", "y") (one group of 8) and over "y" (two groups of
    4 of the same ids in the same order) are different groups: different
    channels, though their id tables hold the same numbers."""
    mesh = cpu_mesh((2, 4), ("x", "y"))

    def body(a):
        b = pk_jax.all_gather(a, ("x", "y"), tiled=True, mechanism="ld_st_push")
        return pk_jax.all_gather(b, "y", tiled=True, mechanism="ld_st_push")[: a.shape[0]]

    calls = _calls(cuda_lowering(body, mesh, P(("x", "y")), (64, 8)))
    assert [ffi_attr(c, "group_size") for c in calls] == ["8", "4"]
    assert ffi_attr(calls[0], "slot") != ffi_attr(calls[1], "slot")


def test_a_hundred_staged_shapes_fit_the_default_workspace(cuda_lowering, monkeypatch):
    """Calls of one channel share its staging region (by power-of-two size
    class): 100 distinct copy-engine gathers of up to 32 MiB per call fit
    the default 1 GiB data area (a region per shape would need ~1.7 GiB)."""
    monkeypatch.setattr(runtime, "workspace_data_bytes", lambda: 1 << 30)
    monkeypatch.setattr("pk_jax._channels._slots", {})
    monkeypatch.setattr("pk_jax._channels._regions", {})
    monkeypatch.setattr("pk_jax._channels._used", {"ll": 0, "other": 0, "data": 0})
    mesh = cpu_mesh((2,), ("x",))
    ends = []
    for i in range(100):
        rows = 2 * (16 + 41 * i)  # 16 .. 4075 rows of 4 KiB per rank: 64 KiB .. 32 MiB staged
        hlo = cuda_lowering(lambda a: pk_jax.all_gather(a, "x", mechanism="copy_engine"), mesh,
                            P("x"), (rows, 1024))
        call, = _calls(hlo)
        ends.append(int(ffi_attr(call, "data_offset")) + int(ffi_attr(call, "data_bytes")))
    assert max(ends) <= 1 << 30


def test_copy_engine_too_large_names_the_knob(cuda_lowering, monkeypatch):
    monkeypatch.setattr(runtime, "workspace_data_bytes", lambda: 1024)
    mesh = cpu_mesh((2,), ("x",))
    with pytest.raises(pk_jax.PkJaxError, match="workspace_bytes"):
        cuda_lowering(lambda a: pk_jax.all_gather(a, "x", mechanism="copy_engine"), mesh,
                      P("x"), (2, 1024))


def test_without_extension_warns_and_uses_xla(monkeypatch):
    monkeypatch.setattr(runtime, "available", lambda: False)
    monkeypatch.setattr("pk_jax._warnings._seen", set())
    mesh = cpu_mesh((2,), ("x",))
    x = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda a: pk_jax.all_gather(a, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x"), check_vma=False))
    with pytest.warns(pk_jax.PkJaxFallbackWarning, match="native kernels are unavailable"):
        hlo = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "pk_all_gather" not in hlo


def test_without_extension_a_forced_mechanism_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(runtime, "available", lambda: False)
    mesh = cpu_mesh((2,), ("x",))
    x = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda a: pk_jax.all_gather(a, "x", mechanism="ld_st_push"),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    with pytest.raises(ValueError, match="mechanism='ld_st_push'.*native kernels are unavailable"):
        f.trace(x).lower(lowering_platforms=("cuda",))


def test_mlp_pair_forward_and_backward_use_only_kernels(cuda_lowering):
    """A column- then row-parallel MLP, and its gradient: every collective is
    a pk_jax kernel call, no XLA all-gather or reduce-scatter is left."""
    mesh = cpu_mesh((2,), ("tp",))
    specs = (P("tp"), P(None, "tp"), P("tp", None))

    def loss(x, w1, w2, mechanism):
        def body(x, w1, w2):
            h = pk_jax.all_gather_matmul(x, w1, "tp", mechanism=mechanism)
            return pk_jax.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", mechanism=mechanism)
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp"))
        return jnp.sum(f(x, w1, w2).astype(jnp.float32) ** 2)

    shapes = [(256, 128), (128, 512), (512, 128)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
            for s, p in zip(shapes, specs)]

    def lowered(fn, mechanism):
        f = lambda *a: fn(*a, mechanism)
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    grad = jax.grad(loss, (0, 1, 2))
    for fn in (loss, grad):
        hlo = lowered(fn, "auto")
        assert _collectives(hlo) == []
        assert "pk_all_gather_matmul" in hlo and "pk_matmul_reduce_scatter" in hlo
        # The check can fail: XLA's path shows its collectives.
        assert set(_collectives(lowered(fn, "xla"))) == {"all_gather", "reduce_scatter"}
    # The backward is one call per op computing dx and dw (the kernels read
    # w^T and the activations^T in place): no dot, no transposed copy.
    hlo = lowered(grad, "auto")
    calls = re.findall(r"custom_call @(pk_\w+)\(", hlo)
    assert sorted(calls) == ["pk_all_gather_matmul", "pk_all_gather_matmul_bwd",
                             "pk_matmul_reduce_scatter", "pk_matmul_reduce_scatter_bwd"], calls
    assert "stablehlo.dot_general" not in hlo and "stablehlo.transpose" not in hlo
    # The check can fail: XLA's backward shows its dots.
    assert "stablehlo.dot_general" in lowered(grad, "xla")


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_fp8_tp_mlp_runs_the_host_sequences(cuda_lowering, recipe):
    """fp8="current" or "block" (bf16 results): the TP MLP's forward is one
    FP8 host sequence per op with FP8 operands and their factors (the
    scaling attribute gemm.h's Scaling; block factors of the rows that
    matmul_reduce_scatter's sequence splits in its two row chunks, [2 *
    K/128, m]), each backward's dx the other op's sequence; no XLA
    all-gather or reduce-scatter is left (the FP8 copies for the weight
    gradients travel by pk's all_gather)."""
    mesh = cpu_mesh((2,), ("tp",))
    specs = (P("tp"), P(None, "tp"), P("tp", None))

    def loss(x, w1, w2):
        def body(x, w1, w2):
            h = pk_jax.all_gather_matmul(x, w1, "tp", fp8=recipe)
            return pk_jax.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", fp8=recipe)
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp"))
        return jnp.sum(f(x, w1, w2).astype(jnp.float32) ** 2)

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
            for s, p in zip([(256, 128), (128, 512), (512, 128)], specs)]
    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert _collectives(hlo) == []
    calls = re.findall(r"custom_call @(pk_\w+_fp8)\(.*?\} : \((.*?)\) ->", hlo)
    assert sorted(c for c, _ in calls) == ["pk_all_gather_matmul_fp8",
                                           "pk_all_gather_matmul_fp8",
                                           "pk_matmul_reduce_scatter_fp8",
                                           "pk_matmul_reduce_scatter_fp8"], calls
    for name, operands in calls:
        types = re.findall(r"tensor<[^>]*>", operands)
        assert len(types) == 4 and all("f8E" in t for t in types[:2]), (name, types)
        assert all(t.endswith("xf32>") for t in types[2:]), (name, types)
        if recipe == "current":
            assert types[2] == types[3] == "tensor<1xf32>", (name, types)
    scalings = re.findall(r"custom_call @pk_\w+_fp8\(.*?scaling = (\d+)", hlo)
    assert scalings == ["2" if recipe == "block" else "1"] * 4, scalings
    # Who runs the GEMMs (gemm.h: Library): cuBLASLt (1) where the
    # extension found it, as the fake extension did.
    want = "1"
    assert re.findall(r"custom_call @pk_\w+_fp8\(.*?library = (\d+)", hlo) == [want] * 4
    wgrads = re.findall(r"custom_call @pk_fp8_matmul\(.*?library = (\d+)", hlo)
    assert wgrads and set(wgrads) == {want}, wgrads
    if recipe == "block":  # x [256, 256] per rank, its factors in two chunks of 128 rows
        rs = [ops for c, ops in calls if c == "pk_matmul_reduce_scatter_fp8"]
        assert all(re.findall(r"tensor<[^>]*>", ops)[2] == "tensor<4x128xf32>" for ops in rs)


@pytest.mark.parametrize("scaling,forced,want", [("tensor", None, "1"),
                                                  ("tensor", "cutlass", "0"),
                                                  ("block", None, "1"),
                                                  ("block", "cutlass", "0")])
def test_fp8_matmul_library_attribute(cuda_lowering, scaling, forced, want):
    """pk_fp8_matmul's `library` (gemm.h: Library) is tuning.fp8_gemm_library's
    choice at lowering: cuBLASLt where the extension found it (the fake
    extension did), else the CUTLASS kernels; each library when forced."""
    a = jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((128, 256), jnp.float8_e4m3fn)
    fa, fb = ((jax.ShapeDtypeStruct((1,), jnp.float32),) * 2 if scaling == "tensor" else
              (jax.ShapeDtypeStruct((2, 256), jnp.float32),
               jax.ShapeDtypeStruct((2, 1), jnp.float32)))
    f = functools.partial(pk_jax.fp8_matmul, scaling=scaling, out_dtype=jnp.bfloat16)
    with tuning.forced(**({"fp8_gemm_library": forced} if forced else {})):
        hlo = jax.jit(f).trace(a, b, fa, fb).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @pk_fp8_matmul\(.*?library = (\d+)", hlo) == [want]
    assert re.findall(r"custom_call @pk_fp8_matmul\(.*?fast_accum = (\w+)", hlo) == ["false"]


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_dot_gradient_gemms_carry_the_recipes_accumulation(cuda_lowering, fast):
    """Fp8Recipe(fast_gradient_accumulation=...) reaches the gradient
    GEMMs' `fast_accum` attribute (gemm::Problem::fast_accum), pk_fp8_matmul's
    and the TP FP8 sequences'."""
    recipe = pk_jax.Fp8Recipe("current", fast_gradient_accumulation=fast)
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    loss = lambda x, w: jnp.sum(pk_jax.fp8_dot(x, w, recipe).astype(jnp.float32) ** 2)
    hlo = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    got = re.findall(r"custom_call @pk_fp8_matmul\(.*?fast_accum = (\w+)", hlo)
    # the forward's e4m3 x e4m3 product accumulates fast regardless
    assert sorted(got) == sorted(["false", str(fast).lower(), str(fast).lower()]), got
    mesh = cpu_mesh((2,), ("tp",))
    body = lambda x, w: pk_jax.all_gather_matmul(x, w, "tp", fp8=recipe)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
            for s, p in zip([(256, 128), (128, 512)], (P("tp"), P(None, "tp")))]
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2),
                           (0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    got = re.findall(r"custom_call @pk_\w+_fp8\(.*?fast_accum = (\w+)", hlo)
    assert got == [str(fast).lower()] * 2, got


def _ring_calls(hlo):
    return re.findall(r"custom_call @pk_ring_attention\(.*?\{(.*?)\}, operand_layouts", hlo)


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_ring_attention_forward_is_one_kernel_call(cuda_lowering, layout, causal):
    """On CUDA the forward is a single pk_ring_attention call (no ppermute
    ring left) with the layout, mask, scale, pieces and channel attributes;
    the pieces follow the block size (about 4 MiB each, at most 8)."""
    mesh = cpu_mesh((2, 4), ("sp", "tp"))
    spec = P(None, "sp", "tp")
    # local q [1, 2048, 4, 128] bf16; k/v [1, 2048, 4, 128]: 2 MiB per block -> 1 piece
    hlo = cuda_lowering(lambda q: pk_jax.ring_attention(q, q, q, "sp", causal=causal,
                                                        layout=layout, scale=0.5),
                        mesh, spec, (1, 4096, 16, 128), jnp.bfloat16)
    assert "collective_permute" not in hlo
    call, = _ring_calls(hlo)
    assert ("zigzag = true" in call) == (layout == "zigzag")
    assert ("causal = true" in call) == causal
    assert "scale = 5.000000e-01" in call
    assert ffi_attr(call, "pieces") == "1"
    assert ffi_attr(call, "group_size") == "2"
    assert ffi_attr(call, "group_ids") == "dense<[0, 4, 1, 5, 2, 6, 3, 7]>"


def test_ring_attention_pieces_and_backward(cuda_lowering, monkeypatch):
    """A 32 MiB block is posted in 8 pieces; the gradient adds one fused
    backward call (its 256 MiB region fits the default workspace beside the
    forward's 64 MiB) and never an XLA collective."""
    monkeypatch.setitem(_channels._used, "data", 0)  # earlier tests' regions do not count
    mesh = cpu_mesh((2,), ("sp",))
    spec = P(None, "sp")
    x = jax.ShapeDtypeStruct((1, 2 * 8192, 16, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, spec))

    def loss(q):
        f = jax.shard_map(lambda q: pk_jax.ring_attention(q, q, q, "sp", causal=True,
                                                          layout="zigzag"),
                          mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return jnp.sum(f(q).astype(jnp.float32))

    fwd = jax.jit(loss).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    call, = _ring_calls(fwd)
    assert ffi_attr(call, "pieces") == "8"
    bwd = jax.jit(jax.grad(loss)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_ring_calls(bwd)) == 1 and "collective_permute" not in bwd
    assert bwd.count("custom_call @pk_ring_attention_bwd(") == 1
    assert _collectives(bwd) == []


@pytest.mark.parametrize("mechanism,comm,want_mech,want_comm", [
    ("copy_engine", None, "0", "0"), ("auto", None, "0", "0"),  # auto: copy_engine (tuning.py)
    ("ld_st", None, "1", "16"), ("ld_st", 5, "1", "5")])
def test_ring_attention_mechanism_attrs(cuda_lowering, mechanism, comm, want_mech, want_comm):
    """The custom call names its mechanism (0 copy_engine, 1 ld_st) and the
    ld_st communicator CTAs (default 16, forced by num_comm_ctas)."""
    mesh = cpu_mesh((2,), ("sp",))
    kw = {} if comm is None else dict(num_comm_ctas=comm)
    hlo = cuda_lowering(lambda q: pk_jax.ring_attention(q, q, q, "sp", causal=True,
                                                        mechanism=mechanism, **kw),
                        mesh, P(None, "sp"), (1, 1024, 4, 128), jnp.bfloat16)
    assert "collective_permute" not in hlo
    call, = _ring_calls(hlo)
    assert ffi_attr(call, "mechanism") == want_mech
    assert ffi_attr(call, "num_comm_ctas") == want_comm


def test_ring_attention_mechanisms_get_their_own_channels(cuda_lowering):
    """copy_engine and ld_st calls on the same group never share a channel
    (ld_st's arrival counters assume a fixed CTA count per channel), nor do
    ld_st calls with different CTA counts; the same call twice does."""
    mesh = cpu_mesh((2,), ("sp",))

    def body(q):
        a = pk_jax.ring_attention(q, q, q, "sp", mechanism="copy_engine")
        b = pk_jax.ring_attention(a, q, q, "sp", mechanism="ld_st")
        c = pk_jax.ring_attention(b, q, q, "sp", mechanism="ld_st", num_comm_ctas=8)
        return pk_jax.ring_attention(c, q, q, "sp", mechanism="ld_st")

    calls = _ring_calls(cuda_lowering(body, mesh, P(None, "sp"), (1, 1024, 4, 128),
                                      jnp.bfloat16))
    slots = [ffi_attr(c, "slot") for c in calls]
    offsets = [int(ffi_attr(c, "data_offset")) for c in calls]
    assert len(calls) == 4 and len(set(slots[:3])) == 3 and slots[3] == slots[1]
    assert len(set(offsets[:3])) == 3 and offsets[3] == offsets[1]


def test_ring_attention_block_layouts_get_their_own_channels(cuda_lowering):
    """Ring calls (forward and fused backward) whose K/V blocks differ in
    shape or element type never share a channel (their copy-engine stamps
    carry no layout: mispaired calls of two layouts then wait on different
    channels and time out instead of reading each other's blocks); calls of
    one layout do, whatever q is."""
    mesh = cpu_mesh((2,), ("sp",))
    spec = P(None, "sp")

    def body(q):                                          # q [1, 2048, 8, 128] per device
        kv = q[:, :, :4]                                  # 4 kv heads: GQA
        half = q[:, :1024, :4]                            # another block shape
        a = pk_jax.ring_attention(q, kv, kv, "sp", mechanism="copy_engine")
        b = pk_jax.ring_attention(a, q, q, "sp", mechanism="copy_engine")
        c = pk_jax.ring_attention(q[:, :1024], half, half, "sp", mechanism="copy_engine")
        d = pk_jax.ring_attention(b, kv.astype(jnp.float16).astype(jnp.bfloat16), kv, "sp",
                                  mechanism="copy_engine")   # kv's layout again
        e = pk_jax.ring_attention(q.astype(jnp.float16), kv.astype(jnp.float16),
                                  kv.astype(jnp.float16), "sp", mechanism="copy_engine")
        return (a + b + d + e.astype(q.dtype)).at[:, :1024].add(c)

    hlo = cuda_lowering(body, mesh, spec, (1, 4096, 8, 128), jnp.bfloat16)
    slots = [ffi_attr(c, "slot") for c in _ring_calls(hlo)]
    assert len(slots) == 5
    assert slots[0] == slots[3] and len({slots[0], slots[1], slots[2], slots[4]}) == 4

    def loss(q, kv):
        f = jax.shard_map(lambda q, kv: pk_jax.ring_attention(q, kv, kv, "sp"),
                          mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return jnp.sum(f(q, kv).astype(jnp.float32))

    def bwd_slot(q_shape, kv_shape):
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
                for s in (q_shape, kv_shape)]
        hlo = jax.jit(jax.grad(loss)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        call, = re.findall(r"custom_call @pk_ring_attention_bwd\(.*?\{(.*?)\}, operand_layouts",
                           hlo)
        return ffi_attr(call, "slot")

    one = bwd_slot((1, 4096, 8, 128), (1, 4096, 4, 128))
    assert bwd_slot((1, 4096, 4, 128), (1, 4096, 4, 128)) == one    # the same blocks
    assert bwd_slot((1, 4096, 8, 128), (1, 4096, 8, 128)) != one    # other blocks


def test_command_buffer_targets_reads_the_outlined_computations():
    """What the GPU tests use to assert that a custom call was captured in a
    command buffer: the targets inside XLA's `command_buffer` computations,
    not those the entry computation runs itself."""
    from helpers.gpu_util import command_buffer_targets
    hlo = "\n".join([
        "HloModule jit_f, is_scheduled=true",
        "%command_buffer (p: u32[8]) -> u32[16] {",
        "  %p = u32[8]{0} parameter(0)",
        '  ROOT %cc = u32[16]{0} custom-call(%p), custom_call_target="pk_all_gather", '
        "api_version=API_VERSION_TYPED_FFI",
        "}",
        "%command_buffer.3 (p.1: f32[4]) -> f32[4] {",
        '  ROOT %cc.1 = f32[4]{0} custom-call(%p.1), custom_call_target="pk_all_reduce"',
        "}",
        "ENTRY %main.9 (x: u32[8], y: f32[4]) -> (u32[16], f32[4], f32[4]) {",
        "  %x = u32[8]{0} parameter(0)",
        "  %call = u32[16]{0} call(%x), to_apply=%command_buffer",
        '  %cc.2 = f32[4]{0} custom-call(%y), custom_call_target="pk_matmul_all_reduce"',
        "}"])
    assert command_buffer_targets(hlo) == {"pk_all_gather", "pk_all_reduce"}
    assert command_buffer_targets(hlo.replace("command_buffer", "fused_computation")) == set()


def test_dumped_command_buffers_read_real_xla_output(tmp_path):
    """The check for XLA versions that form command buffers from the thunk
    sequence (jax 0.11: no `command_buffer` computation in the module's
    text), on what XLA dumped for a pk_fp8_quantize call compiled for an H100
    with --xla_gpu_graph_min_graph_size=1 (tests/data/xla_gpu_command_buffer:
    the thunk sequence, its metadata, the compiled module's text): one
    kCommandBuffer holding the call; with that thunk gone (the call at top
    level, as with command buffers off) none, and the call not captured."""
    import pathlib
    import shutil

    from helpers.gpu_util import command_buffer_targets, dumped_command_buffers
    data = pathlib.Path(__file__).parent / "data" / "xla_gpu_command_buffer"
    text = (data / "compiled.txt").read_text()
    assert command_buffer_targets(text) == set()  # nothing outlined in the HLO
    assert dumped_command_buffers(data, text) == (1, {"pk_fp8_quantize"})
    for f in data.glob("module_*"):
        shutil.copy(f, tmp_path / f.name)
    seq = next(tmp_path.glob("*.thunk_sequence_after_thunk_passes.txt"))
    lines = seq.read_text().splitlines()
    assert lines[0].startswith("000: kCommandBuffer")
    seq.write_text("\n".join(line.strip() for line in lines[1:]) + "\n")
    assert dumped_command_buffers(tmp_path, text) == (0, set())
