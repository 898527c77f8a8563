"""DeMo's compression as pure tensor functions: chunking, the orthonormal DCT-II, top-k
per chunk, sparse scatter and a deterministic mean decode (no process group).

DeMo (Peng, Quesnelle, Kingma; arXiv 2411.19870) transmits only the top-k DCT
coefficients of each chunk of a momentum. Wire format of one call (every tensor's
payload concatenated in call order):

* indices: position inside the chunk, ``int16`` when every chunk of the call has at
  most 32767 elements (always true for ``chunk_size <= 181``), else ``int32``;
* values: ``bfloat16`` by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ChunkLayout",
    "DemoPayload",
    "chunk_size_for",
    "dct_basis",
    "dct_chunks",
    "decode_mean",
    "from_chunks",
    "idct_chunks",
    "index_dtype_for",
    "layout_for",
    "payload_bytes",
    "scatter_chunks",
    "to_chunks",
    "topk_chunks",
]

VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT16_MAX_CHUNK_NUMEL = 32767


# ----------------------------------------------------------------------------- chunking


def chunk_size_for(length: int, max_chunk: int = 64) -> int:
    """The largest divisor of ``length`` that is at most ``max_chunk``."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if isinstance(max_chunk, bool) or not isinstance(max_chunk, int) or max_chunk < 1:
        raise ValueError(f"max_chunk must be a positive int, got {max_chunk!r}")
    for size in range(min(length, max_chunk), 0, -1):
        if length % size == 0:
            return size
    return 1  # unreachable: 1 divides everything


@dataclass(frozen=True)
class ChunkLayout:
    """What :func:`from_chunks` needs to rebuild a tensor from its chunk matrix.

    ``view`` is the 1-D or 2-D shape the tensor was viewed as, ``chunk`` the chunk
    shape along each of those dims (same length as ``view``).
    """

    shape: tuple[int, ...]
    view: tuple[int, ...]
    chunk: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        """Number of chunks (rows of the chunk matrix)."""
        count = 1
        for length, size in zip(self.view, self.chunk):
            count *= length // size
        return count

    @property
    def chunk_numel(self) -> int:
        """Elements per chunk (columns of the chunk matrix)."""
        count = 1
        for size in self.chunk:
            count *= size
        return count


def _view_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 0:
        return (1,)
    if len(shape) == 1:
        return shape
    rest = 1
    for size in shape[1:]:
        rest *= size
    return (shape[0], rest)


def layout_for(shape: Sequence[int], max_chunk: int = 64) -> ChunkLayout:
    """The chunk layout of a tensor of ``shape`` (no data needed)."""
    shape = tuple(int(s) for s in shape)
    if any(s == 0 for s in shape):
        raise ValueError(f"cannot chunk an empty tensor of shape {shape}")
    view = _view_shape(shape)
    chunk = tuple(chunk_size_for(length, max_chunk) for length in view)
    return ChunkLayout(shape=shape, view=view, chunk=chunk)


def to_chunks(tensor: Tensor, max_chunk: int = 64) -> tuple[Tensor, ChunkLayout]:
    """Cut ``tensor`` into a ``(num_chunks, chunk_numel)`` matrix.

    1-D: consecutive runs of length s. 2-D (and >2-D viewed as ``(shape[0], rest)``):
    sr x sc tiles in row-major tile order, each tile flattened row-major.
    0-d: one chunk of length 1.
    """
    layout = layout_for(tensor.shape, max_chunk)
    x = tensor.reshape(layout.view)
    if len(layout.view) == 1:
        return x.reshape(layout.num_chunks, layout.chunk_numel), layout
    (rows, cols), (sr, sc) = layout.view, layout.chunk
    tiles = x.reshape(rows // sr, sr, cols // sc, sc).permute(0, 2, 1, 3)
    return tiles.reshape(layout.num_chunks, layout.chunk_numel), layout


def from_chunks(chunks: Tensor, layout: ChunkLayout) -> Tensor:
    """Inverse of :func:`to_chunks`."""
    if chunks.shape != (layout.num_chunks, layout.chunk_numel):
        raise ValueError(
            f"chunks has shape {tuple(chunks.shape)}, layout needs {(layout.num_chunks, layout.chunk_numel)}"
        )
    if len(layout.view) == 1:
        return chunks.reshape(layout.shape)
    (rows, cols), (sr, sc) = layout.view, layout.chunk
    tiles = chunks.reshape(rows // sr, cols // sc, sr, sc).permute(0, 2, 1, 3)
    return tiles.reshape(layout.shape)


# ----------------------------------------------------------------------------- DCT

_BASIS_CACHE: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def dct_basis(size: int, dtype: torch.dtype = torch.float32, device: Any = None) -> Tensor:
    """The orthonormal DCT-II matrix B (``size x size``): ``y = B x``, ``x = B^T y``.

    ``B[k, n] = sqrt(2/N) cos(pi (2n+1) k / 2N)``, row 0 scaled by ``1/sqrt(2)``.
    Built in float64 and cast; cached per (size, dtype, device). Do not modify the
    returned tensor in place: it is shared.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (size, dtype, device)
    basis = _BASIS_CACHE.get(key)
    if basis is None:
        n = torch.arange(size, dtype=torch.float64)
        k = n[:, None]
        matrix = torch.cos(torch.pi * (2.0 * n[None, :] + 1.0) * k / (2.0 * size)) * (2.0 / size) ** 0.5
        matrix[0] /= 2.0**0.5
        basis = matrix.to(dtype=dtype, device=device)
        _BASIS_CACHE[key] = basis
    return basis


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _transform(chunks: Tensor, layout: ChunkLayout, inverse: bool) -> Tensor:
    dtype, device = chunks.dtype, chunks.device
    if len(layout.chunk) == 1:
        basis = dct_basis(layout.chunk[0], dtype, device)
        # rows are chunks: forward y = B x  <=>  Y = X B^T; inverse X = Y B
        return chunks @ basis if inverse else chunks @ basis.T
    sr, sc = layout.chunk
    br, bc = dct_basis(sr, dtype, device), dct_basis(sc, dtype, device)
    tiles = chunks.reshape(-1, sr, sc)
    out = br.T @ tiles @ bc if inverse else br @ tiles @ bc.T
    return out.reshape(chunks.shape)


def dct_chunks(tensor: Tensor, max_chunk: int = 64) -> tuple[Tensor, ChunkLayout]:
    """Orthonormal DCT-II of every chunk: ``(num_chunks, chunk_numel)`` coefficients.

    1-D chunks use one basis; 2-D tiles X become ``B_r X B_c^T`` (flattened row-major).
    Computed in float64 for float64 input, otherwise in float32.
    """
    chunks, layout = to_chunks(tensor.to(_compute_dtype(tensor.dtype)), max_chunk)
    return _transform(chunks, layout, inverse=False), layout


def idct_chunks(coefficients: Tensor, layout: ChunkLayout) -> Tensor:
    """Exact inverse of :func:`dct_chunks` (up to float rounding), shaped ``layout.shape``."""
    coefficients = coefficients.to(_compute_dtype(coefficients.dtype))
    if coefficients.shape != (layout.num_chunks, layout.chunk_numel):
        raise ValueError(
            f"coefficients has shape {tuple(coefficients.shape)}, "
            f"layout needs {(layout.num_chunks, layout.chunk_numel)}"
        )
    return from_chunks(_transform(coefficients, layout, inverse=True), layout)


# ----------------------------------------------------------------------------- sparse coding


def topk_chunks(coefficients: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest-|c| coefficients of each chunk (row).

    Returns ``(indices int32 (num_chunks, k), values (num_chunks, k))`` with indices
    sorted ascending inside each chunk, so the encoding is canonical. ``k`` is
    clamped to the chunk size. Ties in |c| are resolved by ``torch.topk``, which is
    deterministic for a given input and device.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if coefficients.dim() != 2:
        raise ValueError(f"coefficients must be 2-D (num_chunks, chunk_numel), got {coefficients.dim()}-D")
    k = min(k, coefficients.shape[1])
    _, indices = torch.topk(coefficients.abs(), k, dim=1, largest=True, sorted=False)
    indices, _ = torch.sort(indices, dim=1)
    values = torch.gather(coefficients, 1, indices)
    return indices.to(torch.int32), values


def scatter_chunks(indices: Tensor, values: Tensor, num_chunks: int, chunk_numel: int) -> Tensor:
    """Dense ``(num_chunks, chunk_numel)`` coefficients with ``values`` at ``indices``, 0 elsewhere."""
    out = torch.zeros(num_chunks, chunk_numel, dtype=values.dtype, device=values.device)
    out.scatter_(1, indices.reshape(num_chunks, -1).long(), values.reshape(num_chunks, -1))
    return out


def decode_mean(
    all_indices: Sequence[Tensor], all_values: Sequence[Tensor], num_chunks: int, chunk_numel: int
) -> Tensor:
    """Per coefficient, the mean over the ranks that sent it (0 where nobody did).

    ``all_indices[r]``/``all_values[r]`` are rank r's ``(num_chunks, k)`` payload (any
    shape reshaping to that), in rank order. Sums and counts are accumulated in float32
    with one ``scatter_add_`` per rank, rank 0 first; within one rank indices are
    distinct per chunk, so no two adds hit the same slot and the result is bit-identical
    on every rank and every call.
    """
    if len(all_indices) != len(all_values):
        raise ValueError(f"got {len(all_indices)} index tensors but {len(all_values)} value tensors")
    if len(all_indices) == 0:
        raise ValueError("all_indices must hold at least one rank's payload")
    device = all_values[0].device
    sums = torch.zeros(num_chunks * chunk_numel, dtype=torch.float32, device=device)
    counts = torch.zeros(num_chunks * chunk_numel, dtype=torch.float32, device=device)
    offsets = torch.arange(num_chunks, device=device, dtype=torch.int64)[:, None] * chunk_numel
    for indices, values in zip(all_indices, all_values):
        flat = (indices.reshape(num_chunks, -1).to(device=device, dtype=torch.int64) + offsets).reshape(-1)
        vals = values.reshape(-1).to(device=device, dtype=torch.float32)
        sums.scatter_add_(0, flat, vals)
        counts.scatter_add_(0, flat, torch.ones_like(vals))
    return (sums / counts.clamp_min(1.0)).reshape(num_chunks, chunk_numel)


def index_dtype_for(chunk_numels: Sequence[int]) -> torch.dtype:
    """``int16`` if every chunk has at most 32767 elements, else ``int32``."""
    return torch.int16 if max(chunk_numels, default=1) <= INT16_MAX_CHUNK_NUMEL else torch.int32


def payload_bytes(
    shapes: Sequence[Sequence[int]], topk: int, chunk_size: int = 64, value_dtype: torch.dtype = torch.bfloat16
) -> int:
    """Bytes one rank sends per call for gradients of ``shapes``:

    ``sum_i num_chunks_i * min(topk, chunk_numel_i) * (index_bytes + value_bytes)``.
    """
    layouts = [layout_for(shape, chunk_size) for shape in shapes if all(s > 0 for s in shape)]
    index_bytes = torch.empty((), dtype=index_dtype_for([lay.chunk_numel for lay in layouts])).element_size()
    value_bytes = torch.empty((), dtype=value_dtype).element_size()
    kept = sum(lay.num_chunks * min(topk, lay.chunk_numel) for lay in layouts)
    return kept * (index_bytes + value_bytes)


# ----------------------------------------------------------------------------- wire format


@dataclass
class DemoPayload:
    """One rank's encoded gradients for one call: the wire tensors and how to split them.

    ``indices``/``values`` are 1-D concatenations over the call's tensors; tensor i
    occupies ``counts[i] = num_chunks_i * ks[i]`` entries. Empty tensors have layout
    ``None`` and count 0.
    """

    indices: Tensor
    values: Tensor
    layouts: tuple[ChunkLayout | None, ...]
    ks: tuple[int, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        """Entries of each tensor in ``indices``/``values``."""
        return tuple(0 if lay is None else lay.num_chunks * k for lay, k in zip(self.layouts, self.ks))

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (indices + values)."""
        return self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()
