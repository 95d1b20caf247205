"""INT4 W4A16 MoE weights in the payload's packed layout.

Per expert the layer holds two matrices in math form (y = x @ W.T):
  w13: [2*inter, hidden]  gate rows [0, inter) then up rows [inter, 2*inter)
  w2:  [hidden, inter]

Stored one output column per row, its K values contiguous, two K values per byte, so a
kernel reads each column's weights as whole 16-byte runs (wide shared-memory and register
loads) and never has to interleave nibbles: within every aligned chunk of 32 K values, byte j
holds value j in its low nibble and value 16 + j in its high nibble. The low nibbles of a
tile are therefore the first halves of its chunks and the high nibbles the second halves; a
kernel multiplies each half by the matching half of the activations (any order of K gives the
same dot product, as long as both operands use it).

  packed[e, n, 16c + j] = (q[e, 32c + j, n] + 8) | ((q[e, 32c + 16 + j, n] + 8) << 4)
                                                        uint8 [E, N, K // 2], j in [0, 16)
  scales[e, g, n] = bf16 scale of rows k in [g * group, (g + 1) * group)   bf16  [E, K // group, N]
  W.T[e, k, n]    = q[e, k, n] * scales[e, k // group, n]                  q in [-8, 7]

When K is not a multiple of 32, the last r = K mod 32 values form one shorter chunk, paired
the same way (value j with value r / 2 + j). K is the GEMM's reduction size (hidden for w13,
inter for w2), N its output size.

In memory those rows are stored in tiles (`tile_packed`): 32 rows x 32 bytes (64 K values) per
1 KB block, the blocks of a 32-row group in K order, the row groups one after the other; each
row's bytes past K / 2 are padding up to a whole block (N is a multiple of 32 wherever the
triton backend runs; other N are padded with rows too).

  stored[e, n // 32, b // 32, n % 32, b % 32] = packed[e, n, b]     uint8 [E, N/32, KB, 32, 32]

So a kernel step that reads 32-64 K values of many rows reads whole 1 KB blocks, not one
32-byte piece from each of many rows: the L2 cache serves a request per 128-byte line, and
with the rows one after the other every 32-byte piece was a request of its own (measured:
L2 tag lookups at 85% of their peak at M=2048, the weights more than half of them;
PERFORMANCE.md round 13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class MoEShape:
    experts: int
    hidden: int
    inter: int  # per-shard expert intermediate size (after --tp)
    topk: int
    group_size: int

    def validate(self) -> None:
        """Raise ValueError with an operator-readable reason for an impossible shape."""
        for name in ("experts", "hidden", "inter", "topk", "group_size"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) cannot exceed experts ({self.experts})")
        for name in ("hidden", "inter"):
            value = getattr(self, name)
            if value % self.group_size:
                raise ValueError(f"{name} ({value}) must be a multiple of group size ({self.group_size})")
            if value % 2:
                raise ValueError(f"{name} ({value}) must be even to pack two int4 values per byte")


def _int_specialisation(value: int) -> tuple[bool, bool]:
    """What Triton's JIT specialises an int argument on (its compiled kernel differs by it):
    equal to 1, and divisible by 16."""
    return value == 1, value % 16 == 0


def rehearsal_layer_error(held: quant.MoEShape, layer: quant.MoEShape) -> str | None:
    """Why a backend holding `held` experts cannot compile exactly `layer`'s kernels (None: it
    can). The shapes must agree but for the expert count, which needs at least top-k, at most
    the layer's, and the same JIT specialisation as the layer's (the expert count is a kernel
    argument: Triton compiles apart a value of 1 and one divisible by 16)."""
    if (held.hidden, held.inter, held.topk, held.group_size) != (layer.hidden, layer.inter, layer.topk,
                                                                 layer.group_size):
        return f"the rehearsal's shape {held} differs from its layer {layer} in more than the experts"
    if not layer.topk <= held.experts <= layer.experts:
        return f"the rehearsal holds {held.experts} experts: it needs from top-k ({layer.topk}) to the layer's {layer.experts}"
    if _int_specialisation(held.experts) != _int_specialisation(layer.experts):
        return (f"{held.experts} experts compile other kernels than the layer's {layer.experts} "
                "(Triton specialises the expert count on ==1 and on divisibility by 16)")
    return None


def rehearsal_expert_counts(layer: quant.MoEShape) -> list[int]:
    """Expert counts a rehearsal of this layer can hold (rehearsal_layer_error is None), smallest first."""
    return [e for e in range(layer.topk, layer.experts + 1)
            if rehearsal_layer_error(replace(layer, experts=e), layer) is None]


CHUNK = 32  # K values per pairing chunk (see the module docstring)


def triton_shape_error(shape: MoEShape) -> str | None:
    """Why the triton backend cannot run this (valid) shape, or None. Kept here, free of any
    triton import, so argument checks refuse it before anything runs (the kernels check it too)."""
    group = shape.group_size
    if group < CHUNK or group & (group - 1):
        # Every 32-value pairing chunk of the layout must lie inside one group.
        return (f"the triton backend needs a power-of-two group size of at least {CHUNK}, got {group}; "
                "use --backend torch for this shape")
    return None


ROW_TILE = 32  # rows per tile of the stored layout
TILE_BYTES = 32  # bytes of a row per block (64 K values)


def stored_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """One expert's stored tiles for output size n, reduction size k:
    (ceil(n / 32), ceil(k / 64), 32, 32), the last row group and block padded."""
    return -(-n // ROW_TILE), -(-(k // 2) // TILE_BYTES), ROW_TILE, TILE_BYTES


def tile_packed(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n, k // 2] (one row per output column) -> the stored tiles
    [..., ceil(n / 32), ceil(k / 64), 32, 32], padding zero."""
    *lead, n, half = rows.shape
    n_tiles, blocks, _, _ = stored_shape(n, 2 * half)
    padded = rows.new_zeros((*lead, n_tiles * ROW_TILE, blocks * TILE_BYTES))
    padded[..., :n, :half] = rows
    tiles = padded.view(*lead, n_tiles, ROW_TILE, blocks, TILE_BYTES)
    return tiles.transpose(-3, -2).contiguous()


def untile_packed(stored: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of tile_packed: uint8 [..., n, k // 2]."""
    *lead, n_tiles, blocks, _, _ = stored.shape
    rows = stored.transpose(-3, -2).reshape(*lead, n_tiles * ROW_TILE, blocks * TILE_BYTES)
    return rows[..., :n, : k // 2]


@dataclass
class PackedLinear:
    """One packed weight for all experts: GEMM of reduction size k, output size n."""

    packed: torch.Tensor  # uint8 [E, ceil(n / 32), ceil(k / 64), 32, 32]: tile_packed
    scales: torch.Tensor  # bf16  [E, k // group, n]
    group_size: int

    @property
    def k(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def n(self) -> int:
        return self.scales.shape[2]

    def rows(self, experts: int | torch.Tensor | None = None) -> torch.Tensor:
        """The packed bytes one row per output column: uint8 [E', n, k // 2]."""
        stored = self.packed if experts is None else self.packed[experts]
        return untile_packed(stored, self.n, self.k)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()


@dataclass
class MoEWeights:
    shape: MoEShape
    w13: PackedLinear  # k = hidden, n = 2 * inter
    w2: PackedLinear  # k = inter, n = hidden

    def nbytes(self) -> int:
        return self.w13.nbytes() + self.w2.nbytes()


def packed_linear_bytes(experts: int, k: int, n: int, group_size: int) -> int:
    """Device bytes of one PackedLinear (with the tiles' padding), without allocating it."""
    return experts * (math.prod(stored_shape(n, k)) + (k // group_size) * n * 2)


def weights_bytes(shape: MoEShape) -> int:
    return packed_linear_bytes(shape.experts, shape.hidden, 2 * shape.inter, shape.group_size) + packed_linear_bytes(
        shape.experts, shape.inter, shape.hidden, shape.group_size
    )


def _random_packed_linear(experts: int, k: int, n: int, group_size: int, device, generator) -> PackedLinear:
    # Built in place in the final layout: peak device memory is the final weights alone.
    packed = torch.randint(0, 256, (experts, *stored_shape(n, k)), dtype=torch.uint8, device=device,
                           generator=generator)
    # Scales keep every output near unit variance for unit-variance inputs:
    # var(q) for q uniform on [-8, 7] is 21.25, so scale ~ 1 / sqrt(21.25 * k).
    base = 1.0 / math.sqrt(21.25 * k)
    scales = torch.empty((experts, k // group_size, n), dtype=torch.bfloat16, device=device)
    scales.uniform_(0.5 * base, 1.5 * base, generator=generator)
    return PackedLinear(packed=packed, scales=scales, group_size=group_size)


def random_weights(shape: MoEShape, device: torch.device | str, seed: int = 0) -> MoEWeights:
    """Random weights in their final packed layout, built directly on `device`."""
    shape.validate()
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    w13 = _random_packed_linear(shape.experts, shape.hidden, 2 * shape.inter, shape.group_size, device, generator)
    w2 = _random_packed_linear(shape.experts, shape.inter, shape.hidden, shape.group_size, device, generator)
    return MoEWeights(shape=shape, w13=w13, w2=w2)


def pair_index(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte b of a packed column of k values: the K index of its low and of its high
    nibble ([k // 2] each)."""
    if k % 2:
        raise ValueError(f"the reduction size must be even, got {k}")
    b = torch.arange(k // 2)
    full = k // CHUNK * (CHUNK // 2)  # bytes in whole chunks
    tail_half = (k % CHUNK) // 2
    low = torch.where(b < full, b // 16 * CHUNK + b % 16, k // CHUNK * CHUNK + (b - full))
    high = torch.where(b < full, low + CHUNK // 2, low + tail_half)
    return low, high


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n, k // 2] -> int8 [..., k, n] in [-8, 7] (W.T's layout)."""
    k = packed.shape[-1] * 2
    if k % CHUNK == 0:
        # Whole pairing chunks only (every preset): byte b of a chunk holds K values b (low
        # nibble) and b + 16 (high), so each chunk unpacks as its low half then its high half,
        # without scattering by index.
        chunks = packed.unflatten(-1, (k // CHUNK, CHUNK // 2))
        q = torch.empty((*chunks.shape[:-1], 2, CHUNK // 2), dtype=torch.int8, device=packed.device)
        q[..., 0, :] = chunks & 0x0F
        q[..., 1, :] = chunks >> 4
        q -= 8
        return q.view(*packed.shape[:-1], k).transpose(-1, -2)
    low, high = pair_index(k)
    q = torch.empty((*packed.shape[:-1], k), dtype=torch.int8, device=packed.device)
    q[..., low.to(packed.device)] = (packed & 0x0F).to(torch.int8) - 8
    q[..., high.to(packed.device)] = (packed >> 4).to(torch.int8) - 8
    return q.transpose(-1, -2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [..., k, n] in [-8, 7] -> uint8 [..., n, k // 2]; the inverse of unpack_int4."""
    if q.shape[-2] % 2:
        raise ValueError("the reduction (second to last) dimension must be even")
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("int4 values must lie in [-8, 7]")
    u = (q.to(torch.int16) + 8).to(torch.uint8).transpose(-1, -2)
    low, high = pair_index(q.shape[-2])
    return (u[..., low.to(q.device)] | (u[..., high.to(q.device)] << 4)).contiguous()


def dequantize(linear: PackedLinear, experts: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
    """W.T for the chosen experts (all when None): [E', k, n] in `dtype`."""
    scales = linear.scales if experts is None else linear.scales[experts]
    w = unpack_int4(linear.rows(experts)).to(dtype)
    # Scaled in place, each group's scale row broadcast over its group_size K values: the
    # peak is the result and the int8 values, not three result-sized tensors (the float32
    # reference unpacks one expert at a time beside a live service, see cli --rehearse).
    w.unflatten(-2, (linear.k // linear.group_size, linear.group_size)).mul_(scales.to(dtype).unsqueeze(-2))
    return w
