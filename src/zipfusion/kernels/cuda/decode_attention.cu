// Paged decode attention over the zipfusion KV arena, CUDA C++ (sm_80+; tuned on the H200).
//
// Same contract as the Triton kernel in ../decode_attention.py (which stays the CPU-checkable
// reference): one query token per request, the GQA group of G <= 16 query heads of one KV head
// served together, head_dim 128, pages of 16 tokens that are either *open* ([2, 16, H, D] bf16 at
// `page_loc & ~1`, low bit set) or *compressed* (docs/format.md). Nothing decompressed is
// written to global memory: compressed blocks are restored from shared memory into the
// registers that feed the tensor cores.
//
// Work split. A CTA of 4 warps takes (split s, KV head h, request b); its warps take the
// split's pages round-robin (warp w: pages w, w+4, ...) and run flash decoding independently;
// at the end the four warp states are combined in shared memory, and the splits of a request
// are combined by `merge_kernel` (out = Σ 2^(lse_s − M) o_s / Σ 2^(lse_s − M)).
//
// Per warp, per page (16 tokens), with c = sm_scale·log2(e) and m16n8k16 bf16 MMAs:
//
//   S[16 heads × 16 tokens] = Q[16 × 128] · Kᵀ                        (16 MMAs)
//   m' = max(m, rowmax c·S);  P = 2^(c·S − m');  l = l·2^(m − m') + rowsum P
//   acc[16 heads × 128] = acc · 2^(m − m') + bf16(P) · V              (16 MMAs)
//
// Rows are query heads (rows >= G are zero padding); the C fragment of the first product is
// the A fragment of the second, as in FlashAttention-2.
//
// Where each value goes. The MMA reduction index can be permuted freely as long as both
// operands agree, and that is what lets a thread restore whole groups (8 consecutive channels
// of one token, docs/format.md) straight into its fragments. Lane = 4·g + t (g = 0..7,
// t = 0..3):
//   * Q·Kᵀ: chunk pair (2p, 2p+1) covers K block p (channels 32p..32p+31). Lane (g, t) holds
//     channels 32p+8t .. 32p+8t+7 of token ρ(g) (n-tile 0) and ρ(g)+8 (n-tile 1): four bf16
//     pairs w0..w3 = B fragments {w0, w1} of chunk 2p and {w2, w3} of chunk 2p+1. Q is loaded
//     into A fragments with the same channel order.
//   * token order ρ(2u) = u, ρ(2u+1) = u+4 (u = 0..3). Then P's slots (2t, 2t+1, 2t+8, 2t+9)
//     are tokens (t, t+4, t+8, t+12): one per V block (V blocks hold 4 tokens each), so every
//     load of a V block is uniform across the warp (no divergence between raw and compressed).
//   * P·V: lane (g, t) needs, for its output dims, V of tokens t, t+4 (first B register) and
//     t+8, t+12 (second). It restores groups g and g+8 (channels 8g.., 64+8g..) of those four
//     tokens and transposes bf16 pairs across tokens with one `prmt` per word. n-tile i covers
//     dims φ(i, n) = 8n + i (i < 8) or 64 + 8n + (i − 8).
//
// Loads. Each warp stages whole pages (its head's K and V bodies, <= 8 KB) into shared memory
// with cp.async, STAGES pages deep; an open page is copied into the layout of an all-raw page,
// so the compute sees one format. Page ids, locations and metadata records are read 32 pages at
// a time (one per lane) and broadcast with shuffles.
//
// Exactness. Every source (open page, raw block, compressed block) yields the same 32-bit
// words in the same registers, so everything after the restore -- the MMAs, the softmax, the
// combine and the merge -- is the same instruction stream on the same bits. The uncompressed
// twin (COMPRESSED = false) reads open pages only and gives the same bits as the fused kernel.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int D = 128;            // head dim
constexpr int PAGE = 16;          // tokens per page
constexpr int NB = 4;             // blocks per head and role (K or V)
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int STAGE_BYTES = 8192; // one head's K + V bodies, all raw
constexpr int RECORD = 8;         // metadata bytes per (head, role)
constexpr uint32_t RAW = 0xFF;

// ---------------------------------------------------------------------------------------------
// Small PTX helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ int block_bytes(uint32_t mark) { return mark == RAW ? 1024 : 768; }

// ---------------------------------------------------------------------------------------------
// Restoring one group of 8 values (docs/format.md, section 2)
// ---------------------------------------------------------------------------------------------
// A compressed group is 8 low bytes (lo0123, lo4567) and one word w of 4-bit codes. Four high
// bytes per integer op:
//   hi0123 = (w & 0x87878787) + (b/2)·0x01010101
//   hi4567 = ((w << 1) & 0x80808080 | (w >> 3) & 0x07070707) + (b/2)·0x01010101
// and prmt interleaves low and high bytes into bf16 pairs (values 2k, 2k+1).
// A raw group is the same four words, read as they are.

__device__ __forceinline__ void read_group(const uint8_t* blk, uint32_t mark, int q,
                                           uint32_t (&w)[4]) {
  if (mark == RAW) {
    uint4 r = *reinterpret_cast<const uint4*>(blk + 16 * q);
    w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
  } else {
    uint2 lo = *reinterpret_cast<const uint2*>(blk + 8 * q);
    uint32_t code = *reinterpret_cast<const uint32_t*>(blk + 512 + 4 * q);
    uint32_t base = mark * 0x01010101u;
    uint32_t hi0 = (code & 0x87878787u) + base;
    uint32_t hi1 = (((code << 1) & 0x80808080u) | ((code >> 3) & 0x07070707u)) + base;
    w[0] = __byte_perm(lo.x, hi0, 0x5140);
    w[1] = __byte_perm(lo.x, hi0, 0x7362);
    w[2] = __byte_perm(lo.y, hi1, 0x5140);
    w[3] = __byte_perm(lo.y, hi1, 0x7362);
  }
}

// ---------------------------------------------------------------------------------------------
// Staging a page into shared memory
// ---------------------------------------------------------------------------------------------
// Stage layout (both page kinds): K blocks from byte 0, V blocks from byte `voff`, each block
// 768 (compressed) or 1024 (raw) bytes in the order of docs/format.md. `Desc` says which.

struct Desc {
  uint32_t kmarks;   // 4 bytes: b/2 of K block j, or 0xFF (raw)
  uint32_t vmarks;
  int voff;          // stage offset of V block 0
  int pad;
};

// Copy one page (this head's K and V) into `stage`; lane-uniform arguments.
template <bool COMPRESSED>
__device__ __forceinline__ Desc issue_page(uint8_t* stage, const uint8_t* arena, long long loc,
                                           uint2 rk, uint2 rv, int h, int H, int lane) {
  Desc d;
  if (COMPRESSED && !(loc & 1)) {
    int ksz = 0, vsz = 0;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      ksz += block_bytes((rk.y >> (8 * j)) & 0xFF);
      vsz += block_bytes((rv.y >> (8 * j)) & 0xFF);
    }
    const uint8_t* src = arena + loc + rk.x;     // K bodies, then V bodies, contiguous
    int chunks = (ksz + vsz) >> 4;
    for (int c = lane; c < chunks; c += 32) cp_async16(stage + 16 * c, src + 16 * c);
    d.kmarks = rk.y; d.vmarks = rv.y; d.voff = ksz;
  } else {
    // Open page [2, 16, H, D]: token rows of 256 bytes. K row τ, chunk c (channels 8c..8c+7)
    // goes to raw K block c/4, row τ: 1024·(c/4) + 64·τ + 16·(c%4); V row τ to 4096 + 256·τ
    // + 16·c (= raw V block τ/4, row τ%4).
    const uint8_t* base = arena + (loc & ~1LL) + (long long)h * D * 2;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      int id = 32 * i + lane;            // 0..511
      int role = id >> 8, tok = (id >> 4) & 15, c = id & 15;
      const uint8_t* src = base + ((long long)(role * PAGE + tok) * H) * D * 2 + 16 * c;
      int dst = role ? 4096 + 256 * tok + 16 * c : 1024 * (c >> 2) + 64 * tok + 16 * (c & 3);
      cp_async16(stage + dst, src);
    }
    d.kmarks = 0xFFFFFFFFu; d.vmarks = 0xFFFFFFFFu; d.voff = 4096;
  }
  return d;
}

// ---------------------------------------------------------------------------------------------
// The attention kernel
// ---------------------------------------------------------------------------------------------

template <bool COMPRESSED, int STAGES>
__global__ void __launch_bounds__(THREADS)
attention_kernel(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ arena,
                 const long long* __restrict__ page_loc, const int* __restrict__ block_table,
                 const int* __restrict__ context_lens, __nv_bfloat16* __restrict__ out,
                 float* __restrict__ part_o, float* __restrict__ part_lse, float qk_scale,
                 int bt_stride, int pages_per_split, int num_splits, int H, int G) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ Desc descs[WARPS][STAGES];

  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int Hq = H * G;

  const int ctx = context_lens[b];
  const int n_pages = (ctx + PAGE - 1) / PAGE;
  const int p_begin = s * pages_per_split;
  const int p_end = min(n_pages, p_begin + pages_per_split);
  const long long row0 = (long long)b * Hq + (long long)h * G;   // first query row of the group

  if (p_begin >= p_end) {           // this split of a short request is empty
    if (num_splits > 1) {
      for (int i = threadIdx.x; i < G * D; i += THREADS)
        part_o[((row0 + i / D) * num_splits + s) * D + i % D] = 0.f;
      for (int i = threadIdx.x; i < G; i += THREADS)
        part_lse[(row0 + i) * num_splits + s] = -INFINITY;
    }
    return;
  }

  // Q as A fragments: qa[kc] = {row g, row g+8} × {slots 2t.., slots 2t+8..} of chunk kc.
  uint32_t qa[8][4];
#pragma unroll
  for (int p = 0; p < NB; ++p) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int r = g + 8 * half;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < G) v = *reinterpret_cast<const uint4*>(q + (row0 + r) * D + 32 * p + 8 * t);
      qa[2 * p][half] = v.x;       // chunk 2p:   slots 2t.. = channels +0,+1
      qa[2 * p][2 + half] = v.y;   //             slots 2t+8.. = channels +2,+3
      qa[2 * p + 1][half] = v.z;   // chunk 2p+1: channels +4,+5 and +6,+7
      qa[2 * p + 1][2 + half] = v.w;
    }
  }

  float acc[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};   // rows g, g+8 (log2 domain)
  float l_run[2] = {0.f, 0.f};               // this lane's partial row sums

  uint8_t* stages = smem + (size_t)warp * STAGES * STAGE_BYTES;
  const int my_pages = (p_end - p_begin - warp + WARPS - 1) / WARPS;   // may be <= 0
  const int* bt = block_table + (long long)b * bt_stride;

  // Per-lane metadata for 32 pages of this warp's sequence: lane j holds page j of the batch.
  long long m_loc = 0;
  uint4 m_rec = make_uint4(0, 0, 0, 0);
  auto load_meta = [&](int j0) {
    int j = j0 + lane;
    if (j < my_pages) {
      int page = p_begin + warp + WARPS * j;
      m_loc = page_loc[bt[page]];
      if (COMPRESSED && !(m_loc & 1))
        m_rec = *reinterpret_cast<const uint4*>(arena + m_loc + 2 * RECORD * h);
    }
  };
  auto issue = [&](int j) {
    if ((j & 31) == 0) load_meta(j);
    int src = j & 31;
    long long loc = __shfl_sync(0xffffffffu, m_loc, src);
    uint2 rk, rv;
    rk.x = __shfl_sync(0xffffffffu, m_rec.x, src);
    rk.y = __shfl_sync(0xffffffffu, m_rec.y, src);
    rv.x = __shfl_sync(0xffffffffu, m_rec.z, src);
    rv.y = __shfl_sync(0xffffffffu, m_rec.w, src);
    Desc d = issue_page<COMPRESSED>(stages + (j % STAGES) * STAGE_BYTES, arena, loc, rk, rv, h,
                                    H, lane);
    if (lane == 0) descs[warp][j % STAGES] = d;
  };

#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    if (j < my_pages) issue(j);
    cp_async_commit();
  }

  const int rho = (g >> 1) + 4 * (g & 1);    // token of n-tile 0 for this lane (ρ(g))

  for (int j = 0; j < my_pages; ++j) {
    if (j + STAGES - 1 < my_pages) issue(j + STAGES - 1);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncwarp();

    const uint8_t* st = stages + (j % STAGES) * STAGE_BYTES;
    const Desc d = descs[warp][j % STAGES];
    const int page = p_begin + warp + WARPS * j;
    const int valid = min(PAGE, ctx - page * PAGE);     // tokens of this page inside the context

    // ---- S = Q·Kᵀ: n-tile 0 = tokens ρ(0..7), n-tile 1 = tokens 8 + ρ(0..7) ----
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    int off = 0;
#pragma unroll
    for (int p = 0; p < NB; ++p) {
      const uint32_t mark = (d.kmarks >> (8 * p)) & 0xFF;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t w[4];
        read_group(st + off, mark, 4 * (rho + 8 * nt) + t, w);
        mma_bf16(sc[nt], qa[2 * p][0], qa[2 * p][1], qa[2 * p][2], qa[2 * p][3], w[0], w[1]);
        mma_bf16(sc[nt], qa[2 * p + 1][0], qa[2 * p + 1][1], qa[2 * p + 1][2],
                 qa[2 * p + 1][3], w[2], w[3]);
      }
      off += block_bytes(mark);
    }

    // ---- online softmax; sc[nt][e]: row g (e < 2) or g+8, slot 2t + (e&1) + 8·nt ----
    // slot → token: 2t → t, 2t+1 → t+4, 2t+8 → t+8, 2t+9 → t+12.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int tok = t + 4 * (e & 1) + 8 * nt;
        float v = tok < valid ? sc[nt][e] * qk_scale : -INFINITY;
        sc[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      float m_new = fmaxf(m_run[r], mx[r]);
      alpha[r] = exp2f(m_run[r] - m_new);     // 0 on the first page (m_run = -inf)
      m_run[r] = m_new;
    }
    uint32_t pa[4];
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float p0 = exp2f(sc[nt][0] - m_run[0]), p1 = exp2f(sc[nt][1] - m_run[0]);
      float p2 = exp2f(sc[nt][2] - m_run[1]), p3 = exp2f(sc[nt][3] - m_run[1]);
      rs[0] += p0 + p1;
      rs[1] += p2 + p3;
      pa[2 * nt] = pack_bf16(p0, p1);         // row g,   slots 2t, 2t+1 (+8 for nt = 1)
      pa[2 * nt + 1] = pack_bf16(p2, p3);     // row g+8
    }
    l_run[0] = l_run[0] * alpha[0] + rs[0];
    l_run[1] = l_run[1] * alpha[1] + rs[1];
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        acc[i][0] *= alpha[0]; acc[i][1] *= alpha[0];
        acc[i][2] *= alpha[1]; acc[i][3] *= alpha[1];
      }
    }

    // ---- acc += P·V. V block k holds tokens 4k..4k+3; this lane reads token 4k + t. ----
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t vw[4][4];     // [block k][pair]: channels 64·half + 8g + 2·pair, +1 of token 4k+t
      int voff = d.voff;
#pragma unroll
      for (int k = 0; k < NB; ++k) {
        const uint32_t mark = (d.vmarks >> (8 * k)) & 0xFF;
        read_group(st + voff, mark, 16 * t + 8 * half + g, vw[k]);
        if (4 * k + t >= valid) vw[k][0] = vw[k][1] = vw[k][2] = vw[k][3] = 0u;  // past the end
        voff += block_bytes(mark);
      }
#pragma unroll
      for (int pair = 0; pair < 4; ++pair) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t sel = e ? 0x7632 : 0x5410;   // odd or even channel of the pair
          uint32_t b0 = __byte_perm(vw[0][pair], vw[1][pair], sel);   // tokens t, t+4
          uint32_t b1 = __byte_perm(vw[2][pair], vw[3][pair], sel);   // tokens t+8, t+12
          mma_bf16(acc[8 * half + 2 * pair + e], pa[0], pa[1], pa[2], pa[3], b0, b1);
        }
      }
    }
    __syncwarp();     // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  // ---- combine the four warps: rows g, g+8; acc[i][e] is dim φ(i, 2t + (e&1)) ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  __syncthreads();                                  // all stages are free now
  float* so = reinterpret_cast<float*>(smem);       // [WARPS][16 rows][D]
  float* sm = so + WARPS * 16 * D;                  // [WARPS][16]
  float* sl = sm + WARPS * 16;                      // [WARPS][16]
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int n = 2 * t + (e & 1);
      int dim = i < 8 ? 8 * n + i : 64 + 8 * n + (i - 8);
      so[(warp * 16 + g + 8 * (e >> 1)) * D + dim] = acc[i][e];
    }
  if (t == 0) {
    sm[warp * 16 + g] = m_run[0]; sm[warp * 16 + g + 8] = m_run[1];
    sl[warp * 16 + g] = l_run[0]; sl[warp * 16 + g + 8] = l_run[1];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += THREADS) {
    int r = i / D, dim = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm[w * 16 + r]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      float f = exp2f(sm[w * 16 + r] - M);          // 0 for a warp that had no pages
      L += sl[w * 16 + r] * f;
      O += so[(w * 16 + r) * D + dim] * f;
    }
    if (num_splits == 1) {
      out[(row0 + r) * D + dim] = __float2bfloat16_rn(O / L);
    } else {
      part_o[((row0 + r) * num_splits + s) * D + dim] = O / L;
      if (dim == 0) part_lse[(row0 + r) * num_splits + s] = M + log2f(L);
    }
  }
}

// out[row] = Σ_s 2^(lse_s − M)·o_s / Σ_s 2^(lse_s − M) for one (request, query head) per CTA.
__global__ void merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                             __nv_bfloat16* __restrict__ out, int num_splits) {
  const long long row = blockIdx.x;
  const int dim = threadIdx.x;
  float M = -INFINITY;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, part_lse[row * num_splits + s]);
  float L = 0.f, O = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    float f = exp2f(part_lse[row * num_splits + s] - M);
    L += f;
    O += f * part_o[(row * num_splits + s) * D + dim];
  }
  out[row * D + dim] = __float2bfloat16_rn(O / L);
}

template <bool COMPRESSED, int STAGES>
cudaError_t launch(const void* q, const void* arena, const void* page_loc,
                   const void* block_table, const void* context_lens, void* out, void* part_o,
                   void* part_lse, float qk_scale, int bt_stride, int pages_per_split,
                   int num_splits, int B, int H, int G, cudaStream_t stream) {
  auto kernel = attention_kernel<COMPRESSED, STAGES>;
  const int smem = WARPS * STAGES * STAGE_BYTES;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  dim3 grid(num_splits, H, B);
  kernel<<<grid, THREADS, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const uint8_t*>(arena),
      static_cast<const long long*>(page_loc), static_cast<const int*>(block_table),
      static_cast<const int*>(context_lens), static_cast<__nv_bfloat16*>(out),
      static_cast<float*>(part_o), static_cast<float*>(part_lse), qk_scale, bt_stride,
      pages_per_split, num_splits, H, G);
  e = cudaGetLastError();
  if (e != cudaSuccess || num_splits == 1) return e;
  merge_kernel<<<B * H * G, D, 0, stream>>>(static_cast<const float*>(part_o),
                                            static_cast<const float*>(part_lse),
                                            static_cast<__nv_bfloat16*>(out), num_splits);
  return cudaGetLastError();
}

}  // namespace

// C entry point for ctypes (zipfusion/kernels/cuda_attention.py). Returns a cudaError_t.
extern "C" int zf_decode_attention(int compressed, int stages, const void* q, const void* arena,
                                   const void* page_loc, const void* block_table,
                                   const void* context_lens, void* out, void* part_o,
                                   void* part_lse, float qk_scale, int bt_stride,
                                   int pages_per_split, int num_splits, int B, int H, int G,
                                   void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define ZF_LAUNCH(C, S)                                                                      \
  return (int)launch<C, S>(q, arena, page_loc, block_table, context_lens, out, part_o,      \
                           part_lse, qk_scale, bt_stride, pages_per_split, num_splits, B, H, \
                           G, st)
  if (compressed) {
    if (stages == 2) ZF_LAUNCH(true, 2);
    if (stages == 4) ZF_LAUNCH(true, 4);
    ZF_LAUNCH(true, 3);
  } else {
    if (stages == 2) ZF_LAUNCH(false, 2);
    if (stages == 4) ZF_LAUNCH(false, 4);
    ZF_LAUNCH(false, 3);
  }
#undef ZF_LAUNCH
}

extern "C" const char* zf_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
