"""Exceptions raised by pk_jax."""


class PkJaxError(RuntimeError):
    """Base class of pk_jax's runtime errors."""


class PkJaxTimeoutError(PkJaxError):
    """A kernel's bounded wait for a peer GPU gave up.

    The message names the op, the device and rank that waited, the peer rank
    it waited for and the epoch it expected. The outputs of the call that
    timed out (and of later pk_jax calls on that device) are NaN-poisoned
    (integer gathers: all bits set); the state is cleared by the time this
    is raised.
    """
