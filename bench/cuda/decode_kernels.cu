// The real decode kernels of sluice.cu, timed alone on realistic layouts: a CUDA graph of one
// kernel over L layers (distinct weights, so L2 is cold), microseconds per launch.
#include "sluice.cu"  // crates/sluice-cuda/kernels (run.sh passes -I)
#include <cstdio>
#include <vector>
#include <random>
#include <cstring>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
static std::mt19937_64 rng(7);
static void* dev_random(size_t bytes) { std::vector<unsigned char> h(bytes); for (auto& b : h) b = rng(); void* p; CK(cudaMalloc(&p, bytes)); CK(cudaMemcpy(p, h.data(), bytes, cudaMemcpyHostToDevice)); return p; }
static void* dev_scales(size_t n) { std::vector<__nv_bfloat16> h(n); for (auto& v : h) v = __float2bfloat16((rng() % 1000) / 1000.f * 0.02f - 0.01f); void* p; CK(cudaMalloc(&p, n * 2)); CK(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice)); return p; }
static Mat q4mat(int rows, int cols) { Mat m{}; m.data = (const uint8_t*)dev_random((size_t)rows * cols / 2); m.scales = (const uint8_t*)dev_scales((size_t)rows * cols / 64); m.biases = (const uint8_t*)dev_scales((size_t)rows * cols / 64); m.rows = rows; m.cols = cols; m.fmt = FMT_AFFINE; m.bits = 4; m.group = 64; m.sdt = SDT_BF16; m.gshift = 6; return m; }
template <class F> static double time_graph(cudaStream_t st, int n, F launch) {
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal)); for (int i = 0; i < n; i++) launch(i); CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
  for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, st));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0, st); const int reps = 20; for (int w = 0; w < reps; w++) CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st);
  CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); cudaGraphExecDestroy(ge); cudaGraphDestroy(g); return ms * 1000 / reps / n;
}
int main(int argc, char** argv) {
  const int L = 8, E = 128, K = 8, hidden = 2048, inter = argc > 1 ? atoi(argv[1]) : 768;
  cudaStream_t st; CK(cudaStreamCreate(&st));
  std::vector<ExpertMats*> tables(L); std::vector<uint32_t*> ids(L); std::vector<float*> wts(L);
  for (int l = 0; l < L; l++) {
    std::vector<ExpertMats> t(E); for (auto& e : t) { e.gate = q4mat(inter, hidden); e.up = q4mat(inter, hidden); e.down = q4mat(hidden, inter); }
    CK(cudaMalloc(&tables[l], E * sizeof(ExpertMats))); CK(cudaMemcpy(tables[l], t.data(), E * sizeof(ExpertMats), cudaMemcpyHostToDevice));
    std::vector<uint32_t> id; while ((int)id.size() < K) { uint32_t e = rng() % E; bool dup = false; for (auto x : id) dup |= x == e; if (!dup) id.push_back(e); }
    std::vector<float> w(K, 0.125f);
    CK(cudaMalloc(&ids[l], K * 4)); CK(cudaMemcpy(ids[l], id.data(), K * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&wts[l], K * 4)); CK(cudaMemcpy(wts[l], w.data(), K * 4, cudaMemcpyHostToDevice));
  }
  float* x = (float*)dev_scales(hidden * 2); // any bits: as floats they are finite enough for timing
  std::vector<float> hx(hidden); for (auto& v : hx) v = (rng() % 2000) / 1000.f - 1.f; CK(cudaMemcpy(x, hx.data(), hidden * 4, cudaMemcpyHostToDevice));
  float *h, *h2, *out, *out2; CK(cudaMalloc(&h, K * inter * 4)); CK(cudaMalloc(&h2, K * inter * 4)); CK(cudaMalloc(&out, hidden * 4)); CK(cudaMalloc(&out2, hidden * 4));
  printf("MoE decode, hidden %d, inter %d, top %d of %d, %d layers (%.1f MB gate/up, %.1f MB down per launch)\n", hidden, inter, K, E, L, 2.0 * K * inter * hidden * 0.5625 / 1e6, 1.0 * K * inter * hidden * 0.5625 / 1e6);
  auto gu_w = [&](int i) { moe_gate_up_q4_w<<<dim3((inter + 7) / 8, K), 128, 0, st>>>(tables[i], nullptr, -1, ids[i], K, x, h); };
  auto dn_w = [&](int i) { moe_down_q4_w<<<dim3(hidden / MOE_DOWN_W_ROWS, 1), 128, 0, st>>>(tables[i], nullptr, -1, ids[i], wts[i], K, h, out, hidden, 0); };
  auto dn_s = [&](int i) { moe_down_q4_s<<<dim3(hidden / SPREAD_ROWS, 1), K * (inter / 16), 0, st>>>(tables[i], nullptr, -1, ids[i], wts[i], K, h, out2, hidden, 0); };
  // What the engine runs for blocks of up to 384 threads (four blocks per multiprocessor).
  auto dn_s384 = [&](int i) { moe_down_q4_s384<<<dim3(hidden / SPREAD_ROWS, 1), K * (inter / 16), 0, st>>>(tables[i], nullptr, -1, ids[i], wts[i], K, h, out2, hidden, 0); };
  // correctness: the same down projections (to a tolerance) from both
  gu_w(0); dn_w(0); dn_s(0); CK(cudaStreamSynchronize(st));
  std::vector<float> c(hidden), d(hidden); CK(cudaMemcpy(c.data(), out, hidden * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(d.data(), out2, hidden * 4, cudaMemcpyDeviceToHost));
  double mx = 0, err = 0; for (int i = 0; i < hidden; i++) { mx = fmax(mx, fabs(c[i])); err = fmax(err, fabs(c[i] - d[i])); } printf("  down: max|w - s| / max|w| = %.1e\n", err / mx);
  for (int rep = 0; rep < 2; rep++) {
    printf("  gate_up q4_w %6.2f us\n", time_graph(st, L, gu_w));
    printf("  down    q4_w %6.2f us   q4_s %6.2f us", time_graph(st, L, dn_w), time_graph(st, L, dn_s));
    if (K * (inter / 16) <= 384) printf("   q4_s384 %6.2f us", time_graph(st, L, dn_s384));
    printf("\n");
  }
  // dense: q [4096, 2048], o [2048, 4096] (distinct per layer)
  for (auto sh : {std::make_pair(4096, 2048), std::make_pair(2048, 4096), std::make_pair(512, 2048), std::make_pair(12352, 2048), std::make_pair(151936, 2048)}) {
    if (sh.first > 100000 && inter != 768) continue;
    std::vector<Mat> ms; for (int l = 0; l < L; l++) ms.push_back(q4mat(sh.first, sh.second));
    float* y; CK(cudaMalloc(&y, sh.first * 4));
    int G2 = sh.second / 16, g2 = 0; for (int n = 256 / G2; n >= 1; n--) if (n * G2 % 32 == 0) { g2 = n; break; }
    double tb = time_graph(st, L, [&](int i) { gemv_q4_t1_b<<<sh.first, 128, 0, st>>>(ms[i], x, y); });
    double ts = time_graph(st, L, [&](int i) { gemv_q4_t1_s<<<(sh.first + g2 * SPREAD_ROWS - 1) / (g2 * SPREAD_ROWS), g2 * G2, 0, st>>>(ms[i], x, y); });
    double tr = time_graph(st, L, [&](int i) { gemv_q4_t1_r2<<<(sh.first + 15) / 16, 256, 0, st>>>(ms[i], x, y); });
    printf("  dense [%d, %d]: t1_b %6.2f us   t1_s %6.2f us   t1_r2 %6.2f us\n", sh.first, sh.second, tb, ts, tr);
    for (auto& m : ms) { cudaFree((void*)m.data); cudaFree((void*)m.scales); cudaFree((void*)m.biases); }
  }
}
