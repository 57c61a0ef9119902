"""Helpers shared by the tests: independent numpy oracles, tiny models, inputs, a server
corpus. ``tests/conftest.py`` puts ``tests/`` on ``sys.path``; import them as
``from helpers.oracle import np_keep``."""
