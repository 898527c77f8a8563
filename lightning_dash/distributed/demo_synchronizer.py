"""DeMo gradient synchronisation: error-feedback momentum, DCT top-k, all-gather, mean decode.

:class:`DemoSynchronizer` holds the per-parameter momenta and performs encode ->
all-gather -> decode for a list of gradients, with the pure functions of
:mod:`~lightning_dash.distributed.dct_topk`. Payloads are all-gathered as raw bytes
(``uint8`` views), because gloo has no int16 all-gather; the bytes are reinterpreted
after the collective, so nothing is rounded in transit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dash.distributed.dct_topk import (
    VALUE_DTYPES,
    ChunkLayout,
    DemoPayload,
    dct_chunks,
    decode_mean,
    idct_chunks,
    index_dtype_for,
    scatter_chunks,
    topk_chunks,
)


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
        process_group: Any | None = None,
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
        layouts: list[ChunkLayout | None] = []
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
        indices = (
            torch.cat(index_parts).to(index_dtype) if index_parts else torch.zeros(0, dtype=index_dtype, device=device)
        )
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
            all_indices = [p.indices[offset : offset + count] for p in payloads]
            all_values = [p.values[offset : offset + count] for p in payloads]
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
