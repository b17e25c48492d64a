"""Benchmarks (not tests): ``python -m tests.bench [names...]`` runs the ``bench_*.py`` modules.

pytest does not collect this package (``norecursedirs`` in pyproject.toml excludes it).
"""
