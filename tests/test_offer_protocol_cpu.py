"""The zero-copy offer protocol (csrc/pk/offer.h: how all_gather's ld/st push
and pull lend an XLA buffer to a peer for one call), checked in every
interleaving of a model of a publisher and a possibly late reader, with the
protocol's own decision functions compiled for the host
(tests/native/offer_check.cc).

A reader may only touch the publisher's buffer before the publisher returns
it to XLA (or after the publisher recorded that it could not wait any
longer: ErrorRecord::unsafe), and only with the publisher's layout. The
protocol before (a plain post that a late reader trusted) breaks both; so do
the new protocol with a plain-store post or without the layout check.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import build_native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return build_native("offer_check.cc", tmp_path_factory.mktemp("offer") / "offer_check",
                        opt="-O2")


def _run(exe, variant, layout):
    res = subprocess.run([exe, variant, layout], capture_output=True, text=True, timeout=600)
    assert res.returncode in (0, 1), res.stderr
    return res.returncode == 0, res.stdout.strip()


def test_protocol_is_safe_with_a_late_reader(checker):
    ok, out = _run(checker, "new", "same")
    assert ok, out
    fields = dict(f.split("=") for f in out.split()[1:])
    # Some runs copy (the protocol moves data), some end with the publisher
    # recording that a claimed reader outlived its second wait (flagged, not
    # silent).
    assert int(fields["copies"]) > 0 and int(fields["hazards"]) > 0, out


def test_protocol_never_copies_with_another_layout(checker):
    ok, out = _run(checker, "new", "other")
    assert ok, out
    assert "copies=0" in out, out


def test_old_protocol_lets_a_late_reader_use_a_returned_buffer(checker):
    """The protocol before revocable offers: the late reader writes into a
    buffer the publisher already returned, or copies with the layout of the
    publisher's next (smaller) call."""
    ok, out = _run(checker, "legacy", "same")
    assert not ok and out.startswith("VIOLATION"), out


def test_old_protocol_fails_mispaired_programs(checker):
    ok, out = _run(checker, "legacy", "other")
    assert not ok and out.startswith("VIOLATION"), out


def test_plain_store_post_would_undo_a_claim(checker):
    """A late block re-posting with a plain store turns a claim back into an
    offer that the publisher then revokes while the reader copies: the
    post must be an atomic max."""
    ok, out = _run(checker, "store-post", "same")
    assert not ok and "after P returned" in out, out


def test_layout_check_is_needed(checker):
    ok, out = _run(checker, "no-layout", "other")
    assert not ok and "layout" in out, out
