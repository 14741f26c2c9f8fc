"""Benchmarks for the embedding server: corpus, load generator, in-process ceiling, driver.

Run the modules from the repository root with the project's interpreter, e.g.
``.venv/bin/python -m bench.run --target infinity-torch``; see ``bench/RESULTS.md``.
"""
