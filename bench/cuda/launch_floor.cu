// The latency floor of a decode step's kernel boundaries: a CUDA graph of L dependent launches
// with programmatic dependent launch (as the engine replays a step), microseconds per launch, for
// kernels that do almost nothing: one thread's load and store after the wait, on grids of 1-528
// blocks of 256 threads; a block reading and reducing 2048 floats (a norm's shape); and the
// last-block pattern the router and split attention use (every block writes, fences and counts
// itself on one word; the last one reads what the others wrote).
// H100, 2026-12-07 (us per launch): touch 0.79 (1 block), 0.82 (132), 0.87 (264), 1.07 (528);
// a one-block norm of 2048 floats 2.50; the last-block pattern over 128 or 256 blocks 2.44 / 2.48.
// A boundary costs under a microsecond; each dependent round trip through memory inside a kernel
// (a load before a reduction, the fence, count and reload of the last-block pattern) costs more.
#include <cstdio>
#include <cstdint>
#include <cmath>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
__device__ __forceinline__ void pdl() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__global__ void touch(const float* x, float* y) {
  pdl();
  if (threadIdx.x == 0) y[blockIdx.x] = x[blockIdx.x] * 0.5f + 1.0f;
}
__global__ void norm2048(const float* x, float* y) {
  pdl();
  __shared__ float part[8];
  float ss = 0.f;
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) ss += x[i] * x[i];
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(~0u, ss, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < 8; w++) t += part[w];
  const float inv = rsqrtf(t / 2048 + 1e-6f);
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) y[i] = x[i] * inv;
}
__global__ void last_block(const float* x, float* y, float* parts, uint32_t* count) {
  pdl();
  __shared__ bool last;
  if (threadIdx.x == 0) parts[blockIdx.x] = x[blockIdx.x] + 1.0f;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(count, 1u) == gridDim.x - 1;
    if (last) *count = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float s = 0.f;
  for (int i = threadIdx.x; i < gridDim.x; i += blockDim.x) s += __ldcg(parts + i);
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  if (threadIdx.x == 0) y[0] = s;
}
template <class K, class... A> static void launch(cudaStream_t st, K k, int g, A... a) {
  cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(g); cfg.blockDim = dim3(256); cfg.stream = st;
  cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1; cfg.attrs = at; cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, k, a...));
}
int main() {
  const int L = 384;  // a 48-layer step's 8 kernels a layer
  cudaStream_t st; CK(cudaStreamCreate(&st));
  float *a, *b, *parts; uint32_t* count;
  CK(cudaMalloc(&a, 1 << 20)); CK(cudaMalloc(&b, 1 << 20)); CK(cudaMemset(a, 0, 1 << 20)); CK(cudaMemset(b, 0, 1 << 20));
  CK(cudaMalloc(&parts, 4096 * 4)); CK(cudaMalloc(&count, 4)); CK(cudaMemset(count, 0, 4));
  auto time_graph = [&](auto body) {
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < L; i++) body(i % 2 ? b : a, i % 2 ? a : b);
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
      cudaEventRecord(e0, st); for (int w = 0; w < 10; w++) CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st);
      CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); best = fmin(best, ms * 1000 / 10 / L);
    }
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g); return best;
  };
  for (int rep = 0; rep < 2; rep++) {
    for (int g : {1, 132, 264, 528})
      printf("touch, %3d blocks: %5.2f us per launch\n", g, time_graph([&](float* x, float* y) { launch(st, touch, g, (const float*)x, y); }));
    printf("norm of 2048, 1 block: %5.2f us per launch\n", time_graph([&](float* x, float* y) { launch(st, norm2048, 1, (const float*)x, y); }));
    for (int g : {128, 256})
      printf("last block of %3d: %5.2f us per launch\n", g, time_graph([&](float* x, float* y) { launch(st, last_block, g, (const float*)x, y, parts, count); }));
  }
}
