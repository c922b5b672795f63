// sluice's CUDA kernels. Compiled ahead to PTX (compute_80, PTX ISA 8.4) by
// scripts/cuda/build_kernels.py; the PTX is committed and embedded in the binary, so building sluice
// needs no CUDA toolkit and the driver JIT-compiles it for the GPU at hand.
//
// Conventions (those of sluice_backend::Backend): activations are f32 [rows, cols] row-major, one
// row per token; weights keep their stored format (dense f32/f16/bf16; MLX affine: `bits`-bit
// codes packed little-endian in u32 words, per group of `group` columns `w = scale * q + bias`;
// mxfp4: FP4 E2M1 codes two per byte, low nibble first, times an E8M0 scale per 32 columns).
// Everything accumulates in f32.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
// NVRTC has no libc headers; the fixed-width types it needs:
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (compute capability 9.0 on): in a graph, a kernel may start while
// the one before it finishes, and waits for it (and its memory) at PDL_WAIT. Every kernel lets the
// next one start at once (PDL_LAUNCH_DEPENDENTS) and waits before it touches memory that earlier
// kernels write; a few load their weights first. The PTX targets 8.0, where these instructions do
// not exist: they are comments here, and the loader (kernels.rs) makes them instructions on 9.0
// and newer. Where no launch is programmatic they return at once.
#define PDL_WAIT() asm volatile("// sluice-pdl: griddepcontrol.wait;" ::: "memory")
#define PDL_LAUNCH_DEPENDENTS() asm volatile("// sluice-pdl: griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_START() \
    do { \
        PDL_LAUNCH_DEPENDENTS(); \
        PDL_WAIT(); \
    } while (0)

// Which kernels fetch, before they wait, what an earlier graph launch left for them: weights into
// registers, and into L2 what earlier kernels may still be writing (a prefetch cannot read a stale
// value). Bits: EARLY_NORM (norm weights), EARLY_ATTN (attention's norm weights and frequencies,
// its loads after the wait issued together), EARLY_KV (attention's KV rows into L2), EARLY_TABLE
// (the MoE's expert table into L2), EARLY_DELTA (the DeltaNet state and window into L2). Set by
// the loader (kernels.rs; SLUICE_CUDA_EARLY=MASK, 0 for none, to measure against).
enum { EARLY_NORM = 1, EARLY_ATTN = 2, EARLY_KV = 4, EARLY_TABLE = 8, EARLY_DELTA = 16 };
__constant__ int early_loads = 31;

// Asks L2 for the line at p (nothing is read into registers: safe before PDL_WAIT on any address
// of a live allocation).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// ------------------------------------------------------------------------------------------------
// Weights
// ------------------------------------------------------------------------------------------------

enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_AFFINE = 3, FMT_MXFP4 = 4 };
enum { SDT_F32 = 0, SDT_F16 = 1, SDT_BF16 = 2 };

// A weight matrix [rows, cols] in device memory (mirrors the Rust `Mat`). cols % 8 == 0 and, for
// affine, group % 8 == 0, so 8 consecutive weights never straddle a group or a row. Mxfp4: bits 4,
// group 32 (gshift 5), `scales` one E8M0 byte per group, no biases.
struct Mat {
    const uint8_t* data;
    const uint8_t* scales;
    const uint8_t* biases;
    int rows;
    int cols;
    int fmt;
    int bits;
    int group;
    int sdt;
    // log2(group) (groups are powers of two): scale indices without a division.
    int gshift;
    int pad;
};

// The three projections of one routed expert.
struct ExpertMats {
    Mat gate;
    Mat up;
    Mat down;
};

// How routed experts compute beyond down(silu(gate x) * up x) (sluice_backend::ExpertFfn, mirrors
// the Rust `Ffn`): per-expert biases indexed by expert id (null: none), added to gate and up before
// the activation and to the down projection's output before the routing weight, for the experts
// below `experts` (the host checks that every expert a call computes is); and the activation,
// SwiGLU or (clamped) gpt-oss's with alpha and limit.
struct Ffn {
    const float* gate_bias;  // [experts, inter]
    const float* up_bias;    // [experts, inter]
    const float* down_bias;  // [experts, hidden]
    float alpha;
    float limit;
    int clamped;
    int experts;
    // Entries of the launch's expert table (what prefetch_table asks L2 for; 0: nothing).
    int table;
    int pad;
};

__device__ __forceinline__ float swiglu1(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// The activation of one gate value g and one up value u: silu(g) u, or with `clamped`
// g' sigmoid(alpha g') (u' + 1) for g' = min(g, limit), u' = clamp(u, -limit, limit).
__device__ __forceinline__ float ffn_act(Ffn f, float g, float u) {
    if (f.clamped) {
        g = fminf(g, f.limit);
        u = fminf(fmaxf(u, -f.limit), f.limit);
        return g / (1.0f + expf(-f.alpha * g)) * (u + 1.0f);
    }
    return swiglu1(g, u);
}

// Row r of expert e's gate and up products (g, u) with their biases, through the activation; inter:
// the rows of gate (and up).
__device__ __forceinline__ float ffn_gate_up(Ffn f, uint32_t e, long inter, long r, float g,
                                             float u) {
    if (f.gate_bias != nullptr && e < (uint32_t)f.experts) {
        g += f.gate_bias[(long)e * inter + r];
        u += f.up_bias[(long)e * inter + r];
    }
    return ffn_act(f, g, u);
}

// Row r of expert e's down product d with its bias; hidden: the rows of down.
__device__ __forceinline__ float ffn_down(Ffn f, uint32_t e, long hidden, long r, float d) {
    return f.down_bias != nullptr && e < (uint32_t)f.experts ? d + f.down_bias[(long)e * hidden + r]
                                                              : d;
}

__device__ __forceinline__ float load_scalar(const uint8_t* p, int dt, long i) {
    if (dt == SDT_F32) return reinterpret_cast<const float*>(p)[i];
    if (dt == SDT_F16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
}

// Exact conversion of a small unsigned integer to float: OR it into the mantissa of 2^23.
__device__ __forceinline__ float u2f(uint32_t q) {
    return __uint_as_float(0x4B000000u | q) - 8388608.0f;
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// The FP4 (E2M1) code in the low 4 bits of q as f32, exactly (sluice_backend::FP4_E2M1): bit 3 the
// sign, bits 2-1 the exponent e, bit 0 the mantissa m. A normal code (e > 0) is
// 2^(e - 1) (1 + m / 2): f32 exponent e + 126 and top mantissa bit m, that is
// 0x3F000000 + ((q & 7) << 22); the two subnormal codes are 0 and 0.5 (0x3F000000). No f32
// subnormal is involved.
__device__ __forceinline__ float fp4_e2m1(uint32_t q) {
    const uint32_t mag = q & 7u;
    const uint32_t bits = mag >= 2u ? 0x3F000000u + (mag << 22) : mag * 0x3F000000u;
    return __uint_as_float(bits | ((q & 8u) << 28));
}

// The scale an E8M0 byte e stands for, 2^(e - 127), as sluice_backend::e8m0_to_f32 has it (0: the
// subnormal 2^-127; 255: infinity).
__device__ __forceinline__ float e8m0(uint32_t e) {
    return __uint_as_float(e == 0u ? 0x00400000u : e << 23);
}

// Mxfp4 weights [c, c + 8) of row r (c % 8 == 0: one u32 of codes, one scale) as f32, exactly.
__device__ __forceinline__ void load8_mxfp4(const Mat& m, long r, int c, float w[8]) {
    const long at = r * m.cols + c;
    const uint32_t v = __ldg(reinterpret_cast<const uint32_t*>(m.data) + at / 8);
    const float s = e8m0(__ldg(m.scales + (at >> 5)));
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = fp4_e2m1(v >> (4 * j)) * s;
}

// Weights [c, c + 8) of row r as f32 (c % 8 == 0), dense or affine (the kind-generic kernels'
// formats: the host never gives them mxfp4 weights, which have kernels of their own; load8_any
// takes every format).
__device__ __forceinline__ void load8(const Mat& m, long r, int c, float w[8]) {
    if (m.fmt == FMT_AFFINE) {
        const long row_words = (long)m.cols * m.bits / 32;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(m.data) + r * row_words;
        const long g = (r * m.cols + c) >> m.gshift;
        const float s = load_scalar(m.scales, m.sdt, g);
        const float b = load_scalar(m.biases, m.sdt, g);
        if (m.bits == 4) {
            const uint32_t v = words[c / 8];
#pragma unroll
            for (int j = 0; j < 8; j++) w[j] = fmaf(s, u2f((v >> (4 * j)) & 15u), b);
        } else if (m.bits == 8) {
            const uint2 v = reinterpret_cast<const uint2*>(words)[c / 8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                w[j] = fmaf(s, u2f((v.x >> (8 * j)) & 255u), b);
                w[4 + j] = fmaf(s, u2f((v.y >> (8 * j)) & 255u), b);
            }
        } else {
            const uint32_t mask = (1u << m.bits) - 1u;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const long bit = (long)(c + j) * m.bits;
                const long wi = bit / 32;
                const int sh = (int)(bit % 32);
                uint32_t v = words[wi] >> sh;
                if (sh + m.bits > 32) v |= words[wi + 1] << (32 - sh);
                w[j] = fmaf(s, u2f(v & mask), b);
            }
        }
    } else if (m.fmt == FMT_F32) {
        const float4* p = reinterpret_cast<const float4*>(m.data) + (r * m.cols + c) / 4;
        const float4 a = p[0], b = p[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else {
        const uint4 v = reinterpret_cast<const uint4*>(m.data)[(r * m.cols + c) / 8];
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
        if (m.fmt == FMT_BF16) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                w[2 * j] = bf16_lo(u[j]);
                w[2 * j + 1] = bf16_hi(u[j]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const __half2 h = *reinterpret_cast<const __half2*>(&u[j]);
                const float2 f = __half22float2(h);
                w[2 * j] = f.x;
                w[2 * j + 1] = f.y;
            }
        }
    }
}

// load8 for any format, mxfp4 included (embeddings, matmul_heads).
__device__ __forceinline__ void load8_any(const Mat& m, long r, int c, float w[8]) {
    if (m.fmt == FMT_MXFP4) load8_mxfp4(m, r, c, w);
    else load8(m, r, c, w);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads (every thread gets the result).
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) / 32;
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

// Weight kinds the hot kernels are compiled for (the host picks by format), so that the inner
// loop has no format switch: 4-bit and 8-bit affine, bf16, mxfp4, and everything else through
// load8.
enum { K_GENERIC = 0, K_Q4 = 1, K_Q8 = 2, K_BF16 = 3, K_MXFP4 = 4 };

template <int K>
__device__ __forceinline__ void load8k(const Mat& m, long r, int c, float w[8]) {
    if constexpr (K == K_Q4) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(m.data) + r * (m.cols / 8);
        const long g = (r * m.cols + c) >> m.gshift;
        const float s = load_scalar(m.scales, m.sdt, g);
        const float b = load_scalar(m.biases, m.sdt, g);
        const uint32_t v = __ldg(words + c / 8);
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = fmaf(s, u2f((v >> (4 * j)) & 15u), b);
    } else if constexpr (K == K_Q8) {
        const uint2* p = reinterpret_cast<const uint2*>(m.data + r * (long)m.cols);
        const long g = (r * m.cols + c) >> m.gshift;
        const float s = load_scalar(m.scales, m.sdt, g);
        const float b = load_scalar(m.biases, m.sdt, g);
        const uint2 v = __ldg(p + c / 8);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            w[j] = fmaf(s, u2f((v.x >> (8 * j)) & 255u), b);
            w[4 + j] = fmaf(s, u2f((v.y >> (8 * j)) & 255u), b);
        }
    } else if constexpr (K == K_BF16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(m.data) + (r * m.cols + c) / 8);
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            w[2 * j] = bf16_lo(u[j]);
            w[2 * j + 1] = bf16_hi(u[j]);
        }
    } else if constexpr (K == K_MXFP4) {
        load8_mxfp4(m, r, c, w);
    } else {
        load8(m, r, c, w);
    }
}

// The dots of rows r0 .. r0 + R of `m` with T vectors x[t * x_stride ..] (T <= 8), summed over a
// warp: every lane takes chunks of 8 weights in turn; the R rows' loads go out together. Rows
// past the end repeat the last row (their results are not written).
template <int K, int T, int R>
__device__ __forceinline__ void warp_rows_dot(const Mat& m, long r0, const float* x, long x_stride,
                                              float acc[R][T]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[i][t] = 0.0f;
    for (int c = lane * 8; c < m.cols; c += 32 * 8) {
        float w[R][8];
#pragma unroll
        for (int i = 0; i < R; i++) load8k<K>(m, min(r0 + i, (long)m.rows - 1), c, w[i]);
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float4* xp = reinterpret_cast<const float4*>(x + t * x_stride + c);
            const float4 a = xp[0], b = xp[1];
#pragma unroll
            for (int i = 0; i < R; i++) {
                float s = acc[i][t];
                s = fmaf(w[i][0], a.x, s); s = fmaf(w[i][1], a.y, s);
                s = fmaf(w[i][2], a.z, s); s = fmaf(w[i][3], a.w, s);
                s = fmaf(w[i][4], b.x, s); s = fmaf(w[i][5], b.y, s);
                s = fmaf(w[i][6], b.z, s); s = fmaf(w[i][7], b.w, s);
                acc[i][t] = s;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[i][t] = warp_sum(acc[i][t]);
}

// ------------------------------------------------------------------------------------------------
// Matrix products
// ------------------------------------------------------------------------------------------------

// y[T, rows] = x[T, cols] W^T for T <= 8: each warp computes R consecutive rows, 8 warps a block.
// (Measured on an H100 with 4-bit weights: R = 2 wins on large matrices, R = 1 on small ones;
// a switch on the format inside the loop cost 2.5x.)
template <int K, int T, int R>
__device__ void gemv(const Mat& w, const float* x, float* y) {
    const long r0 = ((long)blockIdx.x * 8 + threadIdx.x / 32) * R;
    if (r0 >= w.rows) return;
    float acc[R][T];
    warp_rows_dot<K, T, R>(w, r0, x, w.cols, acc);
    if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int i = 0; i < R; i++)
            if (r0 + i < w.rows)
#pragma unroll
                for (int t = 0; t < T; t++) y[t * (long)w.rows + r0 + i] = acc[i][t];
    }
}

#define GEMV(K, KN, T, R) \
    extern "C" __global__ void __launch_bounds__(256) gemv_##KN##_t##T##_r##R(Mat w, const float* x, \
                                                                            float* y) { PDL_START(); \
        gemv<K, T, R>(w, x, y); \
    }
// One token, two rows per warp: what large matrices use (the block-per-row kernels below take the
// rest).
GEMV(K_GENERIC, generic, 1, 2) GEMV(K_Q4, q4, 1, 2) GEMV(K_Q8, q8, 1, 2) GEMV(K_BF16, bf16, 1, 2)
GEMV(K_MXFP4, mxfp4, 1, 2)

// ---- tensor-core products for many tokens (prefill) ----
//
// y = x W^T on mma.sync m16n8k8 with tf32 operands. Every f32 operand v (a dequantised weight, an
// activation) is split into hi = tf32(v) and lo = tf32(v - hi), and the product is accumulated in
// f32 as lo*hi + hi*lo + hi*hi ("3xTF32"): 22 significant bits per operand and exact products, so
// the result is as close to the f32 reference as an f32 dot in another order (one tf32 product
// alone is off by ~1e-3 relative), at tensor-core speed. A block of 4 warps computes 64 weight
// rows x 64 tokens, 16 columns at a time, each warp 32 rows x 32 tokens; weights are dequantised
// once per tile into shared memory.

#define TC_BM 64
#define TC_BN 64
#define TC_BK 16
// Words per shared tile row: 16 of data and 4 of padding, so that the fragment loads of a warp
// (8 rows x 4 words) hit 32 different banks.
#define TC_LD 20

__device__ __forceinline__ uint32_t to_tf32(float v) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

// Eight consecutive values into a tile row, as eight words of hi and eight of lo.
__device__ __forceinline__ void store_split8(const float v[8], uint32_t* hi, uint32_t* lo) {
    uint32_t h[8], l[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        h[j] = to_tf32(v[j]);
        l[j] = to_tf32(v[j] - __uint_as_float(h[j]));
    }
    reinterpret_cast<uint4*>(hi)[0] = make_uint4(h[0], h[1], h[2], h[3]);
    reinterpret_cast<uint4*>(hi)[1] = make_uint4(h[4], h[5], h[6], h[7]);
    reinterpret_cast<uint4*>(lo)[0] = make_uint4(l[0], l[1], l[2], l[3]);
    reinterpret_cast<uint4*>(lo)[1] = make_uint4(l[4], l[5], l[6], l[7]);
}

// c += a b for a 16x8 (rows x columns) and b 8x8 (columns x tokens).
__device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Where the mma accumulator value acc[.][i][j][e] of a block's tile belongs (tc_tile, tq_tile: a
// warp holds MI 16-row slices x NJ 8-token slices, the warps lie in rows of WN): its row within
// the block's rows and its token within the block's tokens.
template <int MI, int NJ, int WN>
__device__ __forceinline__ int frag_row(int i, int e) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    return (warp / WN) * 16 * MI + i * 16 + lane / 4 + (e >= 2 ? 8 : 0);
}
template <int MI, int NJ, int WN>
__device__ __forceinline__ int frag_token(int j, int e) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    return (warp % WN) * 8 * NJ + j * 8 + (lane % 4) * 2 + (e & 1);
}

// The shared tiles of a block: NM weight tiles and one token tile, each as hi and lo.
template <int NM>
struct TcTiles {
    uint32_t a[NM][2][TC_BM][TC_LD];
    uint32_t b[2][TC_BN][TC_LD];
};

// The block's products of rows r0 .. r0 + 64 of each of the NM matrices m (same shape) with the 64
// token rows xrow (nullptr: padding, read as zeros). acc[mi][i][j] is the mma accumulator of the
// warp's 16-row slice i and 8-token slice j: see frag_row / frag_token for where its values belong.
template <int K, int NM>
__device__ __forceinline__ void tc_tile(const Mat* m, long r0, const float* const* xrow,
                                        TcTiles<NM>& s, float acc[NM][2][4][4]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t4 = lane % 4;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    const int cols = m[0].cols;
#pragma unroll
    for (int mi = 0; mi < NM; mi++)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][i][j][e] = 0.0f;
    // Each thread fills one chunk of 8 columns of one row (or token) of every tile.
    const int r = threadIdx.x / 2, ch = (threadIdx.x % 2) * 8;
    for (int k0 = 0; k0 < cols; k0 += TC_BK) {
        const int c = k0 + ch;
#pragma unroll
        for (int mi = 0; mi < NM; mi++) {
            float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (c < cols) load8k<K>(m[mi], min(r0 + r, (long)m[mi].rows - 1), c, v);
            store_split8(v, &s.a[mi][0][r][ch], &s.a[mi][1][r][ch]);
        }
        {
            float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float* xr = xrow[r];
            if (xr != nullptr && c < cols) {
                const float4 a = *reinterpret_cast<const float4*>(xr + c);
                const float4 b = *reinterpret_cast<const float4*>(xr + c + 4);
                v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
                v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            }
            store_split8(v, &s.b[0][r][ch], &s.b[1][r][ch]);
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < TC_BK / 8; ks++) {
            // Fragment words: columns t4 and t4 + 4 of this 8-column step.
            const int w0 = ks * 8 + t4, w1 = w0 + 4;
            uint32_t bf[2][4][2];
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint32_t* row = s.b[h][wn + j * 8 + g];
                    bf[h][j][0] = row[w0];
                    bf[h][j][1] = row[w1];
                }
#pragma unroll
            for (int mi = 0; mi < NM; mi++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    uint32_t af[2][4];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint32_t* top = s.a[mi][h][wm + i * 16 + g];
                        const uint32_t* bottom = s.a[mi][h][wm + i * 16 + g + 8];
                        af[h][0] = top[w0];
                        af[h][1] = bottom[w0];
                        af[h][2] = top[w1];
                        af[h][3] = bottom[w1];
                    }
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        mma_tf32(acc[mi][i][j], af[1], bf[0][j]);
                        mma_tf32(acc[mi][i][j], af[0], bf[1][j]);
                        mma_tf32(acc[mi][i][j], af[0], bf[0][j]);
                    }
                }
        }
        __syncthreads();
    }
}

// Stores a block's 64 x 64 product tile (acc as tc_tile's and tq_tile's, warps 2 x 2): row r0 + i
// of token n0 + n at y[(n0 + n) rows + r0 + i], for rows below `rows` and tokens below `ntok`.
__device__ __forceinline__ void gemm_store_tile(const float (&acc)[2][4][4], long r0, long n0,
                                                long rows, long ntok, float* y) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const long r = r0 + frag_row<2, 4, 2>(i, e), n = n0 + frag_token<2, 4, 2>(j, e);
                if (r < rows && n < ntok) y[n * rows + r] = acc[i][j][e];
            }
}

// y[ntok, rows] = x[ntok, cols] W^T. Grid (rows / 64, ntok / 64), 128 threads.
template <int K>
__device__ void gemm_tc(const Mat& w, const float* x, float* y, int ntok) {
    __shared__ TcTiles<1> s;
    __shared__ const float* xrow[TC_BN];
    const long r0 = (long)blockIdx.x * TC_BM, n0 = (long)blockIdx.y * TC_BN;
    if (threadIdx.x < TC_BN) {
        const long n = n0 + threadIdx.x;
        xrow[threadIdx.x] = n < ntok ? x + n * w.cols : nullptr;
    }
    __syncthreads();
    float acc[1][2][4][4];
    tc_tile<K, 1>(&w, r0, xrow, s, acc);
    gemm_store_tile(acc[0], r0, n0, w.rows, ntok, y);
}

#define GEMM_TC(K, KN) \
    extern "C" __global__ void __launch_bounds__(128) gemm_tc_##KN(Mat w, const float* x, float* y, \
                                                                   int ntok) { PDL_START(); \
        gemm_tc<K>(w, x, y, ntok); \
    }
GEMM_TC(K_GENERIC, generic)

// ---- exact-weight tensor-core products (4- and 8-bit affine, bf16 and mxfp4 weights) ----
//
// These weights reach the tensor cores exactly: an affine code q (0..255) and a bf16 weight are bf16
// values, and so is an mxfp4 weight (an FP4 value, 2 significant bits, times a power of two: its
// scale is folded in when the tile is loaded, and it then computes as bf16 weights do). Only the
// activation is split, into TQ_PARTS bf16 parts (x = hi + lo to 16 bits), and for affine weights
// y = sum over groups of s (q . x) + b (sum x), the q . x of a group accumulated by mma.sync
// m16n8k16 in f32 and scaled once per group: two bf16 products per 16 columns where the 3xTF32
// path needs six tf32 ones, and no split of the weights. Groups must be multiples of the
// 32-column tile (mlx's 32, 64, 128). A block of 4 warps computes BM weight
// rows x BN tokens; a warp MI 16-row slices x NJ 8-token slices; the warps lie WM x WN.

#define TQ_BK 32
// bf16 parts per activation (TQ_PARTS x 8 significant bits): two, 16 bits, a relative error of at
// most 2^-17 per activation (a third part, f32's 24 bits, cost 9% of a 512-token prefill on an
// H100 for error far under any tolerance the outputs are held to).
#define TQ_PARTS 2
// Words per shared tile row: 16 of data (32 bf16) and 4 of padding (conflict-free fragments).
#define TQ_LD 20

template <int NM, int BM, int BN>
struct TqTiles {
    uint32_t a[NM][BM][TQ_LD];
    uint32_t b[TQ_PARTS][BN][TQ_LD];
    // Per token, the sums of the tile's four 8-column chunks (the bias term).
    float xs[BN][4];
};

__device__ __forceinline__ uint32_t bf16_of_code(uint32_t q) { return __float_as_uint(u2f(q)) >> 16; }

// Weights [c, c + 8) of row r as bf16 pairs, exactly: the codes of affine weights, mxfp4 weights
// (scaled), or bf16 weights.
template <int K>
__device__ __forceinline__ uint4 load8_exact(const Mat& m, long r, int c) {
    if constexpr (K == K_Q4) {
        const uint32_t v = __ldg(reinterpret_cast<const uint32_t*>(m.data) + r * (m.cols / 8) + c / 8);
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            o[j] = bf16_of_code((v >> (8 * j)) & 15u) | (bf16_of_code((v >> (8 * j + 4)) & 15u) << 16);
        return make_uint4(o[0], o[1], o[2], o[3]);
    } else if constexpr (K == K_Q8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(m.data + r * (long)m.cols) + c / 8);
        const uint32_t w[2] = {v.x, v.y};
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t x = w[j / 2] >> (16 * (j % 2));
            o[j] = bf16_of_code(x & 255u) | (bf16_of_code((x >> 8) & 255u) << 16);
        }
        return make_uint4(o[0], o[1], o[2], o[3]);
    } else if constexpr (K == K_MXFP4) {
        // FP4 value x 2^k has at most 2 significant bits: its bf16 (upper half) is exact.
        float w[8];
        load8_mxfp4(m, r, c, w);
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            o[j] = (__float_as_uint(w[2 * j]) >> 16) |
                   (__float_as_uint(w[2 * j + 1]) & 0xffff0000u);
        return make_uint4(o[0], o[1], o[2], o[3]);
    } else {
        return __ldg(reinterpret_cast<const uint4*>(m.data) + (r * m.cols + c) / 8);
    }
}

// v as TQ_PARTS bf16 parts, largest first, each rounding what the ones before left.
__device__ __forceinline__ void split_bf16(float v, uint32_t p[TQ_PARTS]) {
#pragma unroll
    for (int i = 0; i < TQ_PARTS; i++) {
        const __nv_bfloat16 h = __float2bfloat16_rn(v);
        p[i] = __bfloat16_as_ushort(h);
        v -= __bfloat162float(h);
    }
}

// c += a b for a 16x16 (rows x columns) and b 16x8 (columns x tokens), bf16 in, f32 out.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The block's products of rows r0 .. r0 + BM of each of the NM matrices m (same shape and format)
// with the BN token rows xrow (nullptr: padding, read as zeros), over columns [k_begin, k_end)
// (whole groups). GLU: the token rows hold a gate half then an up half, `cols` apart, and the
// input is their activation as `glu` says (ffn_act).
template <int K, int NM, int MI, int NJ, int WM, int WN, bool GLU = false>
__device__ __forceinline__ void tq_tile(const Mat* m, long r0, const float* const* xrow,
                                        TqTiles<NM, 16 * MI * WM, 8 * NJ * WN>& s,
                                        float acc[NM][MI][NJ][4], int k_begin, int k_end,
                                        Ffn glu = Ffn{}) {
    constexpr int BM = 16 * MI * WM, BN = 8 * NJ * WN;
    // Affine weights: per group, s (q . x) + b (sum x). Bf16 and (scaled) mxfp4 weights: w . x.
    constexpr bool affine = K == K_Q4 || K == K_Q8;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t4 = lane % 4;
    const int wm = (warp / WN) * 16 * MI, wn = (warp % WN) * 8 * NJ;
    const int cols = m[0].cols, group_mask = m[0].group - 1;
    // Per group: the codes' dots (affine) and this thread's tokens' sums.
    float part[NM][MI][NJ][4];
    float xg[NJ][2];
#pragma unroll
    for (int mi = 0; mi < NM; mi++)
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][i][j][e] = part[mi][i][j][e] = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; j++) xg[j][0] = xg[j][1] = 0.0f;
    for (int k0 = k_begin; k0 < k_end; k0 += TQ_BK) {
#pragma unroll
        for (int it = 0; it < BM * 4 / 128; it++) {
            const int idx = threadIdx.x + it * 128, r = idx / 4, ch = idx % 4;
#pragma unroll
            for (int mi = 0; mi < NM; mi++)
                *reinterpret_cast<uint4*>(&s.a[mi][r][ch * 4]) =
                    load8_exact<K>(m[mi], min(r0 + r, (long)m[mi].rows - 1), k0 + ch * 8);
        }
#pragma unroll
        for (int it = 0; it < (BN * 4 + 127) / 128; it++) {
            const int idx = threadIdx.x + it * 128, n = idx / 4, ch = idx % 4;
            if (idx >= BN * 4) break;
            float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (xrow[n] != nullptr) {
                const float4 a = *reinterpret_cast<const float4*>(xrow[n] + k0 + ch * 8);
                const float4 b = *reinterpret_cast<const float4*>(xrow[n] + k0 + ch * 8 + 4);
                v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
                v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
                if constexpr (GLU) {
                    const float4 c = *reinterpret_cast<const float4*>(xrow[n] + cols + k0 + ch * 8);
                    const float4 d = *reinterpret_cast<const float4*>(xrow[n] + cols + k0 + ch * 8 + 4);
                    const float u[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
                    for (int q = 0; q < 8; q++) v[q] = ffn_act(glu, v[q], u[q]);
                }
            }
            uint32_t w[TQ_PARTS][4];
            float sum = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                uint32_t lo[TQ_PARTS], hi[TQ_PARTS];
                split_bf16(v[2 * q], lo);
                split_bf16(v[2 * q + 1], hi);
#pragma unroll
                for (int p = 0; p < TQ_PARTS; p++) w[p][q] = lo[p] | (hi[p] << 16);
                sum += v[2 * q] + v[2 * q + 1];
            }
#pragma unroll
            for (int p = 0; p < TQ_PARTS; p++)
                *reinterpret_cast<uint4*>(&s.b[p][n][ch * 4]) = make_uint4(w[p][0], w[p][1], w[p][2], w[p][3]);
            s.xs[n][ch] = sum;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < TQ_BK / 16; ks++) {
            // Fragment words: columns 2 t4, 2 t4 + 1 and 8 further of this 16-column step.
            const int w0 = ks * 8 + t4, w1 = w0 + 4;
            uint32_t bf[TQ_PARTS][NJ][2];
#pragma unroll
            for (int p = 0; p < TQ_PARTS; p++)
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const uint32_t* row = s.b[p][wn + j * 8 + g];
                    bf[p][j][0] = row[w0];
                    bf[p][j][1] = row[w1];
                }
#pragma unroll
            for (int mi = 0; mi < NM; mi++)
#pragma unroll
                for (int i = 0; i < MI; i++) {
                    const uint32_t* top = s.a[mi][wm + i * 16 + g];
                    const uint32_t* bottom = s.a[mi][wm + i * 16 + g + 8];
                    const uint32_t af[4] = {top[w0], bottom[w0], top[w1], bottom[w1]};
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        float* c = affine ? part[mi][i][j] : acc[mi][i][j];
                        // Smallest part first.
#pragma unroll
                        for (int p = TQ_PARTS - 1; p >= 0; p--) mma_bf16(c, af, bf[p][j]);
                    }
                }
        }
        if constexpr (affine) {
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float* x4 = s.xs[wn + j * 8 + 2 * t4 + e];
                    xg[j][e] += (x4[0] + x4[1]) + (x4[2] + x4[3]);
                }
            // Groups are whole tiles and rows whole groups: the group ends with this tile or not.
            if (((k0 + TQ_BK) & group_mask) == 0) {
                const long groups_per_row = cols >> m[0].gshift, gi = k0 >> m[0].gshift;
#pragma unroll
                for (int mi = 0; mi < NM; mi++)
#pragma unroll
                    for (int i = 0; i < MI; i++) {
                        const long ra = min(r0 + wm + i * 16 + g, (long)m[mi].rows - 1);
                        const long rb = min(ra + 8, (long)m[mi].rows - 1);
                        const float sa = load_scalar(m[mi].scales, m[mi].sdt, ra * groups_per_row + gi);
                        const float ba = load_scalar(m[mi].biases, m[mi].sdt, ra * groups_per_row + gi);
                        const float sb = load_scalar(m[mi].scales, m[mi].sdt, rb * groups_per_row + gi);
                        const float bb = load_scalar(m[mi].biases, m[mi].sdt, rb * groups_per_row + gi);
#pragma unroll
                        for (int j = 0; j < NJ; j++)
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const float sc = e < 2 ? sa : sb, bi = e < 2 ? ba : bb;
                                acc[mi][i][j][e] = fmaf(sc, part[mi][i][j][e],
                                                        fmaf(bi, xg[j][e & 1], acc[mi][i][j][e]));
                                part[mi][i][j][e] = 0.0f;
                            }
                    }
#pragma unroll
                for (int j = 0; j < NJ; j++) xg[j][0] = xg[j][1] = 0.0f;
            }
        }
        __syncthreads();
    }
}

// y[ntok, rows] = x[ntok, cols] W^T. Grid (rows / 64, ntok / 64, splits), 128 threads: with
// several splits (a small grid), block z covers columns [z kc, (z + 1) kc) and writes its partial
// sums to y + z ntok rows, which sum_splits adds up.
template <int K>
__device__ void gemm_tq(const Mat& w, const float* x, float* y, int ntok, int kc) {
    __shared__ TqTiles<1, 64, 64> s;
    __shared__ const float* xrow[64];
    const long r0 = (long)blockIdx.x * 64, n0 = (long)blockIdx.y * 64;
    if (threadIdx.x < 64) {
        const long n = n0 + threadIdx.x;
        xrow[threadIdx.x] = n < ntok ? x + n * w.cols : nullptr;
    }
    __syncthreads();
    float acc[1][2][4][4];
    const int k_begin = blockIdx.z * kc;
    tq_tile<K, 1, 2, 4, 2, 2>(&w, r0, xrow, s, acc, k_begin, min(k_begin + kc, w.cols));
    y += (long)blockIdx.z * ntok * w.rows;
    gemm_store_tile(acc[0], r0, n0, w.rows, ntok, y);
}

#define GEMM_TQ(K, KN) \
    extern "C" __global__ void __launch_bounds__(128) gemm_tq_##KN(Mat w, const float* x, float* y, \
                                                                   int ntok, int kc) { PDL_START(); \
        gemm_tq<K>(w, x, y, ntok, kc); \
    }
GEMM_TQ(K_Q4, q4) GEMM_TQ(K_Q8, q8) GEMM_TQ(K_BF16, bf16) GEMM_TQ(K_MXFP4, mxfp4)

// out[i] = sum over z of part[z n + i], in order of z.
extern "C" __global__ void sum_splits(const float* part, float* out, long n, int splits) {
    PDL_START();
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float acc = part[i];
        for (int z = 1; z < splits; z++) acc += part[z * n + i];
        out[i] = acc;
    }
}

// Row r of `table`, dequantised, into out (a block's threads share it).
__device__ void embed_row(const Mat& table, long r, float* out) {
    for (int c = threadIdx.x * 8; c < table.cols; c += blockDim.x * 8) {
        float v[8];
        load8_any(table, r, c, v);
#pragma unroll
        for (int j = 0; j < 8; j++) out[c + j] = v[j];
    }
}

// One dequantised row of `table` per token.
extern "C" __global__ void embed(Mat table, const uint32_t* tokens, float* out) {
    PDL_START();
    embed_row(table, tokens[blockIdx.x], out + (long)blockIdx.x * table.cols);
}

// Up to eight token ids passed by value, so that a replayed decode graph needs no upload.
struct TokenIds {
    uint32_t id[8];
};

// embed for at most eight tokens whose ids come as a parameter.
extern "C" __global__ void embed_ids(Mat table, TokenIds tokens, float* out) {
    PDL_START();
    embed_row(table, tokens.id[blockIdx.x], out + (long)blockIdx.x * table.cols);
}

// ------------------------------------------------------------------------------------------------
// Elementwise and normalisation
// ------------------------------------------------------------------------------------------------

// Device-to-device copy of n 4-byte words (16 bytes at a time when both ends allow it).
extern "C" __global__ void copy_words(uint32_t* dst, const uint32_t* src, long n) {
    PDL_START();
    const long stride = (long)gridDim.x * blockDim.x;
    const long i0 = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((((unsigned long)dst | (unsigned long)src) & 15) == 0) {
        const long n4 = n / 4;
        for (long j = i0; j < n4; j += stride)
            reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
        const long tail = n4 * 4 + i0;  // the last n % 4 words, one thread each
        if (i0 < 4 && tail < n) dst[tail] = src[tail];
        return;
    }
    for (long i = i0; i < n; i += stride) dst[i] = src[i];
}

// Two copies of n words each in one launch (a token's keys and values into the KV cache).
extern "C" __global__ void copy_words2(uint32_t* dst_a, const uint32_t* src_a, uint32_t* dst_b,
                                       const uint32_t* src_b, long n) {
    PDL_START();
    const long stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * n; i += stride) {
        if (i < n) dst_a[i] = src_a[i];
        else dst_b[i - n] = src_b[i - n];
    }
}

// n 4-byte words set to v.
extern "C" __global__ void fill_words(uint32_t* dst, uint32_t v, long n) {
    PDL_START();
    const long stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = v;
}

// counts[id] += 1 for each of the n routed expert ids: which experts of a layer whose table
// points into host memory are worth a VRAM slot (read back every few forward passes).
extern "C" __global__ void count_experts(const uint32_t* ids, int n, uint32_t* counts) {
    PDL_START();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        atomicAdd(&counts[ids[i]], 1u);
}

// RMS norm of each chunk of n values (one chunk per block).
// Values of a norm's row a thread keeps in registers: i = threadIdx.x + j blockDim.x, j < 8.
#define NORM_HELD 8

// The norm weights of this thread's values, into registers before the kernel waits (nothing
// earlier in a graph writes them), when the row fits (n <= NORM_HELD blockDim); false: read them
// from memory afterwards.
__device__ __forceinline__ bool norm_weights_early(const float* w, int n, float wv[NORM_HELD]) {
    const bool held = (early_loads & EARLY_NORM) && n <= NORM_HELD * (int)blockDim.x;
#pragma unroll
    for (int j = 0; j < NORM_HELD; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        wv[j] = held && i < n ? w[i] : 0.0f;
    }
    return held;
}

extern "C" __global__ void __launch_bounds__(1024) rms_norm(const float* x, const float* w, float* out, int n, float eps) {
    PDL_LAUNCH_DEPENDENTS();
    float wv[NORM_HELD];
    const bool held = norm_weights_early(w, n, wv);
    PDL_WAIT();
    const long base = (long)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[base + i] * x[base + i];
    const float inv = 1.0f / sqrtf(block_sum(ss) / n + eps);
    if (held) {
#pragma unroll
        for (int j = 0; j < NORM_HELD; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < n) out[base + i] = x[base + i] * inv * wv[j];
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[base + i] = x[base + i] * inv * w[i];
}

// h += y, then out = rms_norm(h) per chunk of n.
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm(float* h, const float* y, const float* w, float* out, int n,
                                        float eps) {
    PDL_LAUNCH_DEPENDENTS();
    float wv[NORM_HELD];
    const bool held = norm_weights_early(w, n, wv);
    PDL_WAIT();
    const long base = (long)blockIdx.x * n;
    float ss = 0.0f;
    if (held) {
        float hv[NORM_HELD];
#pragma unroll
        for (int j = 0; j < NORM_HELD; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            hv[j] = i < n ? h[base + i] + y[base + i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < NORM_HELD; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < n) {
                h[base + i] = hv[j];
                ss += hv[j] * hv[j];
            }
        }
        const float inv = 1.0f / sqrtf(block_sum(ss) / n + eps);
#pragma unroll
        for (int j = 0; j < NORM_HELD; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < n) out[base + i] = hv[j] * inv * wv[j];
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = h[base + i] + y[base + i];
        h[base + i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[base + i] = h[base + i] * inv * w[i];
}

// silu(z) * rms_norm(x) * w over one chunk of n, by the whole block.
__device__ void gated_norm_chunk(const float* x, const float* z, const float* w, float* out, int n,
                                 float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(block_sum(ss) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float g = z[i];
        out[i] = x[i] * inv * w[i] * (g / (1.0f + expf(-g)));
    }
}

// silu(z) * rms_norm(x) * w per chunk of n.
extern "C" __global__ void rms_norm_gated(const float* x, const float* z, const float* w, float* out,
                                          int n, float eps) {
    PDL_START();
    const long base = (long)blockIdx.x * n;
    gated_norm_chunk(x + base, z + base, w, out + base, n, eps);
}

extern "C" __global__ void add_assign(float* x, const float* y, long n) {
    PDL_START();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, long n) {
    PDL_START();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu1(g[i], u[i]);
}

__device__ __forceinline__ float sigmoid1(float g) { return 1.0f / (1.0f + expf(-g)); }

// x *= sigmoid(gate): elementwise, or per row when gate_cols == 1.
extern "C" __global__ void sigmoid_mul(float* x, const float* gate, long n, int cols, int gate_cols) {
    PDL_START();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate_cols == 1 ? gate[i / cols] : gate[i];
    x[i] *= sigmoid1(g);
}

// x[r, c] += bias[c].
extern "C" __global__ void add_bias(float* x, const float* bias, long n, int cols) {
    PDL_START();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] += bias[i % cols];
}

// Each chunk of `chunk` values split after `first`: a gets the first parts, b the rests.
extern "C" __global__ void split_chunks(const float* x, float* a, float* b, long n, int chunk,
                                        int first) {
    PDL_START();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long c = i / chunk;
    const int j = (int)(i % chunk);
    if (j < first) a[c * first + j] = x[i];
    else b[c * (chunk - first) + j - first] = x[i];
}

// The inverse of split_chunks: chunks of ca values of a and cb values of b, interleaved.
extern "C" __global__ void join_chunks(const float* a, const float* b, float* out, long n, int ca,
                                       int cb) {
    PDL_START();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long c = i / (ca + cb);
    const int j = (int)(i % (ca + cb));
    out[i] = j < ca ? a[c * ca + j] : b[c * cb + j - ca];
}

// Rotate-half rotary embedding on the first rotary_dim values of each head; row r at position
// first + r. `inv_freq` (rotary_dim / 2 values) comes from the host, computed as the CPU backend
// and MLX do, so that long positions (where an ulp of frequency shows) agree; angles in f32.
extern "C" __global__ void rope(float* x, const float* inv_freq, int rows, int cols, int head_dim,
                                int rotary_dim, int first) {
    PDL_START();
    const int half = rotary_dim / 2;
    const int heads = cols / head_dim;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)rows * heads * half) return;
    const int k = (int)(i % half);
    const long rh = i / half;
    const int h = (int)(rh % heads);
    const long r = rh / heads;
    float s, c;
    sincosf((float)(first + r) * inv_freq[k], &s, &c);
    float* head = x + r * cols + (long)h * head_dim;
    const float a = head[k], b = head[k + half];
    head[k] = a * c - b * s;
    head[k + half] = b * c + a * s;
}

// 1 / rms(x) of one head of n values (n <= 256), eps added, as every warp computes it: lane j sums
// x[j]^2, x[j + 32]^2, ... in order, then the warp adds its lanes. Every kernel that normalises
// heads (rms_norm_rope, qkv_norm_rope_append, the fused decode attention) gets the same bits.
__device__ __forceinline__ float head_inv_rms(const float* x, int n, float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x % 32; i < n; i += 32) ss = fmaf(x[i], x[i], ss);
    return 1.0f / sqrtf(warp_sum(ss) / n + eps);
}

// Value i of a head normalised (y = x * inv * w) and rotated: the first rotary_dim values by pairs
// (i, i + rotary_dim / 2) through the angle pos * inv_freq[i mod rotary_dim / 2]. Rounded step by
// step (no contractions), so that every kernel that inlines it gets the same bits.
// Value i's rotary partner (itself past rotary_dim) and its frequency's index.
__device__ __forceinline__ int rope_pair(int i, int rotary_dim) {
    const int half = rotary_dim / 2;
    return i >= rotary_dim ? i : i < half ? i + half : i - half;
}
__device__ __forceinline__ int rope_freq(int i, int rotary_dim) {
    const int half = rotary_dim / 2;
    return i < half ? i : i - half;
}

// norm_rope_at from the values it reads: x[i], x[p], w[i], w[p] and inv_freq[k] (p, k:
// rope_pair, rope_freq; the last three unused past rotary_dim).
__device__ __forceinline__ float norm_rope_of(float xi, float xp, float wi, float wp, float freq,
                                              float inv, int i, int rotary_dim, long pos) {
    const float y = __fmul_rn(__fmul_rn(xi, inv), wi);
    if (i >= rotary_dim) return y;
    const float yp = __fmul_rn(__fmul_rn(xp, inv), wp);
    float s, c;
    sincosf((float)pos * freq, &s, &c);
    return i < rotary_dim / 2 ? __fsub_rn(__fmul_rn(y, c), __fmul_rn(yp, s))
                              : __fadd_rn(__fmul_rn(y, c), __fmul_rn(yp, s));
}

__device__ __forceinline__ float norm_rope_at(const float* x, const float* w, const float* inv_freq,
                                              float inv, int i, int rotary_dim, long pos) {
    if (i >= rotary_dim) return norm_rope_of(x[i], 0.0f, w[i], 0.0f, 0.0f, inv, i, rotary_dim, pos);
    const int p = rope_pair(i, rotary_dim);
    return norm_rope_of(x[i], x[p], w[i], w[p], inv_freq[rope_freq(i, rotary_dim)], inv, i,
                        rotary_dim, pos);
}

// rms_norm of one head of n values x (n <= 256; every thread of the block calls it, in whole
// warps), then rope on its first rotary_dim values at position pos, into out (not x).
__device__ void norm_rope_head(const float* x, const float* w, const float* inv_freq, float* out,
                               int n, float eps, int rotary_dim, long pos) {
    const float inv = head_inv_rms(x, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[i] = norm_rope_at(x, w, inv_freq, inv, i, rotary_dim, pos);
}

// rms_norm of each head of n values (a block per head; n <= 256), then `rope` on its first
// rotary_dim values; row r at position first + r.
extern "C" __global__ void rms_norm_rope(const float* x, const float* w, const float* inv_freq,
                                         float* out, int n, float eps, int heads, int rotary_dim,
                                         int first) {
    PDL_START();
    const long base = (long)blockIdx.x * n;
    const long r = blockIdx.x / heads;
    norm_rope_head(x + base, w, inv_freq, out + base, n, eps, rotary_dim, first + r);
}

// The attention prelude in one launch: per row r (position first + r), each of the `heads` heads
// of q normalised and rotated into q_out, each of the kv_heads heads of k normalised and rotated
// straight into the key cache at row first + r, and v copied into the value cache there. A block
// per head of each: grid rows * (heads + 2 kv_heads), n (head size) <= 256. With `cached` (the
// cache's length kept on the device, see `attention`) the first position is first + *cached, so
// that a replayed decode step needs no new arguments.
extern "C" __global__ void qkv_norm_rope_append(const float* q, const float* k, const float* v,
                                                const float* wq, const float* wk,
                                                const float* inv_freq, float* q_out, float* keys,
                                                float* values, int n, float eps, int heads,
                                                int kv_heads, int rotary_dim, int first,
                                                const int* cached) {
    PDL_START();
    if (cached) first += *cached;
    const int per_row = heads + 2 * kv_heads;
    const long r = blockIdx.x / per_row;
    const int j = blockIdx.x % per_row;
    const long kv_width = (long)kv_heads * n;
    const long cache_row = (first + r) * kv_width;
    if (j < heads) {
        const long at = (r * heads + j) * n;
        norm_rope_head(q + at, wq, inv_freq, q_out + at, n, eps, rotary_dim, first + r);
    } else if (j < heads + kv_heads) {
        const int h = j - heads;
        norm_rope_head(k + r * kv_width + (long)h * n, wk, inv_freq, keys + cache_row + (long)h * n, n,
                       eps, rotary_dim, first + r);
    } else {
        const int h = j - heads - kv_heads;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            values[cache_row + (long)h * n + i] = v[r * kv_width + (long)h * n + i];
    }
}

// ------------------------------------------------------------------------------------------------
// KV cache formats
// ------------------------------------------------------------------------------------------------

// The storage of a compact attention cache (KvFormat in sluice-backend's kv.rs, whose rounding
// these follow bit for bit: a cache holds what its `round_trip` gives). A position's row of
// `width` (kv_heads x head size) values: the codes of every value, then per group of `group`
// values (a power of two dividing the head, at most 32) its f16 scales: q8 `d` (value = code x d),
// q4 `d` then `min` (value = code x d + min, two roundings as on the host). f16 and bf16 rows are
// the values alone; f32 caches never come here.
enum { KV_F16 = 1, KV_BF16 = 2, KV_Q8 = 3, KV_Q4 = 4 };

__device__ __forceinline__ long kv_row_bytes(int fmt, int width, int group) {
    const long groups = width / group;
    switch (fmt) {
        case KV_Q8: return width + 2 * groups;
        case KV_Q4: return (width + 1) / 2 + 4 * groups;
        default: return 2L * width;
    }
}

__device__ __forceinline__ float kv_half(const uint8_t* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Value `c` of a row.
__device__ __forceinline__ float kv_value(const uint8_t* row, int fmt, int width, int group, int c) {
    switch (fmt) {
        case KV_F16: return kv_half(row + 2L * c);
        case KV_BF16: return __uint_as_float((uint32_t)reinterpret_cast<const unsigned short*>(row)[c] << 16);
        case KV_Q8: {
            const float d = kv_half(row + width + 2 * (c / group));
            return __fmul_rn((float)(signed char)row[c], d);
        }
        default: {
            const uint8_t* s = row + (width + 1) / 2 + 4 * (c / group);
            const float q = (float)((row[c / 2] >> (4 * (c % 2))) & 15);
            return __fadd_rn(__fmul_rn(q, kv_half(s)), kv_half(s + 2));
        }
    }
}

// Stores `rows` rows of keys `k` and values `v` ([rows, width] f32) at positions first + r (with
// `cached`, first + *cached: a replayed decode step) of the caches in format `fmt`. A thread per
// group of `group` values: q8 and q4 round as quantize_q8 and quantize_q4 do (IEEE division and
// round-half-away, no fused multiply-adds).
extern "C" __global__ void kv_store(const float* k, const float* v, uint8_t* keys, uint8_t* values,
                                    int rows, int width, int group, int fmt, int first,
                                    const int* cached) {
    PDL_START();
    if (cached) first += *cached;
    const int groups = width / group;
    const long per = (long)rows * groups;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 2 * per) return;
    const bool is_v = i >= per;
    const long j = is_v ? i - per : i;
    const long r = j / groups;
    const int g = j % groups, c0 = g * group;
    const float* x = (is_v ? v : k) + r * width + c0;
    uint8_t* row = (is_v ? values : keys) + (first + r) * kv_row_bytes(fmt, width, group);
    switch (fmt) {
        case KV_F16:
            for (int c = 0; c < group; c++)
                reinterpret_cast<__half*>(row)[c0 + c] = __float2half_rn(x[c]);
            break;
        case KV_BF16:
            for (int c = 0; c < group; c++)
                reinterpret_cast<__nv_bfloat16*>(row)[c0 + c] = __float2bfloat16_rn(x[c]);
            break;
        case KV_Q8: {
            float amax = 0.0f;
            for (int c = 0; c < group; c++) amax = fmaxf(amax, fabsf(x[c]));
            const float d = __fdiv_rn(amax, 127.0f);
            const float inv = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
            for (int c = 0; c < group; c++)
                row[c0 + c] = (uint8_t)(signed char)fminf(fmaxf(roundf(__fmul_rn(x[c], inv)), -127.0f), 127.0f);
            *reinterpret_cast<__half*>(row + width + 2 * g) = __float2half_rn(d);
            break;
        }
        default: {
            float lo = INFINITY, hi = -INFINITY;
            for (int c = 0; c < group; c++) {
                lo = fminf(lo, x[c]);
                hi = fmaxf(hi, x[c]);
            }
            const __half min = __float2half_rn(lo);
            // The codes count up from the minimum as stored, so that 0 dequantises to it exactly.
            const float base = __half2float(min);
            const float d = __fdiv_rn(fmaxf(__fsub_rn(hi, base), 0.0f), 15.0f);
            const float inv = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
            for (int c = 0; c < group; c++) {
                const uint32_t q =
                    (uint32_t)fminf(fmaxf(roundf(__fmul_rn(__fsub_rn(x[c], base), inv)), 0.0f), 15.0f);
                const int at = c0 + c;
                if (group == 1) {
                    // Odd head sizes: the two nibbles of a byte belong to two threads.
                    const unsigned long long a = (unsigned long long)(row + at / 2);
                    uint32_t* word = reinterpret_cast<uint32_t*>(a & ~3ull);
                    const int shift = 8 * (int)(a & 3) + 4 * (at % 2);
                    atomicAnd(word, ~(15u << shift));
                    atomicOr(word, q << shift);
                } else if (at % 2 == 0) row[at / 2] = (uint8_t)q;
                else row[at / 2] |= (uint8_t)(q << 4);
            }
            uint8_t* s = row + (width + 1) / 2 + 4 * g;
            *reinterpret_cast<__half*>(s) = __float2half_rn(d);
            *reinterpret_cast<__half*>(s + 2) = min;
            break;
        }
    }
}

// Positions [0, n) of the key and value caches in format `fmt` as f32 rows [n, width] (for the
// kernels that read f32 caches: prefill tiles, the generic attention). A thread per value.
extern "C" __global__ void kv_expand(const uint8_t* keys, const uint8_t* values, float* k_out,
                                     float* v_out, int n, int width, int group, int fmt) {
    PDL_START();
    const long per = (long)n * width;
    const long rb = kv_row_bytes(fmt, width, group);
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * per;
         i += (long)gridDim.x * blockDim.x) {
        const bool is_v = i >= per;
        const long j = is_v ? i - per : i;
        const long p = j / width;
        const int c = j % width;
        const float x = kv_value((is_v ? values : keys) + p * rb, fmt, width, group, c);
        (is_v ? v_out : k_out)[j] = x;
    }
}

// The `N` values [c, c + N) of a compact row (c a multiple of N, N in 2, 4, 8; groups of 32) into
// `out`, with the widest loads the format allows: what attention_decode reads per lane.
template <int N>
__device__ __forceinline__ void kv_load(const uint8_t* row, int fmt, int width, int c, float out[N]) {
    if (fmt == KV_F16 || fmt == KV_BF16) {
        uint32_t w[N / 2];
        if constexpr (N == 2) w[0] = *reinterpret_cast<const uint32_t*>(row + 2 * c);
        if constexpr (N == 4) {
            const uint2 u = *reinterpret_cast<const uint2*>(row + 2 * c);
            w[0] = u.x, w[1] = u.y;
        }
        if constexpr (N == 8) {
            const uint4 u = *reinterpret_cast<const uint4*>(row + 2 * c);
            w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
        }
#pragma unroll
        for (int j = 0; j < N / 2; j++) {
            if (fmt == KV_BF16) {
                out[2 * j] = bf16_lo(w[j]);
                out[2 * j + 1] = bf16_hi(w[j]);
            } else {
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
                out[2 * j] = f.x;
                out[2 * j + 1] = f.y;
            }
        }
    } else if (fmt == KV_Q8) {
        uint32_t w[(N + 3) / 4];
        if constexpr (N == 2) w[0] = *reinterpret_cast<const unsigned short*>(row + c);
        if constexpr (N == 4) w[0] = *reinterpret_cast<const uint32_t*>(row + c);
        if constexpr (N == 8) {
            const uint2 u = *reinterpret_cast<const uint2*>(row + c);
            w[0] = u.x, w[1] = u.y;
        }
        const float d = kv_half(row + width + 2 * (c / 32));
#pragma unroll
        for (int j = 0; j < N; j++)
            out[j] = __fmul_rn((float)(signed char)((w[j / 4] >> (8 * (j % 4))) & 255u), d);
    } else {
        uint32_t w;
        if constexpr (N == 2) w = row[c / 2];
        if constexpr (N == 4) w = *reinterpret_cast<const unsigned short*>(row + c / 2);
        if constexpr (N == 8) w = *reinterpret_cast<const uint32_t*>(row + c / 2);
        const uint8_t* s = row + width / 2 + 4 * (c / 32);
        const float d = kv_half(s), min = kv_half(s + 2);
#pragma unroll
        for (int j = 0; j < N; j++)
            out[j] = __fadd_rn(__fmul_rn((float)((w >> (4 * j)) & 15u), d), min);
    }
}

// ------------------------------------------------------------------------------------------------
// Attention
// ------------------------------------------------------------------------------------------------

// The end of a split attention block, after it wrote its part (`mine`: the head's parts, each
// [max, sum, hd values]): the last of the `splits` blocks counted to finish (`counted`; the
// threadfence-reduction pattern) combines the parts into `out_row`, the head's attention sink
// (-INFINITY: none) joining the softmax there, once; and with `cached` the last block of the grid
// stores the cache's new length `total` there (every block counts itself in `all_done`, zero
// before and after).
__device__ __forceinline__ void split_attention_finish(bool counted, int splits, uint32_t* done,
                                                      int* cached, uint32_t* all_done, int total,
                                                      const float* mine, int hd, float* out_row,
                                                      uint32_t blocks, float sink) {
    __shared__ bool last;
    __shared__ float factor[32];
    __shared__ float sum;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = counted && atomicAdd(done, 1u) == (uint32_t)splits - 1;
        if (last) *done = 0;
        // Every block read *cached before counting itself here.
        if (cached && atomicAdd(all_done, 1u) == blocks - 1) {
            *all_done = 0;
            *cached = total;
        }
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        const float m = s < splits ? __ldcg(mine + s * (hd + 2)) : -INFINITY;
        const float top = fmaxf(warp_max(m), sink);
        const float f = m == -INFINITY ? 0.0f : expf(m - top);
        factor[s] = f;
        const float l = warp_sum(s < splits && f > 0.0f ? __ldcg(mine + s * (hd + 2) + 1) * f : 0.0f);
        // The sink's share: a weight with no value.
        if (s == 0) sum = sink == -INFINITY ? l : l + expf(sink - top);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; s++)
            if (factor[s] > 0.0f) o += __ldcg(mine + s * (hd + 2) + 2 + d) * factor[s];
        out_row[d] = o / sum;
    }
}

// Causal grouped-query attention over a cache that already holds this call's keys and values:
// q [T, heads * hd] at positions total - T .. total - 1; keys/values [total, kv_heads * hd].
// One block of 4 warps per (head, token, split): the token's positions are cut into gridDim.z
// splits; each warp runs an online softmax over every 4th position of its block's split, then the
// warps combine. With one split the block writes the output; with more (few tokens: decode) it
// writes (max, sum, unnormalised output) to `partial` [T, heads, splits, hd + 2], and the last
// block of a (head, token) to finish, counted in `done` (zero before, left zero after), combines
// them. hd <= 32 * P, splits <= 32. With `cached` (splits > 1 only) the cache's length before this
// call is kept on the device: total is the call's tokens plus *cached, and the last block of the
// grid to finish, counted in `all_done` (zero before and after), stores the new length there.
// With a sliding `window` (0: none) a token at position p sees positions p + 1 - window ..= p
// only, and only those are split over the blocks (a long cache costs what the window holds); with
// `sinks` (null: none) each query head's sink logit joins the softmax of each of its rows, once:
// in the block that writes the output, or in the splits' combine.
template <int P>
__device__ void attention_generic(const float* q, const float* keys, const float* values, float* out,
                                  int heads, int kv_heads, int hd, int total, int ntok, float scale,
                                  float* partial, uint32_t* done, int* cached,
                                  uint32_t* all_done, int window, const float* sinks) {
    if (cached) total += *cached;
    const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int kv = h / (heads / kv_heads);
    const int width = kv_heads * hd;
    const int per_lane = (hd + 31) / 32;  // <= P
    const int n = total - ntok + t + 1;
    // The token sees positions [first, n).
    const int first = window > 0 ? max(0, n - window) : 0;
    const int chunk = (n - first + splits - 1) / splits;
    const int p0 = first + split * chunk, p1 = min(n, p0 + chunk);
    float qv[P], acc[P];
#pragma unroll
    for (int j = 0; j < P; j++) {
        const int d = lane + 32 * j;
        qv[j] = (j < per_lane && d < hd) ? q[((long)t * heads + h) * hd + d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int p = p0 + warp; p < p1; p += 4) {
        const float* k = keys + (long)p * width + (long)kv * hd;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int d = lane + 32 * j;
            if (j < per_lane && d < hd) dot = fmaf(qv[j], k[d], dot);
        }
        const float s = warp_sum(dot) * scale;
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);
        const float e = expf(s - m_new);
        l = l * correction + e;
        const float* v = values + (long)p * width + (long)kv * hd;
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int d = lane + 32 * j;
            if (j < per_lane && d < hd) acc[j] = acc[j] * correction + e * v[d];
        }
        m = m_new;
    }
    __shared__ float ms[4], ls[4];
    __shared__ float accs[4][P * 32];
    if (lane == 0) {
        ms[warp] = m;
        ls[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < P; j++) {
        const int d = lane + 32 * j;
        if (j < per_lane && d < hd) accs[warp][d] = acc[j];
    }
    __syncthreads();
    // One split: the sink joins here (split, in split_attention_finish).
    const float sink = sinks != nullptr ? sinks[h] : -INFINITY;
    float mx = splits == 1 ? sink : -INFINITY;
    for (int w = 0; w < 4; w++) mx = fmaxf(mx, ms[w]);
    float total_l = 0.0f;
    for (int w = 0; w < 4; w++) total_l += ms[w] == -INFINITY ? 0.0f : ls[w] * expf(ms[w] - mx);
    if (splits == 1 && sinks != nullptr) total_l += expf(sink - mx);
    float* const mine = partial + ((long)t * heads + h) * splits * (hd + 2);
    float* part = mine + split * (hd + 2);
    if (splits > 1 && threadIdx.x == 0) {
        part[0] = mx;
        part[1] = total_l;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < 4; w++)
            if (ms[w] != -INFINITY) o += accs[w][d] * expf(ms[w] - mx);
        if (splits > 1) part[2 + d] = o;
        else out[((long)t * heads + h) * hd + d] = o / total_l;
    }
    if (splits == 1) return;
    split_attention_finish(true, splits, done + t * heads + h, cached, all_done, total, mine, hd,
                           out + ((long)t * heads + h) * hd, gridDim.x * gridDim.y * gridDim.z,
                           sink);
}

// The head sizes of `attention`: up to 256 (8 values per lane), and up to 768 (24: Multi-head
// Latent Attention's absorbed head of 576).
extern "C" __global__ void __launch_bounds__(128) attention(const float* q, const float* keys,
                                                            const float* values, float* out,
                                                            int heads, int kv_heads, int hd,
                                                            int total, int ntok, float scale,
                                                            float* partial, uint32_t* done,
                                                            int* cached, uint32_t* all_done,
                                                            int window, const float* sinks) {
    PDL_START();
    attention_generic<8>(q, keys, values, out, heads, kv_heads, hd, total, ntok, scale, partial,
                         done, cached, all_done, window, sinks);
}

extern "C" __global__ void __launch_bounds__(128) attention_wide(
    const float* q, const float* keys, const float* values, float* out, int heads, int kv_heads,
    int hd, int total, int ntok, float scale, float* partial, uint32_t* done, int* cached,
    uint32_t* all_done, int window, const float* sinks) {
    PDL_START();
    attention_generic<24>(q, keys, values, out, heads, kv_heads, hd, total, ntok, scale, partial,
                          done, cached, all_done, window, sinks);
}

// Split decode attention (few query tokens), head size HD: grid (heads, T, splits), 8 warps. A
// token's positions are cut into splits of at least a pass (8 warps x PR positions: the fewer
// blocks the shorter the chain; up to a pass, one block writes the output and nothing is
// combined); blocks past the last needed split only count themselves. Each warp takes PR
// positions at a time, its lanes across the head (HD / 32 values each): every key and value of
// the PR positions is loaded at once (coalesced), the PR scores summed over the warp, an online
// softmax kept per warp. The warps, then the splits (as in `attention`: (max, sum, unnormalised
// output) in `partial`, the last block of a (head, token) to finish combines them), meet in that
// order. Fused (k non-null, one token): q is raw and is normalised and rotated here
// (norm_rope_at: the arithmetic of rms_norm_rope), the new key and value too, in the blocks that
// score the new position; the first query head of each kv head's group writes them into the
// caches. `cached` and `all_done`, `window` (only the positions a token sees are split) and
// `sinks` (joining in the block that writes the output, or in the combine) as in `attention`.
#define ATTN_WARPS 8
// With C, the caches are compact (`fmt`, see kv_store; groups of 32) and never fused.
// The caller lets the next kernel start (PDL_LAUNCH_DEPENDENTS) and this waits: first, with
// early_loads, thread i < HD reads its q and k norm weights and rotary frequency, and (capacity > 0,
// an f32 cache of that many rows) asks L2 for the first two passes of keys and values of its block
// at the length *cached holds then (a guess that an earlier kernel may still change: a wrong one
// prefetches other rows of the cache, clamped to it).
template <int HD, bool C = false>
__device__ void attention_decode(const float* q, const float* k, const float* v, const float* wq,
                                 const float* wk, const float* inv_freq, float eps, int rotary_dim,
                                 float* keys, float* values, float* out, int heads, int kv_heads,
                                 int total, int ntok, float scale, float* partial, uint32_t* done,
                                 int* cached, uint32_t* all_done, int t, uint32_t blocks,
                                 int window, const float* sinks, int fmt = 0, int capacity = 0) {
    constexpr int DPL = HD / 32, PR = HD > 128 ? 4 : 8, PASS = ATTN_WARPS * PR;
    __shared__ __align__(16) float qs[HD], ks[HD], vs[HD];
    __shared__ __align__(16) float accs[ATTN_WARPS][HD];
    __shared__ float ms[ATTN_WARPS], ls[ATTN_WARPS];
    const int h = blockIdx.x, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int group = heads / kv_heads, kv = h / group;
    const long width = (long)kv_heads * HD;
    const bool fused = !C && k != nullptr;
    const bool early = (early_loads & EARLY_ATTN) && fused;
    // Thread i's value of q and k (i < HD <= blockDim), its rotary partner and frequency.
    const int i = threadIdx.x, ip = rope_pair(i, rotary_dim);
    float wqi = 0.0f, wqp = 0.0f, wki = 0.0f, wkp = 0.0f, freq = 0.0f;
    if (early && i < HD) {
        wqi = wq[i];
        wki = wk[i];
        if (i < rotary_dim) {
            wqp = wq[ip];
            wkp = wk[ip];
            freq = inv_freq[rope_freq(i, rotary_dim)];
        }
    }
    if ((early_loads & EARLY_KV) && fused && capacity > 0) {
        const int len = total + (cached ? *(volatile const int*)cached : 0);
        const int n = len - ntok + t + 1;
        const int first = window > 0 ? max(0, n - window) : 0;
        const int per = max(PASS, (n - first + splits - 1) / splits);
        const int p0 = max(0, first + split * per);
        const int rows = max(0, min(min(n, p0 + per), min(p0 + 2 * PASS, capacity)) - p0);
        constexpr int LINES = HD / 32;  // 128-byte lines of a head's f32 row
        for (int u = threadIdx.x; u < 2 * rows * LINES; u += blockDim.x) {
            const int r = u / LINES % rows, l = u % LINES;
            prefetch_l2((u < rows * LINES ? keys : values) + (long)(p0 + r) * width + kv * HD + l * 32);
        }
    }
    PDL_WAIT();
    if (cached) total += *cached;
    const int n = total - ntok + t + 1, pos = n - 1;
    // The token sees positions [first, n).
    const int first = window > 0 ? max(0, n - window) : 0;
    const int per = max(PASS, (n - first + splits - 1) / splits);
    const int active = (n - first + per - 1) / per;
    const int p0 = first + split * per, p1 = min(n, p0 + per);
    const long row_bytes = C ? kv_row_bytes(fmt, (int)width, 32) : 0;
    const float sink = sinks != nullptr ? sinks[h] : -INFINITY;
    float* const mine = partial + ((long)t * heads + h) * splits * (HD + 2);
    if (split < active) {
        const float* qh = q + ((long)t * heads + h) * HD;
        const bool has_new = fused && p1 == n;
        if (early) {
            // Every load at once: this warp's lanes of q and k for the norms, thread i's values.
            const float* kh = k + (long)kv * HD;
            float ql[DPL], kl[DPL];
#pragma unroll
            for (int j = 0; j < DPL; j++) {
                ql[j] = qh[lane + 32 * j];
                kl[j] = kh[lane + 32 * j];
            }
            float qi = 0.0f, qp = 0.0f, ki = 0.0f, kp = 0.0f, vi = 0.0f;
            if (i < HD) {
                qi = qh[i];
                ki = kh[i];
                vi = v[(long)kv * HD + i];
                if (i < rotary_dim) {
                    qp = qh[ip];
                    kp = kh[ip];
                }
            }
            // head_inv_rms's sums, in its order.
            float sq = 0.0f, sk = 0.0f;
#pragma unroll
            for (int j = 0; j < DPL; j++) {
                sq = fmaf(ql[j], ql[j], sq);
                sk = fmaf(kl[j], kl[j], sk);
            }
            const float inv = 1.0f / sqrtf(warp_sum(sq) / HD + eps);
            const float kinv = 1.0f / sqrtf(warp_sum(sk) / HD + eps);
            if (i < HD) {
                qs[i] = norm_rope_of(qi, qp, wqi, wqp, freq, inv, i, rotary_dim, pos);
                if (has_new) {
                    ks[i] = norm_rope_of(ki, kp, wki, wkp, freq, kinv, i, rotary_dim, pos);
                    vs[i] = vi;
                    if (h % group == 0) {
                        keys[pos * width + (long)kv * HD + i] = ks[i];
                        values[pos * width + (long)kv * HD + i] = vs[i];
                    }
                }
            }
        } else if (fused) {
            const float inv = head_inv_rms(qh, HD, eps);
            for (int i = threadIdx.x; i < HD; i += blockDim.x)
                qs[i] = norm_rope_at(qh, wq, inv_freq, inv, i, rotary_dim, pos);
            if (has_new) {
                const float* kh = k + (long)kv * HD;
                const float kinv = head_inv_rms(kh, HD, eps);
                for (int i = threadIdx.x; i < HD; i += blockDim.x) {
                    ks[i] = norm_rope_at(kh, wk, inv_freq, kinv, i, rotary_dim, pos);
                    vs[i] = v[(long)kv * HD + i];
                    if (h % group == 0) {
                        keys[pos * width + (long)kv * HD + i] = ks[i];
                        values[pos * width + (long)kv * HD + i] = vs[i];
                    }
                }
            }
        } else {
            for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = qh[i];
        }
        __syncthreads();
        float qv[DPL], acc[DPL];
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            qv[j] = qs[lane * DPL + j];
            acc[j] = 0.0f;
        }
        float m = -INFINITY, l = 0.0f;
        for (int base = p0 + warp * PR; base < p1; base += PASS) {
            float kk[PR][DPL], vv[PR][DPL];
#pragma unroll
            for (int i = 0; i < PR; i++) {
                const int p = min(base + i, p1 - 1);
                if constexpr (C) {
                    const int c = kv * HD + lane * DPL;
                    kv_load<DPL>(reinterpret_cast<const uint8_t*>(keys) + p * row_bytes, fmt,
                                 (int)width, c, kk[i]);
                    kv_load<DPL>(reinterpret_cast<const uint8_t*>(values) + p * row_bytes, fmt,
                                 (int)width, c, vv[i]);
                    continue;
                }
                const bool here = has_new && p == pos;
                const float* kp = (here ? ks : keys + (long)p * width + (long)kv * HD) + lane * DPL;
                const float* vp = (here ? vs : values + (long)p * width + (long)kv * HD) + lane * DPL;
#pragma unroll
                for (int j = 0; j < DPL; j += 2) {
                    const float2 a = *reinterpret_cast<const float2*>(kp + j);
                    const float2 b = *reinterpret_cast<const float2*>(vp + j);
                    kk[i][j] = a.x;
                    kk[i][j + 1] = a.y;
                    vv[i][j] = b.x;
                    vv[i][j + 1] = b.y;
                }
            }
            float sc[PR];
            float mx = m;
#pragma unroll
            for (int i = 0; i < PR; i++) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < DPL; j++) d = fmaf(qv[j], kk[i][j], d);
                sc[i] = base + i < p1 ? warp_sum(d) * scale : -INFINITY;
                mx = fmaxf(mx, sc[i]);
            }
            // Position `base` is always scored: mx is finite.
            const float correction = expf(m - mx);
            l *= correction;
#pragma unroll
            for (int j = 0; j < DPL; j++) acc[j] *= correction;
#pragma unroll
            for (int i = 0; i < PR; i++) {
                const float e = expf(sc[i] - mx);
                l += e;
#pragma unroll
                for (int j = 0; j < DPL; j++) acc[j] = fmaf(e, vv[i][j], acc[j]);
            }
            m = mx;
        }
        if (lane == 0) {
            ms[warp] = m;
            ls[warp] = l;
        }
#pragma unroll
        for (int j = 0; j < DPL; j++) accs[warp][lane * DPL + j] = acc[j];
        __syncthreads();
        // One block: the sink joins here (more, in split_attention_finish).
        float mx = active == 1 ? sink : -INFINITY;
        for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, ms[w]);
        float total_l = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) total_l += ms[w] == -INFINITY ? 0.0f : ls[w] * expf(ms[w] - mx);
        if (active == 1 && sinks != nullptr) total_l += expf(sink - mx);
        float* part = mine + split * (HD + 2);
        if (active > 1 && threadIdx.x == 0) {
            part[0] = mx;
            part[1] = total_l;
        }
        for (int d = threadIdx.x; d < HD; d += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < ATTN_WARPS; w++)
                if (ms[w] != -INFINITY) o += accs[w][d] * expf(ms[w] - mx);
            if (active > 1) part[2 + d] = o;
            else out[((long)t * heads + h) * HD + d] = o / total_l;
        }
    }
    split_attention_finish(split < active && active > 1, active, done + t * heads + h, cached,
                           all_done, total, mine, HD, out + ((long)t * heads + h) * HD, blocks,
                           sink);
}

// One token of each of several requests (grid y: the request), each attending through its own
// cache: `attention_decode` with ntok = 1 on request r's rows of q, k, v and out, its cache
// `rows` names, and its own block counters (done + r * heads; all_done + r, counting the
// request's heads x splits blocks). Up to 8 requests.
struct KvRows {
    float* keys[8];
    float* values[8];
    int* cached[8];
    int total[8];
};

#define ATTENTION_DECODE(HD) \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, 1) attention_decode_##HD( \
        const float* q, const float* k, const float* v, const float* wq, const float* wk, \
        const float* inv_freq, float eps, int rotary_dim, float* keys, float* values, float* out, \
        int heads, int kv_heads, int total, int ntok, float scale, float* partial, uint32_t* done, \
        int* cached, uint32_t* all_done, int window, const float* sinks, int capacity) { \
        PDL_LAUNCH_DEPENDENTS(); \
        attention_decode<HD>(q, k, v, wq, wk, inv_freq, eps, rotary_dim, keys, values, out, heads, \
                             kv_heads, total, ntok, scale, partial, done, cached, all_done, \
                             blockIdx.y, gridDim.x * gridDim.y * gridDim.z, window, sinks, 0, \
                             capacity); \
    } \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, 1) attention_decode_rows_##HD( \
        const float* q, const float* k, const float* v, const float* wq, const float* wk, \
        const float* inv_freq, float eps, int rotary_dim, KvRows rows, float* out, int heads, \
        int kv_heads, float scale, float* partial, uint32_t* done, uint32_t* all_done, int window, \
        const float* sinks) { PDL_LAUNCH_DEPENDENTS(); \
        const int r = blockIdx.y; \
        const long kvw = (long)kv_heads * HD; \
        attention_decode<HD>(q + (long)r * heads * HD, k + r * kvw, v + r * kvw, wq, wk, inv_freq, \
                             eps, rotary_dim, rows.keys[r], rows.values[r], \
                             out + (long)r * heads * HD, heads, kv_heads, rows.total[r], 1, scale, \
                             partial + (long)r * heads * gridDim.z * (HD + 2), done + r * heads, \
                             rows.cached[r], all_done + r, 0, gridDim.x * gridDim.z, window, \
                             sinks); \
    } \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, 1) attention_decode_kv_##HD( \
        const float* q, const uint8_t* keys, const uint8_t* values, float* out, int fmt, \
        int heads, int kv_heads, int total, int ntok, float scale, float* partial, uint32_t* done, \
        int* cached, uint32_t* all_done, int window, const float* sinks) { PDL_LAUNCH_DEPENDENTS(); \
        attention_decode<HD, true>(q, nullptr, nullptr, nullptr, nullptr, nullptr, 0.0f, 0, \
                                   (float*)keys, (float*)values, out, heads, kv_heads, total, ntok, \
                                   scale, partial, done, cached, all_done, blockIdx.y, \
                                   gridDim.x * gridDim.y * gridDim.z, window, sinks, fmt); \
    }
ATTENTION_DECODE(64) ATTENTION_DECODE(128) ATTENTION_DECODE(256)

// Causal attention for many query tokens (prefill), flash-style with register tiles: a block of
// 128 threads takes one kv head and 64 query rows (the heads / kv_heads query heads sharing it,
// times 64 / that many tokens), and walks the positions in tiles of 16 keys, which all 64 rows
// use (the one-row kernel above reads them from L2 once per row). Per tile, with q staged
// transposed in shared memory once: the keys are staged transposed; thread (g, j) =
// (tid / 8, tid % 8) scores rows 4g..4g+3 against keys 2j, 2j+1 (8 dots built up over the head
// dims at once); the 8
// threads of a row group share each row's max and sum by shuffles (online softmax) and write the
// weights to shared memory; the values take the keys' place; thread (g, j) then accumulates rows
// 4g..4g+3 at dims 4j + 32i. The blocks with the most positions (the last tokens) start first.
// Grid (kv_heads, ceil(ntok / (64 / group))), 128 threads; group divides 64; HD 64 or 128. With a
// sliding `window` (0: none) the tiles start at the block's first token's first visible position
// and each row masks what it does not see; with `sinks` (null: none) each row's head's sink joins
// its softmax at the end.
template <int HD>
__device__ void attention_tiles(const float* q, const float* keys, const float* values,
                                float* out, int heads, int kv_heads, int total, int ntok,
                                float scale, int window, const float* sinks) {
    constexpr int R = 64, TK = 16, RP = R + 4, KP = TK + 2, DV = HD / 32;
    constexpr int KV_WORDS = HD * KP > TK * HD ? HD * KP : TK * HD;
    __shared__ __align__(16) float qt[HD][RP];   // q transposed: qt[d][row]
    __shared__ __align__(16) float kv[KV_WORDS];  // keys transposed [HD][KP], then values [TK][HD]
    __shared__ __align__(16) float pt[TK][RP];   // weights transposed: pt[key][row]
    const int tid = threadIdx.x, g = tid / 8, j = tid % 8;
    const int kvh = blockIdx.x, group = heads / kv_heads, qt_tokens = R / group;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * qt_tokens, width = kv_heads * HD;
    for (int idx = tid; idx < R * HD / 4; idx += blockDim.x) {
        const int rho = idx / (HD / 4), d = (idx % (HD / 4)) * 4;
        const int t = t0 + rho % qt_tokens, h = kvh * group + rho / qt_tokens;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t < ntok) v = *reinterpret_cast<const float4*>(q + ((long)t * heads + h) * HD + d);
        qt[d][rho] = v.x;
        qt[d + 1][rho] = v.y;
        qt[d + 2][rho] = v.z;
        qt[d + 3][rho] = v.w;
    }
    // Row 4g + i sees positions [lo_row[i], n_row[i]) (n_row 0: no such row): position p when
    // (unsigned)(p - lo_row) < span_row = n_row - lo_row.
    int n_row[4], lo_row[4];
    unsigned span_row[4];
    float m[4], l[4], acc[4][4 * DV];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int t = t0 + (4 * g + i) % qt_tokens;
        n_row[i] = t < ntok ? total - ntok + t + 1 : 0;
        lo_row[i] = window > 0 ? n_row[i] - window : 0;
        span_row[i] = (unsigned)(n_row[i] - lo_row[i]);
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4 * DV; c++) acc[i][c] = 0.0f;
    }
    const int n_block = total - ntok + min(t0 + qt_tokens, ntok);
    // The first position a row of the block sees: its first token's (t0 < ntok).
    const int p_begin = window > 0 ? max(0, total - ntok + t0 + 1 - window) : 0;
    for (int p0 = p_begin; p0 < n_block; p0 += TK) {
        __syncthreads();  // the previous tile's values and weights are used up
        for (int idx = tid; idx < TK * HD / 4; idx += blockDim.x) {
            const int p = idx / (HD / 4), d = (idx % (HD / 4)) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (p0 + p < n_block)
                v = *reinterpret_cast<const float4*>(keys + (long)(p0 + p) * width + (long)kvh * HD + d);
            kv[d * KP + p] = v.x;
            kv[(d + 1) * KP + p] = v.y;
            kv[(d + 2) * KP + p] = v.z;
            kv[(d + 3) * KP + p] = v.w;
        }
        __syncthreads();
        float s[4][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll 8
        for (int d = 0; d < HD; d++) {
            const float4 a = *reinterpret_cast<const float4*>(&qt[d][4 * g]);
            const float2 b = *reinterpret_cast<const float2*>(&kv[d * KP + 2 * j]);
            s[0][0] = fmaf(a.x, b.x, s[0][0]); s[0][1] = fmaf(a.x, b.y, s[0][1]);
            s[1][0] = fmaf(a.y, b.x, s[1][0]); s[1][1] = fmaf(a.y, b.y, s[1][1]);
            s[2][0] = fmaf(a.z, b.x, s[2][0]); s[2][1] = fmaf(a.z, b.y, s[2][1]);
            s[3][0] = fmaf(a.w, b.x, s[3][0]); s[3][1] = fmaf(a.w, b.y, s[3][1]);
        }
        float correction[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const bool valid = (unsigned)(p0 + 2 * j + c - lo_row[i]) < span_row[i];
                s[i][c] = valid ? s[i][c] * scale : -INFINITY;
                mx = fmaxf(mx, s[i][c]);
            }
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[i], mx);
            // A row that has seen nothing yet (or never will) keeps zeros.
            correction[i] = m_new == -INFINITY ? 1.0f : expf(m[i] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const float e = s[i][c] == -INFINITY ? 0.0f : expf(s[i][c] - m_new);
                pt[2 * j + c][4 * g + i] = e;
                sum += e;
            }
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[i] = l[i] * correction[i] + sum;
            m[i] = m_new;
        }
        __syncthreads();  // the keys are used up, the weights written
        for (int idx = tid; idx < TK * HD / 4; idx += blockDim.x) {
            const int p = idx / (HD / 4), d = (idx % (HD / 4)) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (p0 + p < n_block)
                v = *reinterpret_cast<const float4*>(values + (long)(p0 + p) * width + (long)kvh * HD + d);
            *reinterpret_cast<float4*>(&kv[p * HD + d]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int c = 0; c < 4 * DV; c++) acc[i][c] *= correction[i];
#pragma unroll 4
        for (int p = 0; p < TK; p++) {
            const float4 w = *reinterpret_cast<const float4*>(&pt[p][4 * g]);
            const float wr[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int u = 0; u < DV; u++) {
                const float4 v = *reinterpret_cast<const float4*>(&kv[p * HD + 4 * j + 32 * u]);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[i][4 * u] = fmaf(wr[i], v.x, acc[i][4 * u]);
                    acc[i][4 * u + 1] = fmaf(wr[i], v.y, acc[i][4 * u + 1]);
                    acc[i][4 * u + 2] = fmaf(wr[i], v.z, acc[i][4 * u + 2]);
                    acc[i][4 * u + 3] = fmaf(wr[i], v.w, acc[i][4 * u + 3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int rho = 4 * g + i, t = t0 + rho % qt_tokens, h = kvh * group + rho / qt_tokens;
        if (t >= ntok) continue;
        // out = acc c / (l c + e^(sink - m')) with m' = max(m, sink), c = e^(m - m'); without a
        // sink, c = 1 and acc / l.
        float c = 1.0f, denom = l[i];
        if (sinks != nullptr) {
            const float sk = sinks[h], top = fmaxf(m[i], sk);
            c = expf(m[i] - top);
            denom = l[i] * c + expf(sk - top);
        }
        float* o = out + ((long)t * heads + h) * HD;
#pragma unroll
        for (int u = 0; u < DV; u++)
            *reinterpret_cast<float4*>(o + 4 * j + 32 * u) =
                make_float4(acc[i][4 * u] * c / denom, acc[i][4 * u + 1] * c / denom,
                            acc[i][4 * u + 2] * c / denom, acc[i][4 * u + 3] * c / denom);
    }
}

#define ATTENTION_TILES(HD) \
    extern "C" __global__ void __launch_bounds__(128) attention_tiles_##HD( \
        const float* q, const float* keys, const float* values, float* out, int heads, \
        int kv_heads, int total, int ntok, float scale, int window, const float* sinks) { \
        PDL_START(); \
        attention_tiles<HD>(q, keys, values, out, heads, kv_heads, total, ntok, scale, window, \
                            sinks); \
    }
ATTENTION_TILES(64) ATTENTION_TILES(128)

// ------------------------------------------------------------------------------------------------
// Routing and experts
// ------------------------------------------------------------------------------------------------

// Softmax over one row of E router logits and its top k (ties to the lower index), optionally
// renormalised, by one warp, with lane l holding the probabilities of experts l, l + 32, ... (V
// of them, E <= 32 V) in registers. Each pick is two warp reductions: the largest probability
// (non-negative floats order as their bits; picked ones become -1), then the lowest index that
// holds it. The logits are read past L1: other blocks may have just written them. (Against the
// probabilities in shared memory and five shuffle steps per pick: the router of a Qwen3-30B-A3B
// decode step 6.75 -> 4.48 us in a graph of dependent launches, bench/cuda/route_chain.cu, H100.)
template <int V>
__device__ void route_row_v(const float* row, int E, int k, int normalize, uint32_t* ids,
                            float* weights) {
    const int lane = threadIdx.x % 32;
    float p[V];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < V; j++) {
        p[j] = lane + 32 * j < E ? __ldcg(row + lane + 32 * j) : -INFINITY;
        mx = fmaxf(mx, p[j]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < V; j++) {
        const bool in = lane + 32 * j < E;
        p[j] = in ? expf(p[j] - mx) : -1.0f;
        if (in) sum += p[j];
    }
    sum = warp_sum(sum);
    float chosen_total = 0.0f;
    float my_p = 0.0f;  // lane j keeps the j-th choice
    int my_id = 0;
    for (int j = 0; j < k; j++) {
        int best = __float_as_int(p[0]), best_i = lane;
#pragma unroll
        for (int v = 1; v < V; v++) {
            if (__float_as_int(p[v]) > best) {
                best = __float_as_int(p[v]);
                best_i = lane + 32 * v;
            }
        }
        const int top = __reduce_max_sync(0xffffffffu, best);
        const int at = (int)__reduce_min_sync(0xffffffffu, best == top ? (unsigned)best_i : ~0u);
        const float pj = __int_as_float(top) / sum;
        chosen_total += pj;
        if (lane == j) {
            my_p = pj;
            my_id = at;
        }
#pragma unroll
        for (int v = 0; v < V; v++)
            if (lane + 32 * v == at) p[v] = -1.0f;
    }
    if (lane < k) {
        ids[lane] = (uint32_t)my_id;
        weights[lane] = normalize ? my_p / chosen_total : my_p;
    }
}

// route_row_v with the fewest registers that hold E <= 1024 logits (one copy in the PTX, called by
// the routing kernels).
__device__ __noinline__ void route_row(const float* row, int E, int k, int normalize,
                                       uint32_t* ids, float* weights) {
    if (E <= 32) route_row_v<1>(row, E, k, normalize, ids, weights);
    else if (E <= 64) route_row_v<2>(row, E, k, normalize, ids, weights);
    else if (E <= 128) route_row_v<4>(row, E, k, normalize, ids, weights);
    else if (E <= 256) route_row_v<8>(row, E, k, normalize, ids, weights);
    else if (E <= 512) route_row_v<16>(row, E, k, normalize, ids, weights);
    else route_row_v<32>(row, E, k, normalize, ids, weights);
}

// route_row for each row of logits [T, E]: one warp per row; E <= 1024, k <= 32.
extern "C" __global__ void __launch_bounds__(128) route(const float* logits, int ntok, int E, int k,
                                                        int normalize, uint32_t* ids,
                                                        float* weights) {
    PDL_START();
    const int warp = threadIdx.x / 32;
    const long t = (long)blockIdx.x * 4 + warp;
    if (t >= ntok) return;
    route_row(logits + t * E, E, k, normalize, ids + t * k, weights + t * k);
}

// The warp's largest `best` and its index (ties to the lower index), in every lane.
__device__ __forceinline__ void warp_argmax(float& best, int& best_i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ob > best || (ob == best && oi < best_i)) {
            best = ob;
            best_i = oi;
        }
    }
}

// DeepSeek-V3 / GLM-4.5 routing (`noaux_tc`) of one row of E router logits by one warp: experts
// chosen by sigmoid(logit) + bias within the best top_groups of `groups` (<= 32) equal groups (a
// group scores the sum of its two best; the others count as 0), ties to the lower index; weighted
// by sigmoid(logit), renormalised when `normalize` (and k > 1), times `scale`. `choice` is E
// floats of shared memory.
__device__ void route_sigmoid_row(const float* row, const float* bias, int E, int k, int groups,
                                  int top_groups, int normalize, float scale, float* choice,
                                  uint32_t* ids, float* weights) {
    const int lane = threadIdx.x % 32;
    for (int i = lane; i < E; i += 32) choice[i] = sigmoid1(__ldcg(row + i)) + bias[i];
    __syncwarp();
    if (groups > 1) {
        const int per = E / groups;
        float score = -INFINITY;
        if (lane < groups) {
            float a = -INFINITY, b = -INFINITY;  // the group's two best
            for (int i = lane * per; i < (lane + 1) * per; i++) {
                const float c = choice[i];
                if (c > a) {
                    b = a;
                    a = c;
                } else if (c > b) {
                    b = c;
                }
            }
            score = a + b;
        }
        uint32_t kept = 0;
        for (int j = 0; j < top_groups; j++) {
            const bool open = lane < groups && !((kept >> lane) & 1u);
            float best = open ? score : -INFINITY;
            int best_i = open ? lane : 0x7fffffff;
            warp_argmax(best, best_i);
            kept |= 1u << best_i;
        }
        for (int i = lane; i < E; i += 32)
            if (!((kept >> (i / per)) & 1u)) choice[i] = 0.0f;
        __syncwarp();
    }
    float total = 0.0f, my_w = 0.0f;
    int my_id = 0;
    for (int j = 0; j < k; j++) {
        float best = -INFINITY;
        int best_i = 0x7fffffff;
        for (int i = lane; i < E; i += 32) {
            const float c = choice[i];
            if (c > best || (c == best && i < best_i)) {
                best = c;
                best_i = i;
            }
        }
        warp_argmax(best, best_i);
        const float w = sigmoid1(__ldcg(row + best_i));
        total += w;
        if (lane == j) {
            my_w = w;
            my_id = best_i;
        }
        if (lane == 0) choice[best_i] = -INFINITY;
        __syncwarp();
    }
    if (lane < k) {
        ids[lane] = (uint32_t)my_id;
        weights[lane] = (normalize && k > 1 ? my_w / total : my_w) * scale;
    }
}

// route_sigmoid_row for each row of logits [T, E]: one warp per row; E <= 1024, k <= 32.
extern "C" __global__ void __launch_bounds__(128) route_sigmoid(
    const float* logits, const float* bias, int ntok, int E, int k, int groups, int top_groups,
    int normalize, float scale, uint32_t* ids, float* weights) {
    PDL_START();
    __shared__ float choice[4][1024];
    const int warp = threadIdx.x / 32;
    const long t = (long)blockIdx.x * 4 + warp;
    if (t >= ntok) return;
    route_sigmoid_row(logits + t * E, bias, E, k, groups, top_groups, normalize, scale,
                      choice[warp], ids + t * k, weights + t * k);
}

// A routed pair the MoE kernels skip (its expert computed elsewhere: host_split_plan).
#define SKIP_EXPERT 0xffffffffu

// The slot of expert e among the experts a call has: `present` (ascending ids) or, when
// n_present < 0, every expert (slot = e); -1 for SKIP_EXPERT.
// Before an MoE kernel waits for the routing: asks L2 for the expert table (its `entries`), spread
// over the grid's blocks, so that the description of each routed expert is near once the ids are
// known (the table is read once a layer and token, and is long out of L2 by then).
__device__ __forceinline__ void prefetch_table(const ExpertMats* table, int entries) {
    if (!(early_loads & EARLY_TABLE)) return;
    const long lines = ((long)entries * (long)sizeof(ExpertMats) + 127) / 128;
    const long block = (long)blockIdx.y * gridDim.x + blockIdx.x;
    const long threads = (long)gridDim.x * gridDim.y * blockDim.x;
    for (long l = block * blockDim.x + threadIdx.x; l < lines; l += threads)
        prefetch_l2(reinterpret_cast<const uint8_t*>(table) + l * 128);
}

__device__ __forceinline__ int expert_slot(uint32_t e, const uint32_t* present, int n_present) {
    if (e == SKIP_EXPERT) return -1;
    if (n_present < 0) return (int)e;
    int lo = 0, hi = n_present;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (present[mid] < e) lo = mid + 1;
        else hi = mid;
    }
    return (lo < n_present && present[lo] == e) ? lo : -1;
}

// h[t * K + j] = act(gate_e(x_t), up_e(x_t)) for e = ids[t * K + j] (ffn_gate_up: biases and the
// activation as `f` says), for every routed pair whose expert is present. Grid (inter / 16, T * K):
// each warp computes two rows of gate and up for one pair, the four rows' loads in flight
// together; the expert's description is read once per block.
template <int WK>
__device__ void moe_gate_up(const ExpertMats* experts, const uint32_t* present, int n_present,
                            const uint32_t* ids, int K, const float* x, float* h, Ffn f) {
    __shared__ Mat gate, up;
    __shared__ int slot;
    const int pair = blockIdx.y;
    if (threadIdx.x == 0) {
        slot = expert_slot(ids[pair], present, n_present);
        if (slot >= 0) {
            gate = experts[slot].gate;
            up = experts[slot].up;
        }
    }
    __syncthreads();
    if (slot < 0) return;
    // Registers, not shared memory, inside the loop.
    const Mat g_m = gate, u_m = up;
    const long r0 = ((long)blockIdx.x * 8 + threadIdx.x / 32) * 2;
    if (r0 >= g_m.rows) return;
    const int lane = threadIdx.x % 32;
    const float* xt = x + (long)(pair / K) * g_m.cols;
    const long r1 = min(r0 + 1, (long)g_m.rows - 1);
    float g0 = 0.0f, g1 = 0.0f, u0 = 0.0f, u1 = 0.0f;
    for (int c = lane * 8; c < g_m.cols; c += 32 * 8) {
        float wg0[8], wg1[8], wu0[8], wu1[8];
        load8k<WK>(g_m, r0, c, wg0);
        load8k<WK>(g_m, r1, c, wg1);
        load8k<WK>(u_m, r0, c, wu0);
        load8k<WK>(u_m, r1, c, wu1);
        const float4* xp = reinterpret_cast<const float4*>(xt + c);
        const float4 a = xp[0], b = xp[1];
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            g0 = fmaf(wg0[j], xv[j], g0);
            g1 = fmaf(wg1[j], xv[j], g1);
            u0 = fmaf(wu0[j], xv[j], u0);
            u1 = fmaf(wu1[j], xv[j], u1);
        }
    }
    g0 = warp_sum(g0); g1 = warp_sum(g1); u0 = warp_sum(u0); u1 = warp_sum(u1);
    if (lane == 0) {
        float* hp = h + (long)pair * g_m.rows;
        const uint32_t e = ids[pair];
        hp[r0] = ffn_gate_up(f, e, g_m.rows, r0, g0, u0);
        if (r0 + 1 < g_m.rows) hp[r0 + 1] = ffn_gate_up(f, e, g_m.rows, r0 + 1, g1, u1);
    }
}

// The most experts per token the down kernel keeps in registers.
#define MOE_MAX_K 16

// The present experts of token t in ascending id (insertion sort, K <= MOE_MAX_K): their down
// projections (unless `down` is null), routing weights and pair indices; returns how many. One
// thread calls it.
__device__ int token_experts(const ExpertMats* experts, const uint32_t* present, int n_present,
                             const uint32_t* ids, const float* weights, int K, long t, Mat* down,
                             float* weight, int* pair_of) {
    uint32_t sorted_id[MOE_MAX_K];
    int m = 0;
    for (int j = 0; j < K; j++) {
        const uint32_t e = ids[t * K + j];
        const int slot = expert_slot(e, present, n_present);
        if (slot < 0) continue;
        int at = m++;
        while (at > 0 && sorted_id[at - 1] > e) {
            sorted_id[at] = sorted_id[at - 1];
            if (down != nullptr) down[at] = down[at - 1];
            weight[at] = weight[at - 1];
            pair_of[at] = pair_of[at - 1];
            at--;
        }
        sorted_id[at] = e;
        if (down != nullptr) down[at] = experts[slot].down;
        weight[at] = weights[t * K + j];
        pair_of[at] = (int)(t * K + j);
    }
    return m;
}

// ---- block-per-row kernels ----
//
// A block of 128 threads shares one output row's columns (llama.cpp's mapping): many more threads,
// and so many more loads in flight, than a warp per row when rows are few or short.

// acc[i][t] = dot(row r_i, x_t) over the block (result in thread 0), for the N rows given. With
// SWIGLU, x_t is swiglu(x_t, up_t), made as it is read (as the swiglu kernel makes it).
template <int K, int T, int N, bool SWIGLU = false>
__device__ __forceinline__ void block_rows_dot(const Mat* m, const long* r, const float* x,
                                               long x_stride, float acc[N][T],
                                               const float* up = nullptr) {
    __shared__ float red[N][T][4];
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[i][t] = 0.0f;
    const int cols = m[0].cols;
#pragma unroll 2
    for (int c = threadIdx.x * 8; c < cols; c += 128 * 8) {
        float w[N][8];
#pragma unroll
        for (int i = 0; i < N; i++) load8k<K>(m[i], r[i], c, w[i]);
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float4* xp = reinterpret_cast<const float4*>(x + t * x_stride + c);
            float4 a = xp[0], b = xp[1];
            if (SWIGLU) {
                const float4* upp = reinterpret_cast<const float4*>(up + t * x_stride + c);
                const float4 ua = upp[0], ub = upp[1];
                a = make_float4(swiglu1(a.x, ua.x), swiglu1(a.y, ua.y), swiglu1(a.z, ua.z),
                                swiglu1(a.w, ua.w));
                b = make_float4(swiglu1(b.x, ub.x), swiglu1(b.y, ub.y), swiglu1(b.z, ub.z),
                                swiglu1(b.w, ub.w));
            }
#pragma unroll
            for (int i = 0; i < N; i++) {
                float s = acc[i][t];
                s = fmaf(w[i][0], a.x, s); s = fmaf(w[i][1], a.y, s);
                s = fmaf(w[i][2], a.z, s); s = fmaf(w[i][3], a.w, s);
                s = fmaf(w[i][4], b.x, s); s = fmaf(w[i][5], b.y, s);
                s = fmaf(w[i][6], b.z, s); s = fmaf(w[i][7], b.w, s);
                acc[i][t] = s;
            }
        }
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float v = warp_sum(acc[i][t]);
            if (lane == 0) red[i][t][warp] = v;
        }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < N; i++)
#pragma unroll
            for (int t = 0; t < T; t++)
                acc[i][t] = (red[i][t][0] + red[i][t][1]) + (red[i][t][2] + red[i][t][3]);
    }
}

// y[T, rows] = x[T, cols] W^T, T <= 8: one block of 128 per row.
template <int K, int T>
__device__ void gemv_b(const Mat& w, const float* x, float* y) {
    const long r = blockIdx.x;
    float acc[1][T];
    block_rows_dot<K, T, 1>(&w, &r, x, w.cols, acc);
    if (threadIdx.x == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) y[t * (long)w.rows + r] = acc[0][t];
    }
}

// One product per head (Multi-head Latent Attention's absorbed projections): x [rows, heads *
// w.cols], W [heads * out, w.cols]; y[t, j] = x[t, head(j) * w.cols ..] . W[j] with head(j) =
// j / out. A warp per output value, any weight format; small matrices, so no tiling.
extern "C" __global__ void __launch_bounds__(256) matmul_heads(Mat w, const float* x, float* y,
                                                              int rows, int out) {
    PDL_START();
    const long gw = (long)blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (gw >= (long)rows * w.rows) return;
    const long t = gw / w.rows;
    const int j = (int)(gw % w.rows);
    const float* xr = x + (t * (w.rows / out) + j / out) * (long)w.cols;
    float s = 0.0f;
    for (int c = lane * 8; c < w.cols; c += 256) {
        float wv[8];
        load8_any(w, j, c, wv);
#pragma unroll
        for (int k = 0; k < 8; k++) s = fmaf(wv[k], xr[c + k], s);
    }
    s = warp_sum(s);
    if (lane == 0) y[t * w.rows + j] = s;
}

#define GEMV_B(K, KN, T) \
    extern "C" __global__ void __launch_bounds__(128) gemv_##KN##_t##T##_b(Mat w, const float* x, \
                                                                         float* y) { PDL_START(); \
        gemv_b<K, T>(w, x, y); \
    }
// A shared expert's down projection with its SwiGLU and its one-row gate, added onto y:
// y[t, r] += sigmoid(gate[t]) * (W[r] . swiglu(g_t, u_t)), T <= 8, a block of 128 per row. The
// same arithmetic in the same order as swiglu, gemv_b, sigmoid_mul and add_assign in turn (the
// product and the sum rounded apart, as those kernels round them).
template <int K, int T>
__device__ void gemv_gated_add(const Mat& w, const float* g, const float* u, const float* gate,
                               float* y) {
    const long r = blockIdx.x;
    float acc[1][T];
    block_rows_dot<K, T, 1, true>(&w, &r, g, w.cols, acc, u);
    if (threadIdx.x == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) {
            float* o = y + t * (long)w.rows + r;
            *o = __fadd_rn(*o, __fmul_rn(acc[0][t], sigmoid1(gate[t])));
        }
    }
}

#define GEMV_GATED(K, KN, T) \
    extern "C" __global__ void __launch_bounds__(128) gemv_gated_##KN##_t##T( \
        Mat w, const float* g, const float* u, const float* gate, float* y) { PDL_START(); \
        gemv_gated_add<K, T>(w, g, u, gate, y); \
    }
#define GEMV_GATED_ALL(K, KN) \
    GEMV_GATED(K, KN, 1) GEMV_GATED(K, KN, 2) GEMV_GATED(K, KN, 3) GEMV_GATED(K, KN, 4) \
    GEMV_GATED(K, KN, 5) GEMV_GATED(K, KN, 6) GEMV_GATED(K, KN, 7) GEMV_GATED(K, KN, 8)
GEMV_GATED_ALL(K_GENERIC, generic) GEMV_GATED_ALL(K_Q4, q4) GEMV_GATED_ALL(K_Q8, q8)
GEMV_GATED_ALL(K_BF16, bf16) GEMV_GATED_ALL(K_MXFP4, mxfp4)

#define GEMV_B_ALL(K, KN) \
    GEMV_B(K, KN, 1) GEMV_B(K, KN, 2) GEMV_B(K, KN, 3) GEMV_B(K, KN, 4) GEMV_B(K, KN, 5) \
    GEMV_B(K, KN, 6) GEMV_B(K, KN, 7) GEMV_B(K, KN, 8)
GEMV_B_ALL(K_GENERIC, generic) GEMV_B_ALL(K_Q4, q4) GEMV_B_ALL(K_Q8, q8) GEMV_B_ALL(K_BF16, bf16)
GEMV_B_ALL(K_MXFP4, mxfp4)

// moe_down with one block of 128 per (output row, token): grid (hidden, T). Warp w computes the
// dots of the token's w-th, (w + 4)-th, ... present expert (ascending id), each by one warp alone;
// thread 0 adds them (with their down biases, `f`) weighted in ascending id (bit-identical however
// the experts are split).
template <int WK>
__device__ void moe_down_b(const ExpertMats* experts, const uint32_t* present, int n_present,
                           const uint32_t* ids, const float* weights, int K, const float* h,
                           float* out, int hidden, Ffn f) {
    __shared__ Mat down[MOE_MAX_K];
    __shared__ float weight[MOE_MAX_K], dot[MOE_MAX_K];
    __shared__ int pair_of[MOE_MAX_K];
    __shared__ int n;
    const long t = blockIdx.y;
    if (threadIdx.x == 0) n = token_experts(experts, present, n_present, ids, weights, K, t, down,
                                            weight, pair_of);
    __syncthreads();
    const long r = blockIdx.x;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int j = warp; j < n; j += 4) {
        const Mat d = down[j];
        const float* hp = h + (long)pair_of[j] * d.cols;
        float acc[1][1];
        warp_rows_dot<WK, 1, 1>(d, r, hp, 0, acc);
        if (lane == 0) dot[j] = acc[0][0];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = out[t * hidden + r];
        for (int j = 0; j < n; j++)
            acc = fmaf(weight[j], ffn_down(f, ids[pair_of[j]], hidden, r, dot[j]), acc);
        out[t * hidden + r] = acc;
    }
}

#define MOE_B(WK, KN) \
    extern "C" __global__ void __launch_bounds__(128) moe_down_##KN##_b( \
        const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids, \
        const float* weights, int K, const float* h, float* out, int hidden, Ffn f) { PDL_START(); \
        moe_down_b<WK>(experts, present, n_present, ids, weights, K, h, out, hidden, f); \
    }
MOE_B(K_GENERIC, generic) MOE_B(K_Q4, q4) MOE_B(K_Q8, q8) MOE_B(K_BF16, bf16) MOE_B(K_MXFP4, mxfp4)

#define MOE(WK, KN) \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_##KN( \
        const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids, \
        int K, const float* x, float* h, Ffn f) { PDL_START(); \
        moe_gate_up<WK>(experts, present, n_present, ids, K, x, h, f); \
    }
MOE(K_GENERIC, generic) MOE(K_Q4, q4) MOE(K_Q8, q8) MOE(K_BF16, bf16) MOE(K_MXFP4, mxfp4)

// ---- 4-bit decode MoE, every load of a warp in flight at once ----
//
// Measured on an H100 (one token, 8 experts, 4-bit g64; an isolated benchmark over distinct
// experts, so nothing sits in L2): the kernels above wait on one chain of dependent loads after
// another (thread 0 ranks a token's experts alone; a warp walks its columns in short steps), at
// 300-730 GB/s. These two keep more loads in flight: gate/up 19.3 -> 13.8 us (Qwen3-30B-A3B
// shape) and 18.4 -> 11.9 us (Qwen3.5-35B-A3B), down 23.4 -> 15.1 and 20.5 -> 11.0 us. Warps that
// walk more rows, reuse activations across rows or load 32 codes at a time were all slower.

#define FULL_MASK 0xffffffffu

// NW consecutive u32 words of codes (8 NW 4-bit weights) in one load.
template <int NW>
__device__ __forceinline__ void load_words(const uint32_t* p, uint32_t w[NW]) {
    if constexpr (NW == 1) {
        w[0] = __ldg(p);
    } else if constexpr (NW == 2) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x; w[1] = v.y;
    } else {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
}

// N consecutive floats (N % 4 == 0, 16-byte aligned).
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float v[N]) {
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        const float4 a = reinterpret_cast<const float4*>(p)[i];
        v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
    }
}

// sum over the 8 NW codes q_j of q_j x_j.
template <int NW>
__device__ __forceinline__ float q4_dot(const uint32_t w[NW], const float* x) {
    float d = 0.0f;
#pragma unroll
    for (int k = 0; k < NW; k++)
#pragma unroll
        for (int j = 0; j < 8; j++) d = fmaf(u2f((w[k] >> (4 * j)) & 15u), x[8 * k + j], d);
    return d;
}

// acc + sum over the 8 NW codes of (s q_j + b) x_j, each weight dequantised as load8k does.
template <int NW>
__device__ __forceinline__ float q4_dequant_dot(const uint32_t w[NW], float s, float b,
                                                const float* x, float acc) {
#pragma unroll
    for (int k = 0; k < NW; k++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc = fmaf(fmaf(s, u2f((w[k] >> (4 * j)) & 15u), b), x[8 * k + j], acc);
    return acc;
}

// The fast decode kernels (`_i8`, `--kernels fast`): 16 activations quantized to 8-bit codes of
// one scale d = max|x| / 127 and multiplied in integers (dp4a: four code x code products an
// instruction, against about five instructions a weight for an exact one), as llama.cpp's Q8_1
// products do, but per 16 columns. The codes are packed to meet a 4-bit word's nibbles: byte k of
// e[w] holds column 8 w + 2 k (the word's low nibbles), of o[w] column 8 w + 2 k + 1 (its high
// ones). `sum` is the unrounded values' sum, for the groups' biases (exact, as in the f32 path).
struct X16 {
    int e[2], o[2];
    float d, sum;
};

// Four codes in [-127, 127] as the bytes of a word, a first (two's complement).
__device__ __forceinline__ int pack4(int a, int b, int c, int d) {
    return (int)(((uint32_t)a & 255u) | (((uint32_t)b & 255u) << 8) | (((uint32_t)c & 255u) << 16) |
                 ((uint32_t)d << 24));
}

__device__ __forceinline__ X16 quant16(const float xv[16]) {
    X16 q;
    float amax = 0.0f, s = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        amax = fmaxf(amax, fabsf(xv[j]));
        s += xv[j];
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma unroll
    for (int w = 0; w < 2; w++) {
        q.e[w] = pack4(__float2int_rn(xv[8 * w] * inv), __float2int_rn(xv[8 * w + 2] * inv),
                       __float2int_rn(xv[8 * w + 4] * inv), __float2int_rn(xv[8 * w + 6] * inv));
        q.o[w] = pack4(__float2int_rn(xv[8 * w + 1] * inv), __float2int_rn(xv[8 * w + 3] * inv),
                       __float2int_rn(xv[8 * w + 5] * inv), __float2int_rn(xv[8 * w + 7] * inv));
    }
    q.d = amax / 127.0f;
    q.sum = s;
    return q;
}

// The 16 codes of two words against q's, in integers.
__device__ __forceinline__ int q4_dot_i8(const uint32_t w[2], const X16& q) {
    int a = 0;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        a = __dp4a((int)(w[k] & 0x0F0F0F0Fu), q.e[k], a);
        a = __dp4a((int)((w[k] >> 4) & 0x0F0F0F0Fu), q.o[k], a);
    }
    return a;
}

// A shared expert computed in the routed experts' launches (Qwen3.5, Qwen3-Next): its gate, up and
// down projections, of the routed experts' shape, and its one-row gate `scale`; `weight[t]` is
// sigmoid(scale . x_t), which the gate/up kernel writes and the down kernel reads.
struct SharedExpert {
    Mat gate, up, down, scale;
    float* weight;
};

// moe_gate_up for 4-bit weights with cols % 16 == 0 and group >= 16: each warp computes two rows
// of gate and up for one pair, 16 columns per lane per step, each step's group as
// s * sum(q x) + b * sum(x). Grid (inter / (2 warps), T * K), or with SHARED (T * (K + 1)): pair
// T * K + t is token t's shared expert (plain SwiGLU), and its first block also computes the
// shared expert's weight.
template <bool SHARED, bool I8 = false>
__device__ void moe_gate_up_q4w(const ExpertMats* experts, const uint32_t* present, int n_present,
                                const uint32_t* ids, int K, const float* x, float* h, Ffn f,
                                const SharedExpert* sh) {
    constexpr int CW = 16, NW = CW / 8, R = 2;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int pair = blockIdx.y;
    const int routed = SHARED ? gridDim.y / (K + 1) * K : gridDim.y;
    Mat g, u;
    uint32_t e;
    long tok;
    if (!SHARED || pair < routed) {
        e = ids[pair];
        const int slot = expert_slot(e, present, n_present);
        if (slot < 0) return;
        g = experts[slot].gate;
        u = experts[slot].up;
        tok = pair / K;
    } else {
        // No expert id: ffn_gate_up adds no per-expert biases (the host fuses plain SwiGLU only).
        e = 0xffffffffu;
        g = sh->gate;
        u = sh->up;
        tok = pair - routed;
        if (blockIdx.x == 0) {
            // Before any early return: block_rows_dot waits for the whole block.
            float acc[1][1];
            const long r = 0;
            block_rows_dot<K_GENERIC, 1, 1>(&sh->scale, &r, x + tok * sh->scale.cols, 0, acc);
            if (threadIdx.x == 0) sh->weight[tok] = sigmoid1(acc[0][0]);
        }
    }
    const long r0 = ((long)blockIdx.x * (blockDim.x / 32) + warp) * R;
    if (r0 >= g.rows) return;
    const float* xt = x + tok * g.cols;
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
        float xv[CW];
        load_floats<CW>(xt + c, xv);
        if constexpr (I8) {
            const X16 q = quant16(xv);
#pragma unroll
            for (int i = 0; i < R; i++) {
                ag[i] = fmaf(sg[i] * q.d, (float)q4_dot_i8(wg[i], q), fmaf(bg[i], q.sum, ag[i]));
                au[i] = fmaf(su[i] * q.d, (float)q4_dot_i8(wu[i], q), fmaf(bu[i], q.sum, au[i]));
            }
            continue;
        }
        float xs = 0.0f;
#pragma unroll
        for (int j = 0; j < CW; j++) xs += xv[j];
#pragma unroll
        for (int i = 0; i < R; i++) {
            ag[i] = fmaf(sg[i], q4_dot<NW>(wg[i], xv), fmaf(bg[i], xs, ag[i]));
            au[i] = fmaf(su[i], q4_dot<NW>(wu[i], xv), fmaf(bu[i], xs, au[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
        const float gs = warp_sum(ag[i]), us = warp_sum(au[i]);
        if (lane == 0 && r0 + i < g.rows)
            h[(long)pair * g.rows + r0 + i] = ffn_gate_up(f, e, g.rows, r0 + i, gs, us);
    }
}

// moe_gate_up_q4_w, and _shared with the shared expert's pairs after the routed ones (h [T (K +
// 1), inter]); with I8 (the `_i8` names) on 8-bit activations (X16; the shared expert's sigmoid
// gate stays exact).
#define MOE_GATE_UP_Q4W(NAME, SHARED_NAME, I8) \
    extern "C" __global__ void __launch_bounds__(128) NAME( \
        const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids, \
        int K, const float* x, float* h, Ffn f) { \
        PDL_LAUNCH_DEPENDENTS(); \
        prefetch_table(experts, f.table); \
        PDL_WAIT(); \
        moe_gate_up_q4w<false, I8>(experts, present, n_present, ids, K, x, h, f, nullptr); \
    } \
    extern "C" __global__ void __launch_bounds__(128) SHARED_NAME( \
        const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids, \
        int K, const float* x, float* h, Ffn f, SharedExpert sh) { \
        PDL_LAUNCH_DEPENDENTS(); \
        prefetch_table(experts, f.table); \
        PDL_WAIT(); \
        moe_gate_up_q4w<true, I8>(experts, present, n_present, ids, K, x, h, f, &sh); \
    }
MOE_GATE_UP_Q4W(moe_gate_up_q4_w, moe_gate_up_q4_w_shared, false)
MOE_GATE_UP_Q4W(moe_gate_up_q4_w_i8, moe_gate_up_q4_w_shared_i8, true)

// Rows per block of moe_down_q4_w.
#define MOE_DOWN_W_ROWS 4
// Rows of the down projection longer than this many values (Mixtral's 14336) are cut into
// slices of about this length, up to MOE_DOWN_W_SLICES, that warps take separately: one warp
// streaming a whole long row kept too few loads in flight (Mixtral-8x7B's down projections ran
// at 0.33 TB/s on an H100). The slices depend on the row length alone, so the sums' order does
// not change with the experts a call has.
#define MOE_DOWN_W_SLICE 2048
#define MOE_DOWN_W_SLICES 8

// moe_down for 4-bit weights: a block of W warps takes MOE_DOWN_W_ROWS output rows of token
// blockIdx.y; warp w the token's w-th, (w + W)-th, ... (expert, column slice) pair, the present
// experts in ascending id (each warp ranks the experts itself, a lane per expert), every load of a
// column step in flight together; the dots meet in shared memory, the slices of an expert are
// added in order (then the expert's down bias, `f`), and the experts weighted in ascending id,
// onto `out` when `accumulate`, else from zero (bit-identical however the experts are split over
// calls).
__device__ void moe_down_q4w(const ExpertMats* experts, const uint32_t* present, int n_present,
                             const uint32_t* ids, const float* weights, int K, const float* h,
                             float* out, int hidden, int accumulate, Ffn f) {
    constexpr int CW = 8, NW = 1, R = MOE_DOWN_W_ROWS, NC = 3;
    __shared__ float dots[MOE_MAX_K * MOE_DOWN_W_SLICES][R];
    __shared__ float weight[MOE_MAX_K];
    __shared__ uint32_t expert[MOE_MAX_K];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const long t = blockIdx.y;
    const long r0 = (long)blockIdx.x * R;
    uint32_t e = 0xffffffffu;
    int slot = -1;
    float wj = 0.0f;
    if (lane < K) {
        e = ids[t * K + lane];
        wj = weights[t * K + lane];
        slot = expert_slot(e, present, n_present);
    }
    const bool here = slot >= 0;
    int rank = 0;
    for (int i = 0; i < K; i++) {
        const uint32_t o = __shfl_sync(FULL_MASK, e, i);
        const bool o_here = __shfl_sync(FULL_MASK, slot, i) >= 0;
        rank += o_here && (o < e || (o == e && i < lane));
    }
    const unsigned here_mask = __ballot_sync(FULL_MASK, here);
    const int n = __popc(here_mask);
    // Every expert of a layer has the down projection's shape: the first present one's says it.
    int S = 1, width = 0;
    if (n > 0) {
        const int j0 = __ffs(__ballot_sync(FULL_MASK, here && rank == 0)) - 1;
        const int cols = experts[__shfl_sync(FULL_MASK, slot, j0)].down.cols;
        S = min(MOE_DOWN_W_SLICES, (cols + MOE_DOWN_W_SLICE - 1) / MOE_DOWN_W_SLICE);
        S = max(S, 1);
        width = ((cols + S - 1) / S + 32 * CW - 1) / (32 * CW) * (32 * CW);
    }
    for (int u = warp; u < n * S; u += warps) {
        const int p = u / S, sl = u % S;
        const int j = __ffs(__ballot_sync(FULL_MASK, here && rank == p)) - 1;
        const int sj = __shfl_sync(FULL_MASK, slot, j);
        const float wp = __shfl_sync(FULL_MASK, wj, j);
        const uint32_t ep = __shfl_sync(FULL_MASK, e, j);
        const Mat d = experts[sj].down;
        const float* hp = h + (t * K + j) * (long)d.cols;
        const int groups_per_row = d.cols >> d.gshift;
        const long words_per_row = d.cols / 8;
        const int c_end = min(d.cols, (sl + 1) * width);
        float dot[R];
#pragma unroll
        for (int i = 0; i < R; i++) dot[i] = 0.0f;
        for (int c0 = sl * width; c0 < c_end; c0 += NC * 32 * CW) {
            uint32_t wq[NC][R][NW];
            float s[NC][R], b[NC][R], hv[NC][CW];
#pragma unroll
            for (int k = 0; k < NC; k++) {
                const int c = c0 + lane * CW + k * 32 * CW;
                if (c < c_end) {
                    load_floats<CW>(hp + c, hv[k]);
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        const long r = min(r0 + i, (long)hidden - 1);
                        load_words<NW>(reinterpret_cast<const uint32_t*>(d.data) + r * words_per_row + c / 8, wq[k][i]);
                        const long gi = r * groups_per_row + (c >> d.gshift);
                        s[k][i] = load_scalar(d.scales, d.sdt, gi);
                        b[k][i] = load_scalar(d.biases, d.sdt, gi);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < NC; k++) {
                const int c = c0 + lane * CW + k * 32 * CW;
                if (c < c_end) {
#pragma unroll
                    for (int i = 0; i < R; i++)
                        dot[i] = q4_dequant_dot<NW>(wq[k][i], s[k][i], b[k][i], hv[k], dot[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; i++) {
            const float v = warp_sum(dot[i]);
            if (lane == 0) dots[u][i] = v;
        }
        if (lane == 0 && sl == 0) {
            weight[p] = wp;
            expert[p] = ep;
        }
    }
    __syncthreads();
    if (threadIdx.x < R && r0 + threadIdx.x < hidden) {
        const long r = r0 + threadIdx.x, o = t * hidden + r;
        float acc = accumulate ? out[o] : 0.0f;
        for (int p = 0; p < n; p++) {
            float dp = dots[p * S][threadIdx.x];
            for (int sl = 1; sl < S; sl++) dp += dots[p * S + sl][threadIdx.x];
            acc = fmaf(weight[p], ffn_down(f, expert[p], hidden, r, dp), acc);
        }
        out[o] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_down_q4_w(
    const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids,
    const float* weights, int K, const float* h, float* out, int hidden, int accumulate, Ffn f) {
    PDL_START();
    moe_down_q4w(experts, present, n_present, ids, weights, K, h, out, hidden, accumulate, f);
}

// ---- grouped tensor-core MoE (prefill) ----
//
// Many tokens: the routed pairs are grouped by expert (moe_group), each expert's gate/up and down
// run as tc_tile products over its pairs (moe_gate_up_tc, moe_down_tc: every expert's weights read
// once per 64 pairs, not once per pair), and moe_combine adds the weighted down outputs of each
// token in ascending expert id, as moe_down does, so that splitting the experts over several calls
// gives the same bits.

// offsets[s] .. offsets[s + 1] of `sorted` are the pairs (t * K + j) routed to expert slot s (in no
// particular order: each pair's result does not depend on its neighbours); pairs whose expert is
// absent are left out. One block of 1024 threads; n_slots <= 1024; `rank` is scratch [npairs].
// `tiles` maps the MoE kernels' blocks to work ([3][max_tiles]): tile t of `bn` pairs is slot
// tiles[t]'s (-1: none, past the last), its pairs sorted[tiles[max_tiles + t] ..] and
// tiles[2 max_tiles + t] of them; the slots' tiles in turn, so that no block is launched for an
// expert without pairs.
extern "C" __global__ void __launch_bounds__(1024) moe_group(const uint32_t* present, int n_present,
                                                             const uint32_t* ids, int npairs,
                                                             int n_slots, int* offsets,
                                                             int* sorted, int* rank, int bn,
                                                             int max_tiles, int* tiles) {
    PDL_START();
    __shared__ int count[1024];
    __shared__ int tile_start[1025];
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) count[s] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        const int s = expert_slot(ids[p], present, n_present);
        rank[p] = s < 0 ? -1 : atomicAdd(&count[s], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0, total_tiles = 0;
        for (int s = 0; s < n_slots; s++) {
            const int c = count[s];
            count[s] = total;
            offsets[s] = total;
            tile_start[s] = total_tiles;
            total += c;
            total_tiles += (c + bn - 1) / bn;
        }
        offsets[n_slots] = total;
        tile_start[n_slots] = total_tiles;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        const int r = rank[p];
        if (r >= 0) sorted[count[expert_slot(ids[p], present, n_present)] + r] = p;
    }
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
        const int end = offsets[s + 1];
        for (int t = tile_start[s]; t < tile_start[s + 1] && t < max_tiles; t++) {
            const int first = offsets[s] + (t - tile_start[s]) * bn;
            tiles[t] = s;
            tiles[max_tiles + t] = first;
            tiles[2 * max_tiles + t] = min(bn, end - first);
        }
    }
    for (int t = tile_start[n_slots] + threadIdx.x; t < max_tiles; t += blockDim.x) tiles[t] = -1;
}

// The MoE block's tile: its index in moe_group's `tiles` (y, then z: a grid's y is at most 65535)
// and their number (max_tiles).
__device__ __forceinline__ int moe_tile() { return blockIdx.y + gridDim.y * blockIdx.z; }
__device__ __forceinline__ int moe_tiles() { return gridDim.y * gridDim.z; }

// The expert slot of this MoE block's tile, or -1.
__device__ __forceinline__ int moe_tile_slot(const int* tiles) { return tiles[moe_tile()]; }

// The up-to-BN pairs of this block's tile (blockIdx.y of moe_group's `tiles`, of a slot that
// has one), and their input rows (row pair / row_div of `in`, `cols` wide).
template <int BN>
__device__ __forceinline__ void moe_tile_rows(const int* tiles, const int* sorted, int row_div,
                                              const float* in, int cols, int* pair,
                                              const float** rows) {
    const int first = tiles[moe_tiles() + moe_tile()], count = tiles[2 * moe_tiles() + moe_tile()];
    if (threadIdx.x < BN) {
        const int p = (int)threadIdx.x < count ? sorted[first + threadIdx.x] : -1;
        pair[threadIdx.x] = p;
        rows[threadIdx.x] = p >= 0 ? in + (long)(p / row_div) * cols : nullptr;
    }
    __syncthreads();
}

// h[pair] = act(gate(x_t), up(x_t)) for the pairs of each expert: silu(gate) * up, or with FFN
// ffn_gate_up (biases by the pair's expert id ids[pair], the activation `f` says; apart, so that
// the registers of plain SwiGLU stay those of a block of four per multiprocessor). Grid
// (inter / 64, tiles of 64 pairs: moe_group's map).
template <int WK, bool FFN>
__device__ void moe_gate_up_tc(const ExpertMats* experts, const int* tiles, const int* sorted,
                               int K, const float* x, float* h, const uint32_t* ids, Ffn f) {
    __shared__ TcTiles<2> s;
    __shared__ const float* rows[TC_BN];
    __shared__ int pair[TC_BN];
    const int slot = moe_tile_slot(tiles);
    if (slot < 0) return;
    const Mat m[2] = {experts[slot].gate, experts[slot].up};
    const long r0 = (long)blockIdx.x * TC_BM;
    moe_tile_rows<TC_BN>(tiles, sorted, K, x, m[0].cols, pair, rows);
    float acc[2][2][4][4];
    tc_tile<WK, 2>(m, r0, rows, s, acc);
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const long r = r0 + frag_row<2, 4, 2>(i, e);
                const int p = pair[frag_token<2, 4, 2>(j, e)];
                if (r < m[0].rows && p >= 0) {
                    const float g = acc[0][i][j][e], u = acc[1][i][j][e];
                    h[(long)p * m[0].rows + r] =
                        FFN ? ffn_gate_up(f, ids[p], m[0].rows, r, g, u) : swiglu1(g, u);
                }
            }
}

// d[pair] = down(h[pair]) for the pairs of each expert. Grid (hidden / 64, tiles of 64 pairs).
template <int WK>
__device__ void moe_down_tc(const ExpertMats* experts, const int* tiles, const int* sorted,
                            const float* h, float* d) {
    __shared__ TcTiles<1> s;
    __shared__ const float* rows[TC_BN];
    __shared__ int pair[TC_BN];
    const int slot = moe_tile_slot(tiles);
    if (slot < 0) return;
    const Mat m = experts[slot].down;
    const long r0 = (long)blockIdx.x * TC_BM;
    moe_tile_rows<TC_BN>(tiles, sorted, 1, h, m.cols, pair, rows);
    float acc[1][2][4][4];
    tc_tile<WK, 1>(&m, r0, rows, s, acc);
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const long r = r0 + frag_row<2, 4, 2>(i, e);
                const int p = pair[frag_token<2, 4, 2>(j, e)];
                if (r < m.rows && p >= 0) d[(long)p * m.rows + r] = acc[0][i][j][e];
            }
}

#define MOE_TC(WK, KN) \
    extern "C" __global__ void __launch_bounds__(128) moe_gate_up_tc_##KN( \
        const ExpertMats* experts, const int* tiles, const int* sorted, int K, const float* x, \
        float* h, const uint32_t* ids, Ffn f) { PDL_START(); \
        moe_gate_up_tc<WK, false>(experts, tiles, sorted, K, x, h, ids, f); \
    } \
    extern "C" __global__ void __launch_bounds__(128) moe_gate_up_tc_ffn_##KN( \
        const ExpertMats* experts, const int* tiles, const int* sorted, int K, const float* x, \
        float* h, const uint32_t* ids, Ffn f) { PDL_START(); \
        moe_gate_up_tc<WK, true>(experts, tiles, sorted, K, x, h, ids, f); \
    } \
    extern "C" __global__ void __launch_bounds__(128) moe_down_tc_##KN( \
        const ExpertMats* experts, const int* tiles, const int* sorted, const float* h, \
        float* d) { PDL_START(); \
        moe_down_tc<WK>(experts, tiles, sorted, h, d); \
    }
MOE_TC(K_GENERIC, generic)

// Stores a tall MoE tile's results (acc as tq_tile's, warps 4 x 1): the value of row r0 + i for
// pair p at out[p * stride + r0 + i], for rows below `rows` and real pairs; with `bias` (an
// [experts, rows] bias by expert id), plus the bias of the pair's expert ids[p].
template <int MI, int NJ>
__device__ __forceinline__ void moe_store_tile(const float (&acc)[MI][NJ][4], long r0, long rows,
                                               const int* pair, float* out, long stride,
                                               const float* bias = nullptr,
                                               const uint32_t* ids = nullptr) {
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const long r = r0 + frag_row<MI, NJ, 1>(i, q);
                const int p = pair[frag_token<MI, NJ, 1>(j, q)];
                if (r < rows && p >= 0) {
                    float v = acc[i][j][q];
                    if (bias != nullptr) v += bias[(long)ids[p] * rows + r];
                    out[(long)p * stride + r] = v;
                }
            }
}

// The tensor-core MoE kernels for exact weights, over each expert's pairs, BN = 8 NJ pairs and
// BM = 64 MI rows a block (warps 4 x 1: tall tiles, because an expert has few pairs, ~32 at 512
// tokens, 128 experts, top 8). moe_gate_up_tq writes gate(x_t) and up(x_t) side by side, hg[pair]
// = [gate | up] (grid (2 inter / BM, tiles of BN pairs): gate and up in different blocks keeps
// the registers of one product), each with its bias (`f`, by the pair's expert id ids[pair]);
// moe_down_tq computes d[pair] = down(act(gate, up)) (ffn_act; grid (hidden / BM, tiles)).
template <int WK, int MI, int NJ>
__device__ void moe_gate_up_tq(const ExpertMats* experts, const int* tiles, const int* sorted,
                               int K, const float* x, float* hg, const uint32_t* ids,
                               Ffn f) {
    constexpr int BM = 64 * MI, BN = 8 * NJ;
    __shared__ TqTiles<1, BM, BN> s;
    __shared__ const float* rows[BN];
    __shared__ int pair[BN];
    const int slot = moe_tile_slot(tiles);
    if (slot < 0) return;
    const ExpertMats& e = experts[slot];
    const int inter = e.gate.rows, gate_tiles = (inter + BM - 1) / BM;
    const bool up = blockIdx.x >= gate_tiles;
    const Mat m = up ? e.up : e.gate;
    const long r0 = (long)(up ? blockIdx.x - gate_tiles : blockIdx.x) * BM;
    moe_tile_rows<BN>(tiles, sorted, K, x, m.cols, pair, rows);
    float acc[1][MI][NJ][4];
    tq_tile<WK, 1, MI, NJ, 4, 1>(&m, r0, rows, s, acc, 0, m.cols);
    moe_store_tile<MI, NJ>(acc[0], r0, inter, pair, hg + (up ? inter : 0), 2 * inter,
                           up ? f.up_bias : f.gate_bias, ids);
}

template <int WK, int MI, int NJ>
__device__ void moe_down_tq(const ExpertMats* experts, const int* tiles, const int* sorted,
                            const float* hg, float* d, Ffn f) {
    constexpr int BM = 64 * MI, BN = 8 * NJ;
    __shared__ TqTiles<1, BM, BN> s;
    __shared__ const float* rows[BN];
    __shared__ int pair[BN];
    const int slot = moe_tile_slot(tiles);
    if (slot < 0) return;
    const Mat m = experts[slot].down;
    const long r0 = (long)blockIdx.x * BM;
    moe_tile_rows<BN>(tiles, sorted, 1, hg, 2 * m.cols, pair, rows);
    float acc[1][MI][NJ][4];
    tq_tile<WK, 1, MI, NJ, 4, 1, true>(&m, r0, rows, s, acc, 0, m.cols, f);
    moe_store_tile<MI, NJ>(acc[0], r0, m.rows, pair, d, m.rows);
}

#define MOE_TQ(WK, KN, MI, NJ) \
    extern "C" __global__ void __launch_bounds__(128) moe_gate_up_tq_##KN##_n##NJ( \
        const ExpertMats* experts, const int* tiles, const int* sorted, int K, const float* x, \
        float* hg, const uint32_t* ids, Ffn f) { PDL_START(); \
        moe_gate_up_tq<WK, MI, NJ>(experts, tiles, sorted, K, x, hg, ids, f); \
    } \
    extern "C" __global__ void __launch_bounds__(128) moe_down_tq_##KN##_n##NJ( \
        const ExpertMats* experts, const int* tiles, const int* sorted, const float* hg, \
        float* d, Ffn f) { PDL_START(); \
        moe_down_tq<WK, MI, NJ>(experts, tiles, sorted, hg, d, f); \
    }
// NJ 4: 128 rows x 32 pairs; NJ 2: 256 rows x 16 pairs.
MOE_TQ(K_Q4, q4, 2, 4) MOE_TQ(K_Q8, q8, 2, 4) MOE_TQ(K_BF16, bf16, 2, 4)
MOE_TQ(K_MXFP4, mxfp4, 2, 4)
MOE_TQ(K_Q4, q4, 4, 2) MOE_TQ(K_Q8, q8, 4, 2) MOE_TQ(K_BF16, bf16, 4, 2)
MOE_TQ(K_MXFP4, mxfp4, 4, 2)

// out[t] += sum_j weight_j * (d[pair_j] + the down bias of its expert, `f`) over token t's present
// experts in ascending id (the order moe_down adds in). Grid (T), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_combine(
    const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids,
    const float* weights, int K, const float* d, float* out, int hidden, Ffn f) {
    PDL_START();
    __shared__ float weight[MOE_MAX_K];
    __shared__ int pair_of[MOE_MAX_K];
    __shared__ int n;
    const long t = blockIdx.x;
    if (threadIdx.x == 0) n = token_experts(experts, present, n_present, ids, weights, K, t,
                                            nullptr, weight, pair_of);
    __syncthreads();
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = out[t * hidden + c];
        for (int j = 0; j < n; j++) {
            const long p = pair_of[j];
            acc = fmaf(weight[j], ffn_down(f, ids[p], hidden, c, d[p * hidden + c]), acc);
        }
        out[t * hidden + c] = acc;
    }
}

// route(x W^T) for a few tokens in one launch. Grid (E, T): a block of 128 per router row writes
// its logit (as the block-per-row matrix-vector kernel); the last block of a token to finish
// (counted in done[t], left zero) routes it. E <= 1024, k <= 32.
template <int K>
__device__ void route_gemv(const Mat& w, const float* x, int k, int normalize, float* logits,
                           uint32_t* done, uint32_t* ids, float* weights) {
    const int t = blockIdx.y, E = w.rows, warp = threadIdx.x / 32;
    const long r = blockIdx.x;
    float acc[1][1];
    block_rows_dot<K, 1, 1>(&w, &r, x + (long)t * w.cols, 0, acc);
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
    route_row(logits + (long)t * E, E, k, normalize, ids + (long)t * k, weights + (long)t * k);
}

// Asks L2 for row r of m (codes or values, scales, biases): issued before a kernel waits for its
// inputs, the weights arrive while the previous kernel finishes.
__device__ __forceinline__ void prefetch_row(const Mat& m, long r) {
    const bool affine = m.fmt == FMT_AFFINE, mxfp4 = m.fmt == FMT_MXFP4;
    const long row_bytes = affine || mxfp4 ? (long)m.cols * m.bits / 8
                                           : (long)m.cols * (m.fmt == FMT_F32 ? 4 : 2);
    const uint8_t* p = m.data + r * row_bytes;
    for (long o = threadIdx.x * 128L; o < row_bytes; o += blockDim.x * 128L)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
    if (mxfp4 && threadIdx.x == 0) {
        const long bytes = m.cols >> m.gshift;
        for (long o = 0; o < bytes; o += 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(m.scales + r * bytes + o));
    }
    if (affine && threadIdx.x < 2) {
        const long bytes = (long)(m.cols >> m.gshift) * (m.sdt == SDT_F32 ? 4 : 2);
        const uint8_t* sp = (threadIdx.x == 0 ? m.scales : m.biases) + r * bytes;
        for (long o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(sp + o));
    }
}

#define ROUTE_GEMV(K, KN) \
    extern "C" __global__ void __launch_bounds__(128) route_gemv_##KN( \
        Mat w, const float* x, int k, int normalize, float* logits, uint32_t* done, \
        uint32_t* ids, float* weights) { \
        PDL_LAUNCH_DEPENDENTS(); \
        prefetch_row(w, blockIdx.x); \
        PDL_WAIT(); \
        route_gemv<K>(w, x, k, normalize, logits, done, ids, weights); \
    }
ROUTE_GEMV(K_GENERIC, generic) ROUTE_GEMV(K_Q4, q4) ROUTE_GEMV(K_Q8, q8) ROUTE_GEMV(K_BF16, bf16)
ROUTE_GEMV(K_MXFP4, mxfp4)

// ------------------------------------------------------------------------------------------------
// Gated DeltaNet
// ------------------------------------------------------------------------------------------------

// Depthwise causal conv over time then SiLU: the window (k - 1 earlier inputs, [k - 1, C])
// continues into x [T, C] and is then replaced by the last k - 1 inputs. A block of 256 threads
// takes 32 channels, its 8 warps every 8th token (tokens are independent given the inputs), then
// writes the window. K <= 8.
extern "C" __global__ void __launch_bounds__(256) causal_conv1d_silu(const float* x,
                                                                     const float* weight,
                                                                     float* window, float* out,
                                                                     int ntok, int C, int K) {
    PDL_START();
    const int ch = blockIdx.x * 32 + threadIdx.x % 32, lane_t = threadIdx.x / 32;
    const bool active = ch < C;
    float taps[8], win[7];
#pragma unroll
    for (int j = 0; j < 8; j++) taps[j] = active && j < K ? weight[(long)ch * K + j] : 0.0f;
#pragma unroll
    for (int j = 0; j < 7; j++) win[j] = active && j < K - 1 ? window[(long)j * C + ch] : 0.0f;
    // Input at time tau (negative: the window).
    auto input = [&](int tau) {
        float v = 0.0f;
#pragma unroll
        for (int j = 0; j < 7; j++)
            if (tau == j - (K - 1)) v = win[j];
        return tau >= 0 ? x[(long)tau * C + ch] : v;
    };
    if (active) {
        for (int t = lane_t; t < ntok; t += 8) {
            float acc = taps[K - 1] * x[(long)t * C + ch];
#pragma unroll
            for (int j = 0; j < 7; j++)
                if (j < K - 1) acc = fmaf(taps[j], input(t - (K - 1) + j), acc);
            out[(long)t * C + ch] = acc / (1.0f + expf(-acc));
        }
    }
    __syncthreads();
    if (active && lane_t == 0) {
        float next[7];
#pragma unroll
        for (int j = 0; j < 7; j++) next[j] = j < K - 1 ? input(ntok - (K - 1) + j) : 0.0f;
#pragma unroll
        for (int j = 0; j < 7; j++)
            if (j < K - 1) window[(long)j * C + ch] = next[j];
    }
}

// The key head value head h reads: value heads grouped by key head (Hugging Face's order) or,
// with `tiled`, repeating the key heads (llama.cpp's GGUF order).
__device__ __forceinline__ int key_head(int h, int hk, int hv, int tiled) {
    return tiled ? h % hk : h / (hv / hk);
}

// The gated delta rule for one value head per block. State S [dv, dk] (row i = value dim i),
// held in registers: each row is split over dk / 32 consecutive threads of 32 values each.
// Tokens run in order (the recurrence is sequential). dk % 32 == 0, dk <= 256.
extern "C" __global__ void gated_delta_rule(const float* qkv, const float* a, const float* b,
                                            const float* a_log, const float* dt_bias,
                                            float* state, float* y, int ntok, int hk, int hv,
                                            int dk, int dv, int tiled) {
    PDL_START();
    const int h = blockIdx.x;
    const int parts = dk / 32;
    const int i = threadIdx.x / parts;  // value row
    const int part = threadIdx.x % parts;
    const bool active = i < dv;
    const int kh = key_head(h, hk, hv, tiled);
    const int width = 2 * hk * dk + hv * dv;
    __shared__ float qs[256], ks[256];
    float* s = state + ((long)h * dv + (active ? i : 0)) * dk + part * 32;
    float S[32];
#pragma unroll
    for (int c = 0; c < 32; c++) S[c] = active ? s[c] : 0.0f;
    const float q_scale = rsqrtf((float)dk);
    for (int t = 0; t < ntok; t++) {
        const float* row = qkv + (long)t * width;
        // L2-normalise q (times dk^-0.5) and k of this head's key head.
        float sq = 0.0f, sk = 0.0f;
        for (int c = threadIdx.x; c < dk; c += blockDim.x) {
            const float qv = row[kh * dk + c], kv = row[hk * dk + kh * dk + c];
            qs[c] = qv;
            ks[c] = kv;
            sq += qv * qv;
            sk += kv * kv;
        }
        const float inv_q = q_scale / sqrtf(block_sum(sq) + 1e-6f);
        const float inv_k = 1.0f / sqrtf(block_sum(sk) + 1e-6f);
        __syncthreads();
        const float av = a[(long)t * hv + h] + dt_bias[h];
        const float softplus = av > 20.0f ? av : log1pf(expf(av));
        const float g = expf(-expf(a_log[h]) * softplus);
        const float beta = 1.0f / (1.0f + expf(-b[(long)t * hv + h]));
        float kv = 0.0f;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            S[c] *= g;
            kv = fmaf(S[c], ks[part * 32 + c] * inv_k, kv);
        }
        for (int o = 1; o < parts; o <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
        const float v = active ? row[2 * hk * dk + h * dv + i] : 0.0f;
        const float delta = (v - kv) * beta;
        float acc = 0.0f;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            S[c] = fmaf(delta, ks[part * 32 + c] * inv_k, S[c]);
            acc = fmaf(S[c], qs[part * 32 + c] * inv_q, acc);
        }
        for (int o = 1; o < parts; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (active && part == 0) y[((long)t * hv + h) * dv + i] = acc;
        __syncthreads();
    }
    if (active) {
#pragma unroll
        for (int c = 0; c < 32; c++) s[c] = S[c];
    }
}

// ---- the gated delta rule over many tokens ----
//
// gated_delta_rule above spends most of a token on block-wide reductions and barriers, one block
// per head: 512 prompt tokens took 1.2 ms a layer on an H100. Here delta_prep computes what does
// not depend on the state, for every token at once, and gated_delta_rule_rows runs the recurrence
// with a block per (head, 128 / (dk / 32) value rows) and no barrier inside a token. The
// arithmetic is gated_delta_rule's, operation for operation, so both give the same bits.

// prep [ntok, 2 hk dk + 2 hv]: q of every key head L2-normalised times dk^-0.5, k normalised, then
// each value head's decay g and write strength beta. Grid (ntok, blocks over the key heads), 128
// threads, a warp per key head. The squared norms are summed as block_sum sums one value per
// thread (dk <= the old kernel's block).
extern "C" __global__ void __launch_bounds__(128) delta_prep(const float* qkv, const float* a,
                                                            const float* b, const float* a_log,
                                                            const float* dt_bias, float* prep,
                                                            int hk, int hv, int dk, int dv) {
    PDL_START();
    const int t = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int width = 2 * hk * dk + hv * dv;
    const float* row = qkv + (long)t * width;
    float* out = prep + (long)t * (2 * hk * dk + 2 * hv);
    const float q_scale = rsqrtf((float)dk);
    const int warps = blockDim.x / 32;
    for (int kh = blockIdx.y * warps + warp; kh < hk; kh += gridDim.y * warps) {
        const float* qr = row + kh * dk;
        const float* kr = row + hk * dk + kh * dk;
        float pq = 0.0f, pk = 0.0f;  // lane w: the sums of warp w in block_sum
        for (int w = 0; w < dk / 32; w++) {
            const float qv = qr[32 * w + lane], kv = kr[32 * w + lane];
            const float sq = warp_sum(qv * qv), sk = warp_sum(kv * kv);
            if (lane == w) {
                pq = sq;
                pk = sk;
            }
        }
        const float inv_q = q_scale / sqrtf(warp_sum(pq) + 1e-6f);
        const float inv_k = 1.0f / sqrtf(warp_sum(pk) + 1e-6f);
        for (int c = lane; c < dk; c += 32) {
            out[kh * dk + c] = qr[c] * inv_q;
            out[hk * dk + kh * dk + c] = kr[c] * inv_k;
        }
    }
    for (int h = blockIdx.y * blockDim.x + threadIdx.x; h < hv; h += gridDim.y * blockDim.x) {
        const float av = a[(long)t * hv + h] + dt_bias[h];
        const float softplus = av > 20.0f ? av : log1pf(expf(av));
        out[2 * hk * dk + h] = expf(-expf(a_log[h]) * softplus);
        out[2 * hk * dk + hv + h] = 1.0f / (1.0f + expf(-b[(long)t * hv + h]));
    }
}

// Tokens staged in shared memory at a time, and the per-part stride of a staged q or k (32 values
// and 4 of padding: the parts of a warp read different banks).
#define DELTA_CHUNK 16
#define DELTA_LD 36

// A recurrence thread's 32 columns of its state row (16-byte aligned: eight vector loads instead
// of 32 scattered ones); zeros for a thread past the last row.
__device__ __forceinline__ void load_state_part(const float* s, bool active, float S[32]) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const float4 v = active ? reinterpret_cast<const float4*>(s)[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        S[4 * c] = v.x; S[4 * c + 1] = v.y; S[4 * c + 2] = v.z; S[4 * c + 3] = v.w;
    }
}

__device__ __forceinline__ void store_state_part(float* s, const float S[32]) {
#pragma unroll
    for (int c = 0; c < 8; c++)
        reinterpret_cast<float4*>(s)[c] = make_float4(S[4 * c], S[4 * c + 1], S[4 * c + 2], S[4 * c + 3]);
}

// One token of the delta rule on a state row held by `parts` threads (32 columns each, kp/qp
// their columns of k and q): S = g S; S += (v - S k) beta k; returns the row's S q. k and q enter
// times k_scale (their L2 norms' inverse; 1 when already normalised): S k_raw k_scale, and the
// update adds (delta k_scale) k_raw.
__device__ __forceinline__ float delta_row_step(float S[32], const float* kp, const float* qp,
                                                float v, float g, float beta, float k_scale,
                                                int parts) {
    float kv = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; c++) {
        S[c] *= g;
        kv = fmaf(S[c], kp[c], kv);
    }
    for (int o = 1; o < parts; o <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
    const float delta = (v - kv * k_scale) * beta * k_scale;
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; c++) {
        S[c] = fmaf(delta, kp[c], S[c]);
        acc = fmaf(S[c], qp[c], acc);
    }
    for (int o = 1; o < parts; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

// The recurrence of value head blockIdx.x, rows blockIdx.y * R .. (R = blockDim.x / (dk / 32)),
// from delta_prep's prep; 64 or 128 threads, dk % 32 == 0, dk <= 256.
extern "C" __global__ void __launch_bounds__(128) gated_delta_rule_rows(
    const float* qkv, const float* prep, float* state, float* y, int ntok, int hk, int hv, int dk,
    int dv, int tiled) {
    PDL_START();
    __shared__ float qs[DELTA_CHUNK][8 * DELTA_LD], ks[DELTA_CHUNK][8 * DELTA_LD];
    __shared__ float vs[DELTA_CHUNK][128];
    __shared__ float gs[DELTA_CHUNK], betas[DELTA_CHUNK];
    const int h = blockIdx.x, parts = dk / 32, rows = blockDim.x / parts;
    const int r = threadIdx.x / parts, part = threadIdx.x % parts;
    const int i = blockIdx.y * rows + r;  // value row
    const bool active = i < dv;
    const int kh = key_head(h, hk, hv, tiled);
    const int width = 2 * hk * dk + hv * dv, pw = 2 * hk * dk + 2 * hv;
    float* s = state + ((long)h * dv + (active ? i : 0)) * dk + part * 32;
    float S[32];
    load_state_part(s, active, S);
    for (int t0 = 0; t0 < ntok; t0 += DELTA_CHUNK) {
        const int n = min(DELTA_CHUNK, ntok - t0);
        __syncthreads();
        for (int idx = threadIdx.x; idx < n * dk; idx += blockDim.x) {
            const int tt = idx / dk, c = idx % dk;
            const float* pr = prep + (long)(t0 + tt) * pw;
            qs[tt][(c / 32) * DELTA_LD + c % 32] = pr[kh * dk + c];
            ks[tt][(c / 32) * DELTA_LD + c % 32] = pr[hk * dk + kh * dk + c];
        }
        for (int idx = threadIdx.x; idx < n * rows; idx += blockDim.x) {
            const int tt = idx / rows, row = blockIdx.y * rows + idx % rows;
            vs[tt][idx % rows] = row < dv ? qkv[(long)(t0 + tt) * width + 2 * hk * dk + h * dv + row] : 0.0f;
        }
        for (int tt = threadIdx.x; tt < n; tt += blockDim.x) {
            const float* pr = prep + (long)(t0 + tt) * pw;
            gs[tt] = pr[2 * hk * dk + h];
            betas[tt] = pr[2 * hk * dk + hv + h];
        }
        __syncthreads();
        for (int tt = 0; tt < n; tt++) {
            const float acc = delta_row_step(S, &ks[tt][part * DELTA_LD], &qs[tt][part * DELTA_LD],
                                             vs[tt][r], gs[tt], betas[tt], 1.0f, parts);
            if (active && part == 0) y[((long)(t0 + tt) * hv + h) * dv + i] = acc;
        }
    }
    if (active) store_state_part(s, S);
}

// ---- one decode step of the whole Gated DeltaNet core ----
//
// For one token (or a few), causal_conv1d_silu + delta_prep + gated_delta_rule_rows +
// rms_norm_gated are four dependent launches over a few KB each, ~31 us a layer on an H100
// (Qwen3.5-35B-A3B shape). Here they are two: gated_delta_step convolves, in every block, just the
// channels that block reads (its key head's q and k, its own rows of v: the q/k convolution is
// repeated by each block of that key head, a few hundred multiply-adds), normalises q and k, and
// runs the recurrence; delta_norm_window then applies the gated norm per value head and moves the
// convolution window on. The window cannot move in the first kernel: other blocks of it read the
// same channels.

// The taps of channel ch (oldest first; K <= 8), in registers.
struct ConvTaps {
    float w[8];
};

__device__ __forceinline__ ConvTaps conv_taps(const float* conv_w, int ch, int K) {
    ConvTaps t;
#pragma unroll
    for (int j = 0; j < 8; j++) t.w[j] = j < K ? conv_w[(long)ch * K + j] : 0.0f;
    return t;
}

// The convolved input (then SiLU) of channel ch at token t, the inputs before token 0 from the
// window ([K - 1, C]). Unrolled over the largest K so that every load is issued at once (a loop
// over K made each a dependent round trip: 10 us a launch). Same order of operations as
// causal_conv1d_silu.
__device__ __forceinline__ float conv_silu_at(const float* x, const float* window,
                                              const ConvTaps taps, int ch, int t, int C, int K) {
    float in[7];
#pragma unroll
    for (int j = 0; j < 7; j++) {
        const int tau = t - (K - 1) + j;
        in[j] = j >= K - 1 ? 0.0f
                : tau >= 0 ? x[(long)tau * C + ch]
                           : window[(long)(K - 1 + tau) * C + ch];
    }
    float newest = 0.0f;  // taps.w[K - 1], selected without indexing the array at run time
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j == K - 1) newest = taps.w[j];
    float acc = newest * x[(long)t * C + ch];
#pragma unroll
    for (int j = 0; j < 7; j++)
        if (j < K - 1) acc = fmaf(taps.w[j], in[j], acc);
    return acc / (1.0f + expf(-acc));
}

// Channels of q and k (2 dk) a thread of gated_delta_step convolves: the host launches
// max(32, dk / 2) threads.
#define DELTA_STEP_QK 4

// The recurrence of value head blockIdx.x, rows blockIdx.y * R .. (R = blockDim.x / (dk / 32)),
// for ntok tokens of x (the raw projection, [ntok, 2 hk dk + hv dv]), writing the ungated output
// y [ntok, hv dv] and the state; the window is only read. blockDim.x = max(32, dk / 2),
// dk % 32 == 0, dk <= 256, 2 <= K <= 8.
extern "C" __global__ void __launch_bounds__(128) gated_delta_step(
    const float* __restrict__ x, const float* __restrict__ conv_w, const float* __restrict__ window,
    const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, float* __restrict__ state, float* __restrict__ y, int ntok,
    int hk, int hv, int dk, int dv, int K, int tiled) {
    __shared__ float qs[8 * DELTA_LD], ks[8 * DELTA_LD], vs[128];
    __shared__ float sums[2][4];
    const int h = blockIdx.x, parts = dk / 32, rows = blockDim.x / parts;
    const int r = threadIdx.x / parts, part = threadIdx.x % parts;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int i = blockIdx.y * rows + r;  // value row
    const bool active = i < dv;
    const int kh = key_head(h, hk, hv, tiled);
    const int C = 2 * hk * dk + hv * dv;
    // The channels this thread convolves: q/k channel c = threadIdx.x + m blockDim.x (c < dk: q),
    // and, for the first `rows` threads, value row blockIdx.y * rows + threadIdx.x.
    int qk_ch[DELTA_STEP_QK];
#pragma unroll
    for (int m = 0; m < DELTA_STEP_QK; m++) {
        const int c = threadIdx.x + m * blockDim.x;
        qk_ch[m] = c < dk ? kh * dk + c : c < 2 * dk ? hk * dk + kh * dk + (c - dk) : 0;
    }
    const int v_row = blockIdx.y * rows + threadIdx.x;
    const bool has_v = threadIdx.x < rows && v_row < dv;
    const int v_ch = 2 * hk * dk + h * dv + (has_v ? v_row : 0);
    // Weights before the wait: nothing earlier in the graph writes them.
    PDL_LAUNCH_DEPENDENTS();
    ConvTaps qk_taps[DELTA_STEP_QK];
#pragma unroll
    for (int m = 0; m < DELTA_STEP_QK; m++) qk_taps[m] = conv_taps(conv_w, qk_ch[m], K);
    const ConvTaps v_taps = conv_taps(conv_w, v_ch, K);
    const float q_scale = rsqrtf((float)dk), decay = expf(a_log[h]), dt = dt_bias[h];
    float* s = state + ((long)h * dv + (active ? i : 0)) * dk + part * 32;
    if (early_loads & EARLY_DELTA) {
        // The state (this thread's 32 values: a line) and the window's lines into L2: the last
        // step wrote them, long ago in bytes.
        prefetch_l2(s);
        for (int j = 0; j < K - 1; j++) {
#pragma unroll
            for (int m = 0; m < DELTA_STEP_QK; m++)
                if (qk_ch[m] % 32 == 0) prefetch_l2(window + (long)j * C + qk_ch[m]);
            if (has_v && v_ch % 32 == 0) prefetch_l2(window + (long)j * C + v_ch);
        }
    }
    PDL_WAIT();
    float S[32];
    load_state_part(s, active, S);
    for (int t = 0; t < ntok; t++) {
        // q and k of the key head, convolved, and their squared norms.
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int m = 0; m < DELTA_STEP_QK; m++) {
            const int c = threadIdx.x + m * blockDim.x;
            if (c < 2 * dk) {
                const float v = conv_silu_at(x, window, qk_taps[m], qk_ch[m], t, C, K);
                const int cc = c < dk ? c : c - dk;
                (c < dk ? qs : ks)[(cc / 32) * DELTA_LD + cc % 32] = v;
                if (c < dk) sq += v * v; else sk += v * v;
            }
        }
        if (threadIdx.x < rows) vs[threadIdx.x] = has_v ? conv_silu_at(x, window, v_taps, v_ch, t, C, K) : 0.0f;
        const float av = a[(long)t * hv + h] + dt, bv = b[(long)t * hv + h];
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        if (lane == 0) {
            sums[0][warp] = sq;
            sums[1][warp] = sk;
        }
        __syncthreads();
        sq = 0.0f;
        sk = 0.0f;
        for (int w = 0; w < warps; w++) {
            sq += sums[0][w];
            sk += sums[1][w];
        }
        const float inv_q = q_scale / sqrtf(sq + 1e-6f), inv_k = 1.0f / sqrtf(sk + 1e-6f);
        const float softplus = av > 20.0f ? av : log1pf(expf(av));
        const float g = expf(-decay * softplus);
        const float beta = 1.0f / (1.0f + expf(-bv));
        // k enters raw and is normalised inside (inv_k); q's norm scales the output.
        const float acc = delta_row_step(S, &ks[part * DELTA_LD], &qs[part * DELTA_LD], vs[r], g,
                                         beta, inv_k, parts);
        if (active && part == 0) y[((long)t * hv + h) * dv + i] = acc * inv_q;
        __syncthreads();  // the next token rewrites qs, ks, vs and sums
    }
    if (active) store_state_part(s, S);
}

// Channels whose window a thread of delta_norm_window moves (dv threads own dv + 2 dk <= 3 dv
// channels when dk <= dv; more run in a loop).
#define DELTA_WINDOW_CH 3

// After gated_delta_step: block h (dv threads, dv <= 1024) applies silu(z) * rms_norm(y) * w to
// value head h of every token and moves the window on (the last K - 1 inputs of window ++ x) for
// the channels it owns: value head h's, and key head h's q and k when h < hk. A thread reads all
// its channels before it stores any (a load after a store the compiler cannot tell apart from it
// is one more round trip).
extern "C" __global__ void delta_norm_window(const float* __restrict__ y, const float* __restrict__ z,
                                             const float* __restrict__ w, float* __restrict__ out,
                                             const float* __restrict__ x, float* __restrict__ window,
                                             int ntok, int hk, int hv, int dk, int dv, int K,
                                             float eps) {
    PDL_LAUNCH_DEPENDENTS();
    const int h = blockIdx.x, C = 2 * hk * dk + hv * dv, n = threadIdx.x;
    const float wn = n < dv ? w[n] : 0.0f;
    PDL_WAIT();
    const int own = dv + (h < hk ? 2 * dk : 0);
    for (int c0 = 0; c0 < own; c0 += DELTA_WINDOW_CH * blockDim.x) {
        int ch[DELTA_WINDOW_CH];
        float next[DELTA_WINDOW_CH][7];
#pragma unroll
        for (int m = 0; m < DELTA_WINDOW_CH; m++) {
            const int c = c0 + threadIdx.x + m * blockDim.x;
            ch[m] = c >= own ? -1
                    : c < dv ? 2 * hk * dk + h * dv + c
                    : c - dv < dk ? h * dk + (c - dv)
                                  : hk * dk + h * dk + (c - dv - dk);
#pragma unroll
            for (int j = 0; j < 7; j++) {
                const int src = j + ntok;  // index into window ++ x
                next[m][j] = ch[m] < 0 || j >= K - 1 ? 0.0f
                             : src < K - 1 ? window[(long)src * C + ch[m]]
                                           : x[(long)(src - (K - 1)) * C + ch[m]];
            }
        }
#pragma unroll
        for (int m = 0; m < DELTA_WINDOW_CH; m++)
#pragma unroll
            for (int j = 0; j < 7; j++)
                if (ch[m] >= 0 && j < K - 1) window[(long)j * C + ch[m]] = next[m][j];
    }
    for (int t = 0; t < ntok; t++) {
        const long base = ((long)t * hv + h) * dv;
        const float v = n < dv ? y[base + n] : 0.0f, g = n < dv ? z[base + n] : 0.0f;
        const float inv = 1.0f / sqrtf(block_sum(v * v) / dv + eps);
        if (n < dv) out[base + n] = v * inv * wn * (g / (1.0f + expf(-g)));
    }
}

// ------------------------------------------------------------------------------------------------
// Greedy choice
// ------------------------------------------------------------------------------------------------

// The better of (v, i) and (ov, oi) for argmax: NaN never wins, equal values go to the lower index.
__device__ __forceinline__ void argmax_pick(float& v, int& i, float ov, int oi) {
    if (!isnan(ov) && (isnan(v) || ov > v || (ov == v && oi < i))) {
        v = ov;
        i = oi;
    }
}

// argmax_pick over the block; thread 0 gets the result.
__device__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        argmax_pick(v, i, ov, oi);
    }
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x + 31) / 32; w++) argmax_pick(v, i, sv[w], si[w]);
    }
}

// Stage one of argmax over the rows of x [rows, cols]: block p of row blockIdx.y reduces columns
// [p chunk, (p + 1) chunk) to (pv, pi)[row * gridDim.x + p] (index INT_MAX when all NaN).
extern "C" __global__ void __launch_bounds__(256) argmax_parts(const float* x, int cols, int chunk,
                                                              float* pv, int* pi) {
    PDL_START();
    const long row = blockIdx.y;
    const int begin = blockIdx.x * chunk, end = min(cols, begin + chunk);
    float v = __int_as_float(0x7fc00000);
    int i = 0x7fffffff;
    for (int c = begin + threadIdx.x; c < end; c += blockDim.x) argmax_pick(v, i, x[row * cols + c], c);
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        pv[row * gridDim.x + blockIdx.x] = v;
        pi[row * gridDim.x + blockIdx.x] = i;
    }
}

// Stage two: the best of each row's `parts` partial results into out[row] (0 when all NaN).
extern "C" __global__ void __launch_bounds__(256) argmax_finish(const float* pv, const int* pi,
                                                               int parts, uint32_t* out) {
    PDL_START();
    const long row = blockIdx.x;
    float v = __int_as_float(0x7fc00000);
    int i = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) argmax_pick(v, i, pv[row * parts + p], pi[row * parts + p]);
    block_argmax(v, i);
    if (threadIdx.x == 0) out[row] = isnan(v) ? 0u : (uint32_t)i;
}

// ------------------------------------------------------------------------------------------------
// The best few logits (what a top-k sampler needs)
// ------------------------------------------------------------------------------------------------

// A logit's rank as an unsigned key, larger is better: the order of f32 total_cmp among numbers
// (so -0 ranks below +0), every NaN below every number (key 0, which no number has).
__device__ __forceinline__ uint32_t rank_key(float v) {
    const uint32_t b = __float_as_uint(v);
    if (isnan(v)) return 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define TOP_MAX 1024

// Columns a block of top_logits_parts takes: a block's passes over them are 4 loads a thread.
#define TOP_CHUNK 4096

// The n best of vals [count] (0 < n <= min(count, TOP_MAX)) in rank order — larger values first,
// the lower index among equals, NaN last — into out_cols (ids[index], or col_base + index when
// ids is null) and out_vals, by the whole block of 1024 threads. The n-th best key is found a
// byte at a time from the top (a histogram pass per byte, stopping early once a byte's bin holds
// exactly the entries still wanted); then every entry above it is gathered, with the lowest
// indices among those equal to it, and the n are sorted.
__device__ void top_select(const float* vals, int count, int n, const uint32_t* ids,
                           uint32_t col_base, uint32_t* out_cols, float* out_vals) {
    __shared__ uint32_t hist[256];
    __shared__ uint32_t prefix, mask, matched;
    __shared__ int need;  // entries still wanted among those whose key matches prefix under mask
    __shared__ int taken;
    __shared__ int warp_eq[32];
    __shared__ unsigned long long cand[TOP_MAX];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    if (tid == 0) {
        prefix = 0;
        mask = 0;
        need = n;
        matched = (uint32_t)count;
        taken = 0;
    }
    __syncthreads();
    for (int shift = 24; shift >= 0 && matched != (uint32_t)need; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const uint32_t p = prefix, m = mask;
        // Four entries a thread at a time: their loads are in flight together.
        for (int c0 = 0; c0 < count; c0 += 4 * blockDim.x) {
            uint32_t keys[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int c = c0 + u * blockDim.x + tid;
                keys[u] = c < count ? rank_key(vals[c]) : 0u;
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int c = c0 + u * blockDim.x + tid;
                const bool counted = c < count && (keys[u] & m) == p;
                // Lanes of one bin add once (most of a row shares a few bins); others get a bin
                // each.
                const uint32_t bin = counted ? (keys[u] >> shift) & 255u : 256u + lane;
                const uint32_t peers = __match_any_sync(0xffffffffu, bin);
                if (counted && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l holds bins 255 - 8l down to 248 - 8l; the bin where the running count from
            // the top reaches `need` is the byte.
            uint32_t cnt[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                cnt[j] = hist[255 - 8 * lane - j];
                sum += cnt[j];
            }
            uint32_t incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += t;
            }
            const uint32_t want = (uint32_t)need, before = incl - sum;
            __syncwarp();
            if (before < want && want <= incl) {
                uint32_t cum = before;
                for (int j = 0; j < 8; j++) {
                    if (cum + cnt[j] >= want) {
                        prefix = p | ((uint32_t)(255 - 8 * lane - j) << shift);
                        mask = m | (255u << shift);
                        need = (int)(want - cum);
                        matched = cnt[j];
                        break;
                    }
                    cum += cnt[j];
                }
            }
        }
        __syncthreads();
    }
    // Keys above the threshold (prefix under mask) are all taken, in any order (the sort below
    // orders them), by a pass whose loads coalesce. Of those equal to it, the `need` lowest
    // indices: all of them when they are exactly that many, else counted per thread over a
    // contiguous stretch and ranked by a scan (only exact ties at the n-th value get here).
    const uint32_t p = prefix, m = mask;
    const int eq_take = need;
    const bool all_eq = matched == (uint32_t)eq_take;
    for (int c = tid; c < count; c += blockDim.x) {
        const uint32_t key = rank_key(vals[c]);
        const uint32_t top = key & m;
        if (top > p || (all_eq && top == p))
            cand[atomicAdd(&taken, 1)] = ((unsigned long long)key << 32) | (uint32_t)~(uint32_t)c;
    }
    if (!all_eq) {
        const int stretch = (count + blockDim.x - 1) / blockDim.x;
        const int c_begin = min(count, tid * stretch), c_end = min(count, c_begin + stretch);
        int eq = 0;
        for (int c = c_begin; c < c_end; c++) eq += (rank_key(vals[c]) & m) == p;
        int incl = eq;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        if (lane == 31) warp_eq[warp] = incl;
        __syncthreads();
        int rank = incl - eq;
        for (int w = 0; w < warp; w++) rank += warp_eq[w];
        for (int c = c_begin; c < c_end && rank < eq_take; c++) {
            const uint32_t key = rank_key(vals[c]);
            if ((key & m) == p) {
                cand[atomicAdd(&taken, 1)] = ((unsigned long long)key << 32) | (uint32_t)~(uint32_t)c;
                rank++;
            }
        }
    }
    __syncthreads();
    // Bitonic sort, best first, over a power of two padded with zeros (below every entry: a NaN
    // entry's low word ~index is never 0).
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + tid; i < size; i += blockDim.x) cand[i] = 0ull;
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < size; i += blockDim.x) {
                const int partner = i ^ j;
                if (partner > i) {
                    const unsigned long long a = cand[i], b = cand[partner];
                    const bool descending = (i & k) == 0;
                    if (descending ? a < b : a > b) {
                        cand[i] = b;
                        cand[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < n; i += blockDim.x) {
        const uint32_t c = ~(uint32_t)cand[i];
        out_cols[i] = ids ? ids[c] : col_base + c;
        out_vals[i] = vals[c];
    }
}

// x at each of the n_at columns at_cols into out_at (NaN past the end).
__device__ void values_at(const float* x, int cols, const uint32_t* at_cols, int n_at,
                          float* out_at) {
    for (int j = threadIdx.x; j < n_at; j += blockDim.x) {
        const uint32_t c = at_cols[j];
        out_at[j] = c < (uint32_t)cols ? x[c] : __int_as_float(0x7fc00000);
    }
}

// The n best columns of x [cols] (0 < n <= min(cols, TOP_MAX)) in rank order into out_cols and
// out_vals, and x at the n_at columns at_cols into out_at: one block of 1024 threads over the
// whole row (a small row, or to measure against the two stages below).
extern "C" __global__ void __launch_bounds__(1024) top_logits(const float* x, int cols, int n,
                                                              const uint32_t* at_cols, int n_at,
                                                              uint32_t* out_cols, float* out_vals,
                                                              float* out_at) {
    PDL_START();
    top_select(x, cols, n, nullptr, 0, out_cols, out_vals);
    values_at(x, cols, at_cols, n_at, out_at);
}

// Stage one over a wide row: block p takes columns [p TOP_CHUNK, (p + 1) TOP_CHUNK) and writes
// its best min(n, its columns) to part_cols / part_vals [p n ..] in rank order, padded to n with
// column 0xffffffff and NaN (only the last block can be short, so the padding ranks last).
// n <= TOP_CHUNK.
extern "C" __global__ void __launch_bounds__(1024) top_logits_parts(const float* x, int cols, int n,
                                                                    uint32_t* part_cols,
                                                                    float* part_vals) {
    PDL_START();
    const int base = blockIdx.x * TOP_CHUNK, len = min(TOP_CHUNK, cols - base), m = min(n, len);
    uint32_t* oc = part_cols + (long)blockIdx.x * n;
    float* ov = part_vals + (long)blockIdx.x * n;
    top_select(x + base, len, m, nullptr, (uint32_t)base, oc, ov);
    for (int j = m + threadIdx.x; j < n; j += blockDim.x) {
        oc[j] = 0xffffffffu;
        ov[j] = __int_as_float(0x7fc00000);
    }
}

// Stage two: the best n of the parts' count = parts n candidates. Among equal values a part's
// candidates are in column order and the parts in column order, so the lower index is the
// lower column: the row's order.
extern "C" __global__ void __launch_bounds__(1024) top_logits_merge(
    const uint32_t* part_cols, const float* part_vals, int count, int n, const float* x, int cols,
    const uint32_t* at_cols, int n_at, uint32_t* out_cols, float* out_vals, float* out_at) {
    PDL_START();
    top_select(part_vals, count, n, part_cols, 0, out_cols, out_vals);
    values_at(x, cols, at_cols, n_at, out_at);
}

// ------------------------------------------------------------------------------------------------
// Several matrices in one launch
// ------------------------------------------------------------------------------------------------

#define MULTI_MAX 4

// Up to MULTI_MAX matrices of the same width and kind applied to the same input: matrix i owns the
// blocks [first[i], first[i + 1]), one per output row, and writes out[i] [T, m[i].rows].
struct MatSet {
    Mat m[MULTI_MAX];
    float* out[MULTI_MAX];
    int first[MULTI_MAX + 1];
    int n;
};

// gemv_b over a MatSet: one launch for q, k and v, or for a linear attention's four inputs.
template <int K, int T>
__device__ void gemv_multi(const MatSet& set, const float* x) {
    int i = 0;
    while (i + 1 < set.n && (int)blockIdx.x >= set.first[i + 1]) i++;
    const long r = blockIdx.x - set.first[i];
    float acc[1][T];
    block_rows_dot<K, T, 1>(&set.m[i], &r, x, set.m[i].cols, acc);
    if (threadIdx.x == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) set.out[i][t * (long)set.m[i].rows + r] = acc[0][t];
    }
}

#define GEMV_MULTI(K, KN, T) \
    extern "C" __global__ void __launch_bounds__(128) gemv_multi_##KN##_t##T(MatSet set, \
                                                                           const float* x) { PDL_START(); \
        gemv_multi<K, T>(set, x); \
    }
#define GEMV_MULTI_ALL(K, KN) \
    GEMV_MULTI(K, KN, 1) GEMV_MULTI(K, KN, 2) GEMV_MULTI(K, KN, 3) GEMV_MULTI(K, KN, 4) \
    GEMV_MULTI(K, KN, 5) GEMV_MULTI(K, KN, 6) GEMV_MULTI(K, KN, 7) GEMV_MULTI(K, KN, 8)
GEMV_MULTI_ALL(K_GENERIC, generic) GEMV_MULTI_ALL(K_Q4, q4) GEMV_MULTI_ALL(K_Q8, q8)
GEMV_MULTI_ALL(K_BF16, bf16) GEMV_MULTI_ALL(K_MXFP4, mxfp4)

// ------------------------------------------------------------------------------------------------
// One token's 4-bit products, spread over the columns (decode)
// ------------------------------------------------------------------------------------------------
//
// A decode product is latency-bound: its time is the number of dependent trips to memory, and the
// L1 traffic of the activations (each 4-bit weight needs a 4-byte activation). Here every thread
// takes SPREAD_CODES consecutive columns of SPREAD_ROWS rows: its weights and scales are all
// loaded at once before any arithmetic (one trip), and the rows share each activation load. The
// G = cols / SPREAD_CODES threads of a row group sum their dots in eights (shuffles) and then in a
// fixed order (shared memory): deterministic. Measured on an H100 (graph of 24 launches over
// distinct matrices, L2 cold): 4096 x 2048 7.4 -> 6.5 us, 2048 x 4096 7.1 -> 6.9, 12352 x 2048
// 19.0 -> 15.7 against a block of 128 per row (the `gemv_b` kernels; but a warp per two rows,
// `gemv_*_r2`, takes the 12352 rows in 13.4 and an output head 1.3x faster again); the MoE's down
// projections of one token over 8 experts 15.9 -> 12.8 us (expert width 768) and 10.9 -> 7.2 (512)
// against moe_down_q4_w. The same layout for the MoE's gate and up projections was slower than
// moe_gate_up_q4_w (20-22 us against 14 for 14 MB), with the expert read per thread or per block.
// Needs cols % 128 == 0 (G a multiple of 8), group >= 16, and blocks of whole warps: the host
// picks the shapes (Mat::spread in mat.rs).

#define SPREAD_CODES 16
#define SPREAD_ROWS 4

// This thread's share of rows r0 .. r0 + R (clamped to the matrix) over columns [c, c + 16):
// acc[i] = s_i sum(q x) + b_i sum(x), where x is x[c..] or, with SWIGLU, swiglu(x, up)[c..];
// with I8, sum(q x) in integers against x's 8-bit codes (X16).
template <int R, bool SWIGLU, bool I8 = false>
__device__ __forceinline__ void spread_dots(const Mat& m, long r0, int c, const float* x,
                                            const float* up, float acc[R]) {
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
    // Weights are not written by earlier kernels: a kernel that has not waited yet loads them
    // while the one before it finishes.
    PDL_WAIT();
    float xv[SPREAD_CODES];
    load_floats<SPREAD_CODES>(x + c, xv);
    if constexpr (SWIGLU) {
        float uv[SPREAD_CODES];
        load_floats<SPREAD_CODES>(up + c, uv);
#pragma unroll
        for (int j = 0; j < SPREAD_CODES; j++) xv[j] = swiglu1(xv[j], uv[j]);
    }
    if constexpr (I8) {
        const X16 q = quant16(xv);
#pragma unroll
        for (int i = 0; i < R; i++) acc[i] = fmaf(s[i] * q.d, (float)q4_dot_i8(w[i], q), b[i] * q.sum);
        return;
    }
    float xs = 0.0f;
#pragma unroll
    for (int j = 0; j < SPREAD_CODES; j++) xs += xv[j];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = fmaf(s[i], q4_dot<2>(w[i], xv), b[i] * xs);
}

// Sums v[i] over the G threads of each row group of the block (G % 8 == 0, blockDim % G == 0):
// thread g * N + i (i < N) of the block gets group g's total of v[i]; `part` holds blockDim / 8 * N
// floats. Ends with every thread past a barrier.
template <int N>
__device__ __forceinline__ float spread_sum(const float v[N], int G, float* part) {
    const int segs = blockDim.x / 8;
#pragma unroll
    for (int i = 0; i < N; i++) {
        float t = v[i];
        t += __shfl_xor_sync(FULL_MASK, t, 4);
        t += __shfl_xor_sync(FULL_MASK, t, 2);
        t += __shfl_xor_sync(FULL_MASK, t, 1);
        if (threadIdx.x % 8 == 0) part[i * segs + threadIdx.x / 8] = t;
    }
    __syncthreads();
    float total = 0.0f;
    const int g = threadIdx.x / N, i = threadIdx.x % N;
    if (g < (int)blockDim.x / G) {
        const float* p = part + i * segs + g * (G / 8);
        for (int k = 0; k < G / 8; k++) total += p[k];
    }
    return total;
}

// y = x W^T for one token, the rows of this matrix's `block`-th block: blockDim / G row groups of
// SPREAD_ROWS rows per block. With SWIGLU, y += sigmoid(gate[0]) * (W . swiglu(x, up)) (the
// arithmetic of gemv_gated_add).
template <bool SWIGLU, bool I8 = false>
__device__ void spread_gemv(const Mat& m, long block, const float* x, float* y,
                            const float* up = nullptr, const float* gate = nullptr) {
    constexpr int R = SPREAD_ROWS;
    __shared__ float part[R * 256 / 8];
    const int G = m.cols / SPREAD_CODES, groups = blockDim.x / G;
    const long r0 = (block * groups + threadIdx.x / G) * R;
    float acc[R];
    spread_dots<R, SWIGLU, I8>(m, min(r0, (long)m.rows - 1), (threadIdx.x % G) * SPREAD_CODES, x, up, acc);
    const float total = spread_sum<R>(acc, G, part);
    const long r = block * groups * R + threadIdx.x;
    if (threadIdx.x < groups * R && r < m.rows) {
        if constexpr (SWIGLU) y[r] = __fadd_rn(y[r], __fmul_rn(total, sigmoid1(gate[0])));
        else y[r] = total;
    }
}

// gemv_q4_t1_s, gemv_gated_q4_t1_s, and gemv_multi_q4_t1_s over a MatSet whose `first` counts
// blocks (one launch for q, k and v); with I8 (the `_i8` names) on 8-bit activations (X16).
#define GEMV_Q4_T1_S(SUFFIX, I8) \
    extern "C" __global__ void __launch_bounds__(256) gemv_q4_t1_s##SUFFIX(Mat w, const float* x, \
                                                                          float* y) { \
        PDL_LAUNCH_DEPENDENTS(); \
        spread_gemv<false, I8>(w, blockIdx.x, x, y); \
    } \
    extern "C" __global__ void __launch_bounds__(256) gemv_gated_q4_t1_s##SUFFIX( \
        Mat w, const float* g, const float* u, const float* gate, float* y) { \
        PDL_LAUNCH_DEPENDENTS(); \
        spread_gemv<true, I8>(w, blockIdx.x, g, y, u, gate); \
    } \
    extern "C" __global__ void __launch_bounds__(256) gemv_multi_q4_t1_s##SUFFIX(MatSet set, \
                                                                                const float* x) { \
        PDL_LAUNCH_DEPENDENTS(); \
        int i = 0; \
        while (i + 1 < set.n && (int)blockIdx.x >= set.first[i + 1]) i++; \
        spread_gemv<false, I8>(set.m[i], blockIdx.x - set.first[i], x, set.out[i]); \
    }
GEMV_Q4_T1_S(, false)
GEMV_Q4_T1_S(_i8, true)

// The MoE's down projections of token blockIdx.y, SPREAD_ROWS output rows per block: the threads
// j * G .. (j + 1) * G take the token's j-th routed expert (blockDim = K G), each SPREAD_ROWS rows
// of 16 columns; the dots (with their down biases, `f`) are added weighted in ascending expert id,
// onto `out` when `accumulate`, else from zero (moe_down_q4_w's order: bit-identical however the
// experts are split over calls).
// With SHARED, the block has K + 1 groups of G threads: the last takes the shared expert (its
// activations h[T K + t], its weight sh->weight[t]), added after the routed experts as
// gemv_gated_q4_t1_s adds it (the same bits as the unfused down projection, given the same h).
template <bool SHARED, bool I8 = false>
__device__ __forceinline__ void moe_down_q4s(
    const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids,
    const float* weights, int K, const float* h, float* out, int hidden, int accumulate,
    Ffn f, const SharedExpert* sh) {
    constexpr int R = SPREAD_ROWS;
    __shared__ float part[R * 1024 / 8];
    __shared__ float dots[R][MOE_MAX_K];
    __shared__ Mat down[MOE_MAX_K];
    __shared__ bool here[MOE_MAX_K];
    __shared__ int order[MOE_MAX_K];
    __shared__ int n;
    const long t = blockIdx.y;
    const long r0 = (long)blockIdx.x * R;
    if (threadIdx.x < K) {
        // Expert `threadIdx.x`'s description, and its rank among the token's present experts
        // (ascending id, ties by position).
        const uint32_t mine = ids[t * K + threadIdx.x];
        const int slot = expert_slot(mine, present, n_present);
        here[threadIdx.x] = slot >= 0;
        if (slot >= 0) down[threadIdx.x] = experts[slot].down;
        int rank = 0, count = 0;
        for (int o = 0; o < K; o++) {
            const uint32_t other = ids[t * K + o];
            if (expert_slot(other, present, n_present) < 0) continue;
            count++;
            rank += other < mine || (other == mine && o < (int)threadIdx.x);
        }
        if (slot >= 0) order[rank] = threadIdx.x;
        if (threadIdx.x == 0) n = count;
    }
    if (SHARED && threadIdx.x == K) {
        here[K] = true;
        down[K] = sh->down;
    }
    __syncthreads();
    const int groups = K + SHARED;
    const int G = blockDim.x / groups, j = threadIdx.x / G;
    float acc[R] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (here[j]) {
        const Mat& d = down[j];
        const long row = j < K ? t * K + j : (long)gridDim.y * K + t;
        spread_dots<R, false, I8>(d, min(r0, (long)hidden - 1), (threadIdx.x % G) * SPREAD_CODES,
                              h + row * d.cols, nullptr, acc);
    }
    // Thread j' * R + i: expert j' 's total of row i (one "row group" per expert).
    const float total = spread_sum<R>(acc, G, part);
    if (threadIdx.x < groups * R) dots[threadIdx.x % R][threadIdx.x / R] = total;
    __syncthreads();
    if (threadIdx.x < R && r0 + threadIdx.x < hidden) {
        const long r = r0 + threadIdx.x, o = t * hidden + r;
        float a = accumulate ? out[o] : 0.0f;
        for (int p = 0; p < n; p++) {
            const int jj = order[p];
            const float dot = ffn_down(f, ids[t * K + jj], hidden, r, dots[threadIdx.x][jj]);
            a = fmaf(weights[t * K + jj], dot, a);
        }
        if (SHARED) a = __fadd_rn(a, __fmul_rn(dots[threadIdx.x][K], sh->weight[t]));
        out[o] = a;
    }
}

// moe_down_q4_s, and _shared with the shared expert; with I8 (the `_i8` names) on 8-bit
// activations (X16). The `_s384` ones are for blocks of at most 384 threads, four to a
// multiprocessor (registers capped to fit): Qwen3-30B-A3B's 2048 / 4 blocks of 8 x 48 threads then
// run in one wave of 132 x 4 instead of a wave of 132 x 3 and a partial second one.
#define MOE_DOWN_Q4S(NAME, SHARED_NAME, BOUNDS, I8) \
    extern "C" __global__ void BOUNDS NAME( \
        const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids, \
        const float* weights, int K, const float* h, float* out, int hidden, int accumulate, \
        Ffn f) { \
        PDL_LAUNCH_DEPENDENTS(); \
        prefetch_table(experts, f.table); \
        PDL_WAIT(); \
        moe_down_q4s<false, I8>(experts, present, n_present, ids, weights, K, h, out, hidden, \
                                accumulate, f, nullptr); \
    } \
    extern "C" __global__ void BOUNDS SHARED_NAME( \
        const ExpertMats* experts, const uint32_t* present, int n_present, const uint32_t* ids, \
        const float* weights, int K, const float* h, float* out, int hidden, int accumulate, \
        Ffn f, SharedExpert sh) { \
        PDL_LAUNCH_DEPENDENTS(); \
        prefetch_table(experts, f.table); \
        PDL_WAIT(); \
        moe_down_q4s<true, I8>(experts, present, n_present, ids, weights, K, h, out, hidden, \
                               accumulate, f, &sh); \
    }
MOE_DOWN_Q4S(moe_down_q4_s, moe_down_q4_s_shared, __launch_bounds__(1024), false)
MOE_DOWN_Q4S(moe_down_q4_s384, moe_down_q4_s384_shared, __launch_bounds__(384, 4), false)
MOE_DOWN_Q4S(moe_down_q4_s_i8, moe_down_q4_s_shared_i8, __launch_bounds__(1024), true)
MOE_DOWN_Q4S(moe_down_q4_s384_i8, moe_down_q4_s384_shared_i8, __launch_bounds__(384, 4), true)


// ------------------------------------------------------------------------------------------------
// Experts computed by the host beside the device (host_compute.rs)
// ------------------------------------------------------------------------------------------------
//
// A mailbox in page-locked host memory mapped into the device (words; layout in host_compute.rs):
// host_split_plan picks, on the device, which of a layer's routed experts held in no VRAM slot the
// host computes, writes the input rows and routing there and rings the doorbell; the MoE kernels
// run on a copy of the routing in which those pairs are SKIP_EXPERT; host_split_join waits for the
// host's answer and adds it. Nothing returns to the host through the stream: the decode step stays
// one replayed graph.

#define MB_DOORBELL 0
#define MB_DONE 1
#define MB_FAILED 3
#define MB_SHARE 4
#define MB_LAYER 5
#define MB_ROWS 6
#define MB_K 7
#define MB_COLS 8
#define MB_HOST_IDS 16
#define MB_PAIR_IDS (MB_HOST_IDS + 128)
#define MB_PAIR_WEIGHTS (MB_PAIR_IDS + 128)
#define MB_X (MB_PAIR_WEIGHTS + 128)
// state (device words): [0] calls so far, [1] the share's carry (f32), [2] experts the host took.
#define ST_SEQ 0
#define ST_CARRY 1
#define ST_TAKEN 2

__device__ __forceinline__ void store_volatile(uint32_t* p, uint32_t v) {
    *(volatile uint32_t*)p = v;
}

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* p) {
    return *(const volatile uint32_t*)p;
}

// One block. The misses (routed experts whose table entry is not in the VRAM slots [lo, hi)):
// the host takes floor(share x misses + carry) of them, those with the most pairs first (lower id
// among equals). gpu_ids / gpu_weights: the routing with the host's pairs skipped.
extern "C" __global__ void __launch_bounds__(256) host_split_plan(
    const uint32_t* ids, const float* weights, const float* x, const ExpertMats* table,
    unsigned long long lo, unsigned long long hi, int rows, int K, int cols, int layer,
    uint32_t* state, uint32_t* mb, uint32_t* gpu_ids, float* gpu_weights) {
    PDL_START();
    const int n = rows * K;
    __shared__ uint32_t host_ids[128];
    __shared__ int taken;
    if (threadIdx.x == 0) {
        // Distinct routed experts with their pairs; the misses among them.
        uint32_t miss_id[128];
        int miss_uses[128];
        int m = 0;
        for (int p = 0; p < n; p++) {
            const uint32_t e = ids[p];
            bool seen = false;
            for (int q = 0; q < p; q++) seen |= ids[q] == e;
            if (seen) continue;
            const unsigned long long at = (unsigned long long)table[e].gate.data;
            if (at >= lo && at < hi) continue;
            int uses = 0;
            for (int q = p; q < n; q++) uses += ids[q] == e;
            miss_id[m] = e;
            miss_uses[m] = uses;
            m++;
        }
        const float share = __uint_as_float(load_volatile(mb + MB_SHARE));
        const float want = share * (float)m + __uint_as_float(state[ST_CARRY]);
        int take = min((int)floorf(want), m);
        take = max(take, 0);
        state[ST_CARRY] = __float_as_uint(fminf(fmaxf(want - (float)take, 0.0f), 1.0f));
        // The `take` misses with the most uses (selection), then ascending ids.
        for (int i = 0; i < take; i++) {
            int best = i;
            for (int j = i + 1; j < m; j++)
                if (miss_uses[j] > miss_uses[best] ||
                    (miss_uses[j] == miss_uses[best] && miss_id[j] < miss_id[best]))
                    best = j;
            const uint32_t bi = miss_id[i];
            const int bu = miss_uses[i];
            miss_id[i] = miss_id[best];
            miss_uses[i] = miss_uses[best];
            miss_id[best] = bi;
            miss_uses[best] = bu;
        }
        for (int i = 1; i < take; i++)
            for (int j = i; j > 0 && miss_id[j - 1] > miss_id[j]; j--) {
                const uint32_t t = miss_id[j];
                miss_id[j] = miss_id[j - 1];
                miss_id[j - 1] = t;
            }
        for (int i = 0; i < take; i++) host_ids[i] = miss_id[i];
        taken = take;
        state[ST_TAKEN] = take;
    }
    __syncthreads();
    const int take = taken;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        const uint32_t e = ids[p];
        bool on_host = false;
        for (int i = 0; i < take; i++) on_host |= host_ids[i] == e;
        gpu_ids[p] = on_host ? SKIP_EXPERT : e;
        gpu_weights[p] = on_host ? 0.0f : weights[p];
    }
    if (take == 0) return;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        store_volatile(mb + MB_PAIR_IDS + p, ids[p]);
        store_volatile(mb + MB_PAIR_WEIGHTS + p, __float_as_uint(weights[p]));
    }
    for (int i = threadIdx.x; i < take; i += blockDim.x) store_volatile(mb + MB_HOST_IDS + i, host_ids[i]);
    for (int i = threadIdx.x; i < rows * cols; i += blockDim.x)
        store_volatile(mb + MB_X + i, __float_as_uint(x[i]));
    // Every thread's writes reach host memory before the doorbell.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t seq = state[ST_SEQ] + 1;
        state[ST_SEQ] = seq;
        store_volatile(mb + MB_LAYER, (uint32_t)layer);
        store_volatile(mb + MB_ROWS, (uint32_t)rows);
        store_volatile(mb + MB_K, (uint32_t)K);
        store_volatile(mb + MB_COLS, (uint32_t)cols);
        __threadfence_system();
        // The doorbell: the call's number and how many experts the host takes (at most 128).
        store_volatile(mb + MB_DOORBELL, ((seq & 0xffffff) << 8) | (uint32_t)take);
    }
}

// out[i] += y[i] (the host's sum, in the mailbox after the input rows) once the host has
// answered this call; nothing when the host took no expert. Waits at most `timeout_ns`, then
// marks the mailbox failed (the host reports it) and adds nothing.
extern "C" __global__ void __launch_bounds__(1024) host_split_join(
    const uint32_t* state, uint32_t* mb, const uint32_t* y, float* out, int n,
    unsigned long long timeout_ns) {
    PDL_START();
    if (state[ST_TAKEN] == 0) return;
    __shared__ bool ok;
    if (threadIdx.x == 0) {
        const uint32_t seq = state[ST_SEQ] & 0xffffff;
        ok = true;
        if (load_volatile(mb + MB_DONE) != seq) {
            unsigned long long start, now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
            while (load_volatile(mb + MB_DONE) != seq) {
                __nanosleep(200);
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now - start > timeout_ns) {
                    store_volatile(mb + MB_FAILED, 1);
                    ok = false;
                    break;
                }
            }
        }
        __threadfence_system();
    }
    __syncthreads();
    if (!ok) return;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] += __uint_as_float(load_volatile(y + i));
}

// ------------------------------------------------------------------------------------------------
// 8-bit-activation tensor-core products (prefill with the `fast` kernels)
// ------------------------------------------------------------------------------------------------
//
// llama.cpp's arithmetic for many tokens (its MMQ kernels): the activations are quantized to 8
// bits per 32 columns (scale d = max|x| / 127, and the sum of the values for the bias term), the
// 4- or 8-bit codes meet them in integer mma.sync m16n8k32, and each 32 columns' integer dot is
// scaled once: y += s (d q.xq) + b sum(x). Four times fewer tensor-core instructions than the
// exact path's two bf16 parts at k16, and a quarter of its shared-memory traffic. An
// approximation (each activation to within d / 2): tests/fast_prefill.rs bounds its effect on
// the logits.

#define IQ_BLOCK 32
#define IQ_BK 64
// Words per shared tile row: 16 of data (64 codes) and 4 of padding (conflict-free fragments).
#define IQ_LD 20

// Rows of x ([n, cols], or with GLU [n, 2 cols] gate | up of the MoE's pairs, quantizing their
// activation with the biases of the row's expert ids[row] as `f` says, ffn_gate_up) as 8-bit
// values q [n, cols] with, per 32 columns, the scale d and the sum of the unrounded values s
// ([n, cols / 32] each). Eight threads per 32 columns. With `nibble_order`, each 32 columns are stored
// in the order iq_tile reads 4-bit codes in: the even columns of each 8 first, then the odd
// ones (column 8 t + 2 m + o at 16 o + 4 t + m): the codes' low and high nibbles are then
// fragments as they are.
extern "C" __global__ void __launch_bounds__(256) quant_q8_rows(const float* x, long n, int cols,
                                                                int glu, int nibble_order,
                                                                signed char* q, float* d,
                                                                float* s, Ffn f,
                                                                const uint32_t* ids) {
    PDL_START();
    // Eight threads per 32 columns, four consecutive values each.
    const int sub = threadIdx.x % 8;
    const long blocks_per_row = cols / IQ_BLOCK;
    const long b = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 8;
    // Whole groups of eight leave together: the shuffles below stay within live lanes.
    if (b >= n * blocks_per_row) return;
    const long row = b / blocks_per_row, c0 = (b % blocks_per_row) * IQ_BLOCK, c = c0 + 4 * sub;
    float v[4];
    if (glu) {
        const float4 g = *reinterpret_cast<const float4*>(x + row * 2 * cols + c);
        const float4 u = *reinterpret_cast<const float4*>(x + row * 2 * cols + cols + c);
        const float gs[4] = {g.x, g.y, g.z, g.w}, us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = f.gate_bias != nullptr ? ffn_gate_up(f, ids[row], cols, c + i, gs[i], us[i])
                                          : ffn_act(f, gs[i], us[i]);
    } else {
        const float4 a = *reinterpret_cast<const float4*>(x + row * cols + c);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    float sum = (v[0] + v[1]) + (v[2] + v[3]);
    const unsigned mask = __activemask();
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
        sum += __shfl_xor_sync(mask, sum, o);
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    signed char* qb = q + row * cols + c0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int k = 4 * sub + i;
        const int at = nibble_order ? (k & 1) * 16 + (k / 8) * 4 + (k % 8) / 2 : k;
        qb[at] = (signed char)max(-127, min(127, __float2int_rn(v[i] * inv)));
    }
    if (sub == 0) {
        d[b] = amax / 127.0f;
        s[b] = sum;
    }
}

// c += a b for a 16x32 block of codes (u8) and 32x8 of activations (s8), in integers.
__device__ __forceinline__ void mma_u8s8(int c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Asynchronous copies global -> shared of `bytes` (4 or 16), zero-filled past `src_bytes`.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The 8-bit activations a block multiplies: token row `row[n]` (-1: padding) of q [*, cols] with
// its per-32-column d and s.
struct IqRows {
    const signed char* q;
    const float* d;
    const float* s;
};

// Tiles of 64 columns in flight per block (stages of the copy pipeline).
#define IQ_STAGES 3

// One stage of iq_tile: BM rows of stored codes (4-bit: 8 words a row, 8-bit: 16) and BN token
// rows of 8-bit values (16 words), padded to conflict-free fragments; per 32 columns the
// tokens' scales and sums, and the 4-byte words holding the weights' scales and biases (a
// 2-byte scale sits in the half its index's parity says).
template <int K, int BM, int BN>
struct IqStage {
    uint32_t a[BM][(K == K_Q4 ? 8 : 16) + 4];
    uint32_t b[BN][IQ_LD];
    float xd[BN][2], xs[BN][2];
    uint32_t ws[BM][2], wb[BM][2];
};

// A scale or bias of type sdt from the 4-byte word holding it; `half` the index's parity.
__device__ __forceinline__ float scale_from_word(uint32_t w, int sdt, int half) {
    if (sdt == SDT_F32) return __uint_as_float(w);
    const uint32_t h = (w >> (16 * half)) & 0xffffu;
    if (sdt == SDT_F16) return __half2float(__ushort_as_half((unsigned short)h));
    return __uint_as_float(h << 16);
}

// Issues the copies of the tile at column k0 (`steps` 32-column steps of it real, the rest and
// padding tokens zero-filled) into `st`.
template <int K, int BM, int BN>
__device__ __forceinline__ void iq_issue(const Mat& m, long r0, const IqRows& x, const int* row,
                                         int k0, int steps, IqStage<K, BM, BN>& st) {
    constexpr int CA = K == K_Q4 ? 2 : 4;  // 16-byte chunks of a row's 64 codes
    const int cols = m.cols;
    const long xblocks = cols / IQ_BLOCK, groups_per_row = cols >> m.gshift;
    const long row_bytes = K == K_Q4 ? cols / 2 : cols;
#pragma unroll
    for (int it = 0; it < (BM * CA + 127) / 128; it++) {
        const int idx = threadIdx.x + it * 128, r = idx / CA, ch = idx % CA;
        if (idx >= BM * CA) break;
        const int kk = K == K_Q4 ? ch : ch / 2;
        const long rr = min(r0 + r, (long)m.rows - 1);
        const uint8_t* src = m.data + rr * row_bytes + (K == K_Q4 ? k0 / 2 : k0) + ch * 16;
        cp_async16(&st.a[r][ch * 4], kk < steps ? src : m.data, kk < steps ? 16 : 0);
    }
#pragma unroll
    for (int it = 0; it < (BN * 4 + 127) / 128; it++) {
        const int idx = threadIdx.x + it * 128, n = idx / 4, ch = idx % 4;
        if (idx >= BN * 4) break;
        const bool real = row[n] >= 0 && ch / 2 < steps;
        const signed char* src = x.q + (real ? row[n] * (long)cols + k0 + ch * 16 : 0);
        cp_async16(&st.b[n][ch * 4], src, real ? 16 : 0);
    }
    if (threadIdx.x < BN * 2) {
        const int n = threadIdx.x / 2, kb = threadIdx.x % 2;
        const bool real = row[n] >= 0 && kb < steps;
        const long xi = real ? row[n] * xblocks + k0 / IQ_BLOCK + kb : 0;
        cp_async4(&st.xd[n][kb], x.d + xi, real ? 4 : 0);
        cp_async4(&st.xs[n][kb], x.s + xi, real ? 4 : 0);
    }
    const int es = m.sdt == SDT_F32 ? 4 : 2;
#pragma unroll
    for (int it = 0; it < (BM * 2 + 127) / 128; it++) {
        const int idx = threadIdx.x + it * 128, r = idx / 2, kb = idx % 2;
        if (idx >= BM * 2) break;
        const long gi = min(r0 + r, (long)m.rows - 1) * groups_per_row + ((k0 + kb * IQ_BLOCK) >> m.gshift);
        // The aligned word holding element gi; an even 2-byte element reads only itself.
        const long at = es == 4 ? gi * 4 : (gi & ~1L) * 2;
        const int bytes = kb >= steps ? 0 : (es == 4 || (gi & 1)) ? 4 : 2;
        cp_async4(&st.ws[r][kb], m.scales + at, bytes);
        cp_async4(&st.wb[r][kb], m.biases + at, bytes);
    }
}

// The block's products of rows r0 .. r0 + BM of m (4- or 8-bit affine, groups of a multiple of 32
// columns) with the BN token rows `row` of x (4-bit weights: x quantized in nibble order), over
// columns [k_begin, k_end) (multiples of 32). IQ_STAGES tiles of 64 columns are in flight at
// once (cp.async); one barrier per tile. acc as tq_tile's (frag_row / frag_token).
template <int K, int MI, int NJ, int WM, int WN>
__device__ __forceinline__ void iq_tile(const Mat& m, long r0, const IqRows& x, const int* row,
                                        IqStage<K, 16 * MI * WM, 8 * NJ * WN> (&st)[IQ_STAGES],
                                        float acc[MI][NJ][4], int k_begin, int k_end) {
    constexpr int BM = 16 * MI * WM, BN = 8 * NJ * WN;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t4 = lane % 4;
    const int wm = (warp / WN) * 16 * MI, wn = (warp % WN) * 8 * NJ;
    // The parity of the first group index of each fragment row (a 2-byte scale's half).
    const int gpr_odd = (m.cols >> m.gshift) & 1;
    int par[MI][2];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            par[i][h] = (int)(min(r0 + wm + i * 16 + g + 8 * h, (long)m.rows - 1) & gpr_odd);
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    const int tiles = (k_end - k_begin + IQ_BK - 1) / IQ_BK;
    const auto steps_of = [&](int t) { return min(2, (k_end - k_begin - t * IQ_BK) / IQ_BLOCK); };
#pragma unroll
    for (int t = 0; t < IQ_STAGES - 1; t++) {
        if (t < tiles) iq_issue<K, BM, BN>(m, r0, x, row, k_begin + t * IQ_BK, steps_of(t), st[t]);
        cp_async_commit();
    }
    for (int t = 0; t < tiles; t++) {
        cp_async_wait<IQ_STAGES - 2>();
        // Tile t has landed for every thread, and tile t - 1's stage is free to refill.
        __syncthreads();
        const int next = t + IQ_STAGES - 1;
        if (next < tiles)
            iq_issue<K, BM, BN>(m, r0, x, row, k_begin + next * IQ_BK, steps_of(next),
                                st[next % IQ_STAGES]);
        cp_async_commit();
        const IqStage<K, BM, BN>& s = st[t % IQ_STAGES];
        const int k0 = k_begin + t * IQ_BK, steps = steps_of(t);
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            if (kk >= steps) break;
            uint32_t bf[NJ][2];
            float xd[NJ][2], xs[NJ][2];
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int n = wn + j * 8 + g, n0 = wn + j * 8 + 2 * t4;
                bf[j][0] = s.b[n][kk * 8 + t4];
                bf[j][1] = s.b[n][kk * 8 + 4 + t4];
                xd[j][0] = s.xd[n0][kk]; xd[j][1] = s.xd[n0 + 1][kk];
                xs[j][0] = s.xs[n0][kk]; xs[j][1] = s.xs[n0 + 1][kk];
            }
            const int gk = ((k0 + kk * IQ_BLOCK) >> m.gshift) & 1;
#pragma unroll
            for (int i = 0; i < MI; i++) {
                const int ra = wm + i * 16 + g, rb = ra + 8;
                uint32_t af[4];
                if constexpr (K == K_Q4) {
                    const uint32_t wa = s.a[ra][kk * 4 + t4], wb = s.a[rb][kk * 4 + t4];
                    af[0] = wa & 0x0F0F0F0Fu; af[1] = wb & 0x0F0F0F0Fu;
                    af[2] = (wa >> 4) & 0x0F0F0F0Fu; af[3] = (wb >> 4) & 0x0F0F0F0Fu;
                } else {
                    af[0] = s.a[ra][kk * 8 + t4]; af[1] = s.a[rb][kk * 8 + t4];
                    af[2] = s.a[ra][kk * 8 + 4 + t4]; af[3] = s.a[rb][kk * 8 + 4 + t4];
                }
                const int ha = par[i][0] ^ gk, hb = par[i][1] ^ gk;
                const float sa = scale_from_word(s.ws[ra][kk], m.sdt, ha);
                const float ba = scale_from_word(s.wb[ra][kk], m.sdt, ha);
                const float sb = scale_from_word(s.ws[rb][kk], m.sdt, hb);
                const float bb = scale_from_word(s.wb[rb][kk], m.sdt, hb);
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    int c[4] = {0, 0, 0, 0};
                    mma_u8s8(c, af, bf[j]);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float sc = e < 2 ? sa : sb, bi = e < 2 ? ba : bb;
                        acc[i][j][e] = fmaf(sc, xd[j][e & 1] * (float)c[e], fmaf(bi, xs[j][e & 1], acc[i][j][e]));
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
}

// y[ntok, rows] = x[ntok, cols] W^T from 8-bit x. Grid (rows / 64, ntok / 64, splits), 128
// threads; splits as gemm_tq's.
template <int K>
__device__ void gemm_iq(const Mat& w, IqRows x, float* y, int ntok, int kc) {
    __shared__ IqStage<K, 64, 64> s[IQ_STAGES];
    __shared__ int row[64];
    const long r0 = (long)blockIdx.x * 64, n0 = (long)blockIdx.y * 64;
    if (threadIdx.x < 64) row[threadIdx.x] = n0 + threadIdx.x < ntok ? (int)(n0 + threadIdx.x) : -1;
    __syncthreads();
    float acc[2][4][4];
    const int k_begin = blockIdx.z * kc;
    iq_tile<K, 2, 4, 2, 2>(w, r0, x, row, s, acc, k_begin, min(k_begin + kc, w.cols));
    y += (long)blockIdx.z * ntok * w.rows;
    gemm_store_tile(acc, r0, n0, w.rows, ntok, y);
}

#define GEMM_IQ(K, KN) \
    extern "C" __global__ void __launch_bounds__(128, 4) gemm_iq_##KN( \
        Mat w, const signed char* xq, const float* xd, const float* xs, float* y, int ntok, int kc) { \
        PDL_START(); \
        gemm_iq<K>(w, IqRows{xq, xd, xs}, y, ntok, kc); \
    }
GEMM_IQ(K_Q4, q4) GEMM_IQ(K_Q8, q8)

// moe_tile_rows giving the rows' indices (pair / row_div; -1: padding).
template <int BN>
__device__ __forceinline__ void moe_tile_pairs(const int* tiles, const int* sorted, int row_div,
                                               int* pair, int* row) {
    const int first = tiles[moe_tiles() + moe_tile()], count = tiles[2 * moe_tiles() + moe_tile()];
    if (threadIdx.x < BN) {
        const int p = (int)threadIdx.x < count ? sorted[first + threadIdx.x] : -1;
        pair[threadIdx.x] = p;
        row[threadIdx.x] = p >= 0 ? p / row_div : -1;
    }
    __syncthreads();
}

// moe_gate_up_tq and moe_down_tq from 8-bit activations: gate_up writes hg[pair] = [gate | up]
// from x's token rows (their biases join in quant_q8_rows); down writes d[pair] = down(h[pair])
// from h quantized per pair (with quant_q8_rows' GLU). Grids as theirs.
template <int WK, int MI, int NJ>
__device__ void moe_iq(const ExpertMats* experts, const int* tiles, const int* sorted, int K,
                       IqRows x, float* out, bool down) {
    constexpr int BM = 64 * MI, BN = 8 * NJ;
    __shared__ IqStage<WK, BM, BN> s[IQ_STAGES];
    __shared__ int pair[BN], row[BN];
    const int slot = moe_tile_slot(tiles);
    if (slot < 0) return;
    const ExpertMats& e = experts[slot];
    const int inter = e.gate.rows, gate_tiles = (inter + BM - 1) / BM;
    const bool up = !down && blockIdx.x >= gate_tiles;
    const Mat m = down ? e.down : (up ? e.up : e.gate);
    const long r0 = (long)(up ? blockIdx.x - gate_tiles : blockIdx.x) * BM;
    moe_tile_pairs<BN>(tiles, sorted, down ? 1 : K, pair, row);
    float acc[MI][NJ][4];
    iq_tile<WK, MI, NJ, 4, 1>(m, r0, x, row, s, acc, 0, m.cols);
    moe_store_tile<MI, NJ>(acc, r0, m.rows, pair, out + (up ? inter : 0),
                           down ? m.rows : 2 * inter);
}

#define MOE_IQ(WK, KN, MI, NJ) \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_gate_up_iq_##KN##_n##NJ( \
        const ExpertMats* experts, const int* tiles, const int* sorted, int K, \
        const signed char* xq, const float* xd, const float* xs, float* hg) { PDL_START(); \
        moe_iq<WK, MI, NJ>(experts, tiles, sorted, K, IqRows{xq, xd, xs}, hg, false); \
    } \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_down_iq_##KN##_n##NJ( \
        const ExpertMats* experts, const int* tiles, const int* sorted, \
        const signed char* hq, const float* hd, const float* hs, float* d) { PDL_START(); \
        moe_iq<WK, MI, NJ>(experts, tiles, sorted, 1, IqRows{hq, hd, hs}, d, true); \
    }
// NJ 4: 128 rows x 32 pairs; NJ 2: 128 rows x 16 pairs.
MOE_IQ(K_Q4, q4, 2, 4) MOE_IQ(K_Q8, q8, 2, 4) MOE_IQ(K_Q4, q4, 2, 2) MOE_IQ(K_Q8, q8, 2, 2)
