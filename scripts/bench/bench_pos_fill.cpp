// The per-token input of the sparse decode path that grows with the context: every cell's position as F32, an empty
// cell (position -1) as a large value (llama_kv_cache::set_input_kv_pos in the patch). Times the loop as it was
// (a select per cell, which GCC 12 does not vectorize: "control flow in loop") against the branch-free form the patch
// now uses, on 131,328 cells with a few empty ones at the end (a 128K context), and checks that both write the same
// bits. Host code only:
//   g++ -O3 -o /tmp/bench_pos_fill scripts/bench/bench_pos_fill.cpp && /tmp/bench_pos_fill
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

__attribute__((noinline)) static void fill_select(const int32_t * pos, float * data, uint32_t n, float empty) {
    for (uint32_t j = 0; j < n; ++j) data[j] = pos[j] == -1 ? empty : (float) pos[j];
}

__attribute__((noinline)) static void fill_bits(const int32_t * pos, float * out, uint32_t n, float empty) {
    uint32_t empty_bits;
    memcpy(&empty_bits, &empty, sizeof(empty_bits));
    uint32_t * data = (uint32_t *) out;
    for (uint32_t j = 0; j < n; ++j) {
        const float    f = (float) pos[j];
        const uint32_t m = 0u - (uint32_t) (pos[j] == -1);
        uint32_t fb;
        memcpy(&fb, &f, sizeof(fb));
        data[j] = (fb & ~m) | (empty_bits & m);
    }
}

int main() {
    const uint32_t n = 131072 + 256;
    std::vector<int32_t> pos(n);
    for (uint32_t i = 0; i < n; ++i) pos[i] = i < 131100 ? (int32_t) i : -1;
    std::vector<float> a(n), b(n);
    void (*fs[2])(const int32_t *, float *, uint32_t, float) = {fill_select, fill_bits};
    const char * names[2] = {"select (before)", "branch-free (now)"};
    double us[2] = {0, 0};
    for (int round = 0; round < 3; ++round) {          // alternating, best of 3 rounds of 500 fills each
        for (int v = 0; v < 2; ++v) {
            float * d = v ? b.data() : a.data();
            for (int w = 0; w < 50; ++w) fs[v](pos.data(), d, n, 1e30f);
            const auto t0 = std::chrono::steady_clock::now();
            for (int r = 0; r < 500; ++r) fs[v](pos.data(), d, n, 1e30f);
            const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 500;
            us[v] = round == 0 || t < us[v] ? t : us[v];
        }
    }
    const bool same = memcmp(a.data(), b.data(), n * sizeof(float)) == 0;
    for (int v = 0; v < 2; ++v) printf("%-18s %7.1f us per fill of %u cells\n", names[v], us[v], n);
    printf("ratio %.2fx, output %s\n", us[0] / us[1], same ? "bit-identical" : "DIFFERS");
    return same ? 0 : 1;
}
