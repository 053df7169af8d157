// cuBLASLt backend of the GEMM (cublaslt.h): the library opened with dlopen,
// plans cached per problem key.
//
// Row-major D[m, n] = A[m, k] @ B[k, n] is, read column-major, D^T[n, m] =
// B^T[n, k] @ A^T[k, m]: cuBLASLt's first operand is our B and its second
// our A, each passed as it lies in memory with a transpose flag where it is
// stored transposed (b_transposed: B^T [n, k] row-major; a_transposed: A^T
// [k, m] row-major), and D and C are [n, m] column-major with ld = n.
#include "kernels/gemm/cublaslt.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#ifdef PK_HAVE_CUBLASLT
#include <cublasLt.h>
#endif

namespace pk::gemm::cublaslt {

#ifdef PK_HAVE_CUBLASLT
namespace {

// The entry points used, typed from the header so a mismatch cannot compile.
struct Api {
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

struct Library {
  std::mutex mu;
  bool tried = false;
  std::string error = "not loaded";
  Api api;
  size_t version = 0;
  std::map<int, cublasLtHandle_t> handles;  // by device ordinal
};

Library& library() {
  static Library lib;
  return lib;
}

template <class Fn>
bool bind(void* so, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(so, name));
  return *fn != nullptr;
}

std::string open(const std::vector<std::string>& candidates, Api* api, size_t* version) {
  // The soname first: a library the process (XLA) already loaded is reused.
  std::vector<std::string> names = {"libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR)};
  names.insert(names.end(), candidates.begin(), candidates.end());
  void* so = nullptr;
  std::string tried;
  for (const std::string& name : names) {
    so = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (so != nullptr) break;
    tried += (tried.empty() ? "" : ", ") + name;
  }
  if (so == nullptr) return "libcublasLt not found (tried " + tried + ")";
  const bool ok = bind(so, "cublasLtGetVersion", &api->get_version) &&
                  bind(so, "cublasLtCreate", &api->create) &&
                  bind(so, "cublasLtMatmulDescCreate", &api->desc_create) &&
                  bind(so, "cublasLtMatmulDescSetAttribute", &api->desc_set) &&
                  bind(so, "cublasLtMatrixLayoutCreate", &api->layout_create) &&
                  bind(so, "cublasLtMatmulPreferenceCreate", &api->pref_create) &&
                  bind(so, "cublasLtMatmulPreferenceSetAttribute", &api->pref_set) &&
                  bind(so, "cublasLtMatmulPreferenceDestroy", &api->pref_destroy) &&
                  bind(so, "cublasLtMatmulAlgoGetHeuristic", &api->heuristic) &&
                  bind(so, "cublasLtMatmul", &api->matmul);
  if (!ok) return "libcublasLt lacks an entry point pk_jax uses";
  *version = api->get_version();
  if (*version / 10000 != CUBLAS_VER_MAJOR)
    return "libcublasLt " + std::to_string(*version) + " is not major version " +
           std::to_string(CUBLAS_VER_MAJOR) + " (the headers pk_jax was built with)";
  return "";
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// Largest power of two (up to 256, cuBLASLt's default assumption) dividing
// the address: the heuristic then only offers algorithms that accept it.
uint32_t alignment(const void* ptr) {
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, bool, bool, bool, uint32_t,
                       uint32_t, uint32_t, uint32_t, size_t>;

Key key_of(const Problem& p, const Device& dev) {
  return Key{dev.ordinal,         p.m,
             p.n,                 p.k,
             int(p.in),           int(p.out),
             p.b_transposed,      p.a_transposed,
             p.c != nullptr,      alignment(p.a),
             alignment(p.b),      alignment(p.c ? p.c : p.d),
             alignment(p.d),      dev.workspace_bytes};
}

// Descriptors and algorithm of one problem key (never freed: a process makes
// a few dozen).
struct Plan {
  cudaError_t status = cudaErrorInvalidValue;
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

std::map<Key, std::unique_ptr<Plan>>& plans() {
  static std::map<Key, std::unique_ptr<Plan>> m;
  return m;
}

bool ok(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }

// The device's handle, created with that device current.
cublasLtHandle_t handle_for(Library& lib, int ordinal) {
  auto it = lib.handles.find(ordinal);
  if (it != lib.handles.end()) return it->second;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) return nullptr;
  if (current != ordinal && cudaSetDevice(ordinal) != cudaSuccess) return nullptr;
  cublasLtHandle_t h = nullptr;
  const bool created = ok(lib.api.create(&h));
  if (current != ordinal) cudaSetDevice(current);
  if (!created) return nullptr;
  lib.handles[ordinal] = h;
  return h;
}

void make_plan(Library& lib, const Problem& p, const Device& dev, const Key& key, Plan* plan) {
  const Api& api = lib.api;
  plan->handle = handle_for(lib, dev.ordinal);
  if (plan->handle == nullptr) return;
  const cudaDataType_t in = cuda_type(p.in), out = cuda_type(p.out);
  const cublasOperation_t ta = p.b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint64_t m = uint64_t(p.m), n = uint64_t(p.n), k = uint64_t(p.k);
  bool good = ok(api.desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) &&
              ok(api.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))) &&
              ok(api.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))) &&
              // first operand: our B, [n, k] (N) or stored [k, n] (T)
              ok(api.layout_create(&plan->a, in, p.b_transposed ? k : n, p.b_transposed ? n : k,
                                   int64_t(p.b_transposed ? k : n))) &&
              // second operand: our A, [k, m] (N) or stored [m, k] (T)
              ok(api.layout_create(&plan->b, in, p.a_transposed ? m : k, p.a_transposed ? k : m,
                                   int64_t(p.a_transposed ? m : k))) &&
              ok(api.layout_create(&plan->c, out, n, m, int64_t(n))) &&
              ok(api.layout_create(&plan->d, out, n, m, int64_t(n)));
  if (!good) return;
  cublasLtMatmulPreference_t pref = nullptr;
  if (!ok(api.pref_create(&pref))) return;
  const uint64_t workspace = dev.workspace_bytes;
  // The key's alignments: (A, B, C, D) of the problem = cuBLASLt's (B, A, C, D).
  const uint32_t align_lt_a = std::get<10>(key), align_lt_b = std::get<9>(key);
  const uint32_t align_c = std::get<11>(key), align_d = std::get<12>(key);
  good = ok(api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                         sizeof(workspace))) &&
         ok(api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_lt_a,
                         sizeof(align_lt_a))) &&
         ok(api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_lt_b,
                         sizeof(align_lt_b))) &&
         ok(api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                         sizeof(align_c))) &&
         ok(api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                         sizeof(align_d)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (good)
    good = ok(api.heuristic(plan->handle, plan->desc, plan->a, plan->b, plan->c, plan->d, pref,
                            1, &result, &found)) &&
           found == 1 && ok(result.state) && result.workspaceSize <= workspace;
  api.pref_destroy(pref);
  if (!good) return;
  plan->algo = result.algo;
  plan->workspace = result.workspaceSize;
  plan->status = cudaSuccess;
}

// The cached plan of `p` (made on first use); null when not loaded.
const Plan* plan_for(const Problem& p, const Device& dev) {
  Library& lib = library();
  std::lock_guard<std::mutex> lock(lib.mu);
  if (!lib.error.empty()) return nullptr;
  const Key key = key_of(p, dev);
  std::unique_ptr<Plan>& slot = plans()[key];
  if (slot == nullptr) {
    slot = std::make_unique<Plan>();
    make_plan(lib, p, dev, key, slot.get());
  }
  return slot.get();
}

}  // namespace

std::string load(const std::vector<std::string>& candidates) {
  Library& lib = library();
  std::lock_guard<std::mutex> lock(lib.mu);
  if (!lib.tried) {
    lib.tried = true;
    lib.error = open(candidates, &lib.api, &lib.version);
  }
  return lib.error;
}

bool loaded() {
  Library& lib = library();
  std::lock_guard<std::mutex> lock(lib.mu);
  return lib.error.empty();
}

size_t version() {
  Library& lib = library();
  std::lock_guard<std::mutex> lock(lib.mu);
  return lib.error.empty() ? lib.version : 0;
}

cudaError_t check(const Problem& p, const Device& dev) {
  if (!supported(p)) return cudaErrorNotSupported;
  const Plan* plan = plan_for(p, dev);
  return plan == nullptr ? cudaErrorNotSupported : plan->status;
}

cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
  if (!supported(p)) return cudaErrorNotSupported;
  const Plan* plan = plan_for(p, dev);
  if (plan == nullptr) return cudaErrorNotSupported;
  if (plan->status != cudaSuccess) return plan->status;
  const float alpha = 1.0f, beta = p.c ? 1.0f : 0.0f;
  // Without C, beta = 0: cuBLASLt does not read C, so it may name D.
  const void* c = p.c ? p.c : p.d;
  const cublasStatus_t s = library().api.matmul(
      plan->handle, plan->desc, &alpha, p.b, plan->a, p.a, plan->b, &beta, c, plan->c, p.d,
      plan->d, &plan->algo, dev.workspace, plan->workspace, stream);
  if (!ok(s)) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

#else  // built without cublasLt.h

std::string load(const std::vector<std::string>&) {
  return "pk_jax was built without cuBLASLt headers (cublasLt.h)";
}
bool loaded() { return false; }
size_t version() { return 0; }
cudaError_t check(const Problem&, const Device&) { return cudaErrorNotSupported; }
cudaError_t run(const Problem&, const Device&, cudaStream_t) { return cudaErrorNotSupported; }

#endif

}  // namespace pk::gemm::cublaslt
