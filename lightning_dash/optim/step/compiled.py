"""The step's pure kernels run eagerly, or each compiled whole with ``torch.compile``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Distinct graphs one compiled kernel may hold (one per stack shape and dtype, and per
#: subset of moving blocks); torch's default of 8 is too few for a large model.
RECOMPILE_LIMIT = 256
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def kernel(function: Callable[..., Any], compiled: bool) -> Callable[..., Any]:
    """``function`` itself, or compiled whole with ``torch.compile(fullgraph=True)``."""
    if not compiled:
        return function
    if function not in _COMPILED:
        compiled_function = torch.compile(function, fullgraph=True, dynamic=False)

        def call(*args: Any) -> Any:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled_function(*args)

        _COMPILED[function] = call
    return _COMPILED[function]
