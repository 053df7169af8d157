// cuBLASLt's FP8 GEMMs (cublaslt.h): the library loaded at run
// time, a handle per device, cuBLASLt's heuristic choice cached per problem.
//
// Launch config: cuBLASLt's (its heuristic's kernel, within the device's GEMM
// workspace less kRepackBytes at its end); repack_blocks: one thread per
// factor, 256 a block. Arguments: gemm::Problem mapped to the "TN"
// column-major GEMM (cublaslt.h). Roles: repack_blocks writes gemm's B's
// 128x128 factors in cuBLASLt's layout into the workspace's end; the
// library's kernel on the stream. Entry points: load, version, takes, run.
#include "kernels/gemm/cublaslt.h"

#ifdef PK_HAVE_CUBLASLT

#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace pk::gemm::cublaslt {
namespace {

// ---- the library -------------------------------------------------------------
struct Api {
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  int version = 0;
};

// FP8 scale pointers and fast accumulation: cuBLASLt 11.8 and later.
constexpr size_t kFirstVersion = 110800;

template <typename F>
bool resolve(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

// The copy already in the process (XLA's), else one the loader finds.
void* open_library() {
  const char* names[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
  for (int flags : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const char* name : names) {
      if (void* lib = dlopen(name, flags)) return lib;
    }
  }
  return nullptr;
}

const Api* api() {
  static const Api* loaded = []() -> const Api* {
    void* lib = open_library();
    if (lib == nullptr) return nullptr;
    auto* a = new Api;
    const bool ok = resolve(lib, "cublasLtGetVersion", &a->get_version) &&
                    resolve(lib, "cublasLtCreate", &a->create) &&
                    resolve(lib, "cublasLtMatmulDescCreate", &a->desc_create) &&
                    resolve(lib, "cublasLtMatmulDescDestroy", &a->desc_destroy) &&
                    resolve(lib, "cublasLtMatmulDescSetAttribute", &a->desc_set) &&
                    resolve(lib, "cublasLtMatrixLayoutCreate", &a->layout_create) &&
                    resolve(lib, "cublasLtMatrixLayoutDestroy", &a->layout_destroy) &&
                    resolve(lib, "cublasLtMatmulPreferenceCreate", &a->pref_create) &&
                    resolve(lib, "cublasLtMatmulPreferenceDestroy", &a->pref_destroy) &&
                    resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &a->pref_set) &&
                    resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &a->heuristic) &&
                    resolve(lib, "cublasLtMatmul", &a->matmul);
    if (!ok || a->get_version() < kFirstVersion) {
      delete a;
      return nullptr;
    }
    a->version = int(a->get_version());
    return a;
  }();
  return loaded;
}

// ---- the 128x128 factors in cuBLASLt's layout -----------------------------------
// gemm.h stores B's 128x128 factors [kb, nb] (kb = ceil(k / 128) K-blocks, nb
// = ceil(n / 128) N-blocks, N-contiguous); cuBLASLt's 128x128 scale mode
// reads [nb, kb4] K-contiguous with kb4 = kb rounded up to 4 (the padding
// unread). Written into the last kRepackBytes of the workspace before each
// such GEMM (same stream: the previous GEMM has read its copy).
constexpr size_t kRepackBytes = size_t(1) << 20;

int64_t padded_k_blocks(const Problem& p) { return (scale_blocks(p.k) + 3) / 4 * 4; }

bool repacked(const Problem& p) { return p.scaling == Scaling::kBlock && !p.b_row_blocks; }

size_t repack_bytes(const Problem& p) {
  return repacked(p) ? size_t(scale_blocks(p.n)) * size_t(padded_k_blocks(p)) * sizeof(float) : 0;
}

// What cuBLASLt may use of the workspace (0 without one).
size_t library_workspace(const Device& dev) {
  return dev.workspace != nullptr && dev.workspace_bytes > 2 * kRepackBytes
             ? dev.workspace_bytes - kRepackBytes
             : 0;
}

float* repack_buffer(const Device& dev) {
  return reinterpret_cast<float*>(static_cast<char*>(dev.workspace) + library_workspace(dev));
}

__global__ void repack_blocks(const float* __restrict__ src, float* __restrict__ dst, int kb,
                              int nb, int kb4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // dst index: [nb, kb4]
  if (i >= nb * kb4) return;
  const int j = i / kb4, kk = i % kb4;
  dst[i] = kk < kb ? src[size_t(kk) * nb + j] : 1.0f;
}

// ---- per device: handle and the heuristic's choices ----------------------------
struct Choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

// What the heuristic's answer depends on.
using Key = std::tuple<int64_t, int64_t, int64_t, DType, DType, DType, Scaling, bool, bool, bool,
                       uint32_t, uint32_t, uint32_t, uint32_t, size_t>;

struct PerDevice {
  cublasLtHandle_t handle = nullptr;
  std::map<Key, Choice> choices;
};

std::mutex g_mutex;  // guards g_devices and every PerDevice's choices
std::map<int, PerDevice> g_devices;

// The largest power of two (at most 256) dividing the address: the alignment
// the heuristic may assume.
uint32_t alignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

bool to_cuda(DType t, cudaDataType_t* out) {
  switch (t) {
    case DType::kE4M3: *out = CUDA_R_8F_E4M3; return true;
    case DType::kE5M2: *out = CUDA_R_8F_E5M2; return true;
    case DType::kBF16: *out = CUDA_R_16BF; return true;
    case DType::kF32: *out = CUDA_R_32F; return true;
    default: return false;
  }
}

// The descriptors of one problem, destroyed with it.
struct Descriptors {
  const Api* a = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lcd = nullptr;
  ~Descriptors() {
    if (op != nullptr) a->desc_destroy(op);
    for (cublasLtMatrixLayout_t l : {la, lb, lcd})
      if (l != nullptr) a->layout_destroy(l);
  }
};

// cuBLASLt's A is p.b ([n, k] row-major: k x n column-major, transposed), its
// B is p.a ([m, k]: k x m), C and D [m, n] (n x m column-major).
// `b_factors`: gemm's B's factors as cuBLASLt reads them (repacked or p.scale_b).
bool describe(const Api* a, const Problem& p, const float* b_factors, Descriptors* d) {
  cudaDataType_t ta, tb, tout;
  if (!to_cuda(p.in_b, &ta) || !to_cuda(p.in, &tb) || !to_cuda(p.out, &tout)) return false;
  d->a = a;
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  const bool block = p.scaling == Scaling::kBlock;
  const int8_t fast =
      !block && ((p.in == DType::kE4M3 && p.in_b == DType::kE4M3) || p.fast_accum);
  const float* scale_a = b_factors;  // cuBLASLt's A is gemm's B
  const float* scale_b = p.scale_a;
  // Block factors: gemm's A per 1x128 [ceil(k / 128), m] M-contiguous as
  // gemm.h stores them; B per 1x128 likewise (b_row_blocks) or per 128x128
  // repacked (above).
  const int32_t mode_a = !block        ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
                         : p.b_row_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                          : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t mode_b =
      block ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  return a->desc_create(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
         (!block ||
          (a->desc_set(d->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)) ==
               CUBLAS_STATUS_SUCCESS &&
           a->desc_set(d->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)) ==
               CUBLAS_STATUS_SUCCESS)) &&
         a->desc_set(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)) ==
             CUBLAS_STATUS_SUCCESS &&
         a->desc_set(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)) ==
             CUBLAS_STATUS_SUCCESS &&
         a->desc_set(d->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)) ==
             CUBLAS_STATUS_SUCCESS &&
         a->desc_set(d->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)) ==
             CUBLAS_STATUS_SUCCESS &&
         a->desc_set(d->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)) ==
             CUBLAS_STATUS_SUCCESS &&
         a->layout_create(&d->la, ta, uint64_t(p.k), uint64_t(p.n), p.k) ==
             CUBLAS_STATUS_SUCCESS &&
         a->layout_create(&d->lb, tb, uint64_t(p.k), uint64_t(p.m), p.k) ==
             CUBLAS_STATUS_SUCCESS &&
         a->layout_create(&d->lcd, tout, uint64_t(p.n), uint64_t(p.m), p.n) ==
             CUBLAS_STATUS_SUCCESS;
}

const void* c_of(const Problem& p) { return p.c != nullptr ? p.c : p.d; }

Key key_of(const Problem& p, const Device& dev) {
  return Key{p.m,           p.n,        p.k,           p.in,
             p.in_b,        p.out,      p.scaling,     p.b_row_blocks,
             p.fast_accum,  p.c != nullptr, alignment(p.b), alignment(p.a),
             alignment(c_of(p)), alignment(p.d), library_workspace(dev)};
}

Choice ask_heuristic(const Api* a, cublasLtHandle_t handle, const Problem& p, const Device& dev) {
  Choice choice;
  Descriptors d;
  if (repack_bytes(p) > kRepackBytes || (repacked(p) && library_workspace(dev) == 0) ||
      !describe(a, p, p.scale_b, &d))
    return choice;
  cublasLtMatmulPreference_t pref = nullptr;
  if (a->pref_create(&pref) != CUBLAS_STATUS_SUCCESS) return choice;
  const uint64_t workspace = library_workspace(dev);
  const uint32_t align[4] = {alignment(p.b), alignment(p.a), alignment(c_of(p)), alignment(p.d)};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  bool ok = a->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                        sizeof(workspace)) == CUBLAS_STATUS_SUCCESS;
  for (int i = 0; i < 4 && ok; ++i)
    ok = a->pref_set(pref, align_attr[i], &align[i], sizeof(align[i])) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  if (ok && a->heuristic(handle, d.op, d.la, d.lb, d.lcd, d.lcd, pref, 1, &result, &count) ==
                CUBLAS_STATUS_SUCCESS &&
      count > 0 && result.state == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= workspace) {
    choice.found = true;
    choice.algo = result.algo;
  }
  a->pref_destroy(pref);
  return choice;
}

// The cached choice for `p` on `dev` (asked once per key); false without one.
bool choice_for(const Problem& p, const Device& dev, cublasLtHandle_t* handle, Choice* out) {
  const Api* a = api();
  if (a == nullptr || p.scaling == Scaling::kNone || !is_fp8(p.in)) return false;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto dev_it = g_devices.find(dev.ordinal);
  if (dev_it == g_devices.end() || dev_it->second.handle == nullptr) return false;
  PerDevice& pd = dev_it->second;
  const Key key = key_of(p, dev);
  auto it = pd.choices.find(key);
  if (it == pd.choices.end()) it = pd.choices.emplace(key, ask_heuristic(a, pd.handle, p, dev)).first;
  *handle = pd.handle;
  *out = it->second;
  return out->found;
}

}  // namespace

// ---- entry points ----------------------------------------------------------------
cudaError_t load() {
  const Api* a = api();
  if (a == nullptr) return cudaSuccess;
  int ordinal = 0;
  if (cudaError_t err = cudaGetDevice(&ordinal); err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(g_mutex);
  PerDevice& pd = g_devices[ordinal];
  if (pd.handle == nullptr && a->create(&pd.handle) != CUBLAS_STATUS_SUCCESS) pd.handle = nullptr;
  return cudaSuccess;
}

int version() {
  const Api* a = api();
  return a != nullptr ? a->version : 0;
}

bool takes(const Problem& p, const Device& dev) {
  cublasLtHandle_t handle;
  Choice choice;
  return choice_for(p, dev, &handle, &choice);
}

cudaError_t run(const Problem& p, const Device& dev, cudaStream_t stream) {
  cublasLtHandle_t handle;
  Choice choice;
  if (!choice_for(p, dev, &handle, &choice)) return cudaErrorNotSupported;
  const Api* a = api();
  const float* b_factors = p.scale_b;
  if (repacked(p)) {
    const int kb = int(scale_blocks(p.k)), nb = int(scale_blocks(p.n)),
              kb4 = int(padded_k_blocks(p));
    float* to = repack_buffer(dev);
    repack_blocks<<<(nb * kb4 + 255) / 256, 256, 0, stream>>>(p.scale_b, to, kb, nb, kb4);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    b_factors = to;
  }
  Descriptors d;
  if (!describe(a, p, b_factors, &d)) return cudaErrorInvalidValue;
  const float alpha = 1.0f, beta = p.c != nullptr ? 1.0f : 0.0f;
  const cublasStatus_t status =
      a->matmul(handle, d.op, &alpha, p.b, d.la, p.a, d.lb, &beta, c_of(p), d.lcd, p.d, d.lcd,
                &choice.algo, dev.workspace, library_workspace(dev), stream);
  if (status == CUBLAS_STATUS_SUCCESS) return cudaSuccess;
  const cudaError_t err = cudaGetLastError();
  return err != cudaSuccess ? err : cudaErrorInvalidValue;
}

}  // namespace pk::gemm::cublaslt

#else  // built without cublasLt.h: the CUTLASS kernels run every FP8 GEMM

namespace pk::gemm::cublaslt {
cudaError_t load() { return cudaSuccess; }
int version() { return 0; }
bool takes(const Problem&, const Device&) { return false; }
cudaError_t run(const Problem&, const Device&, cudaStream_t) { return cudaErrorNotSupported; }
}  // namespace pk::gemm::cublaslt

#endif  // PK_HAVE_CUBLASLT
