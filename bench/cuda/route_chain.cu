// The router's latency in a decode step: a CUDA graph of L dependent launches with programmatic
// dependent launch (as the engine replays them), microseconds per launch, over distinct 8-bit
// router matrices [128, 2048] (L2 cold). Variants: the engine's route_gemv (a block per expert,
// the last block picks the top k in registers), the same with the previous top k (probabilities
// in shared memory), one block for the whole router, and that block with the residual add and
// RMS norm before it fused in. H100, 2026-12-07: 4.48 / 6.75 / 13.77 / 14.97 us (add_rms_norm
// alone 1.85 us): one block reads the router too slowly. The PDL comments of sluice.cu are made
// instructions (as the loader does); run.sh builds it.
#include "sluice_pdl.cu"
#include "chain.h"
#include <vector>
#include <random>

// The previous route_row (before 2026-12-07): probabilities in shared memory, each pick a loop
// over them and five shuffle steps of (value, index).
__device__ void route_row_shared(const float* row, int E, int k, int normalize, float* probs,
                                 uint32_t* ids, float* weights) {
    const int lane = threadIdx.x % 32;
    float mx = -INFINITY;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, __ldcg(row + i));
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int i = lane; i < E; i += 32) { const float p = expf(__ldcg(row + i) - mx); probs[i] = p; sum += p; }
    sum = warp_sum(sum);
    __syncwarp();
    float chosen_total = 0.0f, my_p = 0.0f;
    int my_id = 0;
    for (int j = 0; j < k; j++) {
        float best = -1.0f;
        int best_i = 0x7fffffff;
        for (int i = lane; i < E; i += 32) { const float p = probs[i]; if (p > best || (p == best && i < best_i)) { best = p; best_i = i; } }
        warp_argmax(best, best_i);
        const float p = best / sum;
        chosen_total += p;
        if (lane == j) { my_p = p; my_id = best_i; }
        if (lane == 0) probs[best_i] = -2.0f;
        __syncwarp();
    }
    if (lane < k) { ids[lane] = (uint32_t)my_id; weights[lane] = normalize ? my_p / chosen_total : my_p; }
}

// route_gemv_q8 with route_row_shared.
__global__ void __launch_bounds__(128) route_gemv_shared(Mat w, const float* x, int k, int normalize,
                                                          float* logits, uint32_t* done, uint32_t* ids,
                                                          float* weights) {
    PDL_LAUNCH_DEPENDENTS();
    prefetch_row(w, blockIdx.x);
    PDL_WAIT();
    const int t = blockIdx.y, E = w.rows, warp = threadIdx.x / 32;
    const long r = blockIdx.x;
    float acc[1][1];
    block_rows_dot<K_Q8, 1, 1>(&w, &r, x + (long)t * w.cols, 0, acc);
    if (threadIdx.x == 0) logits[(long)t * E + r] = acc[0][0];
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done + t, 1u) == gridDim.x - 1;
        if (last) done[t] = 0;
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    __shared__ float probs[1024];
    route_row_shared(logits + (long)t * E, E, k, normalize, probs, ids + (long)t * k, weights + (long)t * k);
}

// One block of 1024 threads for the whole router (E = 128): 32 warps of 4 rows, the logits written
// out and warp 0 picks. NORM: x = rms_norm(h + y) * nw first (h updated), as add_rms_norm.
template <bool NORM>
__global__ void __launch_bounds__(1024) route_block(Mat w, const float* x, int k, int normalize,
                                                    float* logits, uint32_t* ids, float* weights, float* h,
                                                    const float* y, const float* nw, float eps,
                                                    float* xout) {
    PDL_LAUNCH_DEPENDENTS();
    {
        // the whole matrix: codes, then scales and biases
        const long bytes = (long)w.rows * w.cols * w.bits / 8;
        for (long o = threadIdx.x * 128L; o < bytes; o += blockDim.x * 128L)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(w.data + o));
        const long sb = (long)w.rows * (w.cols >> w.gshift) * 2;
        for (long o = threadIdx.x * 128L; o < 2 * sb; o += blockDim.x * 128L)
            asm volatile("prefetch.global.L2 [%0];" ::"l"((o < sb ? w.scales : w.biases) + o % sb));
    }
    PDL_WAIT();
    __shared__ __align__(16) float xs[2048];
    const int n = w.cols;
    if (NORM) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) { const float v = h[i] + y[i]; xs[i] = v; ss += v * v; }
        const float inv = 1.0f / sqrtf(block_sum(ss) / n + eps);
        for (int i = threadIdx.x; i < n; i += blockDim.x) { const float v = xs[i]; h[i] = v; xs[i] = v * inv * nw[i]; xout[i] = xs[i]; }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = x[i];
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc[4][1];
    warp_rows_dot<K_Q8, 1, 4>(w, warp * 4, xs, 0, acc);
    if (lane < 4) logits[warp * 4 + lane] = acc[lane][0];
    __syncthreads();
    if (warp == 0) route_row_v<4>(logits, w.rows, k, normalize, ids, weights);
}

static std::mt19937_64 rng(7);
static void* dev_random(size_t bytes) { std::vector<unsigned char> h(bytes); for (auto& b : h) b = rng(); void* p; CK(cudaMalloc(&p, bytes)); CK(cudaMemcpy(p, h.data(), bytes, cudaMemcpyHostToDevice)); return p; }
static void* dev_scales(size_t n) { std::vector<__nv_bfloat16> h(n); for (auto& v : h) v = __float2bfloat16((rng() % 1000) / 1000.f * 0.02f - 0.01f); void* p; CK(cudaMalloc(&p, n * 2)); CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice)); return p; }
static Mat q8mat(int rows, int cols) { Mat m{}; m.data = (const uint8_t*)dev_random((size_t)rows * cols); m.scales = (const uint8_t*)dev_scales((size_t)rows * cols / 64); m.biases = (const uint8_t*)dev_scales((size_t)rows * cols / 64); m.rows = rows; m.cols = cols; m.fmt = FMT_AFFINE; m.bits = 8; m.group = 64; m.sdt = SDT_BF16; m.gshift = 6; return m; }
int main() {
  const int L = 48, E = 128, K = 8, H = 2048;
  cudaStream_t st; CK(cudaStreamCreate(&st));
  std::vector<Mat> ws; for (int l = 0; l < L; l++) ws.push_back(q8mat(E, H));
  std::vector<float> hx(H); for (auto& v : hx) v = (rng() % 2000) / 1000.f - 1.f;
  float *x, *h, *y, *nw, *xo, *logits, *wts; uint32_t *done, *ids, *ids2;
  CK(cudaMalloc(&x, H * 4)); CK(cudaMemcpy(x, hx.data(), H * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&h, H * 4)); CK(cudaMemcpy(h, hx.data(), H * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&y, H * 4)); CK(cudaMemset(y, 0, H * 4));
  CK(cudaMalloc(&nw, H * 4)); { std::vector<float> o(H, 1.0f); CK(cudaMemcpy(nw, o.data(), H * 4, cudaMemcpyHostToDevice)); }
  CK(cudaMalloc(&xo, H * 4)); CK(cudaMalloc(&logits, E * 4)); CK(cudaMalloc(&wts, K * 4));
  CK(cudaMalloc(&done, 64)); CK(cudaMemset(done, 0, 64)); CK(cudaMalloc(&ids, K * 4)); CK(cudaMalloc(&ids2, K * 4));
  auto a = [&](int i) { launch(st, route_gemv_q8, dim3(E), dim3(128), ws[i], (const float*)x, K, 1, logits, done, ids, wts); };
  auto ar = [&](int i) { launch(st, route_gemv_shared, dim3(E), dim3(128), ws[i], (const float*)x, K, 1, logits, done, ids, wts); };
  auto norm = [&](int i) { launch(st, add_rms_norm, dim3(1), dim3(1024), h, (const float*)y, (const float*)nw, xo, H, 1e-6f); };
  auto c = [&](int i) { launch(st, route_block<false>, dim3(1), dim3(1024), ws[i], (const float*)x, K, 1, logits, ids, wts, h, (const float*)y, (const float*)nw, 1e-6f, xo); };
  auto d = [&](int i) { launch(st, route_block<true>, dim3(1), dim3(1024), ws[i], (const float*)x, K, 1, logits, ids, wts, h, (const float*)y, (const float*)nw, 1e-6f, xo); };
  // same picks?
  a(0); CK(cudaStreamSynchronize(st)); std::vector<uint32_t> i1(K), i2(K); CK(cudaMemcpy(i1.data(), ids, K * 4, cudaMemcpyDeviceToHost));
  ar(0); CK(cudaStreamSynchronize(st)); CK(cudaMemcpy(i2.data(), ids, K * 4, cudaMemcpyDeviceToHost));
  printf("route_row picks %s the shared-memory version's\n", i1 == i2 ? "equal" : "DIFFER from");
  c(0); CK(cudaStreamSynchronize(st)); CK(cudaMemcpy(i2.data(), ids, K * 4, cudaMemcpyDeviceToHost));
  printf("one-block picks %s\n", i1 == i2 ? "equal" : "differ (sum order)");
  for (int rep = 0; rep < 2; rep++) {
    printf("route_gemv_q8        %6.2f us\n", time_graph(st, L, a));
    printf("route_gemv, old topk %6.2f us\n", time_graph(st, L, ar));
    printf("add_rms_norm         %6.2f us\n", time_graph(st, L, norm));
    printf("norm + route_gemv    %6.2f us (pair)\n", 2 * time_graph(st, 2 * L, [&](int i) { if (i % 2) a(i / 2); else norm(i / 2); }));
    printf("one block            %6.2f us\n", time_graph(st, L, c));
    printf("one block + norm     %6.2f us\n", time_graph(st, L, d));
  }
}
