"""GGUF's block-quantized types unpacked with torch ops, on whatever device the bytes are sent to:
how a managed module's weights that rest packed in vramd become the computation dtype right
before their unit runs. The fields are ggml-common.h's layouts, and each product and sum is an
op of its own, rounded once in float32, as the daemon's unpacking (lib/storage/dequantize_ops.cpp)
and the `gguf` package do: in float32 the values are theirs bit for bit."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Packed(NamedTuple):
    """A leased tensor held as GGUF blocks: their type ("Q4_K") and the values' shape. The tensor
    itself is uint8, its last dimension counted in the blocks' bytes."""
    type: str
    shape: tuple[int, ...]


def _half(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field `offset` bytes into each block, as float32 [n, 1]."""
    return b[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _shifts(like: torch.Tensor, step: int, count: int, shape) -> torch.Tensor:
    """Shifts 0, step, 2 step ... made on the blocks' device (an op on its stream, no copy from
    the host), shaped to broadcast."""
    return torch.arange(0, step * count, step, dtype=torch.uint8, device=like.device).view(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 32 quants of a 32-element block's 16 bytes: low nibbles are elements 0-15, high 16-31."""
    return torch.cat([qs & 15, qs >> 4], 1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5's fifth bits: bit e of the 32-bit little-endian qh is element e's, shifted to bit 4."""
    index = torch.arange(32, device=qh.device) // 8
    return ((qh.index_select(1, index) >> (_shifts(qh, 1, 32, (1, 32)) % 8)) & 1) << 4


def _crumbs(qs: torch.Tensor, halves: int) -> torch.Tensor:
    """The K types' 2-bit fields: byte l's bits 2s, 2s+1 are element 32s + l of its 32-byte half,
    giving [n, halves, 4, 32]."""
    return (qs.reshape(qs.shape[0], halves, 1, 32) >> _shifts(qs, 2, 4, (1, 1, 4, 1))) & 3


# Each writes the values of [n, bytes] uint8 blocks into `out`, [n, elements] float32: the
# quants cast into it, then each product and sum made there in place, so that a step allocates
# only its small fields (in ops of the same order as the gguf package's, so rounded the same).
def _q4_0(b, out):
    out.copy_(_nibbles(b[:, 2:18]))
    out.sub_(8).mul_(_half(b, 0))


def _q4_1(b, out):
    out.copy_(_nibbles(b[:, 4:20]))
    out.mul_(_half(b, 0)).add_(_half(b, 2))


def _q5_0(b, out):
    out.copy_(_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6]))
    out.sub_(16).mul_(_half(b, 0))


def _q5_1(b, out):
    out.copy_(_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]))
    out.mul_(_half(b, 0)).add_(_half(b, 2))


def _q8_0(b, out):
    out.copy_(b[:, 2:34].view(torch.int8))
    out.mul_(_half(b, 0))


def _q2_k(b, out):  # scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = _half(b, 80) * (scales & 15).float()
    ml = _half(b, 82) * (scales >> 4).float()
    groups = out.view(n, 16, 16)  # 16 groups of 16
    groups.copy_(_crumbs(b[:, 16:80], 2).reshape(n, 16, 16))
    groups.mul_(dl.view(n, 16, 1)).sub_(ml.view(n, 16, 1))


def _q3_k(b, out):  # hmask[32], qs[64], scales[12] (sixteen 6-bit), d
    n = b.shape[0]
    # Scale i: low 4 bits from byte i % 8 (shifted by 4 for i >= 8), high 2 from byte 8 + i % 4.
    packed = b[:, 96:108]
    low = (packed[:, 0:8].reshape(n, 1, 8) >> _shifts(b, 4, 2, (1, 2, 1))) & 15
    high = (packed[:, 8:12].reshape(n, 1, 4) >> _shifts(b, 2, 4, (1, 4, 1))) & 3
    scales = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)).float() - 32
    dl = _half(b, 108) * scales
    # The high bit of element 32s + l of half h is bit 4h + s of hmask[l]; without it, minus 4.
    high_bit = (b[:, 0:32].reshape(n, 1, 1, 32) >> _shifts(b, 1, 8, (1, 2, 4, 1))) & 1
    groups = out.view(n, 16, 16)
    groups.copy_((_crumbs(b[:, 32:96], 2) | (high_bit << 2)).reshape(n, 16, 16))
    groups.sub_(4).mul_(dl.view(n, 16, 1))


def _q45_k(b, out, fifth: bool):
    """Q4_K and Q5_K: eight 6-bit scales and eight 6-bit mins in 12 bytes, then 4-bit quants (and
    for Q5_K, 32 bytes of fifth bits first)."""
    n = b.shape[0]
    first, second, third = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    scale = torch.cat([first & 63, (third & 15) | ((first >> 6) << 4)], 1)
    least = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], 1)
    dl, ml = _half(b, 0) * scale.float(), _half(b, 2) * least.float()
    # Element 64c + 32k + l: nibble k of qs[32c + l]; its fifth bit is bit 2c + k of qh[l].
    start = 48 if fifth else 16
    q = (b[:, start:start + 128].reshape(n, 4, 1, 32) >> _shifts(b, 4, 2, (1, 1, 2, 1))) & 15
    if fifth:
        qh = b[:, 16:48].reshape(n, 1, 1, 32)
        q = q | (((qh >> _shifts(b, 1, 8, (1, 4, 2, 1))) & 1) << 4)
    groups = out.view(n, 8, 32)
    groups.copy_(q.reshape(n, 8, 32))
    groups.mul_(dl.view(n, 8, 1)).sub_(ml.view(n, 8, 1))


def _q6_k(b, out):  # ql[128], qh[64], scales[16] signed, d
    n = b.shape[0]
    # In each half h: element 32k + l takes ql[l] (k even) or ql[l + 32] (k odd), its low nibble
    # for k < 2, else its high one, with bits 2k, 2k+1 of qh[l] above them, and scale 2k + l/16.
    ql = b[:, 0:128].reshape(n, 2, 2, 32)
    low4 = torch.cat([ql & 15, ql >> 4], 2)  # [n, 2, 4, 32]
    ds = _half(b, 208) * b[:, 192:208].view(torch.int8).float()  # d * scale, rounded, then times the quant
    groups = out.view(n, 2, 4, 2, 16)
    groups.copy_((low4 | (_crumbs(b[:, 128:192], 2) << 4)).view(n, 2, 4, 2, 16))
    groups.sub_(32).mul_(ds.view(n, 2, 4, 2, 1))


def _q4_k(b, out):
    _q45_k(b, out, False)


def _q5_k(b, out):
    _q45_k(b, out, True)


# Each type's elements and bytes per block, and its unpacking of [n, bytes] uint8 into [n, elements] float32.
BLOCKS: dict[str, tuple[int, int, Callable[[torch.Tensor, torch.Tensor], None]]] = {
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0), "Q2_K": (256, 84, _q2_k), "Q3_K": (256, 110, _q3_k), "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k), "Q6_K": (256, 210, _q6_k),
}

# Elements unpacked per step. On the CPU a step's scratch (in a dtype other than float32) and
# fields stay near a MiB. On a GPU each op of a step is a kernel launched from Python (3 for Q8_0
# to about 30 for Q5_K, some microseconds each), which in steps that small would take far longer
# than the bus takes to bring the blocks: 2^22 elements a step keep a 50M-element weight to a
# dozen steps, for a float32 scratch of 16 MiB and fields of a few MiB.
_CPU_STEP_ELEMENTS, _GPU_STEP_ELEMENTS = 1 << 18, 1 << 22


def packed_shape(kind: str, shape) -> tuple[int, ...]:
    """The shape of a tensor of `shape` as the bytes of `kind`'s blocks, which run along the last
    dimension. Raises ValueError for another type, or a last dimension not whole blocks."""
    if kind not in BLOCKS:
        raise ValueError(f"{kind!r} is not a GGUF type vramd unpacks ({', '.join(BLOCKS)})")
    elements, size, _ = BLOCKS[kind]
    if not shape or shape[-1] % elements:
        raise ValueError(f"a tensor of shape {list(shape)} is not whole rows of {kind} blocks of {elements} elements")
    return (*shape[:-1], shape[-1] // elements * size)


def unpack(blocks: torch.Tensor, kind: str, shape, dtype: torch.dtype = torch.float32,
           device: str | torch.device | None = None) -> torch.Tensor:
    """The values of `blocks` (uint8, `kind`'s blocks of a tensor of `shape`, as a lease holds
    them: see Lease.packed) as a new tensor of `shape` in `dtype` on `device` (the blocks' own by
    default). The blocks cross to the device as they are, some at a time (2^18 elements' worth on
    the CPU, 2^22 on a GPU), and are unpacked there in float32, then rounded once into `dtype`."""
    shape = tuple(shape)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != packed_shape(kind, shape):
        raise ValueError(f"{kind} blocks of shape {list(blocks.shape)} in {blocks.dtype} do not unpack into "
                         f"{list(shape)}")
    elements, size, unpack_blocks = BLOCKS[kind]
    out = torch.empty(shape, dtype=dtype, device=device if device is not None else blocks.device)
    rows, values = blocks.reshape(-1, size), out.view(-1, elements)
    step = max(1, (_CPU_STEP_ELEMENTS if out.device.type == "cpu" else _GPU_STEP_ELEMENTS) // elements)
    # Unpacked into `out` itself in float32; in another dtype, into one step's float32 scratch first.
    scratch = None if dtype == torch.float32 else torch.empty(min(step, rows.shape[0]), elements, dtype=torch.float32,
                                                              device=out.device)
    for first in range(0, rows.shape[0], step):
        some = rows[first:first + step].to(out.device, non_blocking=rows.is_pinned())
        target = values[first:first + step]
        if scratch is None:
            unpack_blocks(some, target)
        else:
            unpack_blocks(some, scratch[:some.shape[0]])
            target.copy_(scratch[:some.shape[0]])
    return out
