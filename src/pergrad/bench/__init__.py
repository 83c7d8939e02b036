"""Benchmarks that print ratios against baselines measured in the same run (``pergrad bench``).

Timings are never tests: these modules only measure and print.
"""
