"""DeMo: decoupled momentum with DCT top-k compression as a gradient synchronizer.

DeMo (Peng, Quesnelle, Kingma; arXiv 2411.19870) keeps a local error-feedback
momentum per parameter, transmits only the top-k DCT coefficients of each chunk of
it, and all-gathers those sparse payloads instead of all-reducing dense gradients.

The module has two layers:

* pure tensor functions (chunking, the orthonormal DCT-II, top-k, sparse scatter
  and a deterministic mean decode) that need no process group;
* :class:`DemoSynchronizer`, which holds the per-parameter momenta and performs
  encode -> all-gather -> decode for a list of gradients.

Wire format (per call, every tensor's payload concatenated in call order):

* indices: position inside the chunk, ``int16`` when every chunk of the call has at
  most 32767 elements (always true for ``chunk_size <= 181``), else ``int32``;
* values: ``bfloat16`` by default (``value_dtype``).

Both are all-gathered as raw bytes (``uint8`` views), because gloo has no int16
all-gather; the bytes are reinterpreted after the collective, so nothing is rounded
in transit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "ChunkLayout",
    "DemoPayload",
    "DemoSynchronizer",
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
        matrix[0] /= 2.0 ** 0.5
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


# ----------------------------------------------------------------------------- synchronizer


@dataclass
class DemoPayload:
    """One rank's encoded gradients for one call: the wire tensors and how to split them.

    ``indices``/``values`` are 1-D concatenations over the call's tensors; tensor i
    occupies ``counts[i] = num_chunks_i * ks[i]`` entries. Empty tensors have layout
    ``None`` and count 0.
    """

    indices: Tensor
    values: Tensor
    layouts: tuple[Optional[ChunkLayout], ...]
    ks: tuple[int, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        """Entries of each tensor in ``indices``/``values``."""
        return tuple(0 if lay is None else lay.num_chunks * k for lay, k in zip(self.layouts, self.ks))

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (indices + values)."""
        return self.indices.numel() * self.indices.element_size() + self.values.numel() * self.values.element_size()


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class DemoSynchronizer:
    """DeMo gradient synchronization: error-feedback momentum, DCT top-k, all-gather, mean decode.

    For each gradient g (keyed by a caller-chosen int): ``delta <- momentum * delta + g``;
    the top-``topk`` DCT coefficients of every chunk of delta are sent, and what is
    sent (after rounding to ``value_dtype``) is subtracted from delta, so
    ``sent + kept == accumulated`` up to the float rounding of the DCT round trip.
    Every rank decodes the same gathered payloads to bit-identical tensors.

    The learning rate is not folded into delta (the paper's form is
    ``delta <- beta delta + lr g``); the optimizer applies it.

    Args:
        topk: coefficients kept per chunk (clamped to the chunk size).
        chunk_size: maximum chunk length per dim; each dim uses its largest divisor
            <= chunk_size, so 2-D tiles hold at most ``chunk_size**2`` elements.
        momentum: decay of the local accumulator, in [0, 1).
        process_group: group to all-gather over (None: the default group).
        value_dtype: dtype of transmitted values (bfloat16, float16 or float32).
    """

    def __init__(
        self,
        topk: int = 32,
        chunk_size: int = 64,
        momentum: float = 0.999,
        process_group: Optional[Any] = None,
        value_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        _check_positive_int("topk", topk)
        _check_positive_int("chunk_size", chunk_size)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a float in [0, 1), got {momentum!r}")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of bfloat16, float16, float32, got {value_dtype!r}")
        self.topk = topk
        self.chunk_size = chunk_size
        self.momentum = float(momentum)
        self.process_group = process_group
        self.value_dtype = value_dtype
        self.state: dict[int, Tensor] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_bytes_sent = 0
        self.last_bytes_received = 0

    # -- process group

    def world_size(self) -> int:
        """Ranks in the group; 1 when torch.distributed is not initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    # -- encode / decode (usable without a process group)

    def encode(self, grads: Sequence[Tensor], keys: Sequence[int]) -> DemoPayload:
        """Accumulate ``grads`` into the local momenta, pick and remove the top-k, return the payload."""
        if len(grads) != len(keys):
            raise ValueError(f"grads and keys must have the same length, got {len(grads)} and {len(keys)}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys must be distinct, got {list(keys)}")
        layouts: list[Optional[ChunkLayout]] = []
        ks: list[int] = []
        index_parts: list[Tensor] = []
        value_parts: list[Tensor] = []
        device = grads[0].device if grads else torch.device("cpu")
        for grad, key in zip(grads, keys):  # validate everything before touching any state
            if grad.is_sparse:
                raise ValueError(f"sparse gradients are not supported (key {key})")
            if grad.device != device:
                raise ValueError(f"all grads must be on one device, got {grad.device} and {device} (key {key})")
            if key in self.state and self.state[key].shape != grad.shape:
                raise ValueError(
                    f"key {key}: momentum has shape {tuple(self.state[key].shape)}, grad {tuple(grad.shape)}"
                )
        for grad, key in zip(grads, keys):
            delta = self.state.get(key)
            if delta is None:
                delta = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
            elif delta.device != grad.device or delta.dtype != torch.float32:
                delta = delta.to(device=grad.device, dtype=torch.float32)
            self.state[key] = delta
            delta.mul_(self.momentum).add_(grad.detach().to(torch.float32))
            if grad.numel() == 0:
                layouts.append(None)
                ks.append(0)
                continue
            coefficients, layout = dct_chunks(delta, self.chunk_size)
            indices, values = topk_chunks(coefficients, self.topk)
            sent_values = values.to(self.value_dtype)
            # error feedback: remove exactly what the other ranks will decode
            sent = scatter_chunks(indices, sent_values.to(torch.float32), layout.num_chunks, layout.chunk_numel)
            delta.sub_(idct_chunks(sent, layout))
            layouts.append(layout)
            ks.append(indices.shape[1])
            index_parts.append(indices.reshape(-1))
            value_parts.append(sent_values.reshape(-1))
        index_dtype = index_dtype_for([lay.chunk_numel for lay in layouts if lay is not None])
        indices = torch.cat(index_parts).to(index_dtype) if index_parts else torch.zeros(0, dtype=index_dtype,
                                                                                            device=device)
        values = torch.cat(value_parts) if value_parts else torch.zeros(0, dtype=self.value_dtype, device=device)
        return DemoPayload(indices=indices, values=values, layouts=tuple(layouts), ks=tuple(ks))

    @staticmethod
    def decode(payloads: Sequence[DemoPayload]) -> list[Tensor]:
        """Mean-decode every rank's payload (rank order) and inverse-DCT: float32 tensors.

        All payloads must come from calls with the same shapes and ``topk``.
        """
        if not payloads:
            raise ValueError("payloads must hold at least one rank's payload")
        first = payloads[0]
        for payload in payloads[1:]:
            if payload.counts != first.counts or payload.indices.shape != first.indices.shape:
                raise ValueError("payloads disagree in size: every rank must pass the same shapes and topk")
        outputs: list[Tensor] = []
        offset = 0
        device = first.values.device
        for layout, count in zip(first.layouts, first.counts):
            if layout is None:
                outputs.append(torch.zeros(0, dtype=torch.float32, device=device))
                continue
            all_indices = [p.indices[offset:offset + count] for p in payloads]
            all_values = [p.values[offset:offset + count] for p in payloads]
            coefficients = decode_mean(all_indices, all_values, layout.num_chunks, layout.chunk_numel)
            outputs.append(idct_chunks(coefficients, layout).reshape(layout.shape))
            offset += count
        return outputs

    # -- the collective

    def synchronize(self, grads: Sequence[Tensor], keys: Sequence[int]) -> list[Tensor]:
        """Synchronized float32 tensors (shapes of ``grads``), bit-identical on every rank.

        Every rank must call this with the same keys, in the same order, with the same
        shapes: the payload sizes (and the collectives) must match across ranks.
        """
        grads = list(grads)
        if not grads and not keys:  # nothing to send on any rank (all ranks pass the same keys)
            self.last_bytes_sent = self.last_bytes_received = 0
            return []
        payload = self.encode(grads, keys)
        world = self.world_size()
        sent = payload.nbytes
        if world == 1:
            payloads = [payload]
        else:
            payloads = self._all_gather(payload, world)
        outputs = self.decode(payloads)
        outputs = [out.reshape(grad.shape) for out, grad in zip(outputs, grads)]
        self.last_bytes_sent = sent
        self.last_bytes_received = sent * (world - 1)
        self.bytes_sent += self.last_bytes_sent
        self.bytes_received += self.last_bytes_received
        return outputs

    def _all_gather(self, payload: DemoPayload, world: int) -> list[DemoPayload]:
        # raw bytes: gloo cannot all-gather int16, and bytes are never rounded in transit
        index_bytes = payload.indices.contiguous().view(torch.uint8)
        value_bytes = payload.values.contiguous().view(torch.uint8)
        gathered_indices = [torch.empty_like(index_bytes) for _ in range(world)]
        gathered_values = [torch.empty_like(value_bytes) for _ in range(world)]
        # both inputs stay referenced until wait() returns
        work_indices = dist.all_gather(gathered_indices, index_bytes, group=self.process_group, async_op=True)
        work_values = dist.all_gather(gathered_values, value_bytes, group=self.process_group, async_op=True)
        work_indices.wait()
        work_values.wait()
        return [
            DemoPayload(
                indices=idx.view(payload.indices.dtype),
                values=val.view(payload.values.dtype),
                layouts=payload.layouts,
                ks=payload.ks,
            )
            for idx, val in zip(gathered_indices, gathered_values)
        ]

    # -- checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This rank's momenta (cloned) and byte counters. Momenta differ per rank."""
        return {
            "momentum_buffers": {key: value.detach().clone() for key, value in self.state.items()},
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_bytes_sent": self.last_bytes_sent,
            "last_bytes_received": self.last_bytes_received,
            "config": {
                "topk": self.topk,
                "chunk_size": self.chunk_size,
                "momentum": self.momentum,
                "value_dtype": str(self.value_dtype),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore momenta (cloned) and counters saved by :meth:`state_dict`."""
        if "momentum_buffers" not in state_dict:
            raise ValueError("state_dict has no 'momentum_buffers' entry")
        self.state = {int(key): value.detach().clone() for key, value in state_dict["momentum_buffers"].items()}
        self.bytes_sent = int(state_dict.get("bytes_sent", 0))
        self.bytes_received = int(state_dict.get("bytes_received", 0))
        self.last_bytes_sent = int(state_dict.get("last_bytes_sent", 0))
        self.last_bytes_received = int(state_dict.get("last_bytes_received", 0))
