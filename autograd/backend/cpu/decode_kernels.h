#pragma once
// Kernels only the CPU backend has, for decode: products against weights packed for a few
// rows (packed.cpp) and the attention of one query over a KV cache (attention.cpp,
// attend_row.cpp). The fused decode step and the CPU attention call them directly; they are
// not part of the contract both backends implement (backend/kernels.h).
#include <bit>
#include <cstdint>
#include <type_traits>

#include "autograd/backend/kernel_types.h"

namespace kvlab::cpu {

// ---- packed weights (packed.cpp) ----
// Products of a few rows against a weight packed for them (decode). Row-major w (N, K) is
// stored as blocks of 8 rows, each block as its column chunks of 8 rows x 16 columns (zero
// past row N and column K), so that a product reads one sequential stream instead of eight
// rows at once, and reads it once for all the rows. Each y[m, n] is summed in the order of
// gemm's one-row path, so the two give the same bits, and a row's result does not depend on
// the others. Every form but f32 is widened to f32 in registers as it is read, exactly:
//  - bf16: the values rounded to bf16 (nearest even), two chunks to a 64-byte line (the low
//    and high halves of its words);
//  - q8_0 and q4_0: ggml's blocks of 32 columns (platform/ggml_blocks.h), each unit of 8 rows
//    and 32 columns its 8 scales (as f32) then the rows' codes (q4_0 in the file's nibble
//    order), so K must be whole blocks. A value is code * scale, computed exactly in f32.
// On a weight whose values the form holds exactly (all bf16, or exact_q8_0 / exact_q4_0),
// every form gives the same bits as the f32 one: only the bytes read differ. The forms are the
// formats that hold weights (WeightDtype, platform/formats.h).
//
// Bytes of the form of a (N, K) weight: 0 where there is no kernel (neither AVX-512 nor AVX2
// with FMA: callers then keep to gemm) or the form cannot hold it (q8_0 and q4_0 with K not
// a multiple of 32).
int64_t packed_weight_bytes(WeightDtype form, int64_t N, int64_t K);
// packed (packed_weight_bytes(form, N, K) bytes, 64-byte aligned for speed) = w (N, K),
// contiguous, in the form (rounded or quantised as the form defines).
void pack_weight(WeightDtype form, void* packed, const float* w, int64_t N, int64_t K);
// y[m, n] = dot(w[n, :], a[m, :]) + beta * y[m, n] for m < M and n in [n0, n1): y (M, ldy),
// a (M, K at stride lda), w packed by pack_weight in that form.
void gemm_packed(WeightDtype form, float* y, int64_t ldy, const float* a, int64_t lda,
                 const void* packed, int64_t M, int64_t K, int64_t n0, int64_t n1, float beta);

// llama.cpp's trade (packed_int8.cpp): gemm_packed's y for a q8_0 or q4_0 form with each row of
// a first rounded to q8_0 blocks (quantise_q8_activations), each block's product then an exact
// integer dot product of codes, scaled by the two blocks' scales and summed in f32 (per vector
// lane, then across lanes). Faster, and not exact: a row's results still depend on that row
// alone, so every batch gives it the same bits.
void gemm_packed_int8(WeightDtype form, float* y, int64_t ldy, const float* a, int64_t lda,
                      const void* packed, int64_t M, int64_t K, int64_t n0, int64_t n1,
                      float beta);
// x (K, whole blocks of 32) as llama.cpp's x86 path rounds a product's input to q8_0: per block
// d = max|x| / 127, codes round(x * 127 / max|x|) (ties to even; 0 for a block of zeros) and
// the scale d rounded to f16, given as f32.
void quantise_q8_activations(const float* x, int64_t K, int8_t* codes, float* scales);

// ---- decode attention (attention.cpp, attend_row.cpp) ----
// The rows of one KV head of one batch row of a paged cache (KVBlocks): row j lies at
// base + table[j / block_len] * block_stride + (j % block_len) * pos_stride, base being the
// head's offset within a block; block_len = 2^shift.
template <class KV>
struct BlockRows {
  const KV* base;
  const int32_t* table;  // the batch row's block ids
  int64_t shift, block_stride, pos_stride;
  int64_t block_len() const { return int64_t{1} << shift; }
  const KV* operator()(int64_t j) const {
    return base + table[j >> shift] * block_stride + (j & (block_len() - 1)) * pos_stride;
  }
  // Rows j .. j + run() - 1 from a j that is a multiple of run() lie at stride() apart.
  int64_t run() const { return block_len(); }
  // Batch row b's rows of one KV head of a paged cache (kb), the head's rows in a block at
  // base, pos_stride apart.
  static BlockRows of(const KV* base, const KVBlocks& kb, int64_t b, int64_t pos_stride) {
    return {base, kb.table + b * kb.width, std::countr_zero(static_cast<uint64_t>(kb.block_len)),
            kb.block_stride, pos_stride};
  }
  int64_t stride() const { return pos_stride; }
};

// How a quantised cache's rows read (platform/kv_rows.h): the dtype (fp8, int8 or int4) and,
// for fp8, the scales of the KV head's keys and values.
struct KVQuant {
  DType dtype;
  float k_scale = 0, v_scale = 0;
};

// attend_one_query's row kernel (f32, AVX-512 or AVX2, HS up to 128 or 64): false, having
// written nothing, where there is none for this HS. The uint8_t forms read quantised rows
// (row strides in bytes), each dequantised in registers as it is read, never copied; they need
// HS a whole number of vectors (and an int4 group too).
bool attend_one_query_kernel(float* out, const float* q, const float* k, int64_t kst,
                             const float* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p);
// The same over a paged cache's rows: the same products in the same order, row by row through
// the block table, so it gives the bits of the contiguous one over the same keys and values.
bool attend_one_query_kernel(float* out, const float* q, const BlockRows<float>& k,
                             const BlockRows<float>& v, int64_t n, int64_t HS, float scale,
                             float* p);
bool attend_one_query_kernel(float* out, const float* q, const uint8_t* k, int64_t kst,
                             const uint8_t* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p, const KVQuant& fmt);
bool attend_one_query_kernel(float* out, const float* q, const BlockRows<uint8_t>& k,
                             const BlockRows<uint8_t>& v, int64_t n, int64_t HS, float scale,
                             float* p, const KVQuant& fmt);
// Decode attention of one query over n >= 1 cached keys: out (HS) = softmax(scale q k^T) v,
// q (HS), k and v (n, HS) at row strides kst and vst, p (n) work. Single-threaded; it opens no
// parallel region and allocates nothing. In f32 the row kernel where there is one, otherwise
// the probabilities and products of the general attention.
template <class T>
void attend_one_query(T* out, const T* q, const T* k, int64_t kst, const T* v, int64_t vst,
                      int64_t n, int64_t HS, T scale, T* p);
// The same over a paged cache's rows. Where there is no row kernel, the general attention's
// products run block by block (attention.cpp's attend_blocks).
template <class T>
void attend_one_query(T* out, const T* q, const BlockRows<T>& k, const BlockRows<T>& v, int64_t n,
                      int64_t HS, T scale, T* p);
// MLA's decode attention of G query heads of one batch row over its n latent rows of KW f32
// values (one KV head for all, each row serving as key and value): y (G, KW a head, its first
// R written) = softmax(scale q k^T) times the rows' first R values, q (G, KW) in latent form.
// As two products of the heads with the rows (gemm's few-row kernels, in tiles of up to 4
// heads), which read each row once for a tile's heads, where the row kernel reads it once per
// head and sums all KW columns (docs/bench-log/mla.md). Rows contiguous at row stride st, or
// through a paged cache's block table; p holds G * n.
void attend_latent(float* y, const float* q, int64_t G, const float* rows, int64_t st, int64_t n,
                   int64_t KW, int64_t R, float scale, float* p);
void attend_latent(float* y, const float* q, int64_t G, const BlockRows<float>& rows, int64_t n,
                   int64_t KW, int64_t R, float scale, float* p);
// The decode attention (T = 1, no dropout) of part of a KV group: attention_forward uses it
// at T = 1, as the fused decode step does, for every group size. Each KV group g of
// row b is cut into `parts` tasks of consecutive query heads: task = (b * NKV + g) * parts + part,
// of B * NKV * parts. It opens no parallel region, so a caller that already runs one (the fused
// decode step) can split the tasks among its threads (parts > 1 when there are fewer groups
// than threads).
// `work` holds attention_decode_work(s) elements, s.S bounding every row's length:
// the task allocates nothing, so it cannot throw. Over a paged cache (s.kv_blocks) f32 keys and
// values are read through the block table; bf16 ones are widened block by block into `work`,
// where the contiguous cache's are widened too, and read from there. Quantised ones (KV =
// uint8_t, s.kv_dtype fp8, int8 or int4) are read in place by the row kernel, dequantised in
// registers; where it has no form for HS they are widened as bf16 ones are.
template <class T, class KV = T>
void attention_decode_task(T* out, HeadView out_v, const T* q, HeadView q_v, const KV* k,
                           HeadView k_v, const KV* v, HeadView v_v, const AttentionShape& s,
                           int64_t task, int64_t parts, T* work);
// Its work memory: one query's probabilities and, from a bf16 or quantised cache, the group's
// K and V widened.
template <class T, class KV = T>
int64_t attention_decode_work(const AttentionShape& s) {
  return (1 + (std::is_same_v<KV, T> ? 0 : 2 * s.HS)) * s.S;
}

}  // namespace kvlab::cpu
