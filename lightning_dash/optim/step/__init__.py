"""One DASH step: the update maths per stack, the factor statistics and grafting, the device's verdict
and the host's bookkeeping, and the recomputation of inverse roots (in line or on a side stream)."""
