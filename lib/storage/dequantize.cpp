// Built with -ffp-contract=off (lib/CMakeLists.txt): `d * q - m` must round twice, as llama.cpp's
// reference and numpy do, never fuse into one multiply-add.
#include "storage/dequantize.hpp"

#include <cstdint>
#include <cstring>
#include <string>

#include "util/error.hpp"

namespace vramd::storage {
namespace {

using Block = const uint8_t*;

float half(Block p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(bits);
}

// Each function unpacks one block into y (32 or 256 floats). Layouts are ggml-common.h's.

void q4_0(Block b, float* y) {  // d, qs[16]: low nibbles are elements 0-15, high ones 16-31
  const float d = half(b);
  const Block qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void q4_1(Block b, float* y) {  // d, m, qs[16]
  const float d = half(b), m = half(b + 2);
  const Block qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5: the fifth bit of element j is bit j of qh.
uint32_t fifth_bits(Block qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return bits;
}

void q5_0(Block b, float* y) {  // d, qh[4], qs[16]
  const float d = half(b);
  const uint32_t qh = fifth_bits(b + 2);
  const Block qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int low = (qs[j] & 0x0f) | static_cast<int>(((qh >> j) << 4) & 0x10);
    const int high = (qs[j] >> 4) | static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>(low - 16) * d;
    y[j + 16] = static_cast<float>(high - 16) * d;
  }
}

void q5_1(Block b, float* y) {  // d, m, qh[4], qs[16]
  const float d = half(b), m = half(b + 2);
  const uint32_t qh = fifth_bits(b + 4);
  const Block qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int low = (qs[j] & 0x0f) | static_cast<int>(((qh >> j) << 4) & 0x10);
    const int high = (qs[j] >> 4) | static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>(low) * d + m;
    y[j + 16] = static_cast<float>(high) * d + m;
  }
}

void q8_0(Block b, float* y) {  // d, qs[32] signed
  const float d = half(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

void q2_k(Block b, float* y) {  // scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin
  const Block scales = b, qs = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int group = 0;
  for (int half_block = 0; half_block < 2; ++half_block) {
    const Block q = qs + 32 * half_block;
    for (int shift = 0; shift < 8; shift += 2) {
      for (int part = 0; part < 2; ++part, ++group) {
        const float dl = d * static_cast<float>(scales[group] & 0x0f), ml = dmin * static_cast<float>(scales[group] >> 4);
        for (int l = 16 * part; l < 16 * part + 16; ++l) *y++ = dl * static_cast<float>((q[l] >> shift) & 3) - ml;
      }
    }
  }
}

void q3_k(Block b, float* y) {  // hmask[32], qs[64], scales[12] (sixteen 6-bit), d
  const Block hmask = b, qs = b + 32, packed = b + 96;
  const float d = half(b + 108);
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) {  // low 4 bits from bytes 0-7, high 2 bits from bytes 8-11
    const int low = (packed[i % 8] >> (4 * (i / 8))) & 0x0f;
    const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 0x03;
    scales[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  int group = 0;
  uint8_t mask = 1;
  for (int half_block = 0; half_block < 2; ++half_block) {
    const Block q = qs + 32 * half_block;
    for (int shift = 0; shift < 8; shift += 2, mask <<= 1) {
      for (int part = 0; part < 2; ++part, ++group) {
        const float dl = d * static_cast<float>(scales[group]);
        for (int l = 16 * part; l < 16 * part + 16; ++l) {
          const int value = ((q[l] >> shift) & 3) - ((hmask[l] & mask) ? 0 : 4);
          *y++ = dl * static_cast<float>(value);
        }
      }
    }
  }
}

// Q4_K and Q5_K: eight 6-bit scales and eight 6-bit mins packed in 12 bytes.
void scale_min_k4(int j, Block q, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = static_cast<uint8_t>((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
    min = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Both K types with 4-bit quants: `qh` adds a fifth bit (Q5_K) where given.
void q45_k(Block b, Block qh, Block qs, float* y) {  // d, dmin, scales[12], [qh[32]], qs[128]
  const float d = half(b), dmin = half(b + 2);
  const Block packed = b + 4;
  for (int chunk = 0; chunk < 4; ++chunk) {
    for (int nibble = 0; nibble < 2; ++nibble) {
      uint8_t scale, min;
      scale_min_k4(2 * chunk + nibble, packed, scale, min);
      const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
      const int bit = 2 * chunk + nibble;
      for (int l = 0; l < 32; ++l) {
        int value = (qs[32 * chunk + l] >> (4 * nibble)) & 0x0f;
        if (qh && (qh[l] >> bit) & 1) value += 16;
        *y++ = dl * static_cast<float>(value) - ml;
      }
    }
  }
}

void q4_k(Block b, float* y) { q45_k(b, nullptr, b + 16, y); }
void q5_k(Block b, float* y) { q45_k(b, b + 16, b + 48, y); }

void q6_k(Block b, float* y) {  // ql[128], qh[64], scales[16] signed, d
  const float d = half(b + 208);
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  for (int half_block = 0; half_block < 2; ++half_block) {
    const Block ql = b + 64 * half_block, qh = b + 128 + 32 * half_block;
    const int8_t* sc = scales + 8 * half_block;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
  }
}

using Unpack = void (*)(Block, float*);

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

}  // namespace

void dequantize(DType dtype, std::span<const std::byte> packed, std::span<float> out) {
  const Unpack unpack = unpacker(dtype);
  if (!unpack) throw Error(std::string(dtype_name(dtype)) + " is not a type vramd unpacks");
  const size_t block_bytes = dtype_bits(dtype) / 8, block = dtype_block(dtype);
  if (packed.size() % block_bytes != 0 || packed.size() / block_bytes * block != out.size())
    throw Error("dequantize: " + std::to_string(packed.size()) + " bytes of " + std::string(dtype_name(dtype)) +
                " do not hold " + std::to_string(out.size()) + " elements");
  const auto* bytes = reinterpret_cast<Block>(packed.data());
  for (size_t i = 0; i < packed.size() / block_bytes; ++i) unpack(bytes + i * block_bytes, out.data() + i * block);
}

}  // namespace vramd::storage
