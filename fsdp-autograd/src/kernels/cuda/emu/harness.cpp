// Host emulator for ../kernels.cu (the whole NVRTC program, program::source(), written out by
// tests/emu.rs), driven over stdin/stdout by the Rust tests.
// Build: g++ -std=c++20 -O1 -pthread -ffp-contract=off harness.cpp   (see tests/emu.rs)
//
// Memory: buffers live in host vectors; a device address is ((id + 1) << 40) + byte offset, so
// kernels receive real host pointers after translation and AddressSanitizer (when enabled)
// catches out-of-bounds accesses. Commands, one per line, tokens separated by spaces:
//   alloc <bytes>                      new buffer (ids count up from 0), filled with 0xff bytes
//   write <id> <hex|->                 replace a buffer's contents (hex of every byte)
//   read <addr> <bytes>                print the bytes as one hex line ("-" if empty)
//   memset <addr> <byte> <bytes>
//   copy <dst> <src> <bytes>
//   launch <kernel> <grid> <nargs> <arg>...   arg: u:<dec> f:<hex bits> d:<hex bits> p:<addr>
//                                             v:<rank>,<offset>,<8 shape>,<8 strides>
//   gemm <ta> <tb> <m> <n> <k> <alpha bits> <A> <lda> <sA> <B> <ldb> <sB> <beta bits> <C> <ldc>
//        <sC> <batch> <ab type> <c type> <tf32>
//                                     cublasGemmStridedBatchedEx semantics (column-major); types
//                                     0 = f32, 1 = f16, 2 = bf16; tf32 0 or 1
//   list                               print the kernel names
//   quit
// Any error prints "error: ..." on stderr and exits with status 2.

#include "cuda_emu.h"

#include "../kernels.cu"  // the whole program: common.cu, then every family's .cu (program::source())

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

[[noreturn]] static void fail(const std::string& msg) {
    fprintf(stderr, "error: %s\n", msg.c_str());
    exit(2);
}

// ---------------------------------------------------------------------------------------------
// Memory.

static std::vector<std::vector<unsigned char>> g_bufs;

static unsigned char* translate(uint64_t addr, uint64_t bytes) {
    uint64_t id = (addr >> 40);
    uint64_t off = addr & ((1ull << 40) - 1);
    if (id == 0 || id > g_bufs.size()) fail("address " + std::to_string(addr) + " is no buffer");
    auto& b = g_bufs[id - 1];
    if (off > b.size() || bytes > b.size() - off)
        fail("range of " + std::to_string(bytes) + " bytes at offset " + std::to_string(off) +
             " exceeds buffer " + std::to_string(id - 1) + " of " + std::to_string(b.size()));
    return b.data() + off;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail(std::string("bad hex digit ") + c);
}

// ---------------------------------------------------------------------------------------------
// Execution: a persistent pool of BLOCK threads runs one block at a time.

struct Pool {
    std::vector<std::thread> workers;
    std::barrier<> start{BLOCK + 1};
    std::barrier<> done{BLOCK + 1};
    std::barrier<> sync{BLOCK};
    std::function<void()> body;
    unsigned block = 0, grid = 0;
    bool quit = false;

    Pool() {
        for (unsigned t = 0; t < BLOCK; ++t) {
            workers.emplace_back([this, t] {
                for (;;) {
                    start.arrive_and_wait();
                    if (quit) return;
                    threadIdx = dim3{t, 1, 1};
                    blockIdx = dim3{block, 1, 1};
                    blockDim = dim3{BLOCK, 1, 1};
                    gridDim = dim3{grid, 1, 1};
                    emu_block_barrier = &sync;
                    body();
                    done.arrive_and_wait();
                }
            });
        }
    }

    void run(unsigned g, std::function<void()> f) {
        body = std::move(f);
        grid = g;
        for (unsigned b = 0; b < g; ++b) {
            block = b;
            start.arrive_and_wait();
            done.arrive_and_wait();
        }
    }

    ~Pool() {
        quit = true;
        start.arrive_and_wait();
        for (auto& w : workers) w.join();
    }
};

static Pool* g_pool;

// ---------------------------------------------------------------------------------------------
// Kernel table: parameters are converted from protocol arguments by their C++ types.

struct Arg {
    char kind;
    uint64_t u;
    View v;
};

template <class T>
static T conv(const Arg& a) {
    if constexpr (std::is_pointer_v<T>) {
        if (a.kind != 'p') fail("expected a pointer argument");
        // Extent checks happen in the kernels' accesses (AddressSanitizer); here only the base.
        return reinterpret_cast<T>(translate(a.u, 0));
    } else if constexpr (std::is_same_v<T, View>) {
        if (a.kind != 'v') fail("expected a view argument");
        return a.v;
    } else if constexpr (std::is_same_v<T, float>) {
        if (a.kind != 'f') fail("expected a float argument");
        uint32_t b = (uint32_t)a.u;
        float f;
        memcpy(&f, &b, 4);
        return f;
    } else if constexpr (std::is_same_v<T, double>) {
        if (a.kind != 'd') fail("expected a double argument");
        double d;
        memcpy(&d, &a.u, 8);
        return d;
    } else {
        static_assert(std::is_same_v<T, u64>, "unexpected kernel parameter type");
        if (a.kind != 'u') fail("expected a u64 argument");
        return a.u;
    }
}

using Runner = std::function<void(const std::vector<Arg>&, unsigned)>;

template <class... P, size_t... I>
static std::tuple<P...> convert_all(const std::vector<Arg>& args, std::index_sequence<I...>) {
    return std::tuple<P...>(conv<P>(args[I])...);
}

template <class... P>
static Runner runner(void (*f)(P...)) {
    return [f](const std::vector<Arg>& args, unsigned grid) {
        if (args.size() != sizeof...(P))
            fail("expected " + std::to_string(sizeof...(P)) + " arguments, got " +
                 std::to_string(args.size()));
        auto tup = convert_all<P...>(args, std::index_sequence_for<P...>{});
        g_pool->run(grid, [&] { std::apply(f, tup); });
    };
}

// The kernel table is generated from the Rust declarations (`declare_kernels!` next to each op;
// tests/emu.rs writes it next to this file): one `K(name),` per kernel of the program.
#define K(name) {#name, runner(name)}
static const std::map<std::string, Runner> g_kernels = {
#include "kernel_table.inc"
};
#undef K

// ---------------------------------------------------------------------------------------------
// cublasSgemmStridedBatched / cublasGemmStridedBatchedEx, column-major, with cuBLAS's argument
// checks. Element types: 0 = f32, 1 = f16, 2 = bf16 (A and B share one, C has its own). Products
// accumulate in f32, sequentially over k (cuBLAS's order is unspecified). Half inputs are read
// exactly (their values are what the tensor cores multiply); a half C is read as f32 and the
// result rounded once to nearest even. With tf32, f32 inputs are rounded to TF32 (10 mantissa
// bits, to nearest with ties away from zero, as PTX cvt.rna.tf32.f32) before multiplying: a
// stand-in for the tensor cores' conversion, whose exact rounding cuBLAS does not document.

static float tf32_round(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf / NaN unchanged
    u = (u + 0x1000u) & 0xffffe000u;
    return __uint_as_float(u);
}

static float load_elem(const unsigned char* base, long i, int type) {
    if (type == 0) {
        float f;
        memcpy(&f, base + 4 * i, 4);
        return f;
    }
    unsigned short h;
    memcpy(&h, base + 2 * i, 2);
    if (type == 1) return f16_bits_to_f32(h);
    return __uint_as_float((unsigned)h << 16);
}

static void store_elem(unsigned char* base, long i, int type, float v) {
    if (type == 0) {
        memcpy(base + 4 * i, &v, 4);
        return;
    }
    unsigned short h = type == 1 ? f32_to_f16_bits(v) : f32_to_bf16_bits(v);
    memcpy(base + 2 * i, &h, 2);
}

static void gemm(bool ta, bool tb, long m, long n, long k, float alpha, uint64_t A, long lda,
                 long sa, uint64_t B, long ldb, long sb, float beta, uint64_t C, long ldc, long sc,
                 long batch, int ab_type, int c_type, bool tf32) {
    long rows_a = ta ? k : m, rows_b = tb ? n : k;
    if (m < 0 || n < 0 || k < 0 || batch < 0) fail("gemm: negative size");
    if (ab_type < 0 || ab_type > 2 || c_type < 0 || c_type > 2) fail("gemm: bad element type");
    if (c_type != 0 && c_type != ab_type) fail("gemm: CUBLAS_STATUS_NOT_SUPPORTED (C type)");
    if (tf32 && ab_type != 0) fail("gemm: tf32 needs f32 inputs");
    if (lda < (rows_a > 1 ? rows_a : 1) || ldb < (rows_b > 1 ? rows_b : 1) ||
        ldc < (m > 1 ? m : 1))
        fail("gemm: CUBLAS_STATUS_INVALID_VALUE (leading dimension too small)");
    const uint64_t es = ab_type == 0 ? 4 : 2, cs = c_type == 0 ? 4 : 2;
    for (long p = 0; p < batch; ++p) {
        // Extents: the last element each operand's batch touches.
        long a_cols = ta ? m : k, b_cols = tb ? k : n;
        const unsigned char* a =
            translate(A + es * (uint64_t)(p * sa), es * (uint64_t)((a_cols - 1) * lda + rows_a));
        const unsigned char* b =
            translate(B + es * (uint64_t)(p * sb), es * (uint64_t)((b_cols - 1) * ldb + rows_b));
        unsigned char* c = translate(C + cs * (uint64_t)(p * sc), cs * (uint64_t)((n - 1) * ldc + m));
        for (long j = 0; j < n; ++j) {
            for (long i = 0; i < m; ++i) {
                float acc = 0.0f;
                for (long l = 0; l < k; ++l) {
                    float av = load_elem(a, ta ? l + i * lda : i + l * lda, ab_type);
                    float bv = load_elem(b, tb ? j + l * ldb : l + j * ldb, ab_type);
                    if (tf32) {
                        av = tf32_round(av);
                        bv = tf32_round(bv);
                    }
                    acc = acc + av * bv;
                }
                float r = alpha * acc;
                if (beta != 0.0f) r = r + beta * load_elem(c, i + j * ldc, c_type);
                store_elem(c, i + j * ldc, c_type, r);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

static uint64_t parse_u64(const std::string& s) {
    char* end = nullptr;
    uint64_t v = strtoull(s.c_str(), &end, 10);
    if (end == s.c_str() || *end) fail("bad number " + s);
    return v;
}

static uint64_t parse_hex(const std::string& s) {
    char* end = nullptr;
    uint64_t v = strtoull(s.c_str(), &end, 16);
    if (end == s.c_str() || *end) fail("bad hex number " + s);
    return v;
}

static Arg parse_arg(const std::string& tok) {
    if (tok.size() < 2 || tok[1] != ':') fail("bad argument " + tok);
    Arg a{tok[0], 0, View{}};
    std::string rest = tok.substr(2);
    switch (tok[0]) {
        case 'u':
        case 'p': a.u = parse_u64(rest); break;
        case 'f':
        case 'd': a.u = parse_hex(rest); break;
        case 'v': {
            std::vector<uint64_t> vals;
            std::stringstream ss(rest);
            std::string part;
            while (std::getline(ss, part, ',')) vals.push_back(parse_u64(part));
            if (vals.size() != 2 + 2 * MAX_RANK) fail("bad view " + tok);
            a.v.rank = vals[0];
            a.v.offset = vals[1];
            for (int i = 0; i < MAX_RANK; ++i) {
                a.v.shape[i] = vals[2 + i];
                a.v.strides[i] = vals[2 + MAX_RANK + i];
            }
            break;
        }
        default: fail("bad argument kind " + tok);
    }
    return a;
}

int main() {
    Pool pool;
    g_pool = &pool;
    std::string line;
    while (true) {
        alarm(120);  // a hung kernel (e.g. a divergent barrier) kills the emulator
        if (!std::getline(std::cin, line)) break;
        std::stringstream in(line);
        std::string cmd;
        in >> cmd;
        if (cmd.empty()) continue;
        if (cmd == "quit") break;
        if (cmd == "alloc") {
            std::string n;
            in >> n;
            g_bufs.emplace_back(parse_u64(n), (unsigned char)0xff);
        } else if (cmd == "write") {
            std::string id, hex;
            in >> id >> hex;
            uint64_t i = parse_u64(id);
            if (i >= g_bufs.size()) fail("write: no buffer " + id);
            auto& b = g_bufs[i];
            if (hex == "-") hex.clear();
            if (hex.size() != 2 * b.size()) fail("write: size mismatch for buffer " + id);
            for (size_t k = 0; k < b.size(); ++k)
                b[k] = (unsigned char)(hexval(hex[2 * k]) * 16 + hexval(hex[2 * k + 1]));
        } else if (cmd == "read") {
            std::string addr, n;
            in >> addr >> n;
            uint64_t bytes = parse_u64(n);
            unsigned char* p = translate(parse_u64(addr), bytes);
            static const char* digits = "0123456789abcdef";
            std::string out;
            out.reserve(2 * bytes);
            for (uint64_t k = 0; k < bytes; ++k) {
                out.push_back(digits[p[k] >> 4]);
                out.push_back(digits[p[k] & 15]);
            }
            printf("%s\n", out.empty() ? "-" : out.c_str());
            fflush(stdout);
        } else if (cmd == "memset") {
            std::string addr, byte, n;
            in >> addr >> byte >> n;
            uint64_t bytes = parse_u64(n);
            memset(translate(parse_u64(addr), bytes), (int)parse_u64(byte), bytes);
        } else if (cmd == "copy") {
            std::string dst, src, n;
            in >> dst >> src >> n;
            uint64_t bytes = parse_u64(n);
            memcpy(translate(parse_u64(dst), bytes), translate(parse_u64(src), bytes), bytes);
        } else if (cmd == "launch") {
            std::string name, grid, nargs;
            in >> name >> grid >> nargs;
            auto it = g_kernels.find(name);
            if (it == g_kernels.end()) fail("no kernel " + name);
            std::vector<Arg> args;
            for (uint64_t k = 0, n = parse_u64(nargs); k < n; ++k) {
                std::string tok;
                in >> tok;
                args.push_back(parse_arg(tok));
            }
            uint64_t g = parse_u64(grid);
            if (g == 0 || g > 65535) fail("bad grid " + grid);
            it->second(args, (unsigned)g);
        } else if (cmd == "gemm") {
            std::string t[20];
            for (auto& s : t) in >> s;
            auto f = [&](int i) {
                uint32_t b = (uint32_t)parse_hex(t[i]);
                float v;
                memcpy(&v, &b, 4);
                return v;
            };
            auto l = [&](int i) { return (long)(int64_t)parse_u64(t[i]); };
            gemm(parse_u64(t[0]) != 0, parse_u64(t[1]) != 0, l(2), l(3), l(4), f(5),
                 parse_u64(t[6]), l(7), l(8), parse_u64(t[9]), l(10), l(11), f(12),
                 parse_u64(t[13]), l(14), l(15), l(16), (int)parse_u64(t[17]),
                 (int)parse_u64(t[18]), parse_u64(t[19]) != 0);
        } else if (cmd == "list") {
            std::string out;
            for (auto& [name, _] : g_kernels) out += name + " ";
            printf("%s\n", out.c_str());
            fflush(stdout);
        } else {
            fail("unknown command " + cmd);
        }
    }
    return 0;
}
