// Host emulator for ../kernels.cu, driven over stdin/stdout by the Rust tests
// (src/shared_gpu/tests.rs). Build: g++ -std=c++17 -O1 -ffp-contract=off -fno-strict-aliasing
//
// Memory: buffers are 64-byte aligned host allocations; a device address is
// ((id + 1) << 40) + byte offset, so an address has the alignment of its offset, as on a GPU.
// Commands, one per line:
//   alloc <bytes>                 new buffer (ids count up from 0), filled with 0xa5 bytes
//   write <id> <hex|->            replace a buffer's contents
//   read <addr> <bytes>           print the bytes as one hex line ("-" if empty)
//   launch <kernel> <gx> <gy> <nsrc> <src>... <args>...
//       sg_reduce_*: args dst n op world vec;  sg_copy: args dst chunk total unit
//   quit
// Any error prints "error: ..." on stderr and exits with status 2.

#include "sg_emu.h"

#include "../kernels.cu"

#include <stdio.h>
#include <stdlib.h>

#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

[[noreturn]] static void fail(const std::string& msg) {
    fprintf(stderr, "error: %s\n", msg.c_str());
    exit(2);
}

struct Buf {
    unsigned char* data;
    uint64_t size;
};
static std::vector<Buf> g_bufs;

// The host address of [addr, addr + bytes); fails outside every buffer.
static u64 translate(u64 addr, u64 bytes) {
    u64 id = addr >> 40, off = addr & ((1ull << 40) - 1);
    if (id == 0 || id > g_bufs.size()) fail("address " + std::to_string(addr) + " is no buffer");
    const Buf& b = g_bufs[id - 1];
    if (off > b.size || bytes > b.size - off)
        fail("range of " + std::to_string(bytes) + " bytes at offset " + std::to_string(off) +
             " exceeds buffer " + std::to_string(id - 1) + " of " + std::to_string(b.size));
    return (u64)(b.data + off);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail(std::string("bad hex digit ") + c);
}

typedef void (*ReduceFn)(SgSources, u32, u64, u64, u32, u32, u32);

static const std::map<std::string, std::pair<ReduceFn, u64>> REDUCE = {
    {"sg_reduce_f32", {sg_reduce_f32, 4}},         {"sg_reduce_f16_f32", {sg_reduce_f16_f32, 2}},
    {"sg_reduce_f16", {sg_reduce_f16, 2}},         {"sg_reduce_bf16_f32", {sg_reduce_bf16_f32, 2}},
    {"sg_reduce_bf16", {sg_reduce_bf16, 2}},       {"sg_reduce_i32", {sg_reduce_i32, 4}},
    {"sg_reduce_i64", {sg_reduce_i64, 8}},
};

// Runs `body` once per thread of a gx × gy grid of SG_BLOCK-thread blocks.
template <class F>
static void run_grid(unsigned gx, unsigned gy, F body) {
    if (gx == 0 || gy == 0) fail("empty grid");
    gridDim = dim3{gx, gy, 1};
    blockDim = dim3{SG_BLOCK, 1, 1};
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++)
            for (unsigned t = 0; t < SG_BLOCK; t++) {
                blockIdx = dim3{x, y, 1};
                threadIdx = dim3{t, 0, 0};
                body();
            }
}

static void launch(std::istringstream& in) {
    std::string name;
    unsigned gx = 0, gy = 0, nsrc = 0;
    in >> name >> gx >> gy >> nsrc;
    if (nsrc == 0 || nsrc > SG_MAX_SOURCES) fail("bad source count " + std::to_string(nsrc));
    std::vector<u64> raw(nsrc);
    for (auto& s : raw) in >> s;
    SgSources src;
    memset(&src, 0, sizeof src);
    if (name == "sg_copy") {
        u64 dst, chunk, total;
        u32 unit;
        in >> dst >> chunk >> total >> unit;
        if (!in) fail("bad sg_copy arguments");
        for (unsigned k = 0; k < nsrc; k++) {
            u64 begin = k * chunk;
            u64 len = begin >= total ? 0 : (chunk < total - begin ? chunk : total - begin);
            src.p[k] = raw[k] == 0 ? 0 : translate(raw[k], len);
        }
        u64 d = translate(dst, total);
        if (gy != nsrc) fail("sg_copy needs one grid row per source");
        run_grid(gx, gy, [&] { sg_copy(src, nsrc, d, chunk, total, unit); });
        return;
    }
    auto it = REDUCE.find(name);
    if (it == REDUCE.end()) fail("unknown kernel " + name);
    u64 dst, n;
    u32 op, world, vec;
    in >> dst >> n >> op >> world >> vec;
    if (!in) fail("bad " + name + " arguments");
    u64 bytes = n * it->second.second;
    for (unsigned k = 0; k < nsrc; k++) {
        if (vec && raw[k] % 16 != 0) fail("vec launch with an unaligned source");
        src.p[k] = translate(raw[k], bytes);
    }
    if (vec && dst % 16 != 0) fail("vec launch with an unaligned destination");
    u64 d = translate(dst, bytes);
    ReduceFn f = it->second.first;
    run_grid(gx, gy, [&] { f(src, nsrc, d, n, op, world, vec); });
}

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd;
        in >> cmd;
        if (cmd == "alloc") {
            u64 bytes = 0;
            in >> bytes;
            u64 cap = (bytes + 63) / 64 * 64 + 64;
            auto* p = (unsigned char*)aligned_alloc(64, cap);
            if (!p) fail("out of memory");
            memset(p, 0xa5, cap);
            g_bufs.push_back({p, bytes});
        } else if (cmd == "write") {
            u64 id = 0;
            std::string hex;
            in >> id >> hex;
            if (id >= g_bufs.size()) fail("no buffer " + std::to_string(id));
            if (hex == "-") hex.clear();
            if (hex.size() != 2 * g_bufs[id].size) fail("write of the wrong length");
            for (u64 i = 0; i < g_bufs[id].size; i++)
                g_bufs[id].data[i] = (unsigned char)(hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]));
        } else if (cmd == "read") {
            u64 addr = 0, bytes = 0;
            in >> addr >> bytes;
            const unsigned char* p = (const unsigned char*)translate(addr, bytes);
            static const char* digits = "0123456789abcdef";
            std::string out;
            for (u64 i = 0; i < bytes; i++) {
                out += digits[p[i] >> 4];
                out += digits[p[i] & 15];
            }
            printf("%s\n", out.empty() ? "-" : out.c_str());
            fflush(stdout);
        } else if (cmd == "launch") {
            launch(in);
        } else if (cmd == "quit") {
            return 0;
        } else if (!cmd.empty()) {
            fail("unknown command " + cmd);
        }
    }
    return 0;
}
