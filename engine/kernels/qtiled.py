"""The q4/q5 matmuls over the tiled weight layout (`quant/qweight.py` `tile`), in CUDA compiled at first use by
NVRTC (`engine/nvrtc.py`; the source includes no header, so users need no CUDA toolkit):
- `tiled_mma` (`ROWS1=0`), 2-8 int8 rows (verify and batch steps): int8 `mma.sync.m16n8k32` with each lane's
  weight bytes loaded straight into its A fragments (no shared-memory staging) and x's rows as the MMA's n8 side.
- `tiled_dp4a` (`ROWS1=1`), one row (decode): the same tiles and loads, multiplied by dp4a; `tiled_dp4a_xreg`
  (`XREG=1`) is `tiled_dp4a` with x's bytes and scale loaded beside each group's weights (8 lanes share each 16
  bytes) instead of staged in shared memory before the loop, which drops the block's staging wait and its
  `__syncthreads`.
They exist because Triton cannot express them: its dot pads x's 8 rows to 16 and stages weights through shared
memory, which kept its verify matmul (`int8_mma_groups`) well above the time a read-only kernel of the same bytes
takes.

Tile (16 rows x one group of 64 k; 512 bytes of q4/q5 nibbles): lane (gid, tid) = (lane / 4, lane % 4) holds
bytes 8tid..8tid+7 of rows gid and gid + 8 as one 16-byte load, so a warp instruction reads 512 contiguous bytes.
Those 8 bytes hold plane positions 8tid..8tid+7 (even k in the low nibbles, odd k in the high): the MMA's A words
a0/a2 (row gid) and a1/a3 (row gid + 8) after a mask or a shift. The MMA sums over k in any order, so x's B words
are its bytes at the same positions, from x's even/odd planes (`actquant`'s split rows) staged in shared memory.
q5's fifth bits: a 128-byte tile, 4 bytes per lane (2 of row gid, 2 of row gid + 8). Scales: [N/16, groups, 16].
The MMA accumulates onto the bits of 1.5 * 2**23, so its int32 result read as a float is that number plus the
exact sum, and one subtraction removes it with the zero point (as `int8_mma_groups` does).
Output: fp32 K-slice partials [SPLIT, M, N] (`SplitK`), or with one slice the output in its own dtype.
"""
from __future__ import annotations

import torch

from .. import cuda_launch, nvrtc
from ..quant.qweight import GROUP

SOURCE = r"""
// FMT (4, 5), WARPS (per block), MT (16-row tiles per warp), UNROLL (groups loaded before their use),
// ROWS1 (one x row: dp4a), XREG (with ROWS1: x loaded with the weights, no staging), SCALE_BF16, PDL (sm_90+:
// launched with programmatic dependent launch, `kernels/pdl.py`), NB (n8 chunks of x rows per weight fragment: 1
// stages x's K-slice whole, more stream it through shared memory UNROLL groups at a time): -D options

#if PDL
// wait for the kernel before (its writes visible), then let the next one launch: before any read of x and any store
#define GRID_DEPENDENCY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define GRID_DEPENDENCY()
#endif

__device__ __forceinline__ unsigned spread(unsigned bits) {
    // bits 0, 2, 4, 6 of a byte -> bit 4 of byte lanes 0..3 (the q5 fifth bits of a word's even-k codes)
    return ((bits & 0x55u) * 0x410410u) & 0x10101010u;
}

__device__ __forceinline__ float scale_of(unsigned short s) {
#if SCALE_BF16
    return __uint_as_float(((unsigned)s) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
#endif
}

__device__ __forceinline__ void mma(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int dp4a_u(unsigned a, unsigned b, int c) {  // unsigned codes x signed x
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ int dp4a_s(unsigned a, unsigned b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// out_kind 0: fp32 (a K-slice's partials, or an fp32 output), 1: bf16 (round to nearest even), 2: fp16
__device__ __forceinline__ void store(void* out, long i, float v, int out_kind) {
    if (out_kind == 0) {
        reinterpret_cast<float*>(out)[i] = v;
    } else if (out_kind == 1) {
        unsigned u = __float_as_uint(v);
        u += 0x7FFFu + ((u >> 16) & 1u);
        reinterpret_cast<unsigned short*>(out)[i] = (unsigned short)(u >> 16);
    } else {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        reinterpret_cast<unsigned short*>(out)[i] = h;
    }
}

#if ROWS1
#define XROWS 1
#else
#define XROWS 8
#endif
// streamed x (NB > 1): a stage is UNROLL groups of XR rows (each row's even-k plane bytes, then its odd-k ones, then
// the pad `x_pitch` explains), then per group and row x's scale (float) and byte sum (int)
#define XR (8 * NB)
#define XP (UNROLL * 64 + 32)
#define STAGE_BYTES (XR * XP + UNROLL * XR * 8)

// x's bytes per row in shared memory: the slice's two planes, then a pad that puts the rows gid = 0..3 a warp
// phase reads (8 bytes each) on distinct banks
__host__ __device__ __forceinline__ int x_pitch(int per_split) {
    return (per_split * 64 + 127) / 128 * 128 + 32;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
qtiled(const unsigned char* __restrict__ xq, const float* __restrict__ xs, const int* __restrict__ xsum,
       const unsigned char* __restrict__ codes, const unsigned char* __restrict__ high,
       const unsigned short* __restrict__ scales, void* __restrict__ out, int M, int N, int K, int per_split,
       int out_rows, int out_kind) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tid = lane & 3;
    const int groups = K / 64;
    const int g_begin = blockIdx.y * per_split;
    const int base = (blockIdx.x * WARPS + warp) * MT * 16;  // the warp's first row (N is a multiple of 16)
    const int offset = FMT == 4 ? 8 : 16;  // stored code = code + offset
    struct Groups {
        uint2 w[UNROLL][MT][2];  // rows gid, gid + 8
#if FMT == 5
        unsigned short h[UNROLL][MT][2];  // the fifth bits of those 8 bytes' codes, per row
#endif
        float s[UNROLL / 4][MT][2];  // lane tid holds the scale of group 4q + tid; shuffles hand them round
#if XREG
        uint2 xe[UNROLL], xo[UNROLL];  // x's bytes at the lane's plane positions, even and odd k
        float xs[UNROLL];
#endif
    };
    // each lane's tile pointers at the slice's first group, once: the loop adds the group offset only
    const uint4* wp[MT];
    const unsigned short* sp[MT];
    bool rok[MT];
#if FMT == 5
    const unsigned* hq[MT];
#endif
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const long rb = (base + t * 16) / 16;
        rok[t] = base + t * 16 < N;
        wp[t] = reinterpret_cast<const uint4*>(codes) + (rb * groups + g_begin) * 32 + lane;
        sp[t] = scales + (rb * groups + g_begin + tid) * 16 + gid;
#if FMT == 5
        hq[t] = reinterpret_cast<const unsigned*>(high) + (rb * groups + g_begin) * 32 + lane;
#endif
    }
    auto load = [&](Groups& k, int g0) {  // g0: the first of UNROLL groups, counted within the slice
        const bool gk = g0 < per_split;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            const bool ok = gk && rok[t];
#pragma unroll
            for (int q = 0; q < UNROLL / 4; ++q) {
                k.s[q][t][0] = ok ? scale_of(__ldg(sp[t] + (g0 + 4 * q) * 16)) : 0.0f;
                k.s[q][t][1] = ok ? scale_of(__ldg(sp[t] + (g0 + 4 * q) * 16 + 8)) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint4 v = ok ? __ldg(wp[t] + (g0 + u) * 32) : make_uint4(0u, 0u, 0u, 0u);
                k.w[u][t][0] = make_uint2(v.x, v.y);
                k.w[u][t][1] = make_uint2(v.z, v.w);
#if FMT == 5
                const unsigned h = ok ? __ldg(hq[t] + (g0 + u) * 32) : 0u;
                k.h[u][t][0] = (unsigned short)(h & 0xFFFFu);
                k.h[u][t][1] = (unsigned short)(h >> 16);
#endif
            }
        }
#if XREG
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long g = g_begin + g0 + u;
            k.xe[u] = gk ? __ldg(reinterpret_cast<const uint2*>(xq + g * 32 + 8 * tid)) : make_uint2(0u, 0u);
            k.xo[u] = gk ? __ldg(reinterpret_cast<const uint2*>(xq + K / 2 + g * 32 + 8 * tid)) : make_uint2(0u, 0u);
            k.xs[u] = gk ? __ldg(xs + g) : 0.0f;
        }
#endif
    };
    // the A fragments of tile t's rows gid, gid + 8 in group u: even-k codes (low nibbles) and odd-k (high), as the
    // unsigned codes 0..15 (q4) or 0..31 (q5, the fifth bits spread in)
    auto fragments = [&](const Groups& k, int u, int t, unsigned (&lo)[4], unsigned (&hi)[4]) {
        const uint2 a = k.w[u][t][0], b = k.w[u][t][1];
        lo[0] = a.x & 0x0F0F0F0Fu; lo[1] = b.x & 0x0F0F0F0Fu; lo[2] = a.y & 0x0F0F0F0Fu; lo[3] = b.y & 0x0F0F0F0Fu;
        hi[0] = (a.x >> 4) & 0x0F0F0F0Fu; hi[1] = (b.x >> 4) & 0x0F0F0F0Fu;
        hi[2] = (a.y >> 4) & 0x0F0F0F0Fu; hi[3] = (b.y >> 4) & 0x0F0F0F0Fu;
#if FMT == 5
        const unsigned ha = k.h[u][t][0], hb = k.h[u][t][1];
        const unsigned bits[4] = {ha, hb, ha >> 8, hb >> 8};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            lo[j] |= spread(bits[j] & 0xFFu);
            hi[j] |= spread((bits[j] & 0xFFu) >> 1);
        }
#endif
    };
#if XREG
    GRID_DEPENDENCY();  // the loads below read x
#endif
    Groups cur;
    load(cur, 0);  // the first weights are on their way while x is staged
#if NB > 1
    // tiled_mma_streamed: a K-slice of up to 64 rows does not fit in shared memory, so x comes in stages of UNROLL
    // groups, two in flight (cp.async), each read by every warp for all its tiles; rows past M are zeros
    const unsigned smem_base = (unsigned)__cvta_generic_to_shared(smem);
    auto stage = [&](int g0, int buf) {
        const unsigned dst = smem_base + buf * STAGE_BYTES;
        const long g = g_begin + g0;
        for (int i = threadIdx.x; i < XR * UNROLL * 4; i += WARPS * 32) {  // row r, plane p, 16-byte piece c
            const int c = i % (UNROLL * 2), p = (i / (UNROLL * 2)) & 1, r = i / (UNROLL * 4);
            const unsigned char* src = xq + (long)min(r, M - 1) * K + p * (K / 2) + g * 32 + 16 * c;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(dst + r * XP + p * UNROLL * 32 + 16 * c), "l"(src), "r"(r < M ? 16 : 0));
        }
        for (int i = threadIdx.x; i < 2 * UNROLL * XR; i += WARPS * 32) {  // [scales, sums][group u][row r]
            const int r = i % XR, u = (i / XR) % UNROLL;
            const long at = (long)min(r, M - 1) * groups + g + u;
            const void* src = i < UNROLL * XR ? (const void*)(xs + at) : (const void*)(xsum + at);
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                         :: "r"(dst + XR * XP + 4 * i), "l"(src), "r"(r < M ? 4 : 0));
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    GRID_DEPENDENCY();  // weights never depend on the kernel before: their first loads go ahead of the wait
    stage(0, 0);
    float acc[MT][NB][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < NB; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[t][j][q] = 0.0f;
    for (int g0 = 0, it = 0; g0 < per_split; g0 += UNROLL, ++it) {
        Groups next;
        load(next, g0 + UNROLL);
        if (g0 + UNROLL < per_split) {
            stage(g0 + UNROLL, (it + 1) & 1);
        } else {
            asm volatile("cp.async.commit_group;" ::: "memory");  // an empty group: the wait counts groups
        }
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
        const unsigned char* xsh = smem + (it & 1) * STAGE_BYTES;
        const float* zs = reinterpret_cast<const float*>(xsh + XR * XP);
        const int* zi = reinterpret_cast<const int*>(xsh + XR * XP + UNROLL * XR * 4);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            unsigned lo[MT][4], hi[MT][4];
            float sw[MT][2];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                const int src = (lane & ~3) | (u & 3);
                sw[t][0] = __shfl_sync(0xffffffffu, cur.s[u / 4][t][0], src);
                sw[t][1] = __shfl_sync(0xffffffffu, cur.s[u / 4][t][1], src);
                fragments(cur, u, t, lo[t], hi[t]);
            }
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                const unsigned char* row = xsh + (8 * j + gid) * XP + u * 32 + 8 * tid;
                const uint2 xe = *reinterpret_cast<const uint2*>(row);
                const uint2 xo = *reinterpret_cast<const uint2*>(row + UNROLL * 32);
                const float2 sx = *reinterpret_cast<const float2*>(zs + u * XR + 8 * j + 2 * tid);
                const int2 sum = *reinterpret_cast<const int2*>(zi + u * XR + 8 * j + 2 * tid);
                const float z0 = 12582912.0f + (float)(offset * sum.x), z1 = 12582912.0f + (float)(offset * sum.y);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    int c[4] = {0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000};
                    mma(c, lo[t][0], lo[t][1], lo[t][2], lo[t][3], xe.x, xe.y);
                    mma(c, hi[t][0], hi[t][1], hi[t][2], hi[t][3], xo.x, xo.y);
                    acc[t][j][0] = fmaf(__int_as_float(c[0]) - z0, sw[t][0] * sx.x, acc[t][j][0]);
                    acc[t][j][1] = fmaf(__int_as_float(c[1]) - z1, sw[t][0] * sx.y, acc[t][j][1]);
                    acc[t][j][2] = fmaf(__int_as_float(c[2]) - z0, sw[t][1] * sx.x, acc[t][j][2]);
                    acc[t][j][3] = fmaf(__int_as_float(c[3]) - z1, sw[t][1] * sx.y, acc[t][j][3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before the next iteration's copy refills it
        cur = next;
    }
    const long slice = (long)blockIdx.y * out_rows * N;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int r0 = base + t * 16 + gid;
        if (!rok[t]) continue;
#pragma unroll
        for (int j = 0; j < NB; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int row = r0 + (q >> 1) * 8, m = 8 * j + 2 * tid + (q & 1);
                if (m < M) store(out, slice + (long)m * N + row, acc[t][j][q], out_kind);
            }
    }
#else
#if !XREG
    GRID_DEPENDENCY();  // weights never depend on the kernel before: their first loads go ahead of the wait
    // x's slice (M rows, zeros below) and per group and lane tid (xs of rows 2tid, 2tid + 1, their zero points)
    // in shared memory, once per block: warps read them there instead of each loading them per group
    const int pitch = x_pitch(per_split);
    unsigned char* xsh = smem;
    float4* zx = reinterpret_cast<float4*>(smem + XROWS * pitch);
    {
        const int seg = per_split * 2;  // 16-byte pieces per row and plane
        // cp.async: every piece's copy in flight at once; rows past M are filled with zeros (source size 0)
#pragma unroll
        for (int r = 0; r < XROWS; ++r)
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const unsigned char* src = xq + (long)min(r, M - 1) * K + p * (K / 2) + g_begin * 32;
                const unsigned dst = (unsigned)__cvta_generic_to_shared(xsh + r * pitch + p * per_split * 32);
                for (int piece = threadIdx.x; piece < seg; piece += WARPS * 32)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                                 :: "r"(dst + 16 * piece), "l"(src + 16 * piece), "r"(r < M ? 16 : 0));
            }
        for (int i = threadIdx.x; i < per_split * 4; i += WARPS * 32) {
            const int g = g_begin + i / 4, m0 = 2 * (i % 4), m1 = m0 + 1;
            float4 v;
            v.x = m0 < M ? xs[m0 * groups + g] : 0.0f;
            v.y = m1 < M ? xs[m1 * groups + g] : 0.0f;
            v.z = 12582912.0f + (m0 < M ? (float)(offset * xsum[m0 * groups + g]) : 0.0f);
            v.w = 12582912.0f + (m1 < M ? (float)(offset * xsum[m1 * groups + g]) : 0.0f);
            zx[i] = v;
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
    }
    __syncthreads();
#endif

    float acc[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[t][j] = 0.0f;
    // double-buffered: the next UNROLL groups' loads are issued before this step's work (ptxas does not sink
    // loads past the loop's back edge), so a warp never waits a full memory latency idle
    for (int g0 = 0; g0 < per_split; g0 += UNROLL) {
        Groups next;
        load(next, g0 + UNROLL);  // past the slice's end: every load masked off, nothing read
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int gl = g0 + u;
#if XREG
            const float4 z = make_float4(cur.xs[u], 0.0f, 0.0f, 0.0f);
            const uint2 xe = cur.xe[u], xo = cur.xo[u];
#elif ROWS1
            const float4 z = zx[gl * 4];  // x row 0's scale in .x
            const uint2 xe = *reinterpret_cast<const uint2*>(xsh + gl * 32 + 8 * tid);
            const uint2 xo = *reinterpret_cast<const uint2*>(xsh + (per_split + gl) * 32 + 8 * tid);
#endif
#if ROWS1
            // the zero point's share of this lane's 16 codes per row: offset x the sum of its x bytes
            const int zl = offset * dp4a_s(0x01010101u, xo.y, dp4a_s(0x01010101u, xo.x,
                                    dp4a_s(0x01010101u, xe.y, dp4a_s(0x01010101u, xe.x, 0))));
#else
            const float4 z = zx[gl * 4 + tid];
            const uint2 xe = *reinterpret_cast<const uint2*>(xsh + gid * pitch + gl * 32 + 8 * tid);
            const uint2 xo = *reinterpret_cast<const uint2*>(xsh + gid * pitch + (per_split + gl) * 32 + 8 * tid);
#endif
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                const int src = (lane & ~3) | (u & 3);
                const float s0 = __shfl_sync(0xffffffffu, cur.s[u / 4][t][0], src);
                const float s1 = __shfl_sync(0xffffffffu, cur.s[u / 4][t][1], src);
                unsigned lo[4], hi[4];
                fragments(cur, u, t, lo, hi);
#if ROWS1
                const int d0 = dp4a_u(hi[2], xo.y, dp4a_u(hi[0], xo.x, dp4a_u(lo[2], xe.y, dp4a_u(lo[0], xe.x, 0))));
                const int d1 = dp4a_u(hi[3], xo.y, dp4a_u(hi[1], xo.x, dp4a_u(lo[3], xe.y, dp4a_u(lo[1], xe.x, 0))));
                acc[t][0] = fmaf((float)(d0 - zl), s0 * z.x, acc[t][0]);
                acc[t][2] = fmaf((float)(d1 - zl), s1 * z.x, acc[t][2]);
#else
                int c[4] = {0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000};
                mma(c, lo[0], lo[1], lo[2], lo[3], xe.x, xe.y);
                mma(c, hi[0], hi[1], hi[2], hi[3], xo.x, xo.y);
                // c0, c1: feature row gid, x rows 2tid, 2tid+1; c2, c3: feature row gid + 8
                acc[t][0] = fmaf(__int_as_float(c[0]) - z.z, s0 * z.x, acc[t][0]);
                acc[t][1] = fmaf(__int_as_float(c[1]) - z.w, s0 * z.y, acc[t][1]);
                acc[t][2] = fmaf(__int_as_float(c[2]) - z.z, s1 * z.x, acc[t][2]);
                acc[t][3] = fmaf(__int_as_float(c[3]) - z.w, s1 * z.y, acc[t][3]);
#endif
            }
        }
        cur = next;
    }
    const long slice = (long)blockIdx.y * out_rows * N;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int r0 = base + t * 16 + gid;
        if (!rok[t]) continue;
#if ROWS1
        // each row's sum is spread over its 4 lanes tid
        float v0 = acc[t][0], v1 = acc[t][2];
        v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
        v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
        v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
        v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
        if (tid == 0) {
            store(out, slice + r0, v0, out_kind);
            store(out, slice + r0 + 8, v1, out_kind);
        }
#else
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int row = r0 + (j >> 1) * 8, m = 2 * tid + (j & 1);
            if (m < M) store(out, slice + (long)m * N + row, acc[t][j], out_kind);
        }
#endif
    }
#endif
}
"""

MAX_ROWS = 8  # the MMA's n8: a `tiled_mma` launch multiplies at most 8 rows (more go in groups of 8)
STREAMED_ROWS = 64  # the most rows a `tiled_mma_streamed` launch multiplies (NB = 8 chunks of 8)
SHARED_LIMIT = 48 * 1024 - 16  # dynamic shared memory below what a launch must opt in to (48 KiB)
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_compiled: dict[tuple, object] = {}
_usable: dict[str, bool] = {}


def ptx(fmt: str, warps: int, mt: int, unroll: int, one_row: bool, bf16_scales: bool, arch: str,
        x_in_registers: bool = False, pdl: bool = False, chunks: int = 1) -> bytes:
    """The kernel's PTX for one format and shape on sm_`arch` (`pdl`: for launches with PDL, sm_90 and newer;
    `chunks` > 1: `tiled_mma_streamed` over up to 8 x `chunks` rows)."""
    options = [f"-DFMT={fmt[1:]}", f"-DWARPS={warps}", f"-DMT={mt}", f"-DUNROLL={unroll}", f"-DROWS1={int(one_row)}",
               f"-DXREG={int(one_row and x_in_registers)}", f"-DSCALE_BF16={int(bf16_scales)}", f"-DPDL={int(pdl)}",
               f"-DNB={chunks}"]
    return nvrtc.compile_ptx(SOURCE, "qtiled.cu", arch, options)


def _kernel(fmt: str, warps: int, mt: int, unroll: int, one_row: bool, bf16_scales: bool, device: torch.device,
            x_in_registers: bool = False, pdl: bool = False, chunks: int = 1):
    major, minor = torch.cuda.get_device_capability(device)
    key = (fmt, warps, mt, unroll, one_row, bf16_scales, major, minor, x_in_registers, pdl, chunks)
    if key not in _compiled:
        from torch.cuda._utils import _cuda_load_module  # the loader behind torch.cuda.compile_kernel

        code = ptx(fmt, warps, mt, unroll, one_row, bf16_scales, f"{major}{minor}", x_in_registers, pdl, chunks)
        _compiled[key] = _cuda_load_module(code, ["qtiled"])["qtiled"]
    return _compiled[key]


def usable(device: torch.device) -> bool:
    """Whether these kernels run on `device`: a CUDA GPU with int8 MMA (sm_80+) where NVRTC compiles them. Once
    per device; the loader keeps the row-major layout (and the Triton kernels) where they do not."""
    if device.type != "cuda":
        return False
    name = str(torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device()))
    if name not in _usable:
        try:
            ok = torch.cuda.get_device_capability(device) >= (8, 0)
            if ok:
                _kernel("q4", 4, 1, 4, False, True, device)
        except (OSError, RuntimeError, AttributeError, ImportError):
            ok = False
        _usable[name] = ok
    return _usable[name]


def chunks_for(rows: int) -> int:
    """n8 chunks a `tiled_mma_streamed` launch of `rows` rows compiles for: a power of two, 2 to 8."""
    return max(2, 1 << (-(-min(rows, STREAMED_ROWS) // 8) - 1).bit_length())


def shared_bytes(per_split: int, one_row: bool, x_in_registers: bool = False, unroll: int = 4,
                 chunks: int = 1) -> int:
    """x's rows of the K-slice at the source's `x_pitch`, and a float4 per group and lane tid (none with x in
    registers); streamed (`chunks` > 1), two stages of `unroll` groups whatever the slice."""
    if chunks > 1:
        return 2 * (8 * chunks * (unroll * GROUP + 32) + unroll * 8 * chunks * 8)
    if one_row and x_in_registers:
        return 0
    pitch = -(-per_split * GROUP // 128) * 128 + 32
    return (1 if one_row else 8) * pitch + per_split * GROUP


def launch(xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, w, split: int, warps: int, mt: int,
           unroll: int, out_dtype: torch.dtype, x_in_registers: bool = False, streamed: bool = False) -> torch.Tensor:
    """x's int8 rows (`actquant`'s split codes, scales and sums) times the tiled weight w: fp32 K-slice partials
    [split, M, N], or [M, N] in `out_dtype` when split is 1. One row takes `tiled_dp4a` (`tiled_dp4a_xreg` with
    `x_in_registers`), more rows `tiled_mma` (8 per launch) or, `streamed`, `tiled_mma_streamed` (64 per launch)."""
    from . import pdl

    m, k = xq.shape
    n = w.out_features
    groups = k // GROUP
    per = groups // split
    one_row = m == 1
    assert w.tiled and groups % split == 0 and per % unroll == 0 and unroll % 4 == 0
    assert xq.is_contiguous() and xq.data_ptr() % 16 == 0 and w.codes.data_ptr() % 16 == 0
    assert not (streamed and one_row)
    chunks = chunks_for(m) if streamed else 1
    shared = shared_bytes(per, one_row, x_in_registers, unroll, chunks)
    assert shared <= SHARED_LIMIT, "a K split this small does not fit x's slice in shared memory"
    if split == 1:
        out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
        kind = _OUT_KIND[out_dtype]
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=xq.device)
        kind = 0
    high = w.high if w.high is not None else w.codes
    with_pdl = pdl.on(xq)
    kernel = _kernel(w.fmt, warps, mt, unroll, one_row, w.scales.dtype == torch.bfloat16, xq.device, x_in_registers,
                     with_pdl, chunks)
    grid = (-(-n // (16 * warps * mt)), split, 1)
    per_launch = STREAMED_ROWS if streamed else MAX_ROWS
    for r in range(0, m, per_launch):
        rows = min(per_launch, m - r)
        cuda_launch.launch(kernel, grid, (32 * warps, 1, 1), shared, [xq[r:], xs[r:], xsum[r:], w.codes, high,
                           w.scales, out.view(-1)[r * n:], rows, n, k, per, m, kind], with_pdl)
    return out
