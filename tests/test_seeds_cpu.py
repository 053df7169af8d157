"""tests/helpers/seeds.py: a fixed seed from the environment, else a fresh draw."""

import pytest

from helpers.seeds import TEST_SEED_ENV, fresh_seed


def test_the_environment_fixes_the_seed(monkeypatch):
    monkeypatch.setenv(TEST_SEED_ENV, "123456789")
    assert fresh_seed() == 123456789
    monkeypatch.setenv("PK_JAX_OTHER_SEED", "7")
    assert fresh_seed("PK_JAX_OTHER_SEED") == 7


def test_fresh_draws_differ_and_fit_31_bits(monkeypatch):
    monkeypatch.delenv(TEST_SEED_ENV, raising=False)
    draws = {fresh_seed() for _ in range(8)}
    assert len(draws) > 1
    assert all(0 <= s < 1 << 31 for s in draws)


def test_a_bad_seed_is_named(monkeypatch):
    monkeypatch.setenv(TEST_SEED_ENV, "abc")
    with pytest.raises(ValueError, match="PK_JAX_TEST_SEED='abc'"):
        fresh_seed()
