"""keelrl benchmarks: `python -m bench` runs them all and writes BENCHMARKS.md (see bench/__main__.py)."""
