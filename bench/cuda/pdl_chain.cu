// Programmatic dependent launch on a decode-like chain: a graph of L layers x 8 kernels (tiny
// elementwise ones and 4-bit GEMVs over distinct weights), plain edges vs programmatic ones, with
// the wait at the kernel start or after the weight loads.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
struct M { const uint32_t* q; const __nv_bfloat16* s; const __nv_bfloat16* b; int rows, cols; };
__device__ __forceinline__ float u2f(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }
__device__ __forceinline__ void pdl_wait(int on) { if (on) asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger(int on) { if (on) asm volatile("griddepcontrol.launch_dependents;" :::); }
// y = x + 1 over n (a stand-in for norms, rope, ...): reads the previous output
__global__ void tiny(const float* x, float* y, int n, int pdl) { pdl_trigger(pdl); pdl_wait(pdl); int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = x[i] * 0.5f + 1.0f; }
// seg<2,4>: R=4 rows x 16 codes per thread; pre: weights loaded before the wait
template <bool PRE>
__global__ void __launch_bounds__(256) seg(M m, const float* x, float* y, int pdl) {
  constexpr int NW = 2, R = 4;
  pdl_trigger(pdl);
  if (!PRE) pdl_wait(pdl);
  const int G = m.cols / 16; const int RB = blockDim.x / G;
  const int gi = threadIdx.x / G, ci = threadIdx.x % G;
  const long r0 = ((long)blockIdx.x * RB + gi) * R; const int c = ci * 16;
  uint32_t w[R][NW]; float s[R], b[R];
#pragma unroll
  for (int i = 0; i < R; i++) { long r = min(r0 + i, (long)m.rows - 1);
    uint2 v = __ldg((const uint2*)(m.q + r * (m.cols / 8) + c / 8)); w[i][0] = v.x; w[i][1] = v.y;
    long g = (r * m.cols + c) >> 6; s[i] = __bfloat162float(m.s[g]); b[i] = __bfloat162float(m.b[g]); }
  if (PRE) pdl_wait(pdl);
  float xv[16]; for (int k = 0; k < 4; k++) { float4 a = ((const float4*)(x + c))[k]; xv[4*k] = a.x; xv[4*k+1] = a.y; xv[4*k+2] = a.z; xv[4*k+3] = a.w; }
  float xs = 0; for (int j = 0; j < 16; j++) xs += xv[j];
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; i++) { float d = 0; for (int k = 0; k < NW; k++) for (int j = 0; j < 8; j++) d = fmaf(u2f((w[i][k] >> 4 * j) & 15), xv[8 * k + j], d); acc[i] = fmaf(s[i], d, b[i] * xs); }
  __shared__ float part[R][32];
#pragma unroll
  for (int i = 0; i < R; i++) { float t = acc[i]; for (int o = 4; o; o >>= 1) t += __shfl_xor_sync(~0u, t, o); if (threadIdx.x % 8 == 0) part[i][threadIdx.x / 8] = t; }
  __syncthreads();
  if (threadIdx.x < RB * R) { int g2 = threadIdx.x / R, i = threadIdx.x % R; long r = ((long)blockIdx.x * RB + g2) * R + i;
    if (r < m.rows) { float t = 0; for (int k = 0; k < G / 8; k++) t += part[i][g2 * (G / 8) + k]; y[r] = t * 1e-3f; } }
}
static M q4mat(int rows, int cols) { M m; void *q, *s, *b; size_t qb = (size_t)rows * cols / 2, sb = (size_t)rows * cols / 64 * 2;
  CK(cudaMalloc(&q, qb)); CK(cudaMalloc(&s, sb)); CK(cudaMalloc(&b, sb)); CK(cudaMemset(q, 0x11, qb)); CK(cudaMemset(s, 0, sb)); CK(cudaMemset(b, 0, sb));
  m.q = (uint32_t*)q; m.s = (__nv_bfloat16*)s; m.b = (__nv_bfloat16*)b; m.rows = rows; m.cols = cols; return m; }
template <class K, class... A> static void launch(cudaStream_t st, bool pdl, K k, dim3 g, dim3 b, A... a) {
  cudaLaunchConfig_t cfg = {}; cfg.gridDim = g; cfg.blockDim = b; cfg.stream = st;
  cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at; cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, a...));
}
int main() {
  const int L = 16, H = 2048;
  struct Layer { M qkv, o, gu, dn; } ; std::vector<Layer> ls;
  for (int l = 0; l < L; l++) ls.push_back({q4mat(5120, 2048), q4mat(2048, 4096), q4mat(12288, 2048), q4mat(16384, 768)});
  float *a, *b, *big; CK(cudaMalloc(&a, 1 << 20)); CK(cudaMalloc(&b, 1 << 20)); CK(cudaMalloc(&big, 1 << 20)); CK(cudaMemset(a, 0, 1 << 20)); CK(cudaMemset(b, 0, 1 << 20)); CK(cudaMemset(big, 0, 1 << 20));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  auto blocks = [](const M& m) { int G = m.cols / 16; int RB = 256 / G; return dim3((m.rows / 4 + RB - 1) / RB); };
  auto bs = [](const M& m) { int G = m.cols / 16; return dim3(256 / G * G); };
  for (int mode = 0; mode < 3; mode++) for (int rep = 0; rep < 2; rep++) {
    bool pdl = mode > 0, pre = mode == 2;
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < L; l++) {
      auto gemv = [&](const M& m, const float* x, float* y) { if (pre) launch(st, pdl, seg<true>, blocks(m), bs(m), m, x, y, (int)pdl); else launch(st, pdl, seg<false>, blocks(m), bs(m), m, x, y, (int)pdl); };
      launch(st, pdl, tiny, dim3(8), dim3(256), (const float*)a, b, H, (int)pdl);       // norm
      gemv(ls[l].qkv, b, big);                                                          // qkv
      launch(st, pdl, tiny, dim3(16), dim3(256), (const float*)big, a, 4096, (int)pdl); // rope
      launch(st, pdl, tiny, dim3(16), dim3(256), (const float*)a, big, 4096, (int)pdl); // attention
      gemv(ls[l].o, big, a);                                                            // o
      launch(st, pdl, tiny, dim3(8), dim3(256), (const float*)a, b, H, (int)pdl);       // norm
      gemv(ls[l].gu, b, big);                                                           // gate/up
      gemv(ls[l].dn, big, a);                                                           // down
    }
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    cudaEventRecord(e0, st); for (int w = 0; w < 20; w++) CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st);
    CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1);
    printf("%-28s %7.2f us per layer (8 kernels)\n", mode == 0 ? "plain edges" : mode == 1 ? "PDL, wait at start" : "PDL, weights before wait", ms * 1000 / 20 / L);
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  }
}
