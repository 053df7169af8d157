"""A model of the fused ring backward's stream protocol
(csrc/kernels/ring_attention_bwd/ring_attention_bwd.cu: enqueue and
side_step, kept in step with it by hand): every rank's main and side streams
as lists of waits, events, slot reads and writes, copies and posts, run in
random interleavings. Checks, for rings of 2 .. 9: no deadlock, every
posted[] flag grows monotonically (posts to prev and next share it at n = 2),
and every read (a block kernel, an add, a forwarding copy) sees the content
it expects, unchanged from its start to its end (so the two K/V slots and the
partial slot are never overwritten under a reader). Two broken variants must
fail: without the credit wait a slot is overwritten, and with the credit
posted after the wait the ring deadlocks. Post indices come from the header's
make_posts, parsed."""

import random
import re

import pytest

from test_constants_cpu import _source


def make_posts(n):
    kv, partial, credit = {}, {}, {}
    i = 0; kv[1] = i; i += 1
    home = None
    for s in range(n):
        if s >= 1: credit[s] = i; i += 1
        if s < n - 1: partial[s + 1] = i; i += 1
        else: home = i; i += 1
        if s + 2 <= n - 1: kv[s + 2] = i; i += 1
    return kv, partial, credit, home, i

def build(n, r, credit_wait=True, credit_first=True):
    kv, partial, credit, home, count = make_posts(n)
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

def run(n, seed, **variant):
    rnd = random.Random(seed)
    streams = {}
    for r in range(n):
        m, s = build(n, r, **variant)
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



def test_make_posts_mirrors_the_header():
    """The model's post order is the header's (make_posts, statement for statement)."""
    body = re.search(r"inline Posts make_posts\(int n\) \{(.*?)\n\}", _source(
        "csrc/kernels/ring_attention_bwd/ring_attention_bwd.h"), re.S).group(1)
    lines = [x.strip() for x in body.strip().splitlines()]
    assert lines == ["Posts p;", "int i = 0;", "p.kv[1] = i++;", "for (int s = 0; s < n; ++s) {",
                     "if (s >= 1) p.credit[s] = i++;", "if (s < n - 1) p.partial[s + 1] = i++;",
                     "else p.home = i++;", "if (s + 2 <= n - 1) p.kv[s + 2] = i++;", "}",
                     "p.count = i;", "return p;"]
    for n in range(2, 17):
        assert make_posts(n)[4] == 3 * n - 2


@pytest.mark.parametrize("n", range(2, 10))
def test_protocol_is_safe_and_live(n):
    for seed in range(60):
        run(n, seed)


def test_missing_credit_wait_overwrites_a_slot():
    with pytest.raises(AssertionError, match="overwritten|reads"):
        for seed in range(60):
            run(4, seed, credit_wait=False)


def test_credit_after_its_wait_deadlocks():
    with pytest.raises(AssertionError, match="deadlock"):
        run(3, 0, credit_first=False)
