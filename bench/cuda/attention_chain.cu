// Decode attention's latency in a decode step: a CUDA graph of L dependent attention_decode_128
// launches with programmatic dependent launch (as the engine replays them; Qwen3-30B-A3B's 32
// query and 4 kv heads of 128, 8 splits), one f32 cache per layer at a fixed length, microseconds
// per launch. Variants leave parts out to place the time: the engine's call (q/k norms and rotary
// inside, new key appended, the cache length read and advanced on the device), without the
// device length (every block then skips the grid-wide count), and without the prelude too (q as
// it is, nothing appended).
// Then the engine's call with 1, 2, 4 and 8 splits (grid z; a block takes at least 64 positions,
// so at 100 positions only 2 blocks a head work and the rest only count themselves).
// H100, 2026-12-07 (us per launch at 100 / 200 / 1000 positions): engine 8.76 / 8.60 / 13.05,
// no device length 8.64 / 8.37 / 12.75, no prelude either 7.40 / 7.67 / 10.58; splits 1, 2, 4, 8
// at 100: 8.69, 8.44, 8.68, 8.76; at 200: 12.61, 10.93, 8.37, 8.60; at 1000: 35.49, 23.55,
// 17.16, 13.06. The grid-wide count costs 0.1-0.3 us and the split count nothing at short
// contexts: the kernel's own chain (q, keys and values, the warps' and splits' combine) is the
// time.
#include "sluice_pdl.cu"
#include "chain.h"
#include <vector>
#include <random>

// Puts every layer's device length back to n (the start of a replay).
__global__ void reset_lengths(int* lens, int layers, int n) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x < layers) lens[threadIdx.x] = n;
}

static float* dev_floats(size_t n, std::mt19937_64& rng, float scale) {
  std::vector<float> h(n); for (auto& v : h) v = ((rng() % 2001) / 1000.f - 1.f) * scale;
  float* p; CK(cudaMalloc(&p, n * 4)); CK(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice)); return p;
}
int main() {
  const int L = 48, H = 32, KVH = 4, HD = 128, SPLITS = 8, CAP = 4096;
  std::mt19937_64 rng(7);
  cudaStream_t st; CK(cudaStreamCreate(&st));
  float* q = dev_floats(H * HD, rng, 1.f); float* k = dev_floats(KVH * HD, rng, 1.f); float* v = dev_floats(KVH * HD, rng, 1.f);
  float* wq = dev_floats(HD, rng, 1.f); float* wk = dev_floats(HD, rng, 1.f);
  std::vector<float> f(HD / 2); for (int i = 0; i < HD / 2; i++) f[i] = powf(1e6f, -2.f * i / HD);
  float* inv_freq; CK(cudaMalloc(&inv_freq, HD / 2 * 4)); CK(cudaMemcpy(inv_freq, f.data(), HD / 2 * 4, cudaMemcpyHostToDevice));
  std::vector<float*> keys(L), values(L);
  for (int l = 0; l < L; l++) { keys[l] = dev_floats((size_t)CAP * KVH * HD, rng, 1.f); values[l] = dev_floats((size_t)CAP * KVH * HD, rng, 1.f); }
  float *out, *partial; uint32_t *done, *all_done; int* lens;
  CK(cudaMalloc(&out, H * HD * 4)); CK(cudaMalloc(&partial, H * 32 * (HD + 2) * 4));
  CK(cudaMalloc(&done, H * 4)); CK(cudaMemset(done, 0, H * 4)); CK(cudaMalloc(&all_done, 4)); CK(cudaMemset(all_done, 0, 4));
  CK(cudaMalloc(&lens, L * 4));
  const float scale = 1.0f / sqrtf((float)HD);
  for (int n : {100, 200, 1000}) {
    // with a device length: total = 1 new row, the kernel adds the cache's length
    int splits = SPLITS;
    auto engine = [&](int i) {
      if (i == 0) launch(st, reset_lengths, dim3(1), dim3(64), lens, L, n - 1);
      launch(st, attention_decode_128, dim3(H, 1, splits), dim3(ATTN_WARPS * 32), (const float*)q, (const float*)k, (const float*)v, (const float*)wq, (const float*)wk, (const float*)inv_freq, 1e-6f, HD, keys[i], values[i], out, H, KVH, 1, 1, scale, partial, done, lens + i, all_done, 0, (const float*)nullptr);
    };
    auto no_len = [&](int i) {
      launch(st, attention_decode_128, dim3(H, 1, SPLITS), dim3(ATTN_WARPS * 32), (const float*)q, (const float*)k, (const float*)v, (const float*)wq, (const float*)wk, (const float*)inv_freq, 1e-6f, HD, keys[i], values[i], out, H, KVH, n, 1, scale, partial, done, (int*)nullptr, all_done, 0, (const float*)nullptr);
    };
    auto bare = [&](int i) {
      launch(st, attention_decode_128, dim3(H, 1, SPLITS), dim3(ATTN_WARPS * 32), (const float*)q, (const float*)nullptr, (const float*)nullptr, (const float*)nullptr, (const float*)nullptr, (const float*)nullptr, 0.f, 0, keys[i], values[i], out, H, KVH, n, 1, scale, partial, done, (int*)nullptr, all_done, 0, (const float*)nullptr);
    };
    for (int rep = 0; rep < 2; rep++)
      printf("%4d positions: engine %6.2f us   no device length %6.2f us   no prelude either %6.2f us\n", n, time_graph(st, L, engine), time_graph(st, L, no_len), time_graph(st, L, bare));
    for (int s : {1, 2, 4, 8}) {
      splits = s;
      printf("%4d positions, %d splits: engine %6.2f us\n", n, s, time_graph(st, L, engine));
    }
  }
}
