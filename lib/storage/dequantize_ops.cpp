#include "storage/dequantize_ops.hpp"

#include <ATen/TensorOperators.h>
#include <ATen/ops/bitwise_and.h>
#include <ATen/ops/bitwise_left_shift.h>
#include <ATen/ops/bitwise_or.h>
#include <ATen/ops/bitwise_right_shift.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <string>

#include "util/error.hpp"

namespace vramd::storage {
namespace {

using at::Tensor;

// Each function unpacks `b` ([n, bytes per block], uint8) into [n, 32 or 256] float32, with
// the fields of ggml-common.h's layouts (storage/dequantize.cpp has the same, one block at a
// time). Every product and sum is its own op: two roundings, never a fused multiply-add.

// A float16 field `offset` bytes into each block, as float32 [n, 1].
Tensor half_at(const Tensor& b, int64_t offset) { return b.narrow(1, offset, 2).contiguous().view(at::kHalf).to(at::kFloat); }

// Small constants (shifts, bit numbers) on the blocks' device, shaped to broadcast.
Tensor constant(const Tensor& like, std::vector<int64_t> values, c10::IntArrayRef shape) {
  return at::tensor(values).to(like.device(), at::kByte).view(shape);
}

Tensor shr(const Tensor& a, const Tensor& b) { return at::bitwise_right_shift(a, b); }
Tensor shr(const Tensor& a, int64_t bits) { return at::bitwise_right_shift(a, bits); }
Tensor shl(const Tensor& a, int64_t bits) { return at::bitwise_left_shift(a, bits); }
Tensor low_bits(const Tensor& a, int64_t mask) { return at::bitwise_and(a, mask); }

// The 32 quants of a 32-element block's 16 bytes: low nibbles are elements 0-15, high 16-31.
Tensor nibbles(const Tensor& qs) { return at::cat({low_bits(qs, 15), shr(qs, 4)}, 1); }

// Q5's fifth bits: bit e of the 32-bit little-endian qh is element e's, shifted to bit 4.
Tensor fifth_bits(const Tensor& qh) {
  std::vector<int64_t> byte(32), bit(32);
  for (int e = 0; e < 32; ++e) byte[e] = e / 8, bit[e] = e % 8;
  const Tensor index = at::tensor(byte).to(qh.device());
  return shl(low_bits(shr(qh.index_select(1, index), constant(qh, bit, {1, 32})), 1), 4);
}

Tensor q4_0(const Tensor& b) { return (nibbles(b.narrow(1, 2, 16)).to(at::kFloat) - 8) * half_at(b, 0); }

Tensor q4_1(const Tensor& b) { return nibbles(b.narrow(1, 4, 16)).to(at::kFloat) * half_at(b, 0) + half_at(b, 2); }

Tensor q5_0(const Tensor& b) {
  const Tensor q = at::bitwise_or(nibbles(b.narrow(1, 6, 16)), fifth_bits(b.narrow(1, 2, 4)));
  return (q.to(at::kFloat) - 16) * half_at(b, 0);
}

Tensor q5_1(const Tensor& b) {
  const Tensor q = at::bitwise_or(nibbles(b.narrow(1, 8, 16)), fifth_bits(b.narrow(1, 4, 4)));
  return q.to(at::kFloat) * half_at(b, 0) + half_at(b, 2);
}

Tensor q8_0(const Tensor& b) { return b.narrow(1, 2, 32).view(at::kChar).to(at::kFloat) * half_at(b, 0); }

// The K types' 2-bit fields: byte l's bits 2s, 2s+1 are element 32s + l of its 32-byte half,
// giving [n, halves, 4, 32].
Tensor crumbs(const Tensor& qs, int64_t halves) {
  const int64_t n = qs.size(0);
  return low_bits(shr(qs.reshape({n, halves, 1, 32}), constant(qs, {0, 2, 4, 6}, {1, 1, 4, 1})), 3);
}

Tensor q2_k(const Tensor& b) {  // scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin
  const int64_t n = b.size(0);
  const Tensor scales = b.narrow(1, 0, 16);
  const Tensor dl = half_at(b, 80) * low_bits(scales, 15).to(at::kFloat);
  const Tensor ml = half_at(b, 82) * shr(scales, 4).to(at::kFloat);
  const Tensor q = crumbs(b.narrow(1, 16, 64), 2).reshape({n, 16, 16}).to(at::kFloat);  // 16 groups of 16
  return (dl.view({n, 16, 1}) * q - ml.view({n, 16, 1})).reshape({n, 256});
}

Tensor q3_k(const Tensor& b) {  // hmask[32], qs[64], scales[12] (sixteen 6-bit), d
  const int64_t n = b.size(0);
  // Scale i: low 4 bits from byte i % 8 (shifted by 4 for i >= 8), high 2 from byte 8 + i % 4.
  const Tensor packed = b.narrow(1, 96, 12);
  const Tensor low = low_bits(shr(packed.narrow(1, 0, 8).reshape({n, 1, 8}), constant(b, {0, 4}, {1, 2, 1})), 15);
  const Tensor high = low_bits(shr(packed.narrow(1, 8, 4).reshape({n, 1, 4}), constant(b, {0, 2, 4, 6}, {1, 4, 1})), 3);
  const Tensor scales = at::bitwise_or(low.reshape({n, 16}), shl(high.reshape({n, 16}), 4)).to(at::kFloat) - 32;
  const Tensor dl = half_at(b, 108) * scales;
  // The high bit of element 32s + l of half h is bit 4h + s of hmask[l]; without it, minus 4.
  std::vector<int64_t> bits(8);
  for (int i = 0; i < 8; ++i) bits[i] = i;
  const Tensor high_bit = low_bits(shr(b.narrow(1, 0, 32).reshape({n, 1, 1, 32}), constant(b, bits, {1, 2, 4, 1})), 1);
  const Tensor q = at::bitwise_or(crumbs(b.narrow(1, 32, 64), 2), shl(high_bit, 2)).reshape({n, 16, 16});
  return (dl.view({n, 16, 1}) * (q.to(at::kFloat) - 4)).reshape({n, 256});
}

// Q4_K and Q5_K: eight 6-bit scales and eight 6-bit mins in 12 bytes, then 4-bit quants (and
// for Q5_K, 32 bytes of fifth bits first).
Tensor q45_k(const Tensor& b, bool fifth) {
  const int64_t n = b.size(0);
  const Tensor packed = b.narrow(1, 4, 12);
  const Tensor first = packed.narrow(1, 0, 4), second = packed.narrow(1, 4, 4), third = packed.narrow(1, 8, 4);
  const Tensor scale = at::cat({low_bits(first, 63), at::bitwise_or(low_bits(third, 15), shl(shr(first, 6), 4))}, 1);
  const Tensor min = at::cat({low_bits(second, 63), at::bitwise_or(shr(third, 4), shl(shr(second, 6), 4))}, 1);
  const Tensor dl = half_at(b, 0) * scale.to(at::kFloat), ml = half_at(b, 2) * min.to(at::kFloat);
  // Element 64c + 32k + l: nibble k of qs[32c + l]; its fifth bit is bit 2c + k of qh[l].
  const Tensor qs = b.narrow(1, fifth ? 48 : 16, 128).reshape({n, 4, 1, 32});
  Tensor q = low_bits(shr(qs, constant(b, {0, 4}, {1, 1, 2, 1})), 15);
  if (fifth) {
    std::vector<int64_t> bits(8);
    for (int i = 0; i < 8; ++i) bits[i] = i;
    const Tensor qh = b.narrow(1, 16, 32).reshape({n, 1, 1, 32});
    q = at::bitwise_or(q, shl(low_bits(shr(qh, constant(b, bits, {1, 4, 2, 1})), 1), 4));
  }
  return (dl.view({n, 8, 1}) * q.reshape({n, 8, 32}).to(at::kFloat) - ml.view({n, 8, 1})).reshape({n, 256});
}

Tensor q4_k(const Tensor& b) { return q45_k(b, false); }
Tensor q5_k(const Tensor& b) { return q45_k(b, true); }

Tensor q6_k(const Tensor& b) {  // ql[128], qh[64], scales[16] signed, d
  const int64_t n = b.size(0);
  // In each half h: element 32k + l takes ql[l] (k even) or ql[l + 32] (k odd), its low nibble
  // for k < 2, else its high one, with bits 2k, 2k+1 of qh[l] above them, and scale 2k + l/16.
  const Tensor ql = b.narrow(1, 0, 128).reshape({n, 2, 2, 32});
  const Tensor low4 = at::cat({low_bits(ql, 15), shr(ql, 4)}, 2);  // [n, 2, 4, 32]
  const Tensor q = at::bitwise_or(low4, shl(crumbs(b.narrow(1, 128, 64), 2), 4)).to(at::kFloat) - 32;
  const Tensor scales = b.narrow(1, 192, 16).view(at::kChar).to(at::kFloat);
  const Tensor ds = half_at(b, 208) * scales;  // d * scale, rounded, then times the quant
  return (ds.view({n, 2, 4, 2, 1}) * q.view({n, 2, 4, 2, 16})).reshape({n, 256});
}

using Unpack = Tensor (*)(const Tensor&);

Unpack unpacker(DType dtype) {
  switch (dtype) {
    case DType::Q4_0: return q4_0;
    case DType::Q4_1: return q4_1;
    case DType::Q5_0: return q5_0;
    case DType::Q5_1: return q5_1;
    case DType::Q8_0: return q8_0;
    case DType::Q2_K: return q2_k;
    case DType::Q3_K: return q3_k;
    case DType::Q4_K: return q4_k;
    case DType::Q5_K: return q5_k;
    case DType::Q6_K: return q6_k;
    default: return nullptr;
  }
}

// Elements unpacked per step: the float32 temporaries of one step stay near a MiB each.
constexpr int64_t kStepElements = 1 << 18;

}  // namespace

std::vector<int64_t> packed_shape(DType dtype, c10::IntArrayRef shape) {
  const int64_t block = dtype_block(dtype);
  if (shape.empty() || shape.back() % block != 0)
    throw Error("a tensor of shape " + c10::str(shape) + " is not whole rows of " + std::string(dtype_name(dtype)) +
                " blocks of " + std::to_string(block) + " elements");
  std::vector<int64_t> packed(shape.begin(), shape.end());
  packed.back() = shape.back() / block * static_cast<int64_t>(dtype_bits(dtype) / 8);
  return packed;
}

void dequantize_into(DType dtype, const at::Tensor& packed, at::Tensor& out) {
  const Unpack unpack = unpacker(dtype);
  if (!unpack) throw Error(std::string(dtype_name(dtype)) + " is not a type vramd unpacks");
  if (packed.scalar_type() != at::kByte || !packed.is_contiguous() || !out.is_contiguous() ||
      !packed.sizes().equals(packed_shape(dtype, out.sizes())))
    throw Error("dequantize: " + std::string(dtype_name(dtype)) + " bytes of shape " + c10::str(packed.sizes()) + " on " +
                packed.device().str() + " do not unpack into a contiguous " + c10::str(out.sizes()) + " tensor on " +
                out.device().str());
  const int64_t block = dtype_block(dtype);
  const Tensor blocks = packed.view({-1, static_cast<int64_t>(dtype_bits(dtype) / 8)});
  Tensor values = out.view({-1, block});
  const int64_t step = std::max<int64_t>(1, kStepElements / block);
  for (int64_t first = 0; first < blocks.size(0); first += step) {
    const int64_t count = std::min(step, blocks.size(0) - first);
    // From another device, a step's blocks cross as they are, and are unpacked where out is.
    const Tensor some = blocks.narrow(0, first, count).to(out.device(), /*non_blocking=*/packed.is_pinned());
    values.narrow(0, first, count).copy_(unpack(some));
  }
}

}  // namespace vramd::storage
