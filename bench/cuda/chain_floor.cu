// The floor of a decode step's structure on this GPU: how long one dependent kernel of a chain
// takes (in a CUDA graph, with and without programmatic dependent launch) when it does almost
// nothing, and how long a grid-wide barrier inside one persistent kernel takes.
//   nvcc -O3 -arch=sm_90 -o chain_floor bench/cuda/chain_floor.cu && ./chain_floor
#include <cstdio>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// Each kernel reads what the one before wrote and writes the next value (one L2 round trip).
__global__ void step(unsigned* v, int pdl) {
    if (pdl) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    if (threadIdx.x == 0) {
        unsigned x = __ldcg(v + blockIdx.x);
        __stcg(v + blockIdx.x, x + 1);
    }
}

// One launch, `n` grid-wide barriers (sense by generation), one L2 round trip between them.
__global__ void barriers(unsigned* count, volatile unsigned* gen, unsigned* v, int n) {
    for (int i = 0; i < n; i++) {
        if (threadIdx.x == 0) {
            unsigned x = __ldcg(v + blockIdx.x);
            __stcg(v + blockIdx.x, x + 1);
            const unsigned g = *gen;
            __threadfence();
            if (atomicAdd(count, 1) == gridDim.x - 1) {
                *count = 0;
                __threadfence();
                *gen = g + 1;
            } else {
                while (*gen == g) {}
            }
            __threadfence();
        }
        __syncthreads();
    }
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
    unsigned* v;
    CK(cudaMalloc(&v, 1 << 20));
    CK(cudaMemset(v, 0, 1 << 20));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    const int N = 400;
    int grids[] = {1, 132, 528, 1056};
    for (int pdl = 0; pdl < 2; pdl++)
        for (int gi = 0; gi < 4; gi++) {
            const int blocks = grids[gi];
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < N; i++) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(blocks);
                cfg.blockDim = dim3(128);
                cfg.stream = s;
                cudaLaunchAttribute a[1];
                a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                a[0].val.programmaticStreamSerializationAllowed = pdl;
                cfg.attrs = a;
                cfg.numAttrs = 1;
                CK(cudaLaunchKernelEx(&cfg, step, v, pdl));
            }
            CK(cudaStreamEndCapture(s, &g));
            cudaGraphExec_t ge;
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, s));
            CK(cudaStreamSynchronize(s));
            cudaEvent_t a, b;
            cudaEventCreate(&a); cudaEventCreate(&b);
            float best = 1e9;
            for (int r = 0; r < 5; r++) {
                cudaEventRecord(a, s);
                CK(cudaGraphLaunch(ge, s));
                cudaEventRecord(b, s);
                CK(cudaStreamSynchronize(s));
                float ms; cudaEventElapsedTime(&ms, a, b);
                if (ms < best) best = ms;
            }
            printf("graph of %d dependent kernels, %4d blocks of 128, pdl %d: %.2f us per kernel\n", N, blocks, pdl, best * 1e3 / N);
        }
    unsigned *count, *gen;
    CK(cudaMalloc(&count, 4)); CK(cudaMalloc(&gen, 4));
    CK(cudaMemset(count, 0, 4)); CK(cudaMemset(gen, 0, 4));
    for (int gi = 0; gi < 4; gi++) {
        const int blocks = grids[gi];
        barriers<<<blocks, 128, 0, s>>>(count, gen, v, 10);
        CK(cudaStreamSynchronize(s));
        cudaEvent_t a, b;
        cudaEventCreate(&a); cudaEventCreate(&b);
        cudaEventRecord(a, s);
        barriers<<<blocks, 128, 0, s>>>(count, gen, v, N);
        cudaEventRecord(b, s);
        CK(cudaStreamSynchronize(s));
        float ms; cudaEventElapsedTime(&ms, a, b);
        printf("persistent kernel, %4d blocks of 128: %.2f us per grid barrier\n", blocks, ms * 1e3 / N);
    }
    return 0;
}
