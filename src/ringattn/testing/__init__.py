"""Test tooling shipped with the library: the float64 yardstick and the emulated (local) ring
world.
"""
