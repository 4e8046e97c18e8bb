// Paged decode attention over the zipfusion KV arena, CUDA C++ (sm_80+).
//
// Same contract as the Triton kernel in ../triton_attention.py (which stays the CPU-checkable
// reference): one query token per request, the GQA group of G <= 16 query heads of one KV head
// served together, head_dim D = 64, 128 or 256 (ZF_HEAD_DIM: one library per D), pages of
// 16 tokens that are either *open* ([2, 16, H, D] bf16 at
// `page_loc & ~1`, low bit set) or *compressed* (docs/format.md, version 2: blocks raw,
// compressed, or compressed with up to 4 escape records). Nothing decompressed is
// written to global memory: compressed blocks are restored from shared memory into the
// registers that feed the tensor cores.
//
// Work split. A CTA of 4 warps takes (split s, KV head h, request b) -- at D = 256 eight of the
// group's query heads, the ceil(G / 8) CTAs side by side (`cta_heads`) -- and its warps take the
// split's pages round-robin (warp w: pages w, w+4, ...) and run flash decoding independently;
// at the end the four warp states are combined in shared memory, and the splits of a request
// are combined by `merge_kernel` (out = Σ 2^(lse_s − M) o_s / Σ 2^(lse_s − M)). A split's size
// is `pages_per_split` pages when that is positive (deterministic mode: fixed, so a request's
// sums do not depend on its batch); when it is -T, each request's own pages are spread over the
// launch's splits in runs of whole T-page tiles (`split_size`: balanced, so that one long request
// among short ones is cut as finely, and no split is left with the whole of it). Two kernels
// share that plan and every per-page step (`Flash`): `attention_kernel`, where each warp also
// copies its own pages, and `producer_kernel` (Hopper, the default for compressed pages), where a
// fifth warp issues every copy and the four others only compute. Same pages per warp, same
// arithmetic, same combine: the same bits.
//
// Per warp, per page (16 tokens), with c = sm_scale·log2(e) and m16n8k16 bf16 MMAs whose M
// dimension is the page's 16 tokens (then the head dims), N the query heads (8 per n-tile):
//
//   Sᵀ[16 tokens × 8 heads] = K[16 × D] · Qᵀ                  (D/16 MMAs per n-tile)
//   m' = max(m, colmax c·Sᵀ);  Pᵀ = 2^(c·Sᵀ − m');  l = l·2^(m − m') + colsum Pᵀ
//   Oᵀ[D dims × 8 heads] = Oᵀ · 2^(m − m') + Vᵀ · bf16(Pᵀ)       (D/16 MMAs per n-tile)
//
// Heads >= G are zero padding. Pᵀ leaves the first product as a C fragment (rows = tokens) and
// enters the second as a B fragment (columns = heads): one `movmatrix.trans` per 8×8 tile.
//
// Where each value goes. The MMA reduction index can be permuted freely as long as both
// operands agree, and that is what lets a thread restore whole groups (8 consecutive channels
// of one token, docs/format.md) straight into its fragments. Lane = 4·g + t (g = 0..7,
// t = 0..3); token order σ(2u) = u, σ(2u+1) = u + 4, σ(8 + x) = 8 + σ(x):
//   * K·Qᵀ: chunk pair (2p, 2p+1) covers K block p (channels 32p..32p+31). Lane (g, t) holds
//     channels 32p+8t .. 32p+8t+7 of tokens σ(g) (A row g) and σ(g)+8 (row g+8): bf16 pairs
//     w0..w3 of each; {w0, w1} feed chunk 2p and {w2, w3} chunk 2p+1. Q is loaded into B
//     fragments with the same channel order.
//   * Vᵀ·Pᵀ: the k slots (2t, 2t+1, 2t+8, 2t+9) of lane (g, t) are tokens (t, t+4, t+8, t+12).
//     A V block holds TPB = 512/D tokens; at D <= 128 each load of a V block is uniform across
//     the warp (no divergence between raw and compressed blocks), at D = 256 lanes t < 2 and
//     t >= 2 read two neighbouring blocks. The lane restores channel groups g + 8j (j < D/64)
//     of those four tokens; at D = 128 m-tile i row g is dim 8g + i, row g+8 is 64 + 8g + i
//     (in general `o_dim`), and one `prmt` per register pairs two tokens' values of one dim.
//
// Loads. Each warp stages half pages (its head's K bodies, then its V bodies, <= 32·D bytes each)
// into shared memory, STAGES halves deep, in one of two ways (template TMA):
//   * bulk copies (Hopper's TMA; the fused kernel's default): one `cp.async.bulk` per compressed
//     half page (its blocks are contiguous), 16 row copies per open one, completion counted on an
//     mbarrier; the layout stays as in memory (open K in token rows);
//   * cp.async (16 bytes a lane; the uncompressed kernel's default): open pages are rearranged into the layout
//     of all-raw blocks, and chunks are swizzled inside each block so that the fragment loads
//     are free of bank conflicts (see "swizzles" below).
// The compute then runs one straight-line gather per staged layout (Kind). Page ids, locations
// and metadata records are read 32 pages at a time (one per lane, one batch ahead) and
// broadcast with shuffles.
//
// Exactness. Every source (open page, raw block, compressed block) yields the same 32-bit
// words in the same registers, so everything after the restore -- the MMAs, the softmax, the
// combine and the merge -- is the same instruction stream on the same bits. The uncompressed
// uncompressed kernel (COMPRESSED = false) reads open pages only and gives the same bits as the fused kernel.

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

namespace {

#ifndef ZF_HEAD_DIM
#define ZF_HEAD_DIM 128
#endif
constexpr int D = ZF_HEAD_DIM;    // head dim: one library per value (cuda_attention.py)
static_assert(D == 64 || D == 128 || D == 256, "ZF_HEAD_DIM must be 64, 128 or 256");
constexpr int PAGE = 16;          // tokens per page
constexpr int NB = D / 32;        // blocks per head and role (K or V)
constexpr int TPB = 512 / D;      // tokens per V block
constexpr int ROW_BYTES = 2 * D;  // one token of one head in an open page
constexpr int TILES = D / 16;     // Oᵀ m-tiles
constexpr int VG = D / 64;        // V channel groups a lane restores per token: g + 8j
constexpr int JC = VG < 2 ? VG : 2;   // ... per chunk of Oᵀ m-tiles (one gather each)
constexpr int CHUNKS = VG / JC;
constexpr int TPC = TILES / CHUNKS;   // m-tiles per chunk
constexpr int NPOS = TPB > 4 ? 2 : 1; // lane offsets per V group: tokens t and t + 4 (D = 64)
constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int STAGE_BYTES = 32 * D;   // one head's K (or V) bodies, all raw
constexpr int RECORD = D == 256 ? 16 : 8;   // metadata bytes per (head, role)
// a role's block marks (one byte per block) and their masks: all raw, bit 7
using Marks = std::conditional_t<(NB > 4), uint64_t, uint32_t>;
constexpr Marks ALL_RAW_MARKS = static_cast<Marks>(~0ull >> (64 - 8 * NB));
constexpr Marks BIT7_MARKS = static_cast<Marks>(0x8080808080808080ull) & ALL_RAW_MARKS;
constexpr uint32_t RAW = 0xFF;
constexpr uint32_t ESCAPED = 0x80;  // format v2: metadata byte 0x80 | b/2 = compressed with escapes
constexpr int ESCAPE_AT = 768;      // the escape chunk's offset in such a block (784 bytes long)
constexpr unsigned FULL = 0xffffffffu;

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

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Bulk copies (TMA, sm_90): one thread moves a contiguous range global -> shared; completion
// is counted in bytes on an mbarrier that the consumers wait on. (Built for older GPUs, these
// trap: the host asks for them only on sm_90+.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define ZF_NO_TMA 1
#endif
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
#ifdef ZF_NO_TMA
  __trap();
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)));
#endif
}

__device__ __forceinline__ void mbar_fence_init() {
#ifndef ZF_NO_TMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef ZF_NO_TMA
  __trap();
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef ZF_NO_TMA
  __trap();
#else
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef ZF_NO_TMA
  __trap();
#else
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef ZF_NO_TMA
  __trap();
#else
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
#endif
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ int block_bytes(uint32_t mark) {
  return mark == RAW ? 1024 : (mark & ESCAPED) ? 768 + 16 : 768;
}

// Set bits of a mark word, and its raw blocks (0xFF bytes).
__device__ __forceinline__ int popc(Marks x) {
  if constexpr (sizeof(Marks) == 8) return __popcll(x);
  else return __popc(x);
}
__device__ __forceinline__ int raw_marks(Marks m) {
  int n = __popc(__vcmpeq4(static_cast<uint32_t>(m), 0xFFFFFFFFu)) >> 3;
  if constexpr (sizeof(Marks) == 8) n += __popc(__vcmpeq4(static_cast<uint32_t>(static_cast<uint64_t>(m) >> 32), 0xFFFFFFFFu)) >> 3;
  return n;
}

// The bytes of a compressed page's K (or V) bodies from their NB marks: 768 a block, + 256 for
// each raw one (0xFF), + 16 for each with escapes (0x80..0xFE); bit 7 is set in both, so + 240
// per raw block + 16 per mark with bit 7 (a record's padding bytes are zero).
__device__ __forceinline__ uint32_t half_bytes(Marks marks) {
  return 768 * NB + 240 * raw_marks(marks) + 16 * popc(marks & BIT7_MARKS);
}

// A page's metadata records of KV head h (docs/format.md: M = RECORD bytes each): r[0] = (K
// offset, K marks, V offset, V marks) at M = 8; K and V records in r[0], r[1] at M = 16 (8 marks).
struct Rec {
  uint4 r[RECORD / 8];
};

// Role `role`'s block-0 offset and marks, from lane src's record.
__device__ __forceinline__ void half_rec(const Rec& rec, int role, int src, uint32_t& off,
                                         Marks& marks) {
  if constexpr (RECORD == 8) {
    off = __shfl_sync(FULL, role ? rec.r[0].z : rec.r[0].x, src);
    marks = __shfl_sync(FULL, role ? rec.r[0].w : rec.r[0].y, src);
  } else {
    off = __shfl_sync(FULL, role ? rec.r[1].x : rec.r[0].x, src);
    marks = __shfl_sync(FULL, role ? rec.r[1].y : rec.r[0].y, src) |
            (uint64_t)__shfl_sync(FULL, role ? rec.r[1].z : rec.r[0].z, src) << 32;
  }
}

// A page's location and, for a compressed one, the records of KV head h.
template <bool COMPRESSED>
__device__ __forceinline__ void page_meta(const uint8_t* arena, const long long* page_loc, int id,
                                          int h, long long& loc, Rec& rec) {
  loc = page_loc[id];
  if (COMPRESSED && !(loc & 1)) {
#pragma unroll
    for (int i = 0; i < RECORD / 8; ++i)
      rec.r[i] = *reinterpret_cast<const uint4*>(arena + loc + 2 * RECORD * h + 16 * i);
  }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory swizzles: where byte r of a staged block lives
// ---------------------------------------------------------------------------------------------
// Shared memory serves a warp's 8- and 16-byte loads in 32-bank (128-byte) wavefronts per half
// or quarter warp. Read as laid out in docs/format.md, the lanes of one load hit the same banks
// 2-4 times over (lanes of one column read tokens 128 or 256 bytes apart). Each block is
// therefore staged with 16-byte chunks permuted inside it; the XOR moves a chunk by 32 or 64
// bytes according to its row bits, so every load below is conflict-free:
//   compressed block, low bytes (r < 512):  bits 6,5 ^= bits 7,8
//   compressed block, codes (r = 512 + r'):  bit 5 ^= bit 7 of r'
//   raw block (r < 1024):                   bits 6,5 ^= bits 8,9
// The swizzle is relative to the block's start (a multiple of 256 bytes of its stage where no
// block before it has escapes; format v2's 784-byte blocks shift the next ones by 16 bytes,
// which may cost bank conflicts there but not correctness). A block's escape chunk (16 bytes
// at 768) is staged as it is: every lane reads the same 8 bytes (a broadcast).

__device__ __forceinline__ int swz_lo(int r) { return r ^ (((r >> 1) & 64) | ((r >> 3) & 32)); }
__device__ __forceinline__ int swz_code(int r) { return 512 + ((r - 512) ^ (((r - 512) >> 2) & 32)); }
__device__ __forceinline__ int swz_raw(int r) { return r ^ (((r >> 2) & 64) | ((r >> 4) & 32)); }

// A lane's (swizzled) offsets inside a block for one group index q: 8 low bytes at 8q, 4 code
// bytes at 512 + 4q (compressed) or 16 bytes at 16q (raw); and q itself (escape records).
struct Lane {
  int lo, code, raw, q;
};

template <bool TMA>
__device__ __forceinline__ Lane lane_offsets(int q) {
  if (TMA) return Lane{8 * q, 512 + 4 * q, 16 * q, q};   // bulk copies keep the layout as is
  return Lane{swz_lo(8 * q), swz_code(512 + 4 * q), swz_raw(16 * q), q};
}

// ---------------------------------------------------------------------------------------------
// Restoring one group of 8 values (docs/format.md, section 2)
// ---------------------------------------------------------------------------------------------
// A compressed group is 8 low bytes (lo0123, lo4567) and one word w of 4-bit codes. Four high
// bytes per integer op:
//   hi0123 = (w & 0x87878787) + (b/2)·0x01010101
//   hi4567 = ((w << 1) & 0x80808080 | (w >> 3) & 0x07070707) + (b/2)·0x01010101
// Format v2: in a block with escapes (metadata byte 0x80 | b/2) each of its 4 escape records
// r = v | x << 9 (u16, at byte 768 + 2i; zero records are no-ops) XORs x into the high byte of
// value v: byte v mod 4 of hi0123 (v mod 8 < 4) or hi4567 of the group q = v >> 3. Records
// hold the escapes first, then zeros: the scan stops at the first zero (most such blocks have
// one escape), the same branch for the whole warp.
// Then prmt interleaves low and high bytes into bf16 pairs (values 2k, 2k+1).
// A raw group is the same four words, read as they are. The counterpart of format/triton_restore.py.

__device__ __forceinline__ void read_raw(const uint8_t* p, uint32_t (&w)[4]) {
  const uint4 r = *reinterpret_cast<const uint4*>(p);
  w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
}

__device__ __forceinline__ void patch_escapes(const uint8_t* blk, int q, uint32_t& hi0,
                                              uint32_t& hi1) {
  const uint2 e = *reinterpret_cast<const uint2*>(blk + ESCAPE_AT);
  const uint32_t rec[4] = {e.x & 0xFFFFu, e.x >> 16, e.y & 0xFFFFu, e.y >> 16};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (rec[r] == 0) break;     // the records after the last one are zero (uniform: one block)
    const uint32_t v = rec[r] & 0x1FFu;
    const uint32_t p = (int)(v >> 3) == q ? (rec[r] >> 9) << (8 * (v & 3)) : 0u;
    hi0 ^= (v & 4) ? 0u : p;
    hi1 ^= (v & 4) ? p : 0u;
  }
}

// ESCAPES: the block may have escapes (its flag is tested by the caller, uniformly per block).
template <bool ESCAPES>
__device__ __forceinline__ void read_compressed(const uint8_t* blk, uint32_t mark, const Lane& o,
                                                uint32_t (&w)[4]) {
  const uint2 lo = *reinterpret_cast<const uint2*>(blk + o.lo);
  const uint32_t code = *reinterpret_cast<const uint32_t*>(blk + o.code);
  const uint32_t base = (mark & 0x7Fu) * 0x01010101u;
  uint32_t hi0 = (code & 0x87878787u) + base;
  uint32_t hi1 = (((code << 1) & 0x80808080u) | ((code >> 3) & 0x07070707u)) + base;
  if (ESCAPES) patch_escapes(blk, o.q, hi0, hi1);
  w[0] = __byte_perm(lo.x, hi0, 0x5140);
  w[1] = __byte_perm(lo.x, hi0, 0x7362);
  w[2] = __byte_perm(lo.y, hi1, 0x5140);
  w[3] = __byte_perm(lo.y, hi1, 0x7362);
}

// How a staged half page is laid out. Each kind has its own straight-line gather (no per-block
// branches or run-time offsets where the kind fixes them); MIXED is the general case.
// COMPRESSED_ESC (format v2, built with -DZF_ESC_KIND; off by default: it measured no faster
// with the producer warp, docs/tuning.md): no
// raw block, some with escapes; block p starts at 768·p + 16·(escaped blocks before p), a
// popcount of the marks' bit 7, and only blocks with escapes scan their records.
enum Kind { MIXED, ALL_COMPRESSED, ALL_RAW, OPEN_ROWS, COMPRESSED_ESC };

// Block p of a staged half: its mark (b/2 or RAW) and where it starts.
template <int KIND>
__device__ __forceinline__ void block_at(Marks marks, int p, int& off, uint32_t& mark) {
  mark = KIND == ALL_RAW || KIND == OPEN_ROWS ? RAW : (marks >> (8 * p)) & 0xFF;
  if (KIND == ALL_COMPRESSED) off = 768 * p;
  if (KIND == COMPRESSED_ESC) off = 768 * p + 16 * popc(marks & BIT7_MARKS & ((Marks(1) << (8 * p)) - 1));
  if (KIND == ALL_RAW) off = 1024 * p;
  if (KIND == OPEN_ROWS) off = 64 * p;                      // K in token rows (V never is)
  // MIXED: the caller accumulates `off` block by block
}

// MIXED: raw, compressed or compressed with escapes, by the block's mark (the same for the
// whole warp where every lane reads the same block: uniform branches); blocks without escapes
// pay the flag test only.
template <int KIND>
__device__ __forceinline__ void read_group(const uint8_t* blk, uint32_t mark, const Lane& o,
                                           int raw, uint32_t (&w)[4]) {
  if (KIND == ALL_COMPRESSED) read_compressed<false>(blk, mark, o, w);
  else if (KIND == COMPRESSED_ESC) {
    if (mark & ESCAPED) read_compressed<true>(blk, mark, o, w);
    else read_compressed<false>(blk, mark, o, w);
  } else if (KIND == MIXED && mark != RAW) {
    if (mark & ESCAPED) read_compressed<true>(blk, mark, o, w);
    else read_compressed<false>(blk, mark, o, w);
  } else read_raw(blk + raw, w);
}

// ---------------------------------------------------------------------------------------------
// Staging half a page (this head's K or V) into shared memory
// ---------------------------------------------------------------------------------------------
// Stage layout for both page kinds: the role's NB blocks back to back, 768 (compressed), 784
// (compressed with escapes) or 1024 (raw) bytes each, in the order of docs/format.md (at most
// STAGE_BYTES: a raw block has no escapes). Returns the NB block marks.

// What a warp staged in a stage: the half's block marks, whether the page is open (TMA).
struct Info {
  Marks marks;
  uint32_t open;
};

template <bool COMPRESSED>
__device__ __forceinline__ Marks issue_half(uint8_t* stage, const uint8_t* arena, long long loc,
                                            uint32_t rec_off, Marks marks, int role, int h,
                                            int H, int lane) {
  if (COMPRESSED && !(loc & 1)) {
    // Block by block: chunk `lane` (and 32 + lane) of each block, to its swizzled place.
    const uint8_t* src = arena + loc + rec_off;
    const int lo0 = swz_lo(16 * lane), code1 = swz_code(512 + 16 * lane);
    const int raw0 = swz_raw(16 * lane), raw1 = swz_raw(512 + 16 * lane);
    int off = 0;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const uint32_t mark = (marks >> (8 * j)) & 0xFF;
      if (mark == RAW) {
        cp_async16(stage + off + raw0, src + off + 16 * lane);
        cp_async16(stage + off + raw1, src + off + 512 + 16 * lane);
      } else {
        cp_async16(stage + off + lo0, src + off + 16 * lane);
        if (lane < 16) cp_async16(stage + off + code1, src + off + 512 + 16 * lane);
        else if (lane == 16 && (mark & ESCAPED))          // the escape chunk, unswizzled
          cp_async16(stage + off + ESCAPE_AT, src + off + ESCAPE_AT);
      }
      off += block_bytes(mark);
    }
    return marks;
  }
  // Open page [2, 16, H, D]: token rows of ROW_BYTES. K row τ, chunk c (channels 8c..8c+7)
  // belongs to raw K block c/4 at byte 64·τ + 16·(c%4); V row τ, chunk c to raw V block τ/TPB
  // at byte ROW_BYTES·(τ%TPB) + 16·c.
  const uint8_t* base = arena + (loc & ~1LL) + ((long long)role * PAGE * H + h) * D * 2;
  constexpr unsigned CPR = D / 8;                     // 16-byte chunks per row
  const int c = lane % CPR;
#pragma unroll
  for (int i = 0; i < PAGE * CPR / 32; ++i) {
    const unsigned tok = (32 / CPR) * i + unsigned(lane) / CPR;
    const int dst = role ? 1024 * (tok / TPB) + swz_raw(ROW_BYTES * (tok % TPB) + 16 * c)
                         : 1024 * (c >> 2) + swz_raw(64 * tok + 16 * (c & 3));
    cp_async16(stage + dst, base + (long long)tok * H * D * 2 + 16 * c);
  }
  return ALL_RAW_MARKS;
}

// The same with bulk copies (no swizzle): a compressed page's K (or V) bodies are one contiguous
// range, one copy; an open page's 16 token rows are 16 copies of ROW_BYTES, and its K stays in
// token-row layout (row τ at ROW_BYTES·τ, block p at +64·p) -- V rows already are the raw V layout.
// Lane 0 records the marks and whether the page is open in `info` before arming the barrier.
template <bool COMPRESSED>
__device__ __forceinline__ void issue_half_tma(uint8_t* stage, uint64_t* bar, Info* info,
                                               const uint8_t* arena, long long loc,
                                               uint32_t rec_off, Marks marks, int role, int h,
                                               int H, int lane) {
  if (COMPRESSED && !(loc & 1)) {
    if (lane == 0) {
      const uint32_t bytes = half_bytes(marks);
      info->marks = marks; info->open = 0;
      mbar_expect_tx(bar, bytes);
      bulk_copy(stage, arena + loc + rec_off, bytes, bar);
    }
    return;
  }
  if (lane == 0) {
    info->marks = ALL_RAW_MARKS; info->open = 1;
    mbar_expect_tx(bar, STAGE_BYTES);
  }
  __syncwarp();
  const uint8_t* base = arena + (loc & ~1LL) + ((long long)role * PAGE * H + h) * D * 2;
  if (lane < PAGE)
    bulk_copy(stage + ROW_BYTES * lane, base + (long long)lane * H * D * 2, ROW_BYTES, bar);
}

// ---------------------------------------------------------------------------------------------
// The attention kernel
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// One staged half page: K into scores, V into words
// ---------------------------------------------------------------------------------------------

template <bool COMPRESSED, bool TMA>
__device__ __forceinline__ int stage_kind(Marks marks, bool open_rows) {
  if (!COMPRESSED) return TMA ? OPEN_ROWS : ALL_RAW;      // the uncompressed kernel: open pages only
  if (open_rows) return OPEN_ROWS;
  if (marks == ALL_RAW_MARKS) return ALL_RAW;
  if ((marks & BIT7_MARKS) == 0) return ALL_COMPRESSED;        // no raw block, no escapes
#ifdef ZF_ESC_KIND
  if (raw_marks(marks) == 0) return COMPRESSED_ESC;            // no raw block, escapes
#endif
  return MIXED;
}

// Sᵀ[16 tokens × 8 heads per n-tile] = K·Qᵀ over the NB K blocks (chunk pair p = block p).
template <int KIND, int NT>
__device__ __forceinline__ void qk_page(const uint8_t* st, Marks marks, const Lane (&ko)[2],
                                        const int (&krow)[2], const uint32_t (&qb)[NT][2 * NB][2],
                                        float (&sc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
  int off = 0;
#pragma unroll
  for (int p = 0; p < NB; ++p) {
    uint32_t mark;
    block_at<KIND>(marks, p, off, mark);
    uint32_t w0[4], w1[4];
    read_group<KIND>(st + off, mark, ko[0], KIND == OPEN_ROWS ? krow[0] : ko[0].raw, w0);
    read_group<KIND>(st + off, mark, ko[1], KIND == OPEN_ROWS ? krow[1] : ko[1].raw, w1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma_bf16(sc[nt], w0[0], w1[0], w0[1], w1[1], qb[nt][2 * p][0], qb[nt][2 * p][1]);
      mma_bf16(sc[nt], w0[2], w1[2], w0[3], w1[3], qb[nt][2 * p + 1][0], qb[nt][2 * p + 1][1]);
    }
    if (KIND == MIXED) off += block_bytes(mark);
  }
}

// V words of this lane for chunk CC of the m-tiles: tokens t + 4s (slot s), channel groups
// g + 8(JC·CC + j). Slot s is in block (t + 4s) / TPB; with TPB = 2 (D = 256) lanes t < 2 and
// t >= 2 read two different blocks (a MIXED page's branches may diverge there).
template <int KIND, int CC>
__device__ __forceinline__ void gather_v(const uint8_t* st, Marks marks,
                                         const Lane (&vo)[NPOS][VG], int t,
                                         uint32_t (&vw)[4][JC][4]) {
  int off = 0;
  if constexpr (TPB >= 4) {
#pragma unroll
    for (int k = 0; k < NB; ++k) {
      uint32_t mark;
      block_at<KIND>(marks, k, off, mark);
#pragma unroll
      for (int u = 0; u < 4 / NB; ++u)
#pragma unroll
        for (int j = 0; j < JC; ++j) {
          const Lane& o = vo[u % NPOS][JC * CC + j];
          read_group<KIND>(st + off, mark, o, o.raw, vw[k * (4 / NB) + u][j]);
        }
      if (KIND == MIXED) off += block_bytes(mark);
    }
  } else {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      int off0 = off, off1;
      uint32_t mark0, mark1;
      block_at<KIND>(marks, 2 * s, off0, mark0);
      if (KIND == MIXED) off = off0 + block_bytes(mark0);
      off1 = off;
      block_at<KIND>(marks, 2 * s + 1, off1, mark1);
      if (KIND == MIXED) off = off1 + block_bytes(mark1);
      const int o_blk = t >= 2 ? off1 : off0;
      const uint32_t mark = t >= 2 ? mark1 : mark0;
#pragma unroll
      for (int j = 0; j < JC; ++j) {
        const Lane& o = vo[0][JC * CC + j];
        read_group<KIND>(st + o_blk, mark, o, o.raw, vw[s][j]);
      }
    }
  }
}

// Oᵀ m-tile i, row g (hi = 0) or g + 8 (hi = 1): the head dim it holds for lane group g.
// Chunk i / TPC, its local index x = i % TPC (+ TPC for row g + 8) picks group j = x / 8 of
// the chunk and channel x % 8 of it.
__device__ __forceinline__ constexpr int o_dim(int i, int hi, int g) {
  return 64 * (JC * (i / TPC) + (i % TPC + hi * TPC) / 8) + 8 * g + (i % TPC + hi * TPC) % 8;
}

// Occupancy is bounded by shared memory (4 warps x STAGES x STAGE_BYTES per CTA); the register
// cap makes registers allow as many CTAs per SM.
constexpr int ctas_per_sm(int stages) {
  if (D == 256) return stages <= 2 ? 3 : stages <= 3 ? 2 : 1;
  return stages <= 3 ? 4 : stages <= 4 ? 3 : stages <= 6 ? 2 : 1;
}

// ---------------------------------------------------------------------------------------------
// One warp's flash-decoding state over its pages, and the steps both kernels run per page
// ---------------------------------------------------------------------------------------------
// PACKED: rows that share their leading pages, packed into one request (attention/packing.py).
// Its G query heads per KV head are R = G / slot_heads slots of slot_heads heads, one row each;
// its pages are the shared ones, then each slot's own ones (each slot's first at a page
// boundary). spans[b] = R (begin, end) token ranges: slot r attends tokens [0, begin_0) (the
// shared pages) and [begin_r, end_r). A column may have no key in a split (its own pages lie in
// another): its state stays (m = -inf, l = 0) and it is left out of every sum.
template <bool COMPRESSED, int NT, bool TMA, bool PACKED>
struct Flash {
  uint32_t qb[NT][2 * NB][2];  // Qᵀ as B fragments: {slots 2t.., 2t+8..} of head 8nt + g, chunk kc
  float acc[NT][TILES][4];   // Oᵀ m-tile i; heads 8nt+2t+(e&1); dim o_dim(i, e >= 2, g)
  float m_run[NT][2], l_run[NT][2];   // heads 8nt + 2t + e (log2 domain; partial sums)
  uint32_t pb[NT][2];        // Pᵀ of the current page as B fragments
  int span_lo[NT][2], span_hi[NT][2], shared_end, slots;
  const int* span;
  int sig, lane_t;           // σ(g): token of A row g (K) for this lane; t
  Lane ko[2], vo[NPOS][VG];
  int krow[2];
  float qk_scale;
  int ctx;

  // row0: the CTA's first query row, head0 of the group's G; n: its heads (cta_heads)
  __device__ __forceinline__ void init(const __nv_bfloat16* q, long long row0, int b, int G,
                                       int n, int head0, const int* spans, int slot_heads,
                                       float scale, int ctx_, int lane) {
    const int g = lane >> 2, t = lane & 3;
    qk_scale = scale;
    ctx = ctx_;
    lane_t = t;
    // PACKED: this request's slot ranges; the slot of each of this lane's columns (heads
    // 8nt + 2t + e; padding heads take the last slot's: their output is never read)
    slots = PACKED ? G / slot_heads : 1;
    span = spans + (long long)b * 2 * slots;
    shared_end = PACKED ? span[0] : 0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = PACKED ? min((head0 + 8 * nt + 2 * t + e) / slot_heads, slots - 1) : 0;
        span_lo[nt][e] = PACKED ? span[2 * r] : 0;
        span_hi[nt][e] = PACKED ? span[2 * r + 1] : 0;
      }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int head = 8 * nt + g;
#pragma unroll
      for (int p = 0; p < NB; ++p) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (head < n) v = *reinterpret_cast<const uint4*>(q + (row0 + head) * D + 32 * p + 8 * t);
        qb[nt][2 * p][0] = v.x;       // chunk 2p:   slots 2t.. = channels +0,+1; 2t+8.. = +2,+3
        qb[nt][2 * p][1] = v.y;
        qb[nt][2 * p + 1][0] = v.z;   // chunk 2p+1: channels +4,+5 and +6,+7
        qb[nt][2 * p + 1][1] = v.w;
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < TILES; ++i) acc[nt][i][0] = acc[nt][i][1] = acc[nt][i][2] = acc[nt][i][3] = 0.f;
      m_run[nt][0] = m_run[nt][1] = -INFINITY;
      l_run[nt][0] = l_run[nt][1] = 0.f;
    }
    // this lane's groups: K rows σ(g), σ(g)+8 at channels 8t.. of each block; V tokens t + 4s
    // (row (t + 4s) % TPB of their block) at channel groups g + 8j
    sig = (g >> 1) + 4 * (g & 1);
    ko[0] = lane_offsets<TMA>(4 * sig + t);
    ko[1] = lane_offsets<TMA>(4 * (sig + 8) + t);
#pragma unroll
    for (int u = 0; u < NPOS; ++u)
#pragma unroll
      for (int j = 0; j < VG; ++j) vo[u][j] = lane_offsets<TMA>((t + 4 * u) % TPB * (D / 8) + 8 * j + g);
    krow[0] = ROW_BYTES * sig + 16 * t;      // open K, TMA layout
    krow[1] = ROW_BYTES * (sig + 8) + 16 * t;
  }

  // ---- Sᵀ = K·Qᵀ over a staged K half (A rows g, g+8 = tokens σ(g), σ(g)+8), then the online
  // softmax over its tokens ----
  __device__ __forceinline__ void keys(const uint8_t* st, Marks marks, bool open_rows, int page) {
    float sc[NT][4];
    const int kind = stage_kind<COMPRESSED, TMA>(marks, open_rows);
    if (kind == ALL_COMPRESSED) qk_page<ALL_COMPRESSED>(st, marks, ko, krow, qb, sc);
    else if (kind == ALL_RAW) qk_page<ALL_RAW>(st, marks, ko, krow, qb, sc);
    else if (kind == OPEN_ROWS) qk_page<OPEN_ROWS>(st, marks, ko, krow, qb, sc);
#ifdef ZF_ESC_KIND
    else if (kind == COMPRESSED_ESC) qk_page<COMPRESSED_ESC>(st, marks, ko, krow, qb, sc);
#endif
    else qk_page<MIXED>(st, marks, ko, krow, qb, sc);
    // sc[nt][e]: token σ(g) (e < 2) or σ(g)+8, head 8nt + 2t + (e & 1).
    const int valid = min(PAGE, ctx - page * PAGE);     // tokens of this page inside the context
    const bool in0 = sig < valid, in1 = sig + 8 < valid;
    const int x0 = page * PAGE + sig, x1 = x0 + 8;      // PACKED: the two tokens' positions
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float alpha[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        bool ok0 = in0, ok1 = in1;
        if (PACKED) {
          ok0 = x0 < shared_end || (span_lo[nt][e] <= x0 && x0 < span_hi[nt][e]);
          ok1 = x1 < shared_end || (span_lo[nt][e] <= x1 && x1 < span_hi[nt][e]);
        }
        float s0 = ok0 ? sc[nt][e] * qk_scale : -INFINITY;
        float s1 = ok1 ? sc[nt][e + 2] * qk_scale : -INFINITY;
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
        const float m_new = fmaxf(m_run[nt][e], mx);
        // PACKED: a column with no key yet keeps m = -inf and takes 0 as its reference
        const float m_ref = PACKED && m_new == -INFINITY ? 0.f : m_new;
        alpha[e] = exp2f(m_run[nt][e] - m_ref);    // 0 on the first page (m_run = -inf)
        m_run[nt][e] = m_new;
        sc[nt][e] = exp2f(s0 - m_ref);
        sc[nt][e + 2] = exp2f(s1 - m_ref);
        l_run[nt][e] = l_run[nt][e] * alpha[e] + (sc[nt][e] + sc[nt][e + 2]);
      }
      // Pᵀ 8×8 tiles (rows tokens σ(0..7) / σ(0..7)+8, columns heads) -> B fragments
      pb[nt][0] = transpose8x8(pack_bf16(sc[nt][0], sc[nt][1]));   // k slots 2t, 2t+1
      pb[nt][1] = transpose8x8(pack_bf16(sc[nt][2], sc[nt][3]));   // k slots 2t+8, 2t+9
      if (__any_sync(FULL, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
          acc[nt][i][0] *= alpha[0]; acc[nt][i][1] *= alpha[1];
          acc[nt][i][2] *= alpha[0]; acc[nt][i][3] *= alpha[1];
        }
      }
    }
  }

  // ---- Oᵀ += Vᵀ·Pᵀ over a staged V half, in CHUNKS gathers of m-tiles; this lane reads
  // tokens t + 4s (k slots 2t, 2t+1, 2t+8, 2t+9 = s 0..3) ----
  __device__ __forceinline__ void values(const uint8_t* st, Marks marks, int page) {
    const int kind = stage_kind<COMPRESSED, false>(marks, false);   // V: never token rows
#pragma unroll
    for (int cc = 0; cc < CHUNKS; ++cc) values_chunk(cc, kind, st, marks, page);
  }

  __device__ __forceinline__ void values_chunk(int cc, int kind, const uint8_t* st, Marks marks,
                                               int page) {
    static_assert(CHUNKS <= 2, "one gather per chunk below");
    const int t = lane_t;
    uint32_t vw[4][JC][4];   // [slot s][j]: channels 64(JC·cc + j) + 8g + 2·pair, +1 of token t + 4s
    if (cc == 0) gather_chunk<0>(kind, st, marks, vw);
    else gather_chunk<CHUNKS - 1>(kind, st, marks, vw);
    int valid = min(PAGE, ctx - page * PAGE);
    if (PACKED) {   // the tokens some slot attends: a prefix of the page (ranges begin aligned)
      const int base = page * PAGE;
      valid = base < shared_end ? min(PAGE, shared_end - base) : 0;
      for (int r = 0; r < slots; ++r)
        if (span[2 * r] <= base && base < span[2 * r + 1]) valid = max(valid, min(PAGE, span[2 * r + 1] - base));
    }
    if (valid < PAGE) {                              // the request's last, partial page
#pragma unroll
      for (int s = 0; s < 4; ++s)
        if (t + 4 * s >= valid)                      // past the end of the context
#pragma unroll
          for (int j = 0; j < JC; ++j) vw[s][j][0] = vw[s][j][1] = vw[s][j][2] = vw[s][j][3] = 0u;
    }
#pragma unroll
    for (int x = 0; x < TPC; ++x) {                  // m-tile cc·TPC + x: dims o_dim(., 0/1, g)
      const int j0 = x / 8, j1 = (x + TPC) / 8, pair0 = x % 8 / 2, pair1 = (x + TPC) % 8 / 2;
      const uint32_t sel = (x & 1) ? 0x7632 : 0x5410;   // odd or even channel of the pair
      const uint32_t a0 = __byte_perm(vw[0][j0][pair0], vw[1][j0][pair0], sel);  // tokens t, t+4
      const uint32_t a1 = __byte_perm(vw[0][j1][pair1], vw[1][j1][pair1], sel);
      const uint32_t a2 = __byte_perm(vw[2][j0][pair0], vw[3][j0][pair0], sel);  // t+8, t+12
      const uint32_t a3 = __byte_perm(vw[2][j1][pair1], vw[3][j1][pair1], sel);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mma_bf16(acc[nt][cc * TPC + x], a0, a1, a2, a3, pb[nt][0], pb[nt][1]);
    }
  }

  template <int CC>
  __device__ __forceinline__ void gather_chunk(int kind, const uint8_t* st, Marks marks,
                                               uint32_t (&vw)[4][JC][4]) {
    if (kind == ALL_COMPRESSED) gather_v<ALL_COMPRESSED, CC>(st, marks, vo, lane_t, vw);
    else if (kind == ALL_RAW) gather_v<ALL_RAW, CC>(st, marks, vo, lane_t, vw);
#ifdef ZF_ESC_KIND
    else if (kind == COMPRESSED_ESC) gather_v<COMPRESSED_ESC, CC>(st, marks, vo, lane_t, vw);
#endif
    else gather_v<MIXED, CC>(st, marks, vo, lane_t, vw);
  }
};

// ---- combine the four computing warps (all threads of the CTA call this; the stages are
// free once every warp got here), then write the output or this split's partial result ----
template <int NT, bool PACKED, int NTHREADS, typename F>
__device__ __forceinline__ void combine(F& f, bool computes, uint8_t* smem, int warp, int lane,
                                        long long row0, int G, int s, int num_splits,
                                        __nv_bfloat16* out, float* part_o, float* part_lse) {
  const int g = lane >> 2, t = lane & 3;
  if (computes) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        f.l_run[nt][e] += __shfl_xor_sync(FULL, f.l_run[nt][e], 4);
        f.l_run[nt][e] += __shfl_xor_sync(FULL, f.l_run[nt][e], 8);
        f.l_run[nt][e] += __shfl_xor_sync(FULL, f.l_run[nt][e], 16);
      }
  }
  __syncthreads();                                  // all stages are free now
  constexpr int ROWS = 8 * NT;
  constexpr int SD = D + 1;                         // padded row: 2-way instead of 8-way stores
  float* so = reinterpret_cast<float*>(smem);       // [WARPS][ROWS heads][SD]
  float* sm = so + WARPS * ROWS * SD;               // [WARPS][ROWS]
  float* sl = sm + WARPS * ROWS;                    // [WARPS][ROWS]
  if (computes) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int head = 8 * nt + 2 * t + (e & 1);
          const int dim = o_dim(i, e >= 2, g);
          so[(warp * ROWS + head) * SD + dim] = f.acc[nt][i][e];
        }
      if (g == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          sm[warp * ROWS + 8 * nt + 2 * t + e] = f.m_run[nt][e];
          sl[warp * ROWS + 8 * nt + 2 * t + e] = f.l_run[nt][e];
        }
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += NTHREADS) {
    const int r = i / D, dim = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm[w * ROWS + r]);
    if (PACKED && M == -INFINITY) M = 0.f;          // no key of this column here: L = O = 0
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float fw = exp2f(sm[w * ROWS + r] - M);   // 0 for a warp that had no pages
      L += sl[w * ROWS + r] * fw;
      O += so[(w * ROWS + r) * SD + dim] * fw;
    }
    const float o = PACKED && L == 0.f ? 0.f : O / L;
    if (num_splits == 1) {
      out[(row0 + r) * D + dim] = __float2bfloat16_rn(o);
    } else {
      part_o[((row0 + r) * num_splits + s) * D + dim] = o;
      if (dim == 0) part_lse[(row0 + r) * num_splits + s] = M + log2f(L);   // -inf where L = 0
    }
  }
}

// Pages per split of a request of n_pages pages: pages_per_split if positive, else the request's
// pages over the num_splits splits, rounded up to whole tiles of -pages_per_split pages. The
// attention kernels and the merge ask the same question, so they agree on every split's pages.
__device__ __forceinline__ int split_size(int n_pages, int pages_per_split, int num_splits) {
  if (pages_per_split > 0) return pages_per_split;
  const int tile = -pages_per_split;
  const int even = (n_pages + num_splits - 1) / num_splits;
  return max(tile, (even + tile - 1) / tile * tile);
}

// A split of a short request that holds no page: its partial result is empty.
__device__ __forceinline__ void empty_split(long long row0, int G, int s, int num_splits,
                                            float* part_o, float* part_lse) {
  if (num_splits > 1) {
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
      part_o[((row0 + i / D) * num_splits + s) * D + i % D] = 0.f;
    for (int i = threadIdx.x; i < G; i += blockDim.x)
      part_lse[(row0 + i) * num_splits + s] = -INFINITY;
  }
}

// The CTA's KV head h and its query heads head0 .. head0 + n - 1 of the group's G: all of them,
// or at D = 256 eight (one n-tile: sixteen heads' Oᵀ accumulators would spill), the group's
// ceil(G / 8) passes being CTAs side by side in grid.y.
constexpr int HEADS_PER_CTA = D == 256 ? 8 : 16;
struct Heads {
  int h, head0, n;
};
__device__ __forceinline__ Heads cta_heads(int G) {
  if constexpr (HEADS_PER_CTA >= 16) {
    return Heads{(int)blockIdx.y, 0, G};
  } else {
    const int passes = (G + HEADS_PER_CTA - 1) / HEADS_PER_CTA, pass = blockIdx.y % passes;
    return Heads{(int)blockIdx.y / passes, HEADS_PER_CTA * pass, min(HEADS_PER_CTA, G - HEADS_PER_CTA * pass)};
  }
}

// Both attention kernels take these (the launch: `Args`, below).
#define KERNEL_PARAMS                                                                         \
  const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ arena,                     \
      const long long* __restrict__ page_loc, const int* __restrict__ block_table,            \
      const int* __restrict__ context_lens, __nv_bfloat16* __restrict__ out,                  \
      float* __restrict__ part_o, float* __restrict__ part_lse, float qk_scale, int bt_stride, \
      int pages_per_split, int num_splits, int H, int G, const int* __restrict__ spans,       \
      int slot_heads

// ---------------------------------------------------------------------------------------------
// The attention kernel, each warp copying its own pages
// ---------------------------------------------------------------------------------------------
template <bool COMPRESSED, int NT, int STAGES, bool TMA, bool PACKED>
__global__ void __launch_bounds__(THREADS, ctas_per_sm(STAGES))
attention_kernel(KERNEL_PARAMS) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ Info info_of[WARPS][STAGES];
  __shared__ uint64_t bars[WARPS][STAGES];            // TMA completion, one per stage

  const int s = blockIdx.x, b = blockIdx.z;
  const Heads hs = cta_heads(G);
  const int h = hs.h;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const int ctx = context_lens[b];
  const int n_pages = (ctx + PAGE - 1) / PAGE;
  const int pps = split_size(n_pages, pages_per_split, num_splits);
  const int p_begin = s * pps;
  const int p_end = min(n_pages, p_begin + pps);
  const long long row0 = (long long)b * H * G + (long long)h * G + hs.head0;   // first query row
  if (p_begin >= p_end) return empty_split(row0, hs.n, s, num_splits, part_o, part_lse);

  Flash<COMPRESSED, NT, TMA, PACKED> f;
  f.init(q, row0, b, G, hs.n, hs.head0, spans, slot_heads, qk_scale, ctx, lane);

  uint8_t* stages = smem + (size_t)warp * STAGES * STAGE_BYTES;
  if (TMA) {
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < STAGES; ++i) mbar_init(&bars[warp][i]);
      mbar_fence_init();
    }
    __syncwarp();
  }
  uint32_t phases = 0;                    // TMA: parity to wait for, one bit per stage
  const int my_pages = (p_end - p_begin - warp + WARPS - 1) / WARPS;   // may be <= 0
  const int halves = 2 * max(my_pages, 0);
  const int* bt = block_table + (long long)b * bt_stride;

  // Metadata of 32 of this warp's pages at a time: lane j holds page 32·batch + j. `cur` serves
  // the copies being issued, `nxt` is the next batch, loaded one batch ahead.
  long long loc_cur = 0, loc_nxt = 0;
  Rec rec_cur{}, rec_nxt{};
  auto load_meta = [&](int batch, long long& loc, Rec& rec) {
    int j = 32 * batch + lane;
    if (j < my_pages) page_meta<COMPRESSED>(arena, page_loc, bt[p_begin + warp + WARPS * j], h, loc, rec);
  };
  if (my_pages > 0) { load_meta(0, loc_cur, rec_cur); load_meta(1, loc_nxt, rec_nxt); }

  int issue_stage = 0;                    // stage that issue(u) fills: u % STAGES
  auto issue = [&](int u) {               // half u: page u/2, K (u even) or V (u odd)
    const int j = u >> 1, role = u & 1;
    if (role == 0 && (j & 31) == 0 && j > 0) {
      loc_cur = loc_nxt; rec_cur = rec_nxt;
      load_meta((j >> 5) + 1, loc_nxt, rec_nxt);
    }
    const int src = j & 31;
    long long loc = __shfl_sync(FULL, loc_cur, src);
    uint32_t off;
    Marks marks;
    half_rec(rec_cur, role, src, off, marks);
    if (TMA) {
      issue_half_tma<COMPRESSED>(stages + issue_stage * STAGE_BYTES, &bars[warp][issue_stage],
                                 &info_of[warp][issue_stage], arena, loc, off, marks, role, h,
                                 H, lane);
    } else {
      const Marks mk = issue_half<COMPRESSED>(stages + issue_stage * STAGE_BYTES, arena, loc,
                                              off, marks, role, h, H, lane);
      if (lane == 0) info_of[warp][issue_stage] = Info{mk, 0};
    }
    issue_stage = issue_stage + 1 == STAGES ? 0 : issue_stage + 1;
  };

#pragma unroll
  for (int u = 0; u < STAGES - 1; ++u) {
    if (u < halves) issue(u);
    if (!TMA) cp_async_commit();
  }

  int stage = 0;                          // u % STAGES
  for (int u = 0; u < halves; ++u, stage = stage + 1 == STAGES ? 0 : stage + 1) {
    if (u + STAGES - 1 < halves) issue(u + STAGES - 1);
    if (TMA) {
      mbar_wait(&bars[warp][stage], (phases >> stage) & 1);
      phases ^= 1u << stage;
    } else {
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
      __syncwarp();
    }
    const uint8_t* st = stages + stage * STAGE_BYTES;
    const Marks marks = info_of[warp][stage].marks;
    const int page = p_begin + warp + WARPS * (u >> 1);
    if ((u & 1) == 0) f.keys(st, marks, TMA && info_of[warp][stage].open, page);
    else f.values(st, marks, page);
    __syncwarp();     // every lane is done with this stage before it is refilled
  }
  if (!TMA) cp_async_wait<0>();
  combine<NT, PACKED, THREADS>(f, true, smem, warp, lane, row0, hs.n, s, num_splits, out, part_o,
                               part_lse);
}

// ---------------------------------------------------------------------------------------------
// The same attention with a producer warp (warp specialisation; sm_90, bulk copies)
// ---------------------------------------------------------------------------------------------
// Warps 0..3 only compute; warp 4 copies. Page i of the split (i = 0, 1, ...) is computed by
// warp i mod 4, as in attention_kernel (so both kernels sum the same values in the same order:
// the same bits), and staged whole (K half at 0, V half at STAGE_BYTES) in that warp's ring of
// DEPTH page slots: slot (i / 4) mod DEPTH. Each slot has two mbarriers: `full` (the producer arms it
// with the page's byte count; the bulk copies complete it) and `empty` (the computing warp's
// lane 0 arrives when it is done with the slot). The producer works in rounds of 4·DEPTH pages,
// one page a lane, so the metadata loads, byte counts and waits of a round run side by side;
// the computing warps see only a wait and an arrive per page.
constexpr int PRODUCER_THREADS = THREADS + 32;
constexpr int SLOT_BYTES = 2 * STAGE_BYTES;

struct PageInfo {            // what the producer staged in a slot: K and V marks, page is open
  Marks k, v;
  uint32_t open, pad;
};

// Pages in flight per computing warp (a build define, for tuning), and the register cap: at
// D = 256 one page (64 KB a CTA) and 200 registers, two CTAs an SM (three would cap the
// registers below a warp's state).
#ifndef ZF_PRODUCER_DEPTH
#define ZF_PRODUCER_DEPTH (ZF_HEAD_DIM == 256 ? 1 : 2)
#endif
constexpr int PRODUCER_DEPTH = ZF_PRODUCER_DEPTH;
#if ZF_HEAD_DIM == 256
#define ZF_PRODUCER_BOUNDS __maxnreg__(200)
#else
#define ZF_PRODUCER_BOUNDS __launch_bounds__(PRODUCER_THREADS, ctas_per_sm(2 * DEPTH))
#endif

template <bool COMPRESSED, int NT, int DEPTH, bool PACKED>
__global__ void ZF_PRODUCER_BOUNDS
producer_kernel(KERNEL_PARAMS) {
  static_assert(32 % (WARPS * DEPTH) == 0, "a round of pages must divide a metadata batch");
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ PageInfo info_of[WARPS][DEPTH];
  __shared__ uint64_t full[WARPS][DEPTH], empty[WARPS][DEPTH];

  const int s = blockIdx.x, b = blockIdx.z;
  const Heads hs = cta_heads(G);
  const int h = hs.h;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ctx = context_lens[b];
  const int n_pages = (ctx + PAGE - 1) / PAGE;
  const int pps = split_size(n_pages, pages_per_split, num_splits);
  const int p_begin = s * pps;
  const int n = min(n_pages, p_begin + pps) - p_begin;                // pages of this split
  const long long row0 = (long long)b * H * G + (long long)h * G + hs.head0;
  if (n <= 0) return empty_split(row0, hs.n, s, num_splits, part_o, part_lse);

  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < WARPS; ++w)
#pragma unroll
      for (int d = 0; d < DEPTH; ++d) mbar_init(&full[w][d]), mbar_init(&empty[w][d]);
    mbar_fence_init();
  }
  __syncthreads();

  Flash<COMPRESSED, NT, true, PACKED> f;
  if (warp == WARPS) {
    // ---- the producer: round r0 = pages r0 .. r0 + R - 1, lane l < R takes page r0 + l ----
    constexpr int R = WARPS * DEPTH;
    const int* bt = block_table + (long long)b * bt_stride + p_begin;
    long long loc_cur = 0, loc_nxt = 0;       // lane j: page 32·batch + j (cur), next batch (nxt)
    Rec rec_cur{}, rec_nxt{};
    auto load_meta = [&](int batch, long long& loc, Rec& rec) {
      const int j = 32 * batch + lane;
      if (j < n) page_meta<COMPRESSED>(arena, page_loc, bt[j], h, loc, rec);
    };
    load_meta(0, loc_cur, rec_cur);
    load_meta(1, loc_nxt, rec_nxt);
    for (int r0 = 0; r0 < n; r0 += R) {
      if (r0 > 0 && (r0 & 31) == 0) {
        loc_cur = loc_nxt; rec_cur = rec_nxt;
        load_meta((r0 >> 5) + 1, loc_nxt, rec_nxt);
      }
      const int i = r0 + (lane & (R - 1));
      const int src = i & 31;
      const long long loc = __shfl_sync(FULL, loc_cur, src);
      uint32_t koff, voff;
      Marks kmarks, vmarks;
      half_rec(rec_cur, 0, src, koff, kmarks);
      half_rec(rec_cur, 1, src, voff, vmarks);
      if (lane < R && i < n) {
        const int c = i & (WARPS - 1), k = i / WARPS, d = k % DEPTH, use = k / DEPTH;
        if (use > 0) mbar_wait(&empty[c][d], (use - 1) & 1);      // its last page is done
        uint8_t* slot = smem + (size_t)(c * DEPTH + d) * SLOT_BYTES;
        PageInfo& info = info_of[c][d];
        if (COMPRESSED && !(loc & 1)) {
          const uint32_t kb = half_bytes(kmarks), vb = half_bytes(vmarks);
          info.k = kmarks; info.v = vmarks; info.open = 0;
#ifdef ZF_DIAG_COMPUTE_ONLY   // diagnostic (wrong outputs): no bytes move, the slot's stale ones are used
          mbar_expect_tx(&full[c][d], 0);
#else
          mbar_expect_tx(&full[c][d], kb + vb);
          bulk_copy(slot, arena + loc + koff, kb, &full[c][d]);
          bulk_copy(slot + STAGE_BYTES, arena + loc + voff, vb, &full[c][d]);
#endif
        } else {
          // open page [2, 16, H, D]: 16 K rows (token-row layout), then 16 V rows (raw V layout)
          info.k = info.v = ALL_RAW_MARKS; info.open = 1;
          mbar_expect_tx(&full[c][d], SLOT_BYTES);
          const uint8_t* base = arena + (loc & ~1LL) + (long long)h * D * 2;
          for (int row = 0; row < 2 * PAGE; ++row)
            bulk_copy(slot + ROW_BYTES * row, base + (long long)row * H * D * 2, ROW_BYTES, &full[c][d]);
        }
      }
    }
  } else {
    // ---- the computing warps: page warp + 4k, in slot k mod DEPTH ----
    f.init(q, row0, b, G, hs.n, hs.head0, spans, slot_heads, qk_scale, ctx, lane);
    const int my_pages = (n - warp + WARPS - 1) / WARPS;
    for (int k = 0; k < my_pages; ++k) {
      const int d = k % DEPTH;
      mbar_wait(&full[warp][d], (k / DEPTH) & 1);
      const uint8_t* slot = smem + (size_t)(warp * DEPTH + d) * SLOT_BYTES;
      const int page = p_begin + warp + WARPS * k;
#ifndef ZF_DIAG_COPY_ONLY     // diagnostic (wrong outputs): the pages arrive and are released unread
      f.keys(slot, info_of[warp][d].k, info_of[warp][d].open, page);
      f.values(slot + STAGE_BYTES, info_of[warp][d].v, page);
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[warp][d]);
    }
  }
  combine<NT, PACKED, PRODUCER_THREADS>(f, warp < WARPS, smem, warp, lane, row0, hs.n, s,
                                        num_splits, out, part_o, part_lse);
}

// out[row] = Σ_s 2^(lse_s − M)·o_s / Σ_s 2^(lse_s − M) for one (request, query head) per CTA,
// over the n splits that hold pages of the request, in split order. The splits past its last
// page are left out (not added as zeros), and with n = 1 the output is o_0 rounded, exactly what
// a one-split launch writes (bf16(O / L) of the same O and L): the result does not depend on the
// launch's split count (the other requests, the block table's width) when the split size is
// fixed (split_pages in decode_attention.py); balanced splits depend on the count, not the width.
__global__ void merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                             __nv_bfloat16* __restrict__ out, const int* __restrict__ context_lens,
                             int pages_per_split, int num_splits, int Hq) {
  const long long row = blockIdx.x;
  const int dim = threadIdx.x;
  const int n_pages = (context_lens[row / Hq] + PAGE - 1) / PAGE;
  const int pps = split_size(n_pages, pages_per_split, num_splits);
  const int n = min(num_splits, max(1, (n_pages + pps - 1) / pps));
  const float* lse = part_lse + row * num_splits;
  const float* o = part_o + row * num_splits * D + dim;
  if (n == 1) {
    out[row * D + dim] = __float2bfloat16_rn(o[0]);
    return;
  }
  float M = -INFINITY;
  for (int s = 0; s < n; ++s) M = fmaxf(M, lse[s]);
  if (M == -INFINITY) {                 // a packed request's column with no key at all (padding)
    out[row * D + dim] = __float2bfloat16_rn(0.f);
    return;
  }
  float L = 0.f, O = 0.f;
  for (int s = 0; s < n; ++s) {
    const float f = exp2f(lse[s] - M);
    L += f;
    O += f * o[s * D];
  }
  out[row * D + dim] = __float2bfloat16_rn(O / L);
}

// The arguments every launch passes on.
struct Args {
  const void *q, *arena, *page_loc, *block_table, *context_lens;
  void *out, *part_o, *part_lse;
  float qk_scale;
  int bt_stride, pages_per_split, num_splits, B, H, G;
  const void* spans;
  int slot_heads;
  cudaStream_t stream;
};

template <typename Kernel>
cudaError_t launch(Kernel kernel, int threads, int stage_smem, int NT, const Args& a) {
  const int combine_smem = WARPS * 8 * NT * (D + 3) * 4;
  const int smem = stage_smem > combine_smem ? stage_smem : combine_smem;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  dim3 grid(a.num_splits, a.H * ((a.G + HEADS_PER_CTA - 1) / HEADS_PER_CTA), a.B);
  kernel<<<grid, threads, smem, a.stream>>>(
      static_cast<const __nv_bfloat16*>(a.q), static_cast<const uint8_t*>(a.arena),
      static_cast<const long long*>(a.page_loc), static_cast<const int*>(a.block_table),
      static_cast<const int*>(a.context_lens), static_cast<__nv_bfloat16*>(a.out),
      static_cast<float*>(a.part_o), static_cast<float*>(a.part_lse), a.qk_scale, a.bt_stride,
      a.pages_per_split, a.num_splits, a.H, a.G, static_cast<const int*>(a.spans), a.slot_heads);
  e = cudaGetLastError();
  if (e != cudaSuccess || a.num_splits == 1) return e;
  merge_kernel<<<a.B * a.H * a.G, D, 0, a.stream>>>(
      static_cast<const float*>(a.part_o), static_cast<const float*>(a.part_lse),
      static_cast<__nv_bfloat16*>(a.out), static_cast<const int*>(a.context_lens),
      a.pages_per_split, a.num_splits, a.H * a.G);
  return cudaGetLastError();
}

// copy: 0 = each warp with cp.async, 1 = each warp with bulk copies, 2 = a producer warp with
// bulk copies (PRODUCER_DEPTH pages a computing warp; `stages` is ignored).
template <bool COMPRESSED, int NT>
cudaError_t launch_variant(int copy, int stages, const Args& a) {
#define ZF_WARPS(S, T, P) \
  return launch(attention_kernel<COMPRESSED, NT, S, T, P>, THREADS, WARPS * S * STAGE_BYTES, NT, a)
#define ZF_PRODUCER(P) \
  return launch(producer_kernel<COMPRESSED, NT, PRODUCER_DEPTH, P>, PRODUCER_THREADS,      \
                WARPS * PRODUCER_DEPTH * SLOT_BYTES, NT, a)
  const bool packed = a.spans != nullptr;
  if (copy == 2) {
    if (packed) ZF_PRODUCER(true);
    ZF_PRODUCER(false);
  }
  if (copy == 1) {
    if (packed) { if (stages == 3) ZF_WARPS(3, true, true); ZF_WARPS(4, true, true); }
    switch (stages) { case 3: ZF_WARPS(3, true, false); case 6: ZF_WARPS(6, true, false);
                      default: ZF_WARPS(4, true, false); }
  }
  if (packed) { if (stages == 3) ZF_WARPS(3, false, true); ZF_WARPS(4, false, true); }
  switch (stages) { case 3: ZF_WARPS(3, false, false); case 6: ZF_WARPS(6, false, false);
                    default: ZF_WARPS(4, false, false); }
#undef ZF_WARPS
#undef ZF_PRODUCER
}

}  // namespace

// C entry point for ctypes (zipfusion/kernels/cuda_attention.py). Returns a cudaError_t.
// stages: copy depth in half pages (3, 4 or 6; others -> 4; packed: 3 or 4; producer: 4);
// copy: 0 = cp.async, 1 = bulk copies (sm_90), 2 = bulk copies by a producer warp (sm_90).
// spans: null, or the packed requests' slot ranges (int32 [B, G / slot_heads, 2], see Flash).
extern "C" int zf_decode_attention(int head_dim, int compressed, int stages, int copy, const void* q,
                                   const void* arena, const void* page_loc,
                                   const void* block_table, const void* context_lens, void* out,
                                   void* part_o, void* part_lse, float qk_scale, int bt_stride,
                                   int pages_per_split, int num_splits, int B, int H, int G,
                                   const void* spans, int slot_heads, void* stream) {
  if (head_dim != D || G < 1 || G > 16 || copy < 0 || copy > 2) return (int)cudaErrorInvalidValue;
  if (spans && (slot_heads < 1 || G % slot_heads != 0)) return (int)cudaErrorInvalidValue;
  const Args a{q, arena, page_loc, block_table, context_lens, out, part_o, part_lse, qk_scale,
               bt_stride, pages_per_split, num_splits, B, H, G, spans, slot_heads,
               static_cast<cudaStream_t>(stream)};
  if constexpr (HEADS_PER_CTA == 8) {
    return (int)(compressed ? launch_variant<true, 1>(copy, stages, a)
                            : launch_variant<false, 1>(copy, stages, a));
  } else {
    if (compressed) return (int)(G <= 8 ? launch_variant<true, 1>(copy, stages, a)
                                        : launch_variant<true, 2>(copy, stages, a));
    return (int)(G <= 8 ? launch_variant<false, 1>(copy, stages, a)
                        : launch_variant<false, 2>(copy, stages, a));
  }
}

extern "C" const char* zf_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
