// The int8/int4 KV cache of the native kernels: its layouts, the code offsets of a dim, and the scale
// groups. Shared by the quantizing store (kv_quant_store.cpp) and attention (paged_attention_quant.cpp), both
// written over vec.h and vec_int.h (AVX-512, AVX2 or generic; fp32 <-> fp16: vec.h's fp16 / fp32).
// Needs HEAD_DIM and GROUP (int4 values per scale); kernels/native/build.py hashes this header into the key.
//
// Layouts (block, KV head major, as the bf16 kernel's), codes and fp16 scales in separate tensors:
//   int8 K [blocks, kv_heads, D/4, block_size, 4] u8: dims 4o..4o+3 of one key in a dword (code + 128)
//        V [blocks, kv_heads, block_size/2, D, 2] s8: dim d of the keys (2j, 2j+1) side by side
//   int4 K [blocks, kv_heads, D/8, block_size, 4] u8: byte b of octet o holds dim 8o+b (low nibble) and
//        8o+4+b (high), each code + 8
//        V [blocks, kv_heads, block_size/4, D, 2] u8: byte k of (quad m, dim d) holds dim d of key 4m+k
//        (low nibble) and of key 4m+2+k (high), each code + 8
//   scales K and V [blocks, kv_heads, groups, block_size] fp16; int8: 1 group, int4: D / GROUP
#pragma once

#include "attention_common.h"
#include "vec_int.h"

#ifndef GROUP
#error "compile with -DGROUP=<int4 values per scale>"
#endif

namespace {

constexpr int GROUP4 = GROUP;
static_assert(GROUP4 % 16 == 0 && D % GROUP4 == 0, "int4 groups must be whole 16-dim vectors of head_dim");

template <int BITS>
constexpr int scale_groups() { return BITS == 8 ? 1 : D / GROUP4; }  // scales per token and KV head

// Byte offsets of dim d of the key at offset j of a block, in the K and V code layouts; int4 also gives
// the nibble (0 low, 4 high).
template <int BITS>
inline int64_t k_byte(int bs, int j, int d, int* shift) {
  if constexpr (BITS == 8) {
    *shift = 0;
    return ((int64_t)(d / 4) * bs + j) * 4 + d % 4;
  } else {
    *shift = (d % 8) / 4 * 4;
    return ((int64_t)(d / 8) * bs + j) * 4 + d % 4;
  }
}
template <int BITS>
inline int64_t v_byte(int j, int d, int* shift) {
  if constexpr (BITS == 8) {
    *shift = 0;
    return ((int64_t)(j / 2) * D + d) * 2 + j % 2;
  } else {
    *shift = (j % 4) / 2 * 4;
    return ((int64_t)(j / 4) * D + d) * 2 + j % 2;
  }
}

}  // namespace
