"""Benchmarks and demos; each writes JSON under bench/results/."""
