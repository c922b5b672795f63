// Does reading 8 scattered ~0.9 MB chunks slow down when they lie in a large allocation (TLB)?
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
struct Offs { long o[8]; };
__global__ void rd8(const uint4* base, Offs offs, long n, float* y) {
  const uint4* p = base + offs.o[blockIdx.y]; float a = 0;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) { uint4 v = __ldg(p + i); a += (float)(v.x ^ v.w); }
  if (a == 1234.5f) y[0] = a;
}
int main() {
  const long chunk = 9 * 98304; // bytes: ~0.88 MB
  const long n = chunk / 16;
  size_t freeb, totalb; cudaMemGetInfo(&freeb, &totalb);
  float* y; CK(cudaMalloc(&y, 64));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  for (double gb : {0.25, 1.0, 4.0, 16.0, 48.0}) {
    size_t bytes = (size_t)(gb * (1 << 30));
    if (bytes > freeb - (2ul << 30)) continue;
    uint8_t* base; CK(cudaMalloc(&base, bytes)); CK(cudaMemset(base, 1, bytes));
    std::mt19937_64 rng(1);
    const int NB = 48;
    for (int spread = 0; spread < 2; spread++) {
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < NB; i++) {
        Offs o;
        // spread 0: 8 chunks back to back at a random place; 1: each chunk at its own random place
        long slots = (bytes - 8 * chunk) / (2 << 20);
        long b0 = (long)(rng() % slots) * (2 << 20);
        for (int k = 0; k < 8; k++) o.o[k] = (spread ? (long)(rng() % slots) * (2 << 20) : b0 + k * chunk) / 16;
        rd8<<<dim3(33, 8), 256, 0, st>>>((const uint4*)base, o, n, y);
      }
      CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 2; w++) CK(cudaGraphLaunch(ge, st));
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st); for (int w = 0; w < 10; w++) CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st);
      CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1);
      double us = ms * 1000 / 10 / NB;
      printf("alloc %5.2f GB, %s: %6.2f us per 8 chunks (%.2f MB) = %.0f GB/s\n", gb, spread ? "scattered " : "contiguous", us, 8.0 * chunk / 1e6, 8.0 * chunk / 1e3 / us);
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    }
    cudaFree(base);
  }
}
