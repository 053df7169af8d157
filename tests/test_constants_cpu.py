"""Every constant, enum and mechanism list that Python mirrors from the
C++/CUDA sources agrees with them (and the head dims with the kernels'
supported()); the op packages keep their layering (primitive modules import
no op's api, each package re-exports its api) and the package has no import
cycles."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import types

import pytest

from pk_jax import runtime
from pk_jax.ops.all_gather import primitive as all_gather_primitive
from pk_jax.ops.all_reduce import primitive as all_reduce_primitive
from pk_jax.ops.fp8 import primitive as fp8_primitive
from pk_jax.ops.grouped_matmul import primitive as grouped_matmul_primitive
from pk_jax.ops.ring_attention import attention_bwd_primitive
from pk_jax.ops.ring_attention import bwd_primitive as ring_attention_bwd_primitive
from pk_jax.ops.ring_attention import primitive as ring_attention_primitive
from pk_jax.ops.tp_matmul import primitive as tp_matmul_primitive

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _source(rel: str) -> str:
    """A C++ file without comments."""
    text = (ROOT / rel).read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _int_expr(expr: str, names: dict[str, int]) -> int:
    """An integer constant expression of the headers (literals, <<, *, +, -,
    parentheses, size_t(...) casts and already known names)."""
    expr = re.sub(r"\b(?:size_t|int|int64_t|uint64_t)\s*\(", "(", expr)
    expr = re.sub(r"(\d+)[uUlL]+\b", r"\1", expr)
    tree = ast.parse(expr.strip(), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
               ast.LShift, ast.Mult, ast.Add, ast.Sub, ast.USub, ast.FloorDiv)
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(f"not a simple constant expression: {expr!r}")
    return int(eval(compile(tree, "<header>", "eval"), {"__builtins__": {}}, dict(names)))


def cxx_constants(rel: str) -> dict[str, int]:
    """`constexpr` integer constants of a header, by name."""
    found: dict[str, int] = {}
    for name, expr in re.findall(r"constexpr\s+[\w:]+\s+(k\w+)\s*=\s*([^;]+);", _source(rel)):
        try:
            found[name] = _int_expr(expr, found)
        except (ValueError, NameError, SyntaxError):
            pass  # e.g. sizeof(...): not mirrored
    return found


def cxx_enum(rel: str, enum: str) -> dict[str, int]:
    """Enumerators of `enum [class] <enum> [: type] { ... }`."""
    body = re.search(rf"enum\s+(?:class\s+)?{enum}\b[^{{]*\{{([^}}]*)\}}", _source(rel))
    assert body, f"enum {enum} not found in {rel}"
    return {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body.group(1))}


LAYOUT = "csrc/pk/layout.h"
ALL_GATHER = "csrc/kernels/all_gather/all_gather.h"
ALL_REDUCE = "csrc/kernels/all_reduce/all_reduce.h"
GROUPED = "csrc/kernels/grouped_matmul/grouped_matmul.h"
RING = "csrc/kernels/ring_attention/ring_attention.h"
BWD = "csrc/kernels/attention_bwd/attention_bwd.h"
RING_BWD = "csrc/kernels/ring_attention_bwd/ring_attention_bwd.h"
FP8 = "csrc/kernels/fp8/fp8.h"
GEMM = "csrc/kernels/gemm/gemm.h"
TP_MATMUL = "csrc/kernels/tp_matmul/tp_matmul.h"


@pytest.mark.parametrize("python,header,name", [
    (runtime.MAX_RANKS, LAYOUT, "kMaxRanks"),
    (runtime.MAX_SLOTS, LAYOUT, "kMaxSlots"),
    (runtime.LL_CHANNELS, LAYOUT, "kLlChannels"),
    (runtime.LL_MAX_BYTES, LAYOUT, "kLlMaxBytes"),
    (ring_attention_primitive.TILE_Q, RING, "kTileQ"),
    (ring_attention_primitive.DEFAULT_COMM_CTAS, RING, "kDefaultCommCtas"),
    (ring_attention_primitive.MAX_COMM_CTAS, RING, "kMaxCommCtas"),
    (attention_bwd_primitive.TILE_KV, BWD, "kTileKv"),
    (ring_attention_bwd_primitive.STAMP_BYTES, RING_BWD, "kStampBytes"),
    (fp8_primitive.BLOCK, FP8, "kBlock"),
    (fp8_primitive.BLOCK, GEMM, "kBlockK"),
])
def test_constant_matches_header(python, header, name):
    assert cxx_constants(header)[name] == python, f"{name} in {header}"


def test_piece_limit_matches_the_stamps():
    """Python cuts a block into at most MAX_PIECES pieces; the kernel posts
    each with one stamp (kMaxPieces = kMaxStamps)."""
    layout, ring = cxx_constants(LAYOUT), _source(RING)
    assert re.search(r"kMaxPieces\s*=\s*kMaxStamps\s*;", ring)
    assert layout["kMaxStamps"] == ring_attention_primitive.MAX_PIECES


def test_block_backward_query_tile_matches_header():
    body = re.search(r"int tile_q\(int head_dim\)\s*\{\s*return head_dim == (\d+) \? (\d+) : "
                     r"(\d+);", _source(BWD))
    assert body, "tile_q not found in attention_bwd.h"
    d, if_d, other = map(int, body.groups())
    assert attention_bwd_primitive.tile_q(d) == if_d
    assert attention_bwd_primitive.tile_q(64 if d != 64 else 128) == other


def test_fused_backward_layout_matches_header():
    """Python sizes the fused backward's region and scratch as the host
    sequence lays them out (ring_attention_bwd.h: Layout), for K and V [B, T,
    Hkv, D] of 2-byte elements: e = 2 B T Hkv D elements, kv_bytes = 2 e,
    partial_bytes = 4 e."""
    src = _source(RING_BWD)
    e = 2 * 3 * 256 * 2 * 64
    names = {"kv_bytes": 2 * e, "partial_bytes": 4 * e,
             "kStampBytes": ring_attention_bwd_primitive.STAMP_BYTES}

    def method(name, n):
        body = re.search(rf"size_t {name}\(\) const \{{\s*return ([^;]+);", src)
        assert body, f"Layout::{name} not found"
        expr = body.group(1)
        for call in re.findall(r"(\w+)\(\)", expr):
            expr = expr.replace(f"{call}()", f"({method(call, n)})")
        return _int_expr(expr, {**names, "n": n})

    for n in (2, 3, 8, 16):
        # partial() = the two K/V slots before it, whatever n.
        assert method("partial", n) == 2 * (2 * e)
        assert method("region_bytes", n) == ring_attention_bwd_primitive.region_bytes(
            n, (3, 256, 2, 64)) == 8 * e
    assert method("scratch_bytes", 2) == ring_attention_bwd_primitive.scratch_bytes(
        (3, 256, 2, 64))


def test_fused_backward_stamp_table_fits():
    """Posts::count = 3n - 2 (ring_attention_bwd.h: make_posts) u64 stamps
    fit kStampBytes for every ring size up to kMaxRanks."""
    src = _source(RING_BWD)
    assert re.search(r"static_assert\(\(3 \* kMaxRanks - 2\) \* sizeof\(uint64_t\) <= "
                     r"kStampBytes", src)
    assert (3 * runtime.MAX_RANKS - 2) * 8 <= ring_attention_bwd_primitive.STAMP_BYTES


# Every integer an FFI attribute carries for a name: the Python mirror, the
# enum of the op's kernel header (its one home), and which enumerator each
# name maps to.
FFI_ENUMS = [
    (all_gather_primitive.KERNEL_MECHANISMS, ALL_GATHER, "Mechanism",
     {"ld_st_pull": "kLdStPull", "copy_engine": "kCopyEngine", "ld_st_push": "kLdStPush",
      "ld_st_ll": "kLdStLl"}),
    (all_reduce_primitive.KERNEL_MECHANISMS, ALL_REDUCE, "Mechanism",
     {"one_shot": "kOneShot", "two_shot": "kTwoShot", "copy_engine": "kCopyEngine"}),
    (all_reduce_primitive.KINDS, ALL_REDUCE, "Kind",
     {"all_reduce": "kAllReduce", "reduce_scatter": "kReduceScatter"}),
    (ring_attention_primitive.KERNEL_MECHANISMS, RING, "Mechanism",
     {"copy_engine": "kCopyEngine", "ld_st": "kLdSt"}),
    (tp_matmul_primitive.ALL_REDUCE_KERNEL_MECHANISMS, TP_MATMUL, "AllReduceMechanism",
     {"chunked": "kChunked", "one_shot": "kOneShot"}),
    (grouped_matmul_primitive.KINDS, GROUPED, "Kind",
     {"forward": "kForward", "lhs_grad": "kLhsGrad", "rhs_grad": "kRhsGrad"}),
    (fp8_primitive.GRANULARITY, FP8, "Granularity",
     {"tensor": "kTensor", "rows": "kRows", "cols": "kCols", "blocks": "kBlocks",
      "rows_cols": "kRowsCols", "rows_blocks": "kRowsBlocks"}),
    (fp8_primitive.SCALING, GEMM, "Scaling",
     {"none": "kNone", "tensor": "kTensor", "block": "kBlock"}),
    (fp8_primitive.LIBRARY, GEMM, "Library", {"cutlass": "kCutlass", "cublaslt": "kCublasLt"}),
]


@pytest.mark.parametrize("python,header,enum,names", FFI_ENUMS,
                         ids=[f"{h.rsplit('/', 1)[1]}:{e}" for _, h, e, _ in FFI_ENUMS])
def test_ffi_enum_matches_header(python, header, enum, names):
    assert python.keys() == names.keys(), f"{enum} in {header}: a name without an enumerator"
    assert cxx_enum(header, enum) == {names[k]: v for k, v in python.items()}


def test_ffi_enums_live_in_the_kernel_headers():
    """The handlers read the ids from the kernel headers; no handler declares
    an enum of its own."""
    for path in sorted((ROOT / "xla_ffi").glob("*.cc")):
        assert not re.search(r"\benum\b", _source(str(path.relative_to(ROOT)))), path.name


def _handler_attrs(rel: str) -> dict[str, str]:
    """Each handler symbol of an xla_ffi file (XLA_FFI_DEFINE_HANDLER_SYMBOL)
    and the text of its binding (where it calls a binding helper, the
    helper's body too)."""
    src = _source(rel)
    helpers = dict(re.findall(r"auto (\w+)\(\)\s*\{(.*?)\n\}", src, flags=re.S))
    out = {}
    for name, binding in re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+),\s*\w+,(.*?)"
                                    r"\{ffi::Traits", src, flags=re.S):
        out[name] = binding + "".join(body for h, body in helpers.items() if f"{h}()" in binding)
    return out


def test_ffi_enums_are_int32_enum_classes():
    """Each enum an FFI attribute carries is an `enum class <name> : int32_t`
    (the handlers bind the attribute as int32_t and convert once)."""
    for _, header, enum, _ in FFI_ENUMS:
        assert re.search(rf"enum\s+class\s+{enum}\s*:\s*int32_t\s*\{{", _source(header)), \
            f"{enum} in {header}"


def test_every_mechanism_enum_is_checked():
    """Every mechanism enum of a kernel header (`enum ... <Name>Mechanism`)
    is one of FFI_ENUMS, so Python's list is checked against it."""
    declared = set()
    for path in sorted((ROOT / "csrc" / "kernels").glob("*/*.h")):
        rel = str(path.relative_to(ROOT))
        declared |= {(rel, e) for e in re.findall(r"enum\s+(?:class\s+)?(\w*Mechanism)\b",
                                                  _source(rel))}
    assert declared and declared <= {(h, e) for _, h, e, _ in FFI_ENUMS}, declared


def test_mechanism_attributes_are_int32():
    """Every handler's `mechanism` attribute is an int32 (an FFI_ENUMS enum's
    value), never a bool or an int64."""
    found = 0
    for path in sorted((ROOT / "xla_ffi").glob("*.cc")):
        for kind in re.findall(r'Attr<(\w+)>\("mechanism"\)', _source(str(path.relative_to(ROOT)))):
            assert kind == "int32_t", path.name
            found += 1
    assert found >= 5  # all_gather, all_reduce, ring_attention, matmul_all_reduce (+ FP8)


def test_matmul_all_reduce_mechanisms_cross_as_mechanism():
    """matmul_all_reduce's kernel mechanisms cross the FFI as its handlers'
    (16-bit and FP8) int32 attribute `mechanism` (tp_matmul.h:
    AllReduceMechanism, checked in FFI_ENUMS); the other TP handlers take no
    mechanism (they run the chunked kernels only)."""
    handlers = _handler_attrs("xla_ffi/tp_matmul.cc")
    assert len(handlers) >= 7, sorted(handlers)
    with_mechanism = {h for h, b in handlers.items()
                      if re.search(r'Attr<int32_t>\("mechanism"\)', b)}
    assert with_mechanism == {"MatmulAllReduce", "MatmulAllReduceFp8"}
    assert not [h for h, b in handlers.items() if "one_shot" in b]
    assert tp_matmul_primitive.KERNEL_MECHANISMS == ("chunked",)
    assert list(tp_matmul_primitive.ALL_REDUCE_KERNEL_MECHANISMS) == ["chunked", "one_shot"]


def _function_body(rel: str, signature: str) -> str:
    """The body of the C++ function defined as `signature` in `rel`."""
    src = _source(rel)
    start = src.find(signature + " {")
    assert start >= 0, f"{signature} not found in {rel}"
    depth = 0
    for end in range(src.index("{", start), len(src)):
        depth += {"{": 1, "}": -1}.get(src[end], 0)
        if depth == 0:
            return src[start:end + 1]
    raise AssertionError(f"unbalanced braces after {signature} in {rel}")


@pytest.mark.parametrize("python,source,op", [
    (ring_attention_primitive.HEAD_DIMS, "csrc/kernels/ring_attention/ring_attention.cu", "=="),
    (ring_attention_primitive.BWD_HEAD_DIMS, "csrc/kernels/attention_bwd/attention_bwd.cu", "!="),
], ids=["forward", "block_backward"])
def test_head_dims_match_supported(python, source, op):
    """The head dims Python sends to an attention kernel (HEAD_DIMS: the
    fused forward; BWD_HEAD_DIMS: the block backward, and so the fused ring
    backward) are the ones its supported() takes (`head_dim == D || ...`;
    `head_dim != D && ...` refused)."""
    body = _function_body(source, "bool supported(const Params& p)")
    tests = re.findall(r"head_dim\s*(==|!=|<=|>=|<|>)\s*(\d+)", body)
    assert tests and {o for o, _ in tests} == {op}, tests
    assert sorted(int(d) for _, d in tests) == sorted(python)


def test_grouped_matmul_constants_match_header():
    consts = cxx_constants(GROUPED)
    prim = grouped_matmul_primitive
    assert (consts["kMaxGroups"], consts["kPerGroupScratch"], consts["kKernelScratch"]) == (
        prim.MAX_GROUPS, prim.PER_GROUP_SCRATCH, prim.KERNEL_SCRATCH)


def test_ffi_target_names_match_the_module():
    """The targets Python lowers to are the ones the extension registers."""
    module = _source("xla_ffi/module.cc")
    registered = set(re.findall(r'"(pk_\w+)"', module))
    lowered = set()
    for path in (ROOT / "pk_jax").rglob("*.py"):
        lowered |= set(re.findall(r'ffi_lowering\("(pk_\w+)"\)', path.read_text()))
    assert lowered and lowered == registered


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """The pk_jax modules a module imports at its top level or in functions."""
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import
                parts = mod.split(".")[: -node.level + (path.name == "__init__.py")]
                base = ".".join(parts + [node.module])
            if base.startswith(package):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(package)}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first (an op package's
    # __init__ imports its api.py): those are imports too.
    return out | {i.rsplit(".", k)[0] for i in out for k in range(1, i.count(".") + 1)
                  if i.rsplit(".", k)[0].startswith(package)}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of pk_jax by dotted name (a package by its own name)."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (ROOT / "pk_jax").rglob("*.py")}


def test_no_import_cycles():
    files = _modules()
    graph = {m: {i for i in _imports(p, "pk_jax") if i in files and i != m}
             for m, p in files.items()}
    # A package's __init__ importing its submodules is not a cycle of modules:
    # drop edges from a module to the packages that contain it.
    for m in graph:
        graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for i in sorted(graph[m]):
            if state.get(i) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, i]))
            if i not in state:
                visit(i, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def _is_primitive_module(name: str) -> bool:
    last = name.rsplit(".", 1)[1]
    return last == "primitive" or last.endswith("_primitive")


OPS = ROOT / "pk_jax" / "ops"
PRIMITIVE_MODULES = sorted([*OPS.glob("*/primitive.py"), *OPS.glob("*/*_primitive.py")])


def test_primitive_modules_import_no_op_module():
    """A primitive module (ops/<op>/primitive.py, ops/<op>/*_primitive.py)
    builds on primitive modules and the lowering helpers, never on an op's
    functions (ops/<op>/api.py and the modules beside it, or the names an op
    package re-exports)."""
    assert PRIMITIVE_MODULES
    modules = _modules()
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    for path in PRIMITIVE_MODULES:
        bad = set()
        for i in _imports(path, "pk_jax.ops"):
            parent = i.rsplit(".", 1)[0]
            if i in packages or i == "pk_jax.ops._lowering":
                continue  # a package holding a primitive module; the lowering helpers
            if i in modules:
                if not _is_primitive_module(i):
                    bad.add(i)
            elif parent in packages:
                bad.add(i)  # a name an op package re-exports from its api.py
            # else a name of an imported module, checked as that module
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def _public_names(path: pathlib.Path) -> set[str]:
    """The names a module defines at its top level without an underscore."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("package", sorted(p.parent.name for p in OPS.glob("*/__init__.py")))
def test_op_package_reexports_its_api(package):
    """Every op package (ops/<op>/) has an api.py whose public names its
    __init__ re-exports (`__all__`), so `pk_jax.ops.<op>.<name>` reaches them."""
    mod = importlib.import_module(f"pk_jax.ops.{package}")
    api = _public_names(OPS / package / "api.py")
    assert api and api <= set(mod.__all__), sorted(api - set(mod.__all__))
    for name in mod.__all__:
        assert not isinstance(getattr(mod, name), types.ModuleType), name
