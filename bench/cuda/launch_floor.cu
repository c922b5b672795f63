// The latency floor of a decode step's kernel boundaries: a CUDA graph of L dependent launches
// with programmatic dependent launch (as the engine replays a step), microseconds per launch, for
// kernels that do almost nothing: one thread's load and store after the wait, on grids of 1-528
// blocks of 256 threads; a block reading and reducing 2048 floats (a norm's shape); and the
// last-block pattern the router and split attention use (every block writes, fences and counts
// itself on one word; the last one reads what the others wrote). (`chain_floor.cu` measured the
// boundary before, on an H200, with a grid-wide barrier of one persistent kernel beside it.)
// H100, 2026-12-07 (us per launch): touch 0.79 (1 block), 0.82 (132), 0.87 (264), 1.07 (528);
// a one-block norm of 2048 floats 2.50; the last-block pattern over 128 or 256 blocks 2.44 / 2.48.
// A boundary costs under a microsecond; each dependent round trip through memory inside a kernel
// (a load before a reduction, the fence, count and reload of the last-block pattern) costs more.
#include <cstdint>
#include "chain.h"
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
int main() {
  const int L = 384;  // a 48-layer step's 8 kernels a layer
  cudaStream_t st; CK(cudaStreamCreate(&st));
  float *a, *b, *parts; uint32_t* count;
  CK(cudaMalloc(&a, 1 << 20)); CK(cudaMalloc(&b, 1 << 20)); CK(cudaMemset(a, 0, 1 << 20)); CK(cudaMemset(b, 0, 1 << 20));
  CK(cudaMalloc(&parts, 4096 * 4)); CK(cudaMalloc(&count, 4)); CK(cudaMemset(count, 0, 4));
  // Each launch reads what the one before wrote.
  auto chain = [&](auto body) { return time_graph(st, L, [&](int i) { body(i % 2 ? b : a, i % 2 ? a : b); }); };
  for (int rep = 0; rep < 2; rep++) {
    for (int g : {1, 132, 264, 528})
      printf("touch, %3d blocks: %5.2f us per launch\n", g, chain([&](float* x, float* y) { launch(st, touch, dim3(g), dim3(256), (const float*)x, y); }));
    printf("norm of 2048, 1 block: %5.2f us per launch\n", chain([&](float* x, float* y) { launch(st, norm2048, dim3(1), dim3(256), (const float*)x, y); }));
    for (int g : {128, 256})
      printf("last block of %3d: %5.2f us per launch\n", g, chain([&](float* x, float* y) { launch(st, last_block, dim3(g), dim3(256), (const float*)x, y, parts, count); }));
  }
}
