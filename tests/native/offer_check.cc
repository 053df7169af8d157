// Exhaustive check of the zero-copy offer protocol (csrc/pk/offer.h): every
// interleaving of a publisher rank P and a late-or-not reader rank R, with
// each bounded wait free to give up at any step, using the protocol's own
// decisions (offer::classify, claimed, revoke_outcome, same_layout).
//
// The model, one direction of one channel (the other direction is the same
// with the roles swapped):
//   P runs two calls. In call e its two blocks each publish buffer B_e
//   (layout L_e; call 2's buffer is smaller) and raise the offer word
//   (ptr/layout stores, then the atomic max: two steps); its last block then
//   waits for R's done >= e, revokes on a timeout, waits again (patiently)
//   if R holds the offer, flags `unsafe` if that times out too, and returns:
//   B_e goes back to XLA (released).
//   R runs one call (epoch 1) with layout L_R (P's L_1, or another one: two
//   programs that share the channel ran in different orders). Each of its
//   two blocks waits for the offer (or gives up), claims it (a separate
//   compare-and-swap step), reads ptr and layout, checks the layout, and
//   uses the buffer (a start and an end step: the copy takes time). Its last
//   block then releases done = 1.
// Violations (a silent one fails the check): R uses a released buffer (use
// after free: the late write or read into memory XLA reuses), or R uses a
// buffer whose layout is not L_R (a copy with the wrong shape: out of bounds
// when it is larger), while P has not flagged `unsafe`. Once P flagged it
// (it returned although R held its offer, after two timeouts), nothing is
// promised, but the host is told: counted as a hazard, not a violation.
//
// Variants (argv[1]):
//   new          the protocol as built;
//   legacy       the protocol before it (post = plain stores of ptr and
//                posted = e, the reader uses ptr once posted >= e, no claim,
//                no revoke, no layout): expected to fail;
//   store-post   the new protocol with the post a plain store instead of an
//                atomic max (a late block's post undoes a claim): expected to
//                fail;
//   no-layout    the new protocol without the layout check: expected to fail
//                when the layouts differ.
// The model is sequentially consistent: the kernel's release/acquire pairs
// (pk/offer.h) are what make the hardware's order at least as strong where
// the protocol relies on it.
// argv[2]: "same" (L_R = L_1) or "other".
// Prints "OK states=<n> hazards=<flagged unsafe returns> copies=<runs in
// which R copied>" or "VIOLATION <what>: <trace>" (exit code 1).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "pk/layout.h"
#include "pk/offer.h"

namespace {

using pk::offer::word;

enum Variant { kNew, kLegacy, kStorePost, kNoLayout };

constexpr int kBlocks = 2;  // blocks of each rank's grid that post / claim
constexpr int kCalls = 2;   // P's calls
// Layout ids: call 1's, call 2's (smaller buffer), another program's.
constexpr int kLayoutOf[3] = {0, 1, 2};
constexpr int kOtherLayout = 3;

struct State {
  // Shared words (in R's channel unless noted).
  uint64_t offer = 0;   // new: the offer word; legacy: posted
  int ptr = 0;          // buffer id published (1: B_1, 2: B_2)
  int layout = 0;       // layout published with it
  uint64_t done_r = 0;  // R's done for P (in P's channel)
  bool released[3] = {false, false, false};
  bool unsafe = false;  // P flagged a return while R held its offer
  // P.
  int p_call = 1;
  int p_post[kBlocks] = {0, 0};  // 0: ptr/layout next, 1: offer next, 2: posted
  int p_pc = 0;  // 0: posting, 1: done wait, 2: revoke, 3: patient wait, 4: return, 5: finished
  // R's blocks.
  // 0 wait, 1 claim, 2 read layout, 6 read ptr, 3 use start, 4 use end, 5 end
  int r_pc[kBlocks] = {0, 0};
  uint64_t r_seen[kBlocks] = {0, 0};
  int r_buf[kBlocks] = {0, 0};
  bool r_done = false;
  bool copied = false;

  auto key() const {
    return std::make_tuple(offer, ptr, layout, done_r, released[1], released[2], unsafe, p_call,
                           p_post[0], p_post[1], p_pc, r_pc[0], r_pc[1], r_seen[0], r_seen[1],
                           r_buf[0], r_buf[1], r_done, copied);
  }
  bool operator<(const State& o) const { return key() < o.key(); }
};

struct Checker {
  Variant variant;
  int r_layout;
  std::set<State> seen;
  long hazards = 0, copies = 0;
  std::vector<std::string> trace;
  std::string violation;

  bool legacy() const { return variant == kLegacy; }

  // The buffer of P's call e: B_e with layout L_e.
  static int buffer_layout(int buf) { return kLayoutOf[buf - 1]; }

  bool fail(const std::string& what) {
    violation = what;
    return false;
  }

  // R uses buffer `buf` now (start or end of its copy). Once P flagged
  // `unsafe` (it returned while R held its offer) nothing is promised any
  // more, but it is recorded: not a silent violation.
  bool check_use(const State& s, int buf) {
    if (s.unsafe) return true;
    if (s.released[buf]) return fail("R uses P's buffer after P returned it");
    if (buffer_layout(buf) != r_layout) return fail("R copies with another layout than the buffer's");
    return true;
  }

  // Every successor of s, each with a label.
  std::vector<std::pair<std::string, State>> successors(const State& s) {
    std::vector<std::pair<std::string, State>> out;
    const uint64_t e = uint64_t(s.p_call);
    // ---- P ----
    if (s.p_pc == 0) {
      for (int b = 0; b < kBlocks; ++b) {
        if (s.p_post[b] == 0) {
          State t = s;
          t.ptr = s.p_call;
          t.layout = buffer_layout(s.p_call);
          t.p_post[b] = 1;
          out.push_back({"P" + std::to_string(b) + " stores ptr/layout of call " +
                             std::to_string(e), t});
        } else if (s.p_post[b] == 1) {
          State t = s;
          if (legacy()) t.offer = e;
          else if (variant == kStorePost) t.offer = word(e, pk::offer::kOffered);
          else t.offer = std::max(s.offer, word(e, pk::offer::kOffered));
          t.p_post[b] = 2;
          out.push_back({"P" + std::to_string(b) + " offers call " + std::to_string(e), t});
        }
      }
      // The last block finishes after every block posted.
      if (s.p_post[0] == 2 && s.p_post[1] == 2) {
        State t = s;
        t.p_pc = 1;
        out.push_back({"P finishes its copies", t});
      }
    } else if (s.p_pc == 1) {  // done wait
      if (s.done_r >= e) {
        State t = s;
        t.p_pc = 4;
        out.push_back({"P sees R's done", t});
      }
      State t = s;
      t.p_pc = legacy() ? 4 : 2;
      out.push_back({"P's done wait times out", t});
    } else if (s.p_pc == 2) {  // revoke
      State t = s;
      const uint64_t old = s.offer;
      if (old == word(e, pk::offer::kOffered)) t.offer = word(e, pk::offer::kRevoked);
      const auto r = pk::offer::revoke_outcome(old, e);
      t.p_pc = r == pk::offer::Revoke::kInUse ? 3 : 4;
      out.push_back({"P revokes (found " + std::to_string(old) + ")", t});
    } else if (s.p_pc == 3) {  // patient wait
      if (s.done_r >= e) {
        State t = s;
        t.p_pc = 4;
        out.push_back({"P sees R's done at last", t});
      }
      State t = s;
      t.unsafe = true;
      t.p_pc = 4;
      out.push_back({"P's patient wait times out: unsafe", t});
    } else if (s.p_pc == 4) {  // return: the buffer goes back to XLA
      State t = s;
      t.released[s.p_call] = true;
      if (s.p_call < kCalls) {
        t.p_call = s.p_call + 1;
        t.p_post[0] = t.p_post[1] = 0;
        t.p_pc = 0;
      } else {
        t.p_pc = 5;
      }
      out.push_back({"P returns call " + std::to_string(e), t});
    }
    // ---- R (epoch 1) ----
    const uint64_t re = 1;
    for (int b = 0; b < kBlocks; ++b) {
      const std::string who = "R" + std::to_string(b);
      switch (s.r_pc[b]) {
        case 0: {  // wait for the post
          const bool ready = legacy() ? s.offer >= re : pk::offer::arrived(s.offer, re);
          if (ready) {
            State t = s;
            t.r_seen[b] = s.offer;
            t.r_pc[b] = 1;
            out.push_back({who + " sees the post " + std::to_string(s.offer), t});
          }
          State t = s;
          t.r_pc[b] = 5;
          out.push_back({who + "'s wait times out", t});
          break;
        }
        case 1: {  // claim
          State t = s;
          if (legacy()) {
            t.r_pc[b] = 2;
            out.push_back({who + " trusts the post", t});
            break;
          }
          uint64_t swapped = s.r_seen[b];
          if (pk::offer::classify(s.r_seen[b], re) == pk::offer::Seen::kClaimable) {
            swapped = s.offer;
            if (s.offer == s.r_seen[b]) t.offer = word(re, pk::offer::kClaimed);
          }
          const bool ok = pk::offer::claimed(s.r_seen[b], swapped, re);
          t.r_pc[b] = ok ? 2 : 5;
          out.push_back({who + (ok ? " claims" : " finds the offer gone"), t});
          break;
        }
        case 2: {  // read the layout (as the kernel: rows, row_bytes, then ptr)
          State t = s;
          const bool layout_ok = legacy() || variant == kNoLayout ||
                                 pk::offer::same_layout(uint64_t(r_layout), 1, uint64_t(s.layout), 1);
          t.r_pc[b] = layout_ok ? 6 : 5;
          out.push_back({who + " reads layout " + std::to_string(s.layout) +
                             (layout_ok ? "" : " (differs: no copy)"), t});
          break;
        }
        case 6: {  // read ptr
          State t = s;
          t.r_buf[b] = s.ptr;
          t.r_pc[b] = s.ptr != 0 ? 3 : 5;
          out.push_back({who + " reads ptr " + std::to_string(s.ptr), t});
          break;
        }
        case 3:
        case 4: {  // use the buffer: start, end
          State t = s;
          t.r_pc[b] = s.r_pc[b] + 1;
          t.copied = true;
          out.push_back({who + (s.r_pc[b] == 3 ? " starts" : " ends") + " its copy into B" +
                             std::to_string(s.r_buf[b]), t});
          break;
        }
        default:
          break;
      }
    }
    if (!s.r_done && s.r_pc[0] == 5 && s.r_pc[1] == 5) {
      State t = s;
      t.r_done = true;
      t.done_r = 1;
      out.push_back({"R releases done = 1", t});
    }
    return out;
  }

  bool explore(const State& s) {
    if (!seen.insert(s).second) return true;
    if (s.p_pc == 5 && s.r_done) {  // both finished
      if (s.unsafe) ++hazards;
      if (s.copied) ++copies;
      return true;
    }
    for (auto& [label, t] : successors(s)) {
      trace.push_back(label);
      for (int b = 0; b < kBlocks; ++b)
        if ((t.r_pc[b] == 4 && s.r_pc[b] == 3) || (t.r_pc[b] == 5 && s.r_pc[b] == 4))
          if (!check_use(t, s.r_buf[b])) return false;
      if (!explore(t)) return false;
      trace.pop_back();
    }
    return true;
  }
};

}  // namespace

int main(int argc, char** argv) {
  static_assert(sizeof(pk::SlotFlags) % 128 == 0 && pk::kFlagBytes <= pk::kLlOffset &&
                    pk::kLlOffset % 4096 == 0 && pk::kDataOffset % 4096 == 0,
                "workspace layout");
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s new|legacy|store-post|no-layout same|other\n", argv[0]);
    return 2;
  }
  Checker c;
  const std::string v = argv[1];
  c.variant = v == "legacy" ? kLegacy : v == "store-post" ? kStorePost
            : v == "no-layout" ? kNoLayout : kNew;
  c.r_layout = std::strcmp(argv[2], "same") == 0 ? kLayoutOf[0] : kOtherLayout;
  if (!c.explore(State{})) {
    std::printf("VIOLATION %s:", c.violation.c_str());
    for (const auto& step : c.trace) std::printf(" | %s", step.c_str());
    std::printf("\n");
    return 1;
  }
  std::printf("OK states=%zu hazards=%ld copies=%ld\n", c.seen.size(), c.hazards, c.copies);
  return 0;
}
