// A B=1 decode step's weight stream as hand-written CUDA: 36 layers x 4 weight matrices (q|k|v, o, gate|up, down at
// Higgs v3's shapes, random FP8 or bf16), one kernel each, 144 kernels captured in one CUDA graph. `higgs-trt bench
// weight-stream` builds (nvcc) and runs this program. It measures what kernel boundaries cost a chain of that many
// dependent kernels, and a design the GPU engine's Triton kernels cannot express; it is not part of the engine.
//
// Two kernels:
//   read_all  reads a matrix once (16-byte loads, four in flight a thread): the chain's bytes with no other work
//   gemv      y[n] = sum_k W[n,k] x[k], x and y fp32, each block a contiguous range of rows. A producer warp streams
//             the block's rows into a ring of shared-memory stages by bulk copies (cp.async.bulk, completion on an
//             mbarrier); eight consumer warps load the x values they need into registers once, then take the
//             stages in order. Checked against a double-precision sum on the host (--check).
// Launch modes (programmatic dependent launch: each block lets the next kernel launch as it starts, so the next
// kernel's blocks may become resident beside it where registers and shared memory allow):
//   serial   no programmatic dependent launch: each kernel starts after the previous one ends
//   plain    every load after griddepcontrol.wait, the wait for the previous kernel (what a Triton kernel does)
//   preload  gemv's producer never waits (no kernel writes the weights): its ring fills while the previous kernel
//            still runs; only the consumers wait, for x. read_all has nothing to load ahead: the same as nodep
//   nodep    nobody waits (x read stale): the same streaming with no dependency at all

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK(call)                                                                               \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "Error: %s (%s:%d)\n", cudaGetErrorString(err_), __FILE__, __LINE__);       \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

constexpr int CONSUMER_WARPS = 8;
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
constexpr int THREADS = CONSUMERS + 32;  // + the producer warp
constexpr int MAX_STAGES = 16;
constexpr int MAX_ROWS = 160;  // rows a block may own (19456 / 132 = 148)

enum Mode { PLAIN, PRELOAD, NODEP, SERIAL };

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void await_previous() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_next() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// 16 bytes of weights times the matching x values (8 bf16 or 16 FP8 elements)
__device__ __forceinline__ float dot16(uint4 w, const float (&x)[8], float s, __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    s = fmaf(f.x, x[2 * i], fmaf(f.y, x[2 * i + 1], s));
  }
  return s;
}

__device__ __forceinline__ float dot16(uint4 w, const float (&x)[16], float s, __nv_fp8_e4m3) {
  const __nv_fp8x2_storage_t* p = reinterpret_cast<const __nv_fp8x2_storage_t*>(&w);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[i], __NV_E4M3)));
    s = fmaf(f.x, x[2 * i], fmaf(f.y, x[2 * i + 1], s));
  }
  return s;
}

constexpr int STAGE_BYTES = 16384;  // a stage holds the most whole rows (1, 2, 4 or 8) that fit, at least one
constexpr int PIECES = 5;           // 16-byte pieces of a row a consumer thread takes, at most (asserted at launch)

// One GEMV. Dynamic shared memory: the ring (stages x rows_per_stage rows). Consumer thread t takes row
// t / (CONSUMERS / rows_per_stage) of every stage and the same 16-byte pieces of it each time, so the x values it
// multiplies are loaded into registers once, after the wait.
template <typename W>
__global__ void __launch_bounds__(THREADS, 2)
    gemv(const W* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n, int k,
         int rows_per_stage, int stages, int mode) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ uint64_t full[MAX_STAGES], empty[MAX_STAGES];
  __shared__ float acc[MAX_ROWS];
  if (mode != SERIAL) launch_next();
  const int row0 = static_cast<int>(static_cast<long long>(n) * blockIdx.x / gridDim.x);
  const int row1 = static_cast<int>(static_cast<long long>(n) * (blockIdx.x + 1) / gridDim.x);
  const int rows = row1 - row0;
  const int chunks = (rows + rows_per_stage - 1) / rows_per_stage;
  const uint32_t row_bytes = k * sizeof(W);
  const uint32_t stage_bytes = rows_per_stage * row_bytes;
  const int t = threadIdx.x;
  if (t == 0) {
    for (int s = 0; s < stages; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = t; i < rows; i += THREADS) acc[i] = 0.f;
  __syncthreads();

  if (t >= CONSUMERS) {  // producer warp: one lane issues every copy
    if (t == CONSUMERS) {
      if (mode == PLAIN || mode == SERIAL) await_previous();
      const unsigned char* src = reinterpret_cast<const unsigned char*>(w) + static_cast<size_t>(row0) * row_bytes;
      for (int c = 0; c < chunks; ++c) {
        const int s = c % stages;
        if (c >= stages) bar_wait(&empty[s], ((c / stages) + 1) & 1);
        const uint32_t bytes = min(rows_per_stage, rows - c * rows_per_stage) * row_bytes;
        bar_expect(&full[s], bytes);
        bulk_copy(ring + static_cast<size_t>(s) * stage_bytes, src + static_cast<size_t>(c) * stage_bytes, bytes,
                  &full[s]);
      }
    }
    return;
  }

  constexpr int PER_PIECE = 16 / sizeof(W);
  const int pieces = k / PER_PIECE;
  const int per_row = CONSUMERS / rows_per_stage;  // threads on one row of a stage, a multiple of 32
  const int lane_row = t / per_row;
  const int first = t % per_row;
  if (mode != NODEP) await_previous();
  float xr[PIECES][PER_PIECE];
#pragma unroll
  for (int i = 0; i < PIECES; ++i) {
    const int p = first + i * per_row;
#pragma unroll
    for (int j = 0; j < PER_PIECE; j += 4) {
      const float4 v = p < pieces ? *reinterpret_cast<const float4*>(x + p * PER_PIECE + j) : make_float4(0, 0, 0, 0);
      xr[i][j] = v.x, xr[i][j + 1] = v.y, xr[i][j + 2] = v.z, xr[i][j + 3] = v.w;
    }
  }
  for (int c = 0; c < chunks; ++c) {
    const int s = c % stages;
    bar_wait(&full[s], (c / stages) & 1);
    const int row = c * rows_per_stage + lane_row;
    if (row < rows) {
      const uint4* stage = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(s) * stage_bytes +
                                                          static_cast<size_t>(lane_row) * row_bytes);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < PIECES; ++i) {
        const int p = first + i * per_row;
        if (p < pieces) sum = dot16(stage[p], xr[i], sum, W());
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if ((t & 31) == 0) atomicAdd(&acc[row], sum);
    }
    __syncwarp();
    if ((t & 31) == 0) bar_arrive(&empty[s]);
  }
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  for (int i = t; i < rows; i += CONSUMERS) y[row0 + i] = acc[i];
}

// Every byte of one weight matrix read once, 16 bytes a load, four loads in flight a thread, folded into one word: the
// chain's bytes with no work but the reads. Modes as the GEMV's: plain and serial wait for the previous kernel before
// the first load, preload and nodep never wait (no shared memory to fill ahead: their loads are the whole kernel).
__global__ void read_all(const uint4* __restrict__ src, size_t pieces, unsigned* out, int mode) {
  if (mode != SERIAL) launch_next();
  if (mode == PLAIN || mode == SERIAL) await_previous();
  unsigned v = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < pieces; i += 4 * stride) {
    const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
                d = __ldcs(src + i + 3 * stride);
    v ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < pieces; i += stride) {
    const uint4 a = __ldcs(src + i);
    v ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (v == 0x12345678u) atomicAdd(out, 1u);  // keeps the loads
}

__global__ void fill(unsigned char* p, size_t bytes, unsigned seed, int fp8) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // FP8: exponent field 3..8 (values 2^-4..2^1), either sign; bf16 (little-endian pairs): the high byte keeps an
    // exponent near 2^-4, so no weight is inf or NaN
    p[i] = fp8 ? static_cast<unsigned char>((h & 0x87u) | ((3u + (h >> 8) % 6u) << 3))
               : ((i & 1) ? static_cast<unsigned char>((h & 0x80u) | 0x3Du) : static_cast<unsigned char>(h));
  }
}

struct Shape {
  const char* name;
  int n, k;
};
constexpr Shape LAYER[] = {{"q|k|v", 6144, 2560}, {"o", 2560, 4096}, {"gate|up", 19456, 2560}, {"down", 2560, 9728}};
constexpr int LAYERS = 36;

struct Chain {
  bool fp8;
  size_t elt;
  std::vector<unsigned char*> weights;  // LAYERS x 4
  size_t bytes = 0;
  float *a, *b;  // ping-pong activations
};

// `kernel` on `stream`, launched with programmatic dependent launch unless mode is SERIAL
template <typename... Params, typename... Args>
static void launch_in_mode(void (*kernel)(Params...), int blocks, int threads, size_t smem, int mode,
                           cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = mode == SERIAL ? 0 : 1;
  CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

static int rows_per_stage(const Shape& s, size_t elt) {
  int r = 1;
  while (2 * r * s.k * elt <= STAGE_BYTES && 2 * r <= 8) r *= 2;
  return r;
}

template <typename W>
static void launch(const unsigned char* w, const float* x, float* y, const Shape& s, int ring_kb, int mode,
                   int blocks, cudaStream_t stream) {
  const int r = rows_per_stage(s, sizeof(W));
  const size_t stage_bytes = r * s.k * sizeof(W);
  const int pieces = s.k * sizeof(W) / 16;
  const int per_row = CONSUMERS / r;
  if ((pieces + per_row - 1) / per_row > PIECES || (s.n + blocks - 1) / blocks > MAX_ROWS) {
    fprintf(stderr, "Error: %s does not fit the kernel's registers or row table\n", s.name);
    exit(2);
  }
  const int stages = std::max(2, std::min<int>(MAX_STAGES, static_cast<int>(ring_kb * 1024ull / stage_bytes)));
  launch_in_mode(gemv<W>, blocks, THREADS, stages * stage_bytes, mode, stream, reinterpret_cast<const W*>(w), x, y,
                 s.n, s.k, r, stages, mode);
}

static void launch_any(const Chain& c, const unsigned char* w, const float* x, float* y, const Shape& s, int ring_kb,
                       int mode, int blocks, cudaStream_t stream) {
  if (c.fp8)
    launch<__nv_fp8_e4m3>(w, x, y, s, ring_kb, mode, blocks, stream);
  else
    launch<__nv_bfloat16>(w, x, y, s, ring_kb, mode, blocks, stream);
}

static Chain make_chain(bool fp8) {
  Chain c;
  c.fp8 = fp8;
  c.elt = fp8 ? 1 : 2;
  for (int l = 0; l < LAYERS; ++l)
    for (const Shape& s : LAYER) {
      unsigned char* p;
      const size_t bytes = static_cast<size_t>(s.n) * s.k * c.elt;
      CHECK(cudaMalloc(&p, bytes));
      fill<<<1024, 256>>>(p, bytes, 1234u + static_cast<unsigned>(c.weights.size()), fp8);
      c.weights.push_back(p);
      c.bytes += bytes;
    }
  CHECK(cudaMalloc(&c.a, 19456 * sizeof(float)));
  CHECK(cudaMalloc(&c.b, 19456 * sizeof(float)));
  std::vector<float> x(19456);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
  CHECK(cudaMemcpy(c.a, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(c.b, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());
  return c;
}

static void free_chain(Chain& c) {
  for (auto p : c.weights) CHECK(cudaFree(p));
  CHECK(cudaFree(c.a));
  CHECK(cudaFree(c.b));
}

// the launches of `capture` in one graph, replayed back to back: ms per replay (median of 5 rounds of 10)
template <typename F>
static float time_graph(cudaStream_t stream, F capture) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  capture();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(exec, stream));
  std::vector<float> rounds;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < 10; ++i) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    rounds.push_back(ms / 10);
  }
  std::sort(rounds.begin(), rounds.end());
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return rounds[rounds.size() / 2];
}

// the step's 144 GEMVs in one graph
static float time_chain(const Chain& c, int ring_kb, int mode, int blocks, cudaStream_t stream) {
  return time_graph(stream, [&] {
    for (size_t i = 0; i < c.weights.size(); ++i) {
      const float* x = (i % 2) ? c.b : c.a;
      float* y = (i % 2) ? c.a : c.b;
      launch_any(c, c.weights[i], x, y, LAYER[i % 4], ring_kb, mode, blocks, stream);
    }
  });
}

// the step's 144 weight matrices, each read by its own kernel (`blocks` blocks of 256 threads), in one graph
static float time_reads(const Chain& c, int mode, int blocks, cudaStream_t stream, unsigned* sink) {
  return time_graph(stream, [&] {
    for (size_t i = 0; i < c.weights.size(); ++i) {
      const size_t bytes = static_cast<size_t>(LAYER[i % 4].n) * LAYER[i % 4].k * c.elt;
      launch_in_mode(read_all, blocks, 256, 0, mode, stream, reinterpret_cast<const uint4*>(c.weights[i]), bytes / 16,
                     sink, mode);
    }
  });
}

static float copy_rate(cudaStream_t stream) {  // device-to-device copy of 1 GiB: bytes read + written per second
  const size_t bytes = size_t(1) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  std::vector<float> rounds;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(e0, stream));
    CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    rounds.push_back(ms);
  }
  std::sort(rounds.begin(), rounds.end());
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return 2.0f * bytes / (rounds[2] * 1e-3f);
}

static float to_float(const unsigned char* p, bool fp8) {
  if (fp8) {
    __nv_fp8_e4m3 v;
    memcpy(&v, p, 1);
    return static_cast<float>(v);
  }
  uint32_t bits = static_cast<uint32_t>(p[0] | (p[1] << 8)) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// One GEMV of each shape in every mode against a double-precision sum on the host: the largest error relative to the
// row's sum of |w·x|. Returns false past 1e-4.
static bool check(const Chain& c, int ring_kb, int blocks, cudaStream_t stream) {
  bool ok = true;
  std::vector<float> x(19456), y(19456);
  CHECK(cudaMemcpy(x.data(), c.a, x.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < 4; ++i) {
    const Shape& s = LAYER[i];
    std::vector<unsigned char> w(static_cast<size_t>(s.n) * s.k * c.elt);
    CHECK(cudaMemcpy(w.data(), c.weights[i], w.size(), cudaMemcpyDeviceToHost));
    for (int mode : {PLAIN, PRELOAD, SERIAL}) {
      CHECK(cudaMemset(c.b, 0, 19456 * sizeof(float)));
      launch_any(c, c.weights[i], c.a, c.b, s, ring_kb, mode, blocks, stream);
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaMemcpy(y.data(), c.b, s.n * sizeof(float), cudaMemcpyDeviceToHost));
      double worst = 0;
      for (int n = 0; n < s.n; ++n) {
        double sum = 0, mag = 0;
        for (int k = 0; k < s.k; ++k) {
          const double p = static_cast<double>(to_float(&w[(static_cast<size_t>(n) * s.k + k) * c.elt], c.fp8)) * x[k];
          sum += p;
          mag += std::fabs(p);
        }
        worst = std::max(worst, std::fabs(sum - y[n]) / (mag + 1e-30));
      }
      if (!(worst <= 1e-4)) ok = false;
      printf("check %s %-7s mode %d: worst error %.2e of sum |w x|%s\n", c.fp8 ? "fp8 " : "bf16", s.name, mode, worst,
             worst <= 1e-4 ? "" : "  FAILED");
    }
  }
  return ok;
}

static std::vector<int> int_list(const char* text) {
  std::vector<int> out;
  std::string copy = text;
  for (char* p = strtok(copy.data(), ","); p; p = strtok(nullptr, ",")) out.push_back(atoi(p));
  return out;
}

int main(int argc, char** argv) {
  bool check_only = false;
  std::string precision = "both";
  std::vector<int> rings = {32, 48, 64, 96, 128}, blocks_per_sm = {1, 2};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--check") check_only = true;
    else if (a == "--precision" && i + 1 < argc) precision = argv[++i];
    else if (a == "--rings" && i + 1 < argc) rings = int_list(argv[++i]);
    else if (a == "--blocks" && i + 1 < argc) blocks_per_sm = int_list(argv[++i]);
    else {
      fprintf(stderr, "Error: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int smem_optin;
  CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  CHECK(cudaFuncSetAttribute(gemv<__nv_fp8_e4m3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin - 4096));
  CHECK(cudaFuncSetAttribute(gemv<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin - 4096));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned* sink;
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  const float rate = copy_rate(stream);
  printf("copy rate %.2f TB/s (read + written), %d multiprocessors\n", rate / 1e12, sms);
  bool ok = true;
  for (bool fp8 : {false, true}) {
    if (precision != "both" && (precision == "fp8") != fp8) continue;
    Chain c = make_chain(fp8);
    const char* p = fp8 ? "fp8 " : "bf16";
    ok = check(c, 32, sms, stream) && ok;
    if (!check_only) {
      const float floor_ms = c.bytes / rate * 1e3f;
      printf("%s: %.2f GB of weights a step; floor at the copy rate %.3f ms\n%s: ms a step (x the floor), modes "
             "serial / plain / preload / nodep\n", p, c.bytes / 1e9, floor_ms, p);
      for (int b : {4, 8}) {
        printf("%s reads only, %d blocks of 256 an SM:", p, b);
        for (int mode : {SERIAL, PLAIN, PRELOAD, NODEP}) {
          const float ms = time_reads(c, mode, b * sms, stream, sink);
          printf("  %.3f (%.2fx)", ms, ms / floor_ms);
        }
        printf("\n");
      }
      for (int b : blocks_per_sm)
        for (int ring : rings) {
          printf("%s GEMVs, %d block%s an SM, ring %3d KB:", p, b, b > 1 ? "s" : " ", ring);
          for (int mode : {SERIAL, PLAIN, PRELOAD, NODEP}) {
            const float ms = time_chain(c, ring, mode, b * sms, stream);
            printf("  %.3f (%.2fx)", ms, ms / floor_ms);
          }
          printf("\n");
          fflush(stdout);
        }
    }
    free_chain(c);
  }
  return ok ? 0 : 1;
}
