"""The test tree's library, imported by tests, fixtures and `bench/`: servers started as
subprocesses and what they leave on the machine, the reference the served vectors are held
to, how answers are read, and tiny model folders built at test time. No fixtures and no
tests live here (they are in tests/conftest.py and the test modules)."""
