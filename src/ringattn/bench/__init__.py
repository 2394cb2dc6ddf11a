"""Benchmarks: one rank's share of an emulated ring against monolithic attention, and the 1M-token
check.
"""
