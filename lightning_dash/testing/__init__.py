"""Instruments for tests and benchmarks: counting what a piece of code asks of the device."""
