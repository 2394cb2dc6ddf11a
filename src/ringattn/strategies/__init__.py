"""Strategies: ring, all-gather, Ulysses and hybrid, each one algorithm over the core seams."""
