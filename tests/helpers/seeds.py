"""Seeds of the tests whose inputs are fresh every run."""

from __future__ import annotations

import os

import numpy as np

TEST_SEED_ENV = "PK_JAX_TEST_SEED"


def fresh_seed(env: str = TEST_SEED_ENV) -> int:
    """A seed drawn from numpy's default_rng, or the integer in environment
    variable `env` where it is set. Tests name their seed in failure messages;
    `PK_JAX_TEST_SEED=<seed> pytest <test id>` reruns a failure with it."""
    fixed = os.environ.get(env)
    if fixed:
        try:
            return int(fixed)
        except ValueError:
            raise ValueError(f"{env}={fixed!r}: expected an integer seed") from None
    return int(np.random.default_rng().integers(1 << 31))
