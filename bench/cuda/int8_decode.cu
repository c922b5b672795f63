// One-token 4-bit products with the activations quantized to 8 bits and multiplied in integers
// (dp4a: four code x activation products per instruction, as llama.cpp's MMVQ does) against
// sluice's exact kernels (each code made a float and fused-multiplied: ~5 instructions a weight),
// on the Qwen3-30B-A3B decode shapes: the MoE's gate/up and down over 8 experts, and the dense
// q and o projections. Microseconds per launch in a graph of programmatic launches, over L
// distinct weights (L2 cold) and over one (L2 warm), and each variant's max|diff| / max|exact|.
//   i8   sluice.cu's `_i8` kernels: each thread quantizes the 16 activations it multiplies
//   pre  the activations come quantized (16 bytes, a scale and a sum per 16 columns)
#include "sluice_pdl.cu"  // sluice.cu with its programmatic-launch instructions (run.sh makes it)
#include "chain.h"
#include <random>
#include <vector>

// X16, quant16 and q4_dot_i8 are sluice.cu's (the `_i8` kernels').

// Quantized activations [cols / 16] of (16 codes as e0 o0 e1 o1, d, sum): what a producer would
// write beside its f32 output.
struct XQ {
    int4 codes;
    float2 ds;
};

extern "C" __global__ void quant_x16(const float* x, int cols, XQ* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i * 16 >= cols) return;
    float xv[16];
    load_floats<16>(x + i * 16, xv);
    const X16 q = quant16(xv);
    out[i].codes = make_int4(q.e[0], q.o[0], q.e[1], q.o[1]);
    out[i].ds = make_float2(q.d, q.sum);
}

// spread_dots with the integer dot; PRE: x is an XQ array.
template <int R, bool PRE>
__device__ __forceinline__ void spread_dots_i8(const Mat& m, long r0, int c, const void* x, float acc[R]) {
    uint32_t w[R][2];
    float s[R], b[R];
    const long words_per_row = m.cols / 8;
#pragma unroll
    for (int i = 0; i < R; i++) {
        const long r = min(r0 + i, (long)m.rows - 1);
        load_words<2>(reinterpret_cast<const uint32_t*>(m.data) + r * words_per_row + c / 8, w[i]);
        const long gi = (r * m.cols + c) >> m.gshift;
        s[i] = load_scalar(m.scales, m.sdt, gi);
        b[i] = load_scalar(m.biases, m.sdt, gi);
    }
    PDL_WAIT();
    X16 q;
    if constexpr (PRE) {
        const XQ v = reinterpret_cast<const XQ*>(x)[c / 16];
        q.e[0] = v.codes.x, q.o[0] = v.codes.y, q.e[1] = v.codes.z, q.o[1] = v.codes.w;
        q.d = v.ds.x, q.sum = v.ds.y;
    } else {
        float xv[16];
        load_floats<16>(reinterpret_cast<const float*>(x) + c, xv);
        q = quant16(xv);
    }
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = fmaf(s[i] * q.d, (float)q4_dot_i8(w[i], q), b[i] * q.sum);
}

template <bool PRE>
__device__ void spread_gemv_i8(const Mat& m, long block, const void* x, float* y) {
    constexpr int R = SPREAD_ROWS;
    __shared__ float part[R * 256 / 8];
    const int G = m.cols / SPREAD_CODES, groups = blockDim.x / G;
    const long r0 = (block * groups + threadIdx.x / G) * R;
    float acc[R];
    spread_dots_i8<R, PRE>(m, min(r0, (long)m.rows - 1), (threadIdx.x % G) * SPREAD_CODES, x, acc);
    const float total = spread_sum<R>(acc, G, part);
    const long r = block * groups * R + threadIdx.x;
    if (threadIdx.x < groups * R && r < m.rows) y[r] = total;
}

extern "C" __global__ void __launch_bounds__(256) gemv_q4_t1_s_pre(Mat w, const XQ* x, float* y) {
    PDL_LAUNCH_DEPENDENTS();
    spread_gemv_i8<true>(w, blockIdx.x, x, y);
}

// moe_gate_up_q4w (not shared) with the integer dot.
template <bool PRE>
__device__ void moe_gate_up_i8(const ExpertMats* experts, const uint32_t* ids, int K, const void* x, float* h, Ffn f) {
    constexpr int CW = 16, NW = CW / 8, R = 2;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int pair = blockIdx.y;
    const uint32_t e = ids[pair];
    const Mat g = experts[e].gate, u = experts[e].up;
    const long tok = pair / K;
    const long r0 = ((long)blockIdx.x * (blockDim.x / 32) + warp) * R;
    if (r0 >= g.rows) return;
    const int groups_per_row = g.cols >> g.gshift;
    const long words_per_row = g.cols / 8;
    float ag[R] = {0.0f, 0.0f}, au[R] = {0.0f, 0.0f};
#pragma unroll 2
    for (int c = lane * CW; c < g.cols; c += 32 * CW) {
        uint32_t wg[R][NW], wu[R][NW];
        float sg[R], bg[R], su[R], bu[R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            const long r = min(r0 + i, (long)g.rows - 1);
            load_words<NW>(reinterpret_cast<const uint32_t*>(g.data) + r * words_per_row + c / 8, wg[i]);
            load_words<NW>(reinterpret_cast<const uint32_t*>(u.data) + r * words_per_row + c / 8, wu[i]);
            const long gi = r * groups_per_row + (c >> g.gshift);
            sg[i] = load_scalar(g.scales, g.sdt, gi);
            bg[i] = load_scalar(g.biases, g.sdt, gi);
            su[i] = load_scalar(u.scales, u.sdt, gi);
            bu[i] = load_scalar(u.biases, u.sdt, gi);
        }
        X16 q;
        if constexpr (PRE) {
            const XQ v = reinterpret_cast<const XQ*>(x)[(tok * g.cols + c) / 16];
            q.e[0] = v.codes.x, q.o[0] = v.codes.y, q.e[1] = v.codes.z, q.o[1] = v.codes.w;
            q.d = v.ds.x, q.sum = v.ds.y;
        } else {
            float xv[CW];
            load_floats<CW>(reinterpret_cast<const float*>(x) + tok * g.cols + c, xv);
            q = quant16(xv);
        }
#pragma unroll
        for (int i = 0; i < R; i++) {
            ag[i] = fmaf(sg[i] * q.d, (float)q4_dot_i8(wg[i], q), fmaf(bg[i], q.sum, ag[i]));
            au[i] = fmaf(su[i] * q.d, (float)q4_dot_i8(wu[i], q), fmaf(bu[i], q.sum, au[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
        const float gs = warp_sum(ag[i]), us = warp_sum(au[i]);
        if (lane == 0 && r0 + i < g.rows) h[(long)pair * g.rows + r0 + i] = ffn_gate_up(f, e, g.rows, r0 + i, gs, us);
    }
}

extern "C" __global__ void __launch_bounds__(128) moe_gate_up_q4_w_pre(const ExpertMats* experts, const uint32_t* ids, int K, const XQ* x, float* h, Ffn f) {
    PDL_START();
    moe_gate_up_i8<true>(experts, ids, K, x, h, f);
}

static std::mt19937_64 rng(7);
static void* dev_bytes(size_t bytes) { std::vector<unsigned long long> h((bytes + 7) / 8); for (auto& b : h) b = rng(); void* p; CK(cudaMalloc(&p, bytes)); CK(cudaMemcpy(p, h.data(), bytes, cudaMemcpyHostToDevice)); return p; }
static float* dev_floats(size_t n) { std::vector<float> h(n); std::normal_distribution<float> nd(0.f, 1.f); for (auto& v : h) v = nd(rng); float* p; CK(cudaMalloc(&p, n * 4)); CK(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice)); return p; }
// MLX 4-bit, groups of 64, bf16 scales and biases (bias = -8 scale: centred like a trained model's).
static Mat q4mat(int rows, int cols) {
  Mat m{}; m.data = (const uint8_t*)dev_bytes((size_t)rows * cols / 2);
  size_t ng = (size_t)rows * cols / 64; std::vector<__nv_bfloat16> s(ng), b(ng);
  for (size_t i = 0; i < ng; i++) { float v = 0.002f + 0.01f * (rng() % 1000) / 1000.f; s[i] = __float2bfloat16(v); b[i] = __float2bfloat16(-8.f * v); }
  void *ps, *pb; CK(cudaMalloc(&ps, ng * 2)); CK(cudaMalloc(&pb, ng * 2)); CK(cudaMemcpy(ps, s.data(), ng * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(pb, b.data(), ng * 2, cudaMemcpyHostToDevice));
  m.scales = (const uint8_t*)ps; m.biases = (const uint8_t*)pb; m.rows = rows; m.cols = cols; m.fmt = FMT_AFFINE; m.bits = 4; m.group = 64; m.sdt = SDT_BF16; m.gshift = 6; return m;
}
static double rel_err(const float* a, const float* b, size_t n) {
  std::vector<float> x(n), y(n); CK(cudaDeviceSynchronize()); CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost));
  double mx = 0, err = 0; for (size_t i = 0; i < n; i++) { mx = fmax(mx, fabs(x[i])); err = fmax(err, fabs(x[i] - y[i])); } return err / mx;
}

int main() {
  const int L = 16, E = 128, K = 8, hidden = 2048, inter = 768;
  cudaStream_t st; CK(cudaStreamCreate(&st));
  Ffn f{}; // plain SwiGLU, no biases, no table prefetch
  std::vector<ExpertMats*> tables(L); std::vector<uint32_t*> ids(L); std::vector<float*> wts(L);
  for (int l = 0; l < L; l++) {
    // Only the K routed experts get weights of their own (the rest of the table repeats one).
    std::vector<uint32_t> id; while ((int)id.size() < K) { uint32_t e = rng() % E; bool dup = false; for (auto x : id) dup |= x == e; if (!dup) id.push_back(e); }
    std::vector<ExpertMats> t(E); for (auto e : id) { t[e].gate = q4mat(inter, hidden); t[e].up = q4mat(inter, hidden); t[e].down = q4mat(hidden, inter); }
    for (auto& e : t) if (e.gate.data == nullptr) e = t[id[0]];
    CK(cudaMalloc(&tables[l], E * sizeof(ExpertMats))); CK(cudaMemcpy(tables[l], t.data(), E * sizeof(ExpertMats), cudaMemcpyHostToDevice));
    std::vector<float> w(K, 0.125f);
    CK(cudaMalloc(&ids[l], K * 4)); CK(cudaMemcpy(ids[l], id.data(), K * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&wts[l], K * 4)); CK(cudaMemcpy(wts[l], w.data(), K * 4, cudaMemcpyHostToDevice));
  }
  float* x = dev_floats(4096);
  XQ* xq; CK(cudaMalloc(&xq, 4096 / 16 * sizeof(XQ))); quant_x16<<<4, 64>>>(x, 4096, xq);
  float *h, *h2, *out, *out2; CK(cudaMalloc(&h, K * inter * 4)); CK(cudaMalloc(&h2, K * inter * 4)); CK(cudaMalloc(&out, 4 * hidden * 4)); CK(cudaMalloc(&out2, 4 * hidden * 4));
  XQ* hq; CK(cudaMalloc(&hq, K * inter / 16 * sizeof(XQ)));
  printf("Qwen3-30B-A3B decode shapes, 4-bit groups of 64; us per launch, graph of %d programmatic launches; cold: %d distinct weights, warm: one\n", L, L);
  const unsigned gu_grid = (inter + 7) / 8;
  auto gu = [&](int i) { launch(st, moe_gate_up_q4_w, dim3(gu_grid, K), dim3(128), (const ExpertMats*)tables[i], (const uint32_t*)nullptr, -1, (const uint32_t*)ids[i], K, (const float*)x, h, f); };
  auto gu_i8 = [&](int i) { launch(st, moe_gate_up_q4_w_i8, dim3(gu_grid, K), dim3(128), (const ExpertMats*)tables[i], (const uint32_t*)nullptr, -1, (const uint32_t*)ids[i], K, (const float*)x, h2, f); };
  auto gu_pre = [&](int i) { launch(st, moe_gate_up_q4_w_pre, dim3(gu_grid, K), dim3(128), (const ExpertMats*)tables[i], (const uint32_t*)ids[i], K, (const XQ*)xq, h2, f); };
  auto dn = [&](int i) { launch(st, moe_down_q4_s384, dim3(hidden / SPREAD_ROWS, 1), dim3(K * (inter / 16)), (const ExpertMats*)tables[i], (const uint32_t*)nullptr, -1, (const uint32_t*)ids[i], (const float*)wts[i], K, (const float*)h, out, hidden, 0, f); };
  auto dn_i8 = [&](int i) { launch(st, moe_down_q4_s384_i8, dim3(hidden / SPREAD_ROWS, 1), dim3(K * (inter / 16)), (const ExpertMats*)tables[i], (const uint32_t*)nullptr, -1, (const uint32_t*)ids[i], (const float*)wts[i], K, (const float*)h, out2, hidden, 0, f); };
  for (int l = 0; l < 2; l++) { gu(0); gu_i8(0); }
  printf("  gate/up i8 vs exact: max|diff|/max = %.2e\n", rel_err(h, h2, K * inter));
  gu_pre(0); printf("  gate/up pre vs exact: max|diff|/max = %.2e\n", rel_err(h, h2, K * inter));
  dn(0); dn_i8(0); printf("  down i8 vs exact: max|diff|/max = %.2e\n", rel_err(out, out2, hidden));
  for (int rep = 0; rep < 2; rep++) {
    printf("  gate/up [8 x 2 x %d, %d] cold: exact %6.2f  i8 %6.2f  pre %6.2f   warm: exact %6.2f  i8 %6.2f  pre %6.2f\n", inter, hidden,
           time_graph(st, L, gu), time_graph(st, L, gu_i8), time_graph(st, L, gu_pre),
           time_graph(st, L, [&](int) { gu(0); }), time_graph(st, L, [&](int) { gu_i8(0); }), time_graph(st, L, [&](int) { gu_pre(0); }));
    printf("  down    [8 x %d, %d]     cold: exact %6.2f  i8 %6.2f                warm: exact %6.2f  i8 %6.2f\n", hidden, inter,
           time_graph(st, L, dn), time_graph(st, L, dn_i8), time_graph(st, L, [&](int) { dn(0); }), time_graph(st, L, [&](int) { dn_i8(0); }));
  }
  for (auto sh : {std::make_pair(4096, 2048), std::make_pair(2048, 4096), std::make_pair(5120, 2048)}) {
    const int rows = sh.first, cols = sh.second;
    std::vector<Mat> ms; for (int l = 0; l < L; l++) ms.push_back(q4mat(rows, cols));
    float *y, *y2; CK(cudaMalloc(&y, rows * 4)); CK(cudaMalloc(&y2, rows * 4));
    const int G = cols / 16; int groups = 1; for (int n = 256 / G; n >= 1; n--) if (n * G % 32 == 0) { groups = n; break; }
    const dim3 grid((rows + groups * SPREAD_ROWS - 1) / (groups * SPREAD_ROWS)), block(groups * G);
    auto ex = [&](int i) { launch(st, gemv_q4_t1_s, grid, block, ms[i], (const float*)x, y); };
    auto i8 = [&](int i) { launch(st, gemv_q4_t1_s_i8, grid, block, ms[i], (const float*)x, y2); };
    auto pre = [&](int i) { launch(st, gemv_q4_t1_s_pre, grid, block, ms[i], (const XQ*)xq, y2); };
    ex(0); i8(0); double e1 = rel_err(y, y2, rows); pre(0); double e2 = rel_err(y, y2, rows);
    printf("  dense [%d, %d] (err i8 %.1e pre %.1e)\n", rows, cols, e1, e2);
    for (int rep = 0; rep < 2; rep++)
      printf("      cold: exact %6.2f  i8 %6.2f  pre %6.2f   warm: exact %6.2f  i8 %6.2f  pre %6.2f\n",
             time_graph(st, L, ex), time_graph(st, L, i8), time_graph(st, L, pre),
             time_graph(st, L, [&](int) { ex(0); }), time_graph(st, L, [&](int) { i8(0); }), time_graph(st, L, [&](int) { pre(0); }));
    for (auto& m : ms) { cudaFree((void*)m.data); cudaFree((void*)m.scales); cudaFree((void*)m.biases); }
  }
  (void)hq;
}
