"""Code the tests share, imported as `helpers.<module>`: tests/conftest.py puts tests/ on sys.path, since under
--import-mode=importlib a test module cannot import another.

- cli: the CLI in process (`invoke`, `invoke_ok`) and the one-error-line check;
- artifacts: a checkpoint and its export (fused when asked), from a model built here or imported through the CLI;
- sources: random source ids, seeded by a number: ordinary ids only, as the source kind defines them;
- faults: stand-ins that make a call fail (a full disk, Ctrl-C, a refused permission).
"""
