"""A model of the fused ring backward's stream protocol
(csrc/kernels/ring_attention_bwd/ring_attention_bwd.cu: enqueue and
side_step): every rank's main and side streams as lists of waits, events,
slot reads and writes, copies and posts, run in random interleavings.
Checks, for rings of 2 .. 9: no deadlock, every posted[] flag grows
monotonically (posts to prev and next share it at n = 2), and every read (a
block kernel, an add, a forwarding copy) sees the content it expects,
unchanged from its start to its end (so the two K/V slots and the partial
slot are never overwritten under a reader). Two broken variants must fail:
without the credit wait a slot is overwritten, and with the credit posted
after the wait the ring deadlocks.

The post indices the streams use are not a copy: they are what the header's
make_posts computes, compiled for the host (tests/native/bwd_posts_check.cc)
and read at test time, so a change of the header's post order is checked by
the model as it is."""

import os
import random
import subprocess

import pytest

from conftest import build_native, cuda_home

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_MAX_MODEL = 9  # ring sizes the model runs (each interleaving grows with n)


@pytest.fixture(scope="module")
def posts(tmp_path_factory):
    """{n: (kv, partial, credit, home, count)} from the header's make_posts,
    kv / partial / credit as {step: index}."""
    cuda = cuda_home()
    include = (os.path.join(cuda, "include") if cuda else
               os.path.join(ROOT, "tests", "native", "host_stub"))
    exe = build_native("bwd_posts_check.cc", tmp_path_factory.mktemp("posts") / "bwd_posts",
                       (include,))
    out = subprocess.run([exe], capture_output=True, text=True, check=True, timeout=60).stdout
    table = {}
    for line in out.strip().splitlines():
        head, kv, partial, credit = line.split("|")
        n, count, home = (int(v) for v in head.split())
        steps = lambda field: dict(zip(range(1, n), (int(v) for v in field.split())))
        table[n] = (steps(kv), steps(partial), steps(credit), home, count)
    return table


def build(posts, r, credit_wait=True, credit_first=True):
    kv, partial, credit, home, count = posts
    n = len(kv) + 1
    prev, nxt = (r - 1) % n, (r + 1) % n
    main, side = [], []
    ev = {"fork": 0, "join": 0}
    def fork():
        ev["fork"] += 1; k = ev["fork"]
        main.append(("rec", "fork", k)); side.append(("waitev", r, "fork", k))
    def push(src, dst_slot, content, idx):
        side.append(("copy", src, (nxt, dst_slot), content))
        side.append(("post", nxt, idx))
    def side_step(s):
        fork()
        if s >= 1:
            post, wait = ("post", prev, credit[s]), ("wait", nxt, credit[s])
            side.extend([post, wait] if credit_first else [wait, post])
            if not credit_wait:
                side.remove(wait)
        if s < n - 1:
            push((r, "acc"), "partial", ("partial", (r - s) % n, s + 1), partial[s + 1])
            ev["join"] += 1; side.append(("rec", "join", ev["join"]))
        else:
            push((r, "home"), "partial", ("home", nxt), home)
        if s + 2 <= n - 1:
            side.append(("wait", prev, kv[s + 1]))
            push((r, "kv%d" % ((s + 1) % 2)), "kv%d" % ((s + 2) % 2), ("kv", (r - s - 1) % n), kv[s + 2])
    fork()
    push((r, "own"), "kv1", ("kv", r), kv[1])
    main.append(("write", (r, "acc"), ("partial", r, 1)))
    side_step(0)
    for s in range(1, n):
        main.append(("wait", prev, kv[s]))
        main.append(("read", (r, "kv%d" % (s % 2)), ("kv", (r - s) % n)))  # block kernel
        main.append(("wait", prev, partial[s]))
        main.append(("waitev", r, "join", s))
        main.append(("read", (r, "partial"), ("partial", (r - s) % n, s)))
        if s < n - 1: main.append(("write", (r, "acc"), ("partial", (r - s) % n, s + 1)))
        else: main.append(("write", (r, "home"), ("home", (r + 1) % n)))
        side_step(s)
    main.append(("wait", prev, home))
    main.append(("read", (r, "partial"), ("home", r)))
    return main, side

def run(posts, seed, **variant):
    rnd = random.Random(seed)
    n = len(posts[0]) + 1
    streams = {}
    for r in range(n):
        m, s = build(posts, r, **variant)
        streams[(r, "m")] = m; streams[(r, "s")] = s
    pc = {k: 0 for k in streams}
    posted = {(r, q): -1 for r in range(n) for q in range(n)}  # posted[q] on rank r
    events = {(r, e): 0 for r in range(n) for e in ("fork", "join")}
    mem = {(r, "own"): ("kv", r) for r in range(n)}
    inflight = {}  # stream -> (op, phase, snapshot)
    while True:
        ready = []
        for k, ops in streams.items():
            if pc[k] >= len(ops): continue
            op = ops[pc[k]]; r = k[0]
            if op[0] == "wait" and posted[(r, op[1])] < op[2]: continue
            if op[0] == "waitev" and events[(op[1], op[2])] < op[3]: continue
            ready.append(k)
        if not ready:
            left = {k: streams[k][pc[k]] for k in streams if pc[k] < len(streams[k])}
            assert not left, f"deadlock n={n}: {left}"
            return
        k = rnd.choice(ready); op = streams[k][pc[k]]; r = k[0]
        kind = op[0]
        if kind in ("read", "copy"):
            src = op[1]
            if k not in inflight:  # begin
                want = op[2] if kind == "read" else op[3]
                assert mem.get(src) == want, f"n={n} {k} {op}: reads {mem.get(src)}"
                inflight[k] = mem.get(src); continue
            assert mem.get(src) == inflight.pop(k), f"n={n} {k} {op}: overwritten while read"
            if kind == "copy": mem[op[2]] = op[3]
        elif kind == "write": mem[op[1]] = op[2]
        elif kind == "post":
            idx = op[2]; q = op[1]
            assert idx > posted[(q, r)], f"n={n} non-monotonic post {op} from {r}"
            posted[(q, r)] = idx
        elif kind == "rec": events[(r, op[1])] = op[2]
        pc[k] += 1



def test_posts_from_the_header(posts):
    """Every ring size of the header (2 .. kMaxRanks) has 3n - 2 distinct
    posts, one index each, 0 .. 3n - 3, and kv[1] is the first."""
    assert sorted(posts) == list(range(2, max(posts) + 1)) and max(posts) >= N_MAX_MODEL
    for n, (kv, partial, credit, home, count) in posts.items():
        indices = [*kv.values(), *partial.values(), *credit.values(), home]
        assert count == 3 * n - 2 and sorted(indices) == list(range(count)), n
        assert kv[1] == 0 and home == count - 1


@pytest.mark.parametrize("n", range(2, N_MAX_MODEL + 1))
def test_protocol_is_safe_and_live(posts, n):
    for seed in range(60):
        run(posts[n], seed)


def test_missing_credit_wait_overwrites_a_slot(posts):
    with pytest.raises(AssertionError, match="overwritten|reads"):
        for seed in range(60):
            run(posts[4], seed, credit_wait=False)


def test_credit_after_its_wait_deadlocks(posts):
    with pytest.raises(AssertionError, match="deadlock"):
        run(posts[3], 0, credit_first=False)


def test_the_model_follows_the_header(posts):
    """The model runs on the compiled constants, not on a copy: a header
    whose kv posts come after their step's partial (another order) makes the
    same model fail."""
    kv, partial, credit, home, count = posts[4]
    swapped = ({s: partial.get(s, v) for s, v in kv.items()},
               {s: kv.get(s, v) for s, v in partial.items()}, credit, home, count)
    with pytest.raises(AssertionError, match="non-monotonic|deadlock|reads|overwritten"):
        for seed in range(20):
            run(swapped, seed)
