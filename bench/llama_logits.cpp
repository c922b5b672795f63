// Writes llama.cpp's logits at every position of a token list to a .npy file, the way
// `sluice logits` does, so that the two engines can be compared on the same GGUF numbers
// (bench/compare_llama_logits.py).
//
// Build against a llama.cpp build tree (static libraries), e.g.:
//   g++ -O2 -std=c++17 bench/llama_logits.cpp -I LLAMA/include -I LLAMA/ggml/include \
//       LLAMA/build/src/libllama.a LLAMA/build/ggml/src/libggml*.a -fopenmp -lpthread -o llama_logits
// Usage: llama_logits MODEL.gguf 1,2,3 OUT.npy [prefill|decode] [threads] [gpu_layers]

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int fail(const std::string & msg) {
    fprintf(stderr, "llama_logits: %s\n", msg.c_str());
    return 1;
}

static bool write_npy(const char * path, const std::vector<float> & data, size_t rows, size_t cols) {
    FILE * f = fopen(path, "wb");
    if (!f) {
        return false;
    }
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) +
                         ", " + std::to_string(cols) + "), }";
    size_t total = 10 + header.size() + 1;
    header.append((64 - total % 64) % 64, ' ');
    header.push_back('\n');
    const unsigned char magic[8] = { 0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0 };
    const unsigned short len = (unsigned short) header.size();
    bool ok = fwrite(magic, 1, 8, f) == 8 && fwrite(&len, 2, 1, f) == 1 &&
              fwrite(header.data(), 1, header.size(), f) == header.size() &&
              fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
    return fclose(f) == 0 && ok;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        return fail("usage: llama_logits MODEL.gguf TOKENS(1,2,3) OUT.npy [prefill|decode] [threads] [gpu_layers]");
    }
    const char * model_path = argv[1];
    std::vector<llama_token> tokens;
    for (const char * p = argv[2]; *p;) {
        char * end = nullptr;
        long v = strtol(p, &end, 10);
        if (end == p) {
            return fail(std::string("bad token list: ") + argv[2]);
        }
        tokens.push_back((llama_token) v);
        p = *end == ',' ? end + 1 : end;
    }
    const std::string mode = argc > 4 ? argv[4] : "prefill";
    if (mode != "prefill" && mode != "decode") {
        return fail("mode must be prefill or decode");
    }
    const int threads = argc > 5 ? atoi(argv[5]) : 2;
    const int gpu_layers = argc > 6 ? atoi(argv[6]) : 0;

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = gpu_layers;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        return fail(std::string("could not load ") + model_path);
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t : tokens) {
        if (t < 0 || t >= n_vocab) {
            return fail("token " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(n_vocab));
        }
    }
    const int n = (int) tokens.size();
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) ((n + 255) / 256 * 256);
    cp.n_batch = (uint32_t) n;
    cp.n_ubatch = (uint32_t) n;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        return fail("could not create a context");
    }

    std::vector<float> out((size_t) n * n_vocab);
    llama_batch batch = llama_batch_init(n, 0, 1);
    const int step = mode == "prefill" ? n : 1;
    for (int start = 0; start < n; start += step) {
        batch.n_tokens = 0;
        for (int i = start; i < start + step; i++) {
            const int j = batch.n_tokens++;
            batch.token[j] = tokens[i];
            batch.pos[j] = i;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            return fail("llama_decode failed at position " + std::to_string(start));
        }
        for (int j = 0; j < batch.n_tokens; j++) {
            const float * l = llama_get_logits_ith(ctx, j);
            memcpy(&out[(size_t) (start + j) * n_vocab], l, sizeof(float) * n_vocab);
        }
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    if (!write_npy(argv[3], out, (size_t) n, (size_t) n_vocab)) {
        return fail(std::string("could not write ") + argv[3]);
    }
    return 0;
}
