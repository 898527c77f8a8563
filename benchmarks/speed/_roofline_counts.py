"""The roofline model's counts (``roofline.py``): FLOPs and bytes per block, per element and per root,
and the parameter shapes of the models it covers."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "distributed"))  # fsdp_estimate.py: Qwen3's layout

from _step_time_cases import MODELS as STEP_TIME_MODELS
from _step_time_cases import GPTShape, gpt_parameter_shapes
from fsdp_estimate import Qwen3Config, qwen3_parameters

from lightning_dash.optim.config import DEFAULT_EPSILON, DashConfig
from lightning_dash.optim.roots import spectrum_floor
from lightning_dash.optim.roots.common import spectral_upper_bound
from lightning_dash.optim.roots.newton import planned_scaled_iterations
from lightning_dash.optim.stacks.blocks import MatrixView, param_regions
from lightning_dash.optim.step.grafting import SPECTRAL_ITERATIONS

Shapes = list[tuple[str, tuple[int, ...]]]
STATE_BYTES = 4  # optimizer state is fp32 in every column


# ---------------------------------------------------------------------- cost constants
#: FLOPs per element of DASH's elementwise work on a block, counted from factors.py,
#: grafting.py and stack_update.py: gradient scaling for the factors 4, Adam second moment
#: (hypot) 7, momentum lerp 3, bias correction 1, Adam direction 3, graft norm (two block
#: norms and the rescale) 12, fallback select and -lr 2, finiteness check 1, parameter add 1.
BLOCK_ELEMENTWISE_FLOPS = 34
#: FLOPs per element of Adam on a 1-D parameter inside DASH (the above without the factor
#: scaling and the graft norm).
VECTOR_ELEMENTWISE_FLOPS = 17
#: AdamW per element: two moment updates 7, denominator 3, update 3, weight decay 1.
ADAMW_FLOPS = 14
#: Fused passes over a block's elements: parameter read and write and gradient read (in
#: the parameter dtype), momentum and Adam second moment read and write, the fp32 gradient
#: block the statistics GEMMs read written once, the direction read once (fp32).
BLOCK_PARAM_PASSES = 3
BLOCK_STATE_PASSES = 6
#: 1-D parameters: parameter read/write and gradient read; the fp32 gradient copy written
#: and read, momentum and second moment read and write, the update written and read.
VECTOR_STATE_PASSES = 8
#: fp32 passes over each block side's ``s x s`` per step that packed state adds (``stacks/packed.py``):
#: the root formed from its triangle for the direction (the triangle read twice, the root written) 3,
#: the new factor's triangle written into the pair (new and old read, written) 3, the pair
#: re-assembled (read, written) 2.
PACKING_PASSES = 8
#: fp32 reads of a block per step by spectral grafting's estimate of the largest singular value
#: (``grafting.spectral_norm``): two products per power iteration and one after them, for the Shampoo
#: direction and for the Adam step; each product reads the block once and does 2 FLOPs per element.
SPECTRAL_READS = 2 * (2 * SPECTRAL_ITERATIONS + 1)
#: ``torch.where(bad, old, new, out=old)`` per state tensor, eager: read old, read new, and
#: the write of the candidate into its own tensor that an in-place update would not need.
COMMIT_PASSES = 3
#: eigh FLOPs per b^3: symmetric QR with eigenvectors, ~9 n^3 (Golub and Van Loan, Matrix
#: Computations, 4th ed., Table 8.3.1), plus 2 b^3 for the reconstruction ``V diag V^T``.
EIGH_FLOPS = 9
EIGH_RECONSTRUCTION_FLOPS = 2
#: Newton-DB (one scaled coupled pass for ``A^(-1/4)``, ``_coupled_iteration``): GEMMs per
#: iteration, ``X N``, ``N^2``, ``N^4`` and ``N^4 M``; the first step skips ``X N`` and the last
#: needs only ``X N``, so ``K`` iterations cost ``4 (K - 1)`` GEMMs.
NEWTON_GEMMS_PER_ITERATION = 4
#: fp32 elementwise passes over b^2 per iteration: the residual's read of ``M`` 1, ``N = beta M``
#: read and write 2 (the identity is added on the diagonal only).
NEWTON_PASSES_PER_ITERATION = 3
#: fp32 passes over b^2 per factor and root computation outside the iterations: the due
#: factors concatenated 2, ``normalise`` 5, ``add_diagonal`` clone 2 (the noise-floor lift is
#: in place), power iteration (11 batched mat-vecs of 8 vectors, each reading the matrix) 11,
#: spectral scaling 2, ``symmetrize`` 3, rescaling 4, accept 3.
NEWTON_SETUP_PASSES = 32
POWER_ITERATION_FLOPS = 11 * 2 * 8  # per b^2: 11 products of (b x b)(b x 8)
#: fp32 passes over b^2 per factor on the eigh path besides the decomposition and the
#: reconstruction GEMM: concatenation 2, ``normalise`` 5, ``symmetrize`` 5, eigenvectors
#: scaled 2, rescaling 2, accept 3.
EIGH_PASSES = 19


# ---------------------------------------------------------------------- shapes
GPT_1_3B = GPTShape(width=2048, layers=24, vocab=50257, context=2048)  # GPT-3 XL (Brown et al. 2020, Table 2.1)
LLAMA3_8B = Qwen3Config(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    tie_word_embeddings=False,
)


def llama3_parameters(config: Qwen3Config = LLAMA3_8B) -> Shapes:
    """Llama-3's parameters: Qwen3's list (same layout) without its per-head q/k RMSNorms."""
    qk_norms = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    return [(name, shape) for name, shape in qwen3_parameters(config) if not name.endswith(qk_norms)]


MODELS: dict[str, Shapes] = {
    "gpt2-125m": gpt_parameter_shapes(STEP_TIME_MODELS["gpt2-125m"]),
    "gpt2-350m": gpt_parameter_shapes(STEP_TIME_MODELS["gpt2-350m"]),
    "gpt2-774m": gpt_parameter_shapes(STEP_TIME_MODELS["gpt2-774m"]),
    "gpt-1.3b": gpt_parameter_shapes(GPT_1_3B),
    "llama3-8b": llama3_parameters(),
}


def block_counts(shapes: Iterable[tuple[int, ...]], block_size: int) -> Counter[tuple[int, int]]:
    """How many ``rows x cols`` blocks DASH cuts the parameters of >= 2 dims into, by shape."""
    counts: Counter[tuple[int, int]] = Counter()
    for index, shape in enumerate(shapes):
        if len(shape) >= 2 and math.prod(shape) > 0:
            for region in param_regions(index, MatrixView.of(shape), block_size):
                counts[region.block_shape] += region.num_blocks
    return counts


def vector_elements(shapes: Iterable[tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes if len(shape) == 1)


def factor_sides(blocks: Counter[tuple[int, int]]) -> Counter[int]:
    """Factor matrices by side: each block has one ``m x m`` and one ``n x n``."""
    sides: Counter[int] = Counter()
    for (rows, cols), count in blocks.items():
        sides[rows] += count
        sides[cols] += count
    return sides


# ---------------------------------------------------------------------- counts per block
def statistics_flops(rows: int, cols: int) -> int:
    """``G G^T`` and ``G^T G``: two matmuls, ``2 m n (m + n)``."""
    return 2 * rows * cols * (rows + cols)


def statistics_bytes(rows: int, cols: int) -> int:
    """The fp32 gradient block read by both GEMMs; L and R read and written."""
    return STATE_BYTES * (2 * rows * cols + 2 * (rows * rows + cols * cols))


def direction_flops(rows: int, cols: int) -> int:
    """``(L^(-1/4) M) R^(-1/4)``: two matmuls, ``2 m n (m + n)``."""
    return 2 * rows * cols * (rows + cols)


def direction_bytes(rows: int, cols: int) -> int:
    """Both roots and M read; the intermediate written and read back; the direction written."""
    return STATE_BYTES * (rows * rows + cols * cols + 4 * rows * cols)


def block_elementwise_bytes(rows: int, cols: int, param_bytes: int) -> int:
    return rows * cols * (BLOCK_PARAM_PASSES * param_bytes + BLOCK_STATE_PASSES * STATE_BYTES)


def block_commit_bytes(rows: int, cols: int) -> int:
    """Commit passes of momentum, second moment, L and R (every step)."""
    return COMMIT_PASSES * STATE_BYTES * (2 * rows * cols + rows * rows + cols * cols)


def packing_bytes(rows: int, cols: int) -> int:
    """The passes packed state adds on both sides of a block (every step)."""
    return PACKING_PASSES * STATE_BYTES * (rows * rows + cols * cols)


def spectral_grafting_flops(rows: int, cols: int) -> int:
    """Spectral grafting's products over a block (every step)."""
    return 2 * SPECTRAL_READS * rows * cols


def spectral_grafting_bytes(rows: int, cols: int) -> int:
    return SPECTRAL_READS * STATE_BYTES * rows * cols


def adamw_bytes_per_element(param_bytes: int) -> int:
    """Read parameter, gradient, m and v; write parameter, m and v (m and v in fp32)."""
    return 3 * param_bytes + 4 * STATE_BYTES


def vector_bytes_per_element(param_bytes: int) -> int:
    """DASH's Adam on 1-D parameters, commit passes not included."""
    return 3 * param_bytes + VECTOR_STATE_PASSES * STATE_BYTES


def newton_db_iterations(matmul_dtype: torch.dtype, side: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """Iterations of Newton-DB's one pass, as DASH plans them for relative damping ``epsilon``
    (the same calls as :func:`~lightning_dash.optim.roots.newton.newton_db` makes)."""
    settings = DashConfig(inverse_root_method="newton_db", matmul_dtype=matmul_dtype, epsilon=epsilon).root_settings
    floor = spectrum_floor(settings, side, epsilon)
    return planned_scaled_iterations(floor, spectral_upper_bound(settings.scaling), 4)


def newton_gemms(iterations: int) -> int:
    """GEMMs of one Newton-DB root of ``iterations`` steps (none into ``X = I``, none after the last)."""
    return NEWTON_GEMMS_PER_ITERATION * (iterations - 1)


def newton_root_flops(side: int, iterations: int) -> int:
    """GEMM FLOPs of one Newton-DB root of a ``side x side`` factor."""
    return newton_gemms(iterations) * 2 * side**3


def newton_root_gemm_bytes(side: int, iterations: int, gemm_bytes: int) -> int:
    return newton_gemms(iterations) * gemm_bytes * side * side


def newton_root_elementwise_flops(side: int) -> int:
    """The power iteration's mat-vecs (the elementwise passes' FLOPs are left out)."""
    return POWER_ITERATION_FLOPS * side * side


def newton_root_elementwise_bytes(side: int, iterations: int) -> int:
    """fp32 passes of one Newton-DB root outside its GEMMs (its commit is counted with the others)."""
    return (NEWTON_SETUP_PASSES + iterations * NEWTON_PASSES_PER_ITERATION) * STATE_BYTES * side * side


def eigh_flops(side: int) -> int:
    return (EIGH_FLOPS + EIGH_RECONSTRUCTION_FLOPS) * side**3
