// What the graph-chain benchmarks share: an error check, a launch with programmatic dependent
// launch allowed (as the engine's replayed graphs make them), and the time of a graph of such
// launches.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

template <class K, class... A> static void launch(cudaStream_t st, K k, dim3 g, dim3 b, A... a) {
  cudaLaunchConfig_t cfg = {}; cfg.gridDim = g; cfg.blockDim = b; cfg.stream = st;
  cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at; cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, k, a...));
}

// Microseconds per launch of a graph of n launches (body(i) issues the i-th): the best of five
// timings of 20 replays, after 3 to warm up.
template <class F> static double time_graph(cudaStream_t st, int n, F body) {
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal)); for (int i = 0; i < n; i++) body(i); CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
  for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, st));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  double best = 1e30;
  for (int rep = 0; rep < 5; rep++) {
    cudaEventRecord(e0, st); const int reps = 20; for (int w = 0; w < reps; w++) CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st);
    CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); best = fmin(best, ms * 1000 / reps / n);
  }
  cudaEventDestroy(e0); cudaEventDestroy(e1); cudaGraphExecDestroy(ge); cudaGraphDestroy(g); return best;
}
