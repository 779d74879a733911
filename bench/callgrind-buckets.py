#!/usr/bin/env python3
"""Instructions per request of a callgrind profile of a ticketd node, by part.

    bench/callgrind-buckets.py CALLGRIND_OUT REQUESTS

Each function's own instructions (not those of what it calls) go to a part
by its name. Generic code (collections, Vec growth, drops, iterators) is
charged to its callers in proportion to what each caller spent in it, up
the call graph, until a function of a named part is reached. malloc/free
and memcpy/memmove stay parts of their own; their callers are listed below
the table. The libc system-call wrappers are counted per request too.
"""
import re
import sys
from collections import defaultdict

PARTS = [
    ("allocation (malloc/free/realloc)", r"(^|::)(_?int_)?(malloc|free|realloc|calloc)$|^_int_|malloc_consolidate|unlink_chunk|tcache|__rust_(alloc|dealloc|realloc)|^cfree|^__libc_(malloc|free|realloc)"),
    ("copies (memcpy/memmove/memset/memcmp)", r"^__mem|^mem(cpy|move|set|cmp)|__memcpy|__memmove|__memset|__memcmp|bcmp"),
    ("TLS (rustls, ring)", r"^<?rustls|^ring::|^<ring|ring_core|aes_|gcm_|GFp|chacha|poly1305|x25519|sha(256|512)_block"),
    ("CRC32 (crc32fast)", r"crc32fast"),
    ("protobuf encode/decode", r"^<?protobuf::|^<raft_proto::|^raft_proto::|protobuf::"),
    ("raft-rs step/ready/log", r"^<?raft::|^raft::|<raft::"),
    ("WAL (storage.rs)", r"ticketd::cluster::storage"),
    ("state machine (state.rs, engine)", r"ticketd::cluster::state|ticketd::engine|ticketd::hash|ticketd::time|SipKey|hashbrown"),
    ("commands (command.rs)", r"ticketd::cluster::command"),
    ("node: Ready, proposals, replies (node.rs)", r"ticketd::cluster::node|ticketd::cluster::service"),
    ("peer transport (transport.rs)", r"ticketd::cluster::transport"),
    ("client path (server/, proto.rs)", r"ticketd::server|ticketd::proto|ticketd::service|ticketd::single"),
    ("kernel entry (libc syscall wrappers)", r"^(__libc_)?(write|writev|read|readv|send|sendto|sendmsg|recv|recvfrom|recvmsg|epoll_wait|epoll_ctl|fdatasync|fsync|futex|syscall|pwrite64?|pread64?|__GI_|__syscall|clock_gettime|__clock_gettime|__vdso)"),
    ("mio, std, other", r".*"),
]
GENERIC = re.compile(
    r"^(<)?(alloc::|core::|std::collections|hashbrown::raw|<alloc::|<core::|<\[|<&|<\*|<T as|<std::collections)"
    r"|drop_in_place|RawVec|finish_grow|::clone$|btree|<alloc|<core|__rust_begin_short_backtrace"
)
SYSCALLS = ["write", "writev", "read", "readv", "send", "sendto", "sendmsg", "recv", "recvfrom",
            "recvmsg", "epoll_wait", "epoll_ctl", "fdatasync", "futex", "syscall", "pwrite64",
            "pwritev", "pwritev64", "accept4", "clock_gettime"]


def parse(path):
    names = {}
    self_cost = defaultdict(int)
    calls = defaultdict(int)  # (caller, callee) -> inclusive Ir
    ncalls = defaultdict(int)  # (caller, callee) -> count
    fn = None
    cfn = None
    pending_call = None

    def name_of(kind, rest):
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if not m:
            return rest
        key = (kind, m.group(1))
        if m.group(2) is not None:
            names[key] = m.group(2)
        return names.get(key, rest)

    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                if len(parts) < 2:
                    continue
                ir = int(parts[1])
                if pending_call is not None:
                    calls[(fn, cfn)] += ir
                    ncalls[(fn, cfn)] += pending_call
                    pending_call = None
                else:
                    self_cost[fn] += ir
            elif line.startswith("fn="):
                fn = name_of("fn", line[3:])
            elif line.startswith("cfn="):
                cfn = name_of("fn", line[4:])
            elif line.startswith("calls="):
                pending_call = int(line[6:].split()[0])
    return self_cost, calls, ncalls


def part_of(name):
    if GENERIC.search(name) and not re.search(PARTS[0][1], name) and not re.search(PARTS[1][1], name):
        return None
    for part, rx in PARTS:
        if re.search(rx, name):
            return part
    return PARTS[-1][0]


def main():
    path, reqs = sys.argv[1], int(sys.argv[2])
    self_cost, calls, ncalls = parse(path)
    callers = defaultdict(list)
    for (a, b), ir in calls.items():
        if a != b:
            callers[b].append((a, ir))
    total = sum(self_cost.values())
    memo = {}

    def charge(fn, depth=0, seen=()):
        """How fn's own cost splits over named parts (fractions)."""
        p = part_of(fn)
        if p is not None or depth > 12:
            return {p or PARTS[-1][0]: 1.0}
        if fn in memo:
            return memo[fn]
        cs = [(a, ir) for a, ir in callers.get(fn, []) if a not in seen]
        tot = sum(ir for _, ir in cs)
        if tot == 0:
            return {PARTS[-1][0]: 1.0}
        out = defaultdict(float)
        for a, ir in cs:
            for q, fr in charge(a, depth + 1, seen + (fn,)).items():
                out[q] += fr * ir / tot
        if depth == 0:
            memo[fn] = out
        return out

    parts = defaultdict(float)
    for fn, ir in self_cost.items():
        for q, fr in charge(fn).items():
            parts[q] += ir * fr
    print(f"total {total:,} Ir over {reqs:,} requests = {total / reqs:,.0f} Ir/request")
    print(f"| part | Ir per request | share |")
    print(f"|---|---:|---:|")
    for part, _ in PARTS:
        v = parts.get(part, 0.0)
        if v:
            print(f"| {part} | {v / reqs:,.0f} | {100 * v / total:.1f} % |")
    # Who calls the allocator and memcpy, by the caller's part.
    for label, rx in [("malloc+realloc calls", r"^(malloc|realloc|__libc_malloc|__libc_realloc)$"),
                      ("memcpy/memmove", r"__memcpy|__memmove|^memcpy|^memmove")]:
        by = defaultdict(float)
        n = 0
        for (a, b), cnt in ncalls.items():
            if re.search(rx, b) and not re.search(rx, a):
                n += cnt
                for q, fr in charge(a).items() if part_of(a) is None else [(part_of(a), 1.0)]:
                    by[q] += cnt * fr
        print(f"{label}: {n / reqs:.1f} per request: " + ", ".join(
            f"{q.split(' (')[0]} {v / reqs:.1f}" for q, v in sorted(by.items(), key=lambda x: -x[1]) if v / reqs >= 0.05))
    sc = defaultdict(int)
    for (a, b), cnt in ncalls.items():
        base = b.split(" ")[0]
        base = re.sub(r"^__libc_|^__GI___?|^__", "", base)
        if base in SYSCALLS and a != b and not re.sub(r"^__libc_|^__GI___?|^__", "", a) in SYSCALLS:
            sc[base] += cnt
    print("system calls per request: " + ", ".join(
        f"{k} {v / reqs:.2f}" for k, v in sorted(sc.items(), key=lambda x: -x[1]) if v / reqs >= 0.01))
    if len(sys.argv) > 3:
        top = sorted(self_cost.items(), key=lambda x: -x[1])[: int(sys.argv[3])]
        for fn, ir in top:
            print(f"{ir / reqs:9,.0f}  {part_of(fn) or 'generic'}  {fn[:150]}")


main()
