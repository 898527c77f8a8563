"""DeMo: DCT chunking, top-k coding, deterministic decode, the synchronizer (1 and 2 gloo
processes) and the sign-descent optimizer, checked against hand-written expectations."""

from __future__ import annotations

import dataclasses
import io
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.spawning import START_METHOD

from lightning_dash.distributed.dct_topk import (
    chunk_size_for,
    dct_basis,
    dct_chunks,
    decode_mean,
    from_chunks,
    idct_chunks,
    payload_bytes,
    scatter_chunks,
    to_chunks,
    topk_chunks,
)
from lightning_dash.distributed.demo_optimizer import DeMo
from lightning_dash.distributed.demo_synchronizer import DemoSynchronizer
from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit

ROUND_TRIP_SHAPES = [(96, 80), (7, 5), (130,), (64, 64), (16, 3, 5, 5), (), (97,)]


def closed_form_basis(n: int) -> torch.Tensor:
    """sqrt(2/N) cos(pi (2j+1) k / 2N), row k=0 times 1/sqrt(2), with Python floats."""
    rows = []
    for k in range(n):
        scale = math.sqrt(2.0 / n) * (1.0 / math.sqrt(2.0) if k == 0 else 1.0)
        rows.append([scale * math.cos(math.pi * (2 * j + 1) * k / (2 * n)) for j in range(n)])
    return torch.tensor(rows, dtype=torch.float64)


def randn(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- DCT and chunking


@pytest.mark.parametrize("n", [1, 5, 8, 26, 64])
def test_dct_basis_closed_form_and_orthonormal(n):
    basis = dct_basis(n, torch.float64)
    torch.testing.assert_close(basis, closed_form_basis(n), rtol=0, atol=1e-13)
    torch.testing.assert_close(basis @ basis.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    single = dct_basis(n)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single @ single.T, torch.eye(n), rtol=0, atol=1e-6)
    assert dct_basis(n) is single  # cached per (size, dtype, device)


@pytest.mark.parametrize(
    "length, max_chunk, expected",
    [
        (96, 64, 48),
        (7, 64, 7),
        (130, 64, 26),
        (64, 64, 64),
        (4096, 64, 64),
        (97, 64, 1),
        (1, 64, 1),
        (80, 64, 40),
        (130, 8, 5),
        (64, 8, 8),
    ],
)
def test_chunk_size_for(length, max_chunk, expected):
    assert chunk_size_for(length, max_chunk) == expected


@pytest.mark.parametrize("shape", ROUND_TRIP_SHAPES)
def test_round_trip_float64_and_float32(shape):
    x64 = randn(*shape, seed=1, dtype=torch.float64)
    coefficients, layout = dct_chunks(x64, 64)
    assert coefficients.dtype == torch.float64
    assert coefficients.shape == (layout.num_chunks, layout.chunk_numel)
    assert layout.num_chunks * layout.chunk_numel == max(x64.numel(), 1)
    back = idct_chunks(coefficients, layout)
    assert back.shape == x64.shape
    assert (back - x64).abs().max().item() <= 1e-12
    # orthonormal: energy is preserved
    assert coefficients.square().sum().item() == pytest.approx(x64.square().sum().item(), rel=1e-12)

    x32 = x64.float()
    coefficients, layout = dct_chunks(x32, 64)
    back = idct_chunks(coefficients, layout)
    assert back.dtype == torch.float32 and back.shape == x32.shape
    assert (back - x32).abs().max().item() <= 1e-6 * max(1.0, x32.abs().max().item())


def test_chunk_order_matches_tiles_and_runs():
    # 2-D: tile (i, j) of 96x80 is 48x40, row-major tile order, coefficients B_r X B_c^T row-major
    x = randn(96, 80, seed=2, dtype=torch.float64)
    coefficients, layout = dct_chunks(x, 64)
    assert layout.chunk == (48, 40) and layout.num_chunks == 4 and layout.chunk_numel == 48 * 40
    br, bc = closed_form_basis(48), closed_form_basis(40)
    for i in range(2):
        for j in range(2):
            tile = x[48 * i : 48 * (i + 1), 40 * j : 40 * (j + 1)]
            expected = (br @ tile @ bc.T).reshape(-1)
            torch.testing.assert_close(coefficients[2 * i + j], expected, rtol=0, atol=1e-12)
    # 1-D: 130 = 5 runs of 26
    v = randn(130, seed=3, dtype=torch.float64)
    coefficients, layout = dct_chunks(v, 64)
    assert coefficients.shape == (5, 26)
    b26 = closed_form_basis(26)
    for t in range(5):
        torch.testing.assert_close(coefficients[t], b26 @ v[26 * t : 26 * (t + 1)], rtol=0, atol=1e-12)
    # conv weight (16, 3, 5, 5) is viewed as (16, 75): one 16x25 tile per 25 columns
    w = randn(16, 3, 5, 5, seed=4, dtype=torch.float64)
    coefficients, layout = dct_chunks(w, 64)
    assert layout.view == (16, 75) and layout.chunk == (16, 25)
    flat = w.reshape(16, 75)
    b16, b25 = closed_form_basis(16), closed_form_basis(25)
    for j in range(3):
        expected = (b16 @ flat[:, 25 * j : 25 * (j + 1)] @ b25.T).reshape(-1)
        torch.testing.assert_close(coefficients[j], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", ROUND_TRIP_SHAPES)
def test_to_from_chunks_exact(shape):
    x = randn(*shape, seed=5)
    chunks, layout = to_chunks(x)
    assert torch.equal(from_chunks(chunks, layout), x)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.shape = (1,)


# ----------------------------------------------------------------------------- sparse coding


def test_topk_chunks_selects_largest_magnitudes_canonically():
    coefficients = randn(6, 20, seed=6)
    indices, values = topk_chunks(coefficients, 5)
    assert indices.dtype == torch.int32 and indices.shape == (6, 5) and values.shape == (6, 5)
    for row in range(6):
        magnitudes = coefficients[row].abs().tolist()
        expected = sorted(sorted(range(20), key=lambda j: -magnitudes[j])[:5])
        assert indices[row].tolist() == expected
        assert values[row].tolist() == [coefficients[row, j].item() for j in expected]
    again = topk_chunks(coefficients, 5)
    assert torch.equal(again[0], indices) and torch.equal(again[1], values)
    # k is clamped to the chunk size
    indices, values = topk_chunks(coefficients, 100)
    assert indices.shape == (6, 20)
    assert indices.tolist() == [list(range(20))] * 6
    assert torch.equal(values, coefficients)


def test_scatter_chunks_dense():
    indices = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    values = torch.tensor([[1.5, -2.0], [3.0, 4.0]])
    expected = torch.tensor([[1.5, 0.0, 0.0, -2.0], [0.0, 3.0, 4.0, 0.0]])
    assert torch.equal(scatter_chunks(indices, values, 2, 4), expected)


def test_decode_mean_matches_hand_mean_and_is_deterministic():
    num_chunks, chunk_numel, k, ranks = 3, 6, 3, 4
    generator = torch.Generator().manual_seed(7)
    all_indices, all_values = [], []
    for _ in range(ranks):
        idx = torch.stack([torch.randperm(chunk_numel - 1, generator=generator)[:k] for _ in range(num_chunks)])
        all_indices.append(idx.sort(dim=1).values.to(torch.int16))  # slot chunk_numel-1 never sent
        all_values.append(torch.randn(num_chunks, k, generator=generator).to(torch.bfloat16))
    expected = torch.zeros(num_chunks, chunk_numel, dtype=torch.float64)
    for c in range(num_chunks):
        for j in range(chunk_numel):
            sent = [
                all_values[r][c, s].item() for r in range(ranks) for s in range(k) if all_indices[r][c, s].item() == j
            ]
            expected[c, j] = sum(sent) / len(sent) if sent else 0.0
    decoded = decode_mean(all_indices, all_values, num_chunks, chunk_numel)
    assert decoded.dtype == torch.float32
    torch.testing.assert_close(decoded.double(), expected, rtol=0, atol=1e-6)
    assert (decoded[:, chunk_numel - 1] == 0).all()
    assert torch.equal(decode_mean(all_indices, all_values, num_chunks, chunk_numel), decoded)


# ----------------------------------------------------------------------------- the synchronizer, one process


def test_lossless_when_topk_is_the_chunk_size():
    sync = DemoSynchronizer(topk=64, chunk_size=8, momentum=0.9, value_dtype=torch.float32)
    grads = [randn(24, 16, seed=8), randn(40, seed=9)]
    out = sync.synchronize(grads, [0, 1])  # first step: accumulated momentum == grad
    for synchronized, grad, key in zip(out, grads, [0, 1]):
        assert synchronized.dtype == torch.float32 and synchronized.shape == grad.shape
        torch.testing.assert_close(synchronized, grad, rtol=0, atol=1e-5)
        assert sync.state[key].abs().max().item() < 1e-5
    # later steps: nothing is kept, so the accumulator is only the new grad
    grads2 = [randn(24, 16, seed=10), randn(40, seed=11)]
    for synchronized, grad in zip(sync.synchronize(grads2, [0, 1]), grads2):
        torch.testing.assert_close(synchronized, grad, rtol=0, atol=1e-5)
    # bfloat16 values: lossless up to bf16 rounding, the rounding error is kept locally
    sync16 = DemoSynchronizer(topk=64, chunk_size=8, momentum=0.9)
    (synchronized,) = sync16.synchronize([grads[0]], [0])
    assert (synchronized - grads[0]).abs().max().item() <= 2**-8 * grads[0].abs().max().item() * 8
    torch.testing.assert_close(synchronized + sync16.state[0], grads[0], rtol=0, atol=1e-5)


def test_error_feedback_conserves_and_matches_hand_topk():
    momentum, k = 0.8, 5
    sync = DemoSynchronizer(topk=k, chunk_size=8, momentum=momentum)
    basis = closed_form_basis(8).float()
    kept = torch.zeros(8, 8)
    for step in range(4):
        grad = randn(8, 8, seed=20 + step)
        accumulated = momentum * kept + grad
        (synchronized,) = sync.synchronize([grad], [3])
        kept = sync.state[3].clone()
        # sent + kept == accumulated
        torch.testing.assert_close(synchronized + kept, accumulated, rtol=0, atol=1e-5)
        # independent: one 8x8 tile, keep the k largest |B X B^T|, bf16-round, invert
        coefficients = (basis @ accumulated @ basis.T).reshape(-1)
        top = coefficients.abs().argsort(descending=True)[:k]
        sparse = torch.zeros(64)
        sparse[top] = coefficients[top].to(torch.bfloat16).float()
        expected = basis.T @ sparse.reshape(8, 8) @ basis
        torch.testing.assert_close(synchronized, expected, rtol=0, atol=1e-5)


def test_bytes_match_hand_payload():
    # 64x64 with chunk 8: 8*8 = 64 tiles of 8x8 = 64 coefficients, keep 8 per tile -> 512 entries.
    # 130-vector with chunk 8: chunk_size_for(130, 8) = 5 -> 26 runs of 5, k clamped to 5 -> 130 entries.
    # int16 index (2 B, every chunk <= 32767 elements) + bfloat16 value (2 B) per entry.
    expected = (64 * 8 + 26 * 5) * (2 + 2)
    assert expected == 2568
    sync = DemoSynchronizer(topk=8, chunk_size=8, momentum=0.9)
    grads = [randn(64, 64, seed=30), randn(130, seed=31)]
    sync.synchronize(grads, [0, 1])
    assert sync.last_bytes_sent == expected and sync.last_bytes_received == 0  # W = 1
    sync.synchronize(grads, [0, 1])
    assert sync.bytes_sent == 2 * expected and sync.bytes_received == 0
    assert payload_bytes([(64, 64), (130,)], 8, 8) == expected
    # 64x64 with chunk 64: one 64x64 tile, 8 entries -> 32 bytes
    single = DemoSynchronizer(topk=8, chunk_size=64)
    single.synchronize([grads[0]], [0])
    assert single.last_bytes_sent == 8 * (2 + 2) == 32
    # a 200x200 tile (40000 elements > 32767) needs int32 indices: 4 entries * (4 + 2) bytes
    wide = DemoSynchronizer(topk=4, chunk_size=200)
    wide.synchronize([randn(200, 200, seed=32)], [0])
    assert wide.last_bytes_sent == 4 * (4 + 2) == 24
    # float32 values
    full = DemoSynchronizer(topk=8, chunk_size=8, value_dtype=torch.float32)
    full.synchronize(grads, [0, 1])
    assert full.last_bytes_sent == (64 * 8 + 26 * 5) * (2 + 4)


def _run_steps(sync, steps, start=0):
    outputs = []
    for step in range(start, steps):
        grads = [randn(16, 24, seed=40 + step), randn(10, seed=60 + step), randn(4, 3, 3, 3, seed=80 + step)]
        outputs.append(sync.synchronize(grads, [0, 1, 2]))
    return outputs


def test_state_dict_resumes_exactly():
    reference = DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9)
    expected = _run_steps(reference, 5)
    first = DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9)
    _run_steps(first, 2)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    saved = first.state_dict()
    saved["momentum_buffers"][0].add_(1.0)  # a clone: the live state is untouched
    assert not torch.equal(saved["momentum_buffers"][0], first.state[0])
    buffer.seek(0)
    resumed = DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.bytes_sent == first.bytes_sent
    resumed_outputs = _run_steps(resumed, 5, start=2)
    for got, want in zip(resumed_outputs, expected[2:]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert resumed.bytes_sent == reference.bytes_sent
    assert all(torch.equal(resumed.state[key], reference.state[key]) for key in reference.state)


# ----------------------------------------------------------------------------- two gloo processes


def _rank_grads(rank: int, step: int) -> list[torch.Tensor]:
    seed = 1000 * rank + step
    return [randn(16, 24, seed=seed), randn(10, seed=seed + 100), randn(4, 3, 3, 3, seed=seed + 200)]


def _gloo_worker(rank: int, init_file: str, out_dir: str, threads: int, steps: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    settle_gloo_workers_at_exit()  # no abort at exit (see its module)
    try:
        sync = DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9)
        outputs = [sync.synchronize(_rank_grads(rank, step), [0, 1, 2]) for step in range(steps)]
        torch.save(
            {
                "outputs": outputs,
                "sent": sync.bytes_sent,
                "received": sync.bytes_received,
                "last_sent": sync.last_bytes_sent,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_gloo_ranks_agree_bitwise_with_single_process_decode(tmp_path):
    steps = 3
    mp.start_processes(
        _gloo_worker,
        args=(str(tmp_path / "init"), str(tmp_path), torch.get_num_threads(), steps),
        nprocs=2,
        start_method=START_METHOD,
    )
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    # single-process reference: each rank's encoder, then the mean decode of both payloads
    encoders = [DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9) for _ in range(2)]
    per_call = payload_bytes([(16, 24), (10,), (4, 3, 3, 3)], 4, 8)
    for step in range(steps):
        payloads = [encoders[rank].encode(_rank_grads(rank, step), [0, 1, 2]) for rank in range(2)]
        expected = DemoSynchronizer.decode(payloads)
        own = DemoSynchronizer.decode(payloads[:1])
        for i in range(3):
            assert torch.equal(results[0]["outputs"][step][i], results[1]["outputs"][step][i])
            assert torch.equal(results[0]["outputs"][step][i], expected[i])
            assert not torch.equal(expected[i], own[i])  # rank 1's payload was really used
    for result in results:
        assert result["last_sent"] == per_call
        assert result["sent"] == steps * per_call and result["received"] == steps * per_call  # W - 1 = 1


# ----------------------------------------------------------------------------- the DeMo optimizer


def _least_squares(seed=0):
    a = randn(64, 12, seed=seed)
    b = a @ randn(12, 3, seed=seed + 1) + 0.01 * randn(64, 3, seed=seed + 2)  # nearly consistent
    weight = torch.nn.Parameter(torch.zeros(12, 3))
    bias = torch.nn.Parameter(torch.zeros(3))

    def loss_fn():
        return ((a @ weight + bias - b) ** 2).mean()

    return weight, bias, loss_fn


def test_demo_optimizer_reduces_least_squares_loss():
    weight, bias, loss_fn = _least_squares()
    optimizer = DeMo([weight, bias], lr=0.01, topk=8, chunk_size=8, momentum=0.9)
    initial = loss_fn().item()

    def closure():
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    losses = [optimizer.step(closure).item() for _ in range(60)]
    assert losses[0] == pytest.approx(initial)
    assert loss_fn().item() < 0.6 * initial


def test_demo_update_is_lr_times_sign_and_weight_decay_is_decoupled():
    weight, bias, loss_fn = _least_squares(seed=3)
    frozen = torch.nn.Parameter(torch.ones(5))
    lr, weight_decay = 0.05, 0.1
    with torch.no_grad():
        weight.copy_(randn(12, 3, seed=4))
    twin = DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9)
    optimizer = DeMo(
        [weight, bias, frozen],
        lr=lr,
        weight_decay=weight_decay,
        synchronizer=DemoSynchronizer(topk=4, chunk_size=8, momentum=0.9),
    )
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn().backward()
        frozen.grad = torch.zeros(5)  # synchronized value 0: no sign step, only weight decay
        before = [p.detach().clone() for p in (weight, bias, frozen)]
        synchronized = twin.synchronize([weight.grad, bias.grad, frozen.grad], [0, 1, 2])
        optimizer.step()
        for param, old, s in zip((weight, bias, frozen), before, synchronized):
            decayed = old * (1 - lr * weight_decay)
            assert torch.equal(param.detach(), decayed - lr * torch.sign(s))
            moved = (param.detach() - decayed).abs()
            nonzero = s != 0
            torch.testing.assert_close(moved[nonzero], torch.full_like(moved[nonzero], lr), rtol=0, atol=1e-6)
            assert (moved[~nonzero] == 0).all()
        assert (synchronized[0] != 0).any() and (synchronized[2] == 0).all()


def test_demo_optimizer_state_dict_round_trip():
    weight, bias, loss_fn = _least_squares(seed=5)
    optimizer = DeMo([weight, bias], lr=0.01, topk=4, chunk_size=8, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    state = optimizer.state_dict()
    assert {"state", "param_groups", "demo_synchronizer"} <= set(state)
    w2, b2, _ = _least_squares(seed=5)
    with torch.no_grad():
        w2.copy_(weight)
        b2.copy_(bias)
    restored = DeMo([w2, b2], lr=0.01, topk=4, chunk_size=8, momentum=0.9)
    restored.load_state_dict(state)
    for opt, params in ((optimizer, (weight, bias)), (restored, (w2, b2))):
        opt.zero_grad()
        ((randn(64, 12, seed=9) @ params[0] + params[1]) ** 2).mean().backward()
        opt.step()
    assert torch.equal(weight, w2) and torch.equal(bias, b2)
    assert restored.synchronizer.bytes_sent == optimizer.synchronizer.bytes_sent


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"topk": 0}, "topk"),
        ({"topk": 2.5}, "topk"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"value_dtype": torch.int8}, "value_dtype"),
    ],
)
def test_synchronizer_rejects_invalid_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DemoSynchronizer(**kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": -1.0}, "lr"),
        ({"weight_decay": -0.5}, "weight_decay"),
        ({"synchronizer": object()}, "synchronizer"),
        ({"topk": 0}, "topk"),
        ({"momentum": 1.5}, "momentum"),
    ],
)
def test_demo_optimizer_rejects_invalid_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DeMo([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_function_arguments_are_validated():
    with pytest.raises(ValueError, match="length"):
        chunk_size_for(0)
    with pytest.raises(ValueError, match="max_chunk"):
        chunk_size_for(8, 0)
    with pytest.raises(ValueError, match="k"):
        topk_chunks(torch.zeros(2, 4), 0)
    sync = DemoSynchronizer()
    with pytest.raises(ValueError, match="keys"):
        sync.synchronize([torch.zeros(3)], [0, 1])
    sync.synchronize([torch.zeros(3)], [0])
    with pytest.raises(ValueError, match="shape"):
        sync.synchronize([torch.zeros(4)], [0])
