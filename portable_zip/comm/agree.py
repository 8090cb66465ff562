"""The agreement rule's messages (docs/COMM.md): every plan is a pure
function of facts both ends hold alike; what they might not hold alike
travels here and is checked, so a mismatch raises the same MismatchError on
every rank of the transfer.

- control: a send/recv group's specs, per peer pair (PROTO);
- spec: a collective's (or the constructor's) spec, to every rank (SPEC_PROTO);
- check: PZ_CHECK_PLANS's hash of a send/recv group's plan and specs (CHECK_PROTO).

All three are int64[CTRL_WORDS] messages (control adds a second message when
a pair moves several tensors), so a rank in one kind of exchange and a peer in
another read each other's first words and say so."""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence

import torch

from .. import _C
from .._dtypes import CODE_TO_DTYPE, code_of
from .deadline import Deadline
from .errors import MismatchError, PeerError
from .transports.base import RECV, SEND, Transport

PROTO = 0x505A4331  # "PZC1": a send/recv control message
SPEC_PROTO = 0x505A4353  # "PZCS": a collective's (or the constructor's) spec message; same length
CHECK_PROTO = 0x505A434B  # "PZCK": a send/recv group's plan check (PZ_CHECK_PLANS); same length
WIRE_VERSION = 1 + (_C.format_version << 8)  # protocol 1 carrying stream format N
CTRL_WORDS = 12
PLAN_RAW, PLAN_CODED = 1, 2  # a control message's per-tensor plan
OPS = ["send", "recv", "broadcast", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
MODES = ["auto", "always", "never"]
PLAN_IDS = {"native": 0, "raw": 1, "compressed": 2, "decided from the split matrix": 3}
_PLAN_NAMES = {v: k for k, v in PLAN_IDS.items()}


def describe(dtype_code: int, numel: int) -> str:
    name = str(CODE_TO_DTYPE.get(dtype_code, f"dtype#{dtype_code}")).replace("torch.", "")
    return f"{name}[{numel}]"


def _version_text(v: int) -> str:
    return f"{v & 0xFF}/{v >> 8}"


def swap_all(tp: Transport, spec: Sequence, deadline: Deadline, dtype: torch.dtype = torch.int64) -> list:
    """Every rank's message of len(spec) values (this rank's is spec)."""
    if tp.world == 1:
        return [list(spec)]
    mine = torch.tensor(spec, dtype=dtype, device=tp.ctrl_device)
    peers = [j for j in range(tp.world) if j != tp.rank]
    got = {j: torch.empty_like(mine) for j in peers}
    tp.wait(tp.post([(SEND, mine, j) for j in peers] + [(RECV, got[j], j) for j in peers]), deadline)
    return [list(spec) if j == tp.rank else got[j].tolist() for j in range(tp.world)]


def _screen(rows: list, rank: int, where: str) -> None:
    """Reject rows that are not spec messages of this wire version, alike on every rank."""
    problems = []
    for j, row in enumerate(rows):
        if row[0] in (PROTO, CHECK_PROTO):
            problems.append(f"rank {j} is in a send/recv exchange while rank {rank} is in {where}")
        elif row[0] != SPEC_PROTO:
            raise PeerError(f"rank {j} sent a garbled control message")
        elif row[1] != WIRE_VERSION:
            problems.append(f"version mismatch: rank {j} speaks wire/format version {_version_text(row[1])}, "
                            f"rank {rank} {_version_text(WIRE_VERSION)}")
    if problems:
        raise MismatchError("; ".join(problems))


# --- the constructor --------------------------------------------------------

def handshake(tp: Transport, mode: str, want_check: bool, cached: int, piece_override: int, wave_bytes: int,
              deadline: Deadline) -> tuple:
    """Agree at construction on everything later plans read besides the op's
    own arguments: compress mode, wire/format version, the PZ_CHECK_PLANS
    mode, PZ_PIECE_BYTES and PZ_WAVE_BYTES (both ends cut the same waves),
    and whether every rank holds the same cached calibration. Returns
    (check plans, reuse the cache)."""
    spec = [SPEC_PROTO, WIRE_VERSION, -1, MODES.index(mode), int(want_check), cached, piece_override, wave_bytes]
    rows = swap_all(tp, spec + [0] * (CTRL_WORDS - len(spec)), deadline)
    _screen(rows, tp.rank, "the constructor")
    if any(row[3] != rows[0][3] for row in rows):
        modes = ", ".join(f"rank {j} {MODES[row[3]] if 0 <= row[3] < 3 else row[3]!r}" for j, row in enumerate(rows))
        raise MismatchError(f"compress= differs between ranks: {modes}; every rank must use the same mode")
    for k, name in ((6, "PZ_PIECE_BYTES"), (7, "PZ_WAVE_BYTES")):
        if any(row[k] != rows[0][k] for row in rows):
            raise MismatchError(f"{name} differs between ranks: " +
                                ", ".join(f"rank {j} {row[k] or 'unset'}" for j, row in enumerate(rows)))
    return any(row[4] for row in rows), rows[0][5] != 0 and all(row[5] == rows[0][5] for row in rows)


# --- collectives ------------------------------------------------------------

def _field(k: int, row: list) -> str:
    v = row[5 + k]
    if k == 0:
        return f"dtype {str(CODE_TO_DTYPE.get(v, v)).replace('torch.', '')}"
    return f"{['numel', 'arg', 'arg', 'arg'][k - 1]} {v}"


def collective(tp: Transport, op: str, plan: str, fingerprint: int, dtype: torch.dtype, fields: Sequence[int],
               piece_override: int, deadline: Deadline, splits=None) -> Optional[list]:
    """Swap a spec with every peer so a mismatched dtype, size, version, plan
    or policy state raises the same MismatchError on every rank. fields (up
    to 4 ints) must agree on all ranks; splits (all_to_all: input and output
    split sizes) are checked as a matrix in a second round, so every rank sees
    every pair's mismatch. Returns that matrix (else None)."""
    spec = [SPEC_PROTO, WIRE_VERSION, OPS.index(op), PLAN_IDS[plan], fingerprint & 0x7FFFFFFF, code_of(dtype), *fields]
    # The last word: PZ_PIECE_BYTES, which sets the piece sizes collectives derive on both sides.
    rows = swap_all(tp, spec + [0] * (CTRL_WORDS - 1 - len(spec)) + [piece_override], deadline)
    _screen(rows, tp.rank, op)
    problems = []
    for j, row in enumerate(rows):
        if row[2] != spec[2]:
            problems.append(f"rank {j} is in {OPS[row[2]] if 0 <= row[2] < len(OPS) else 'the constructor'} "
                            f"while rank {tp.rank} is in {op}")
        elif row[3] != rows[0][3]:
            problems.append(f"{op}: rank {j} runs the {_PLAN_NAMES.get(row[3], row[3])} plan but rank 0 the "
                            f"{_PLAN_NAMES.get(rows[0][3], rows[0][3])} plan (the plan rule diverged)")
        elif any(row[k] != rows[0][k] for k in range(5, 6 + len(fields))):
            problems += [f"{op}: rank {j} has {_field(k - 5, row)} but rank 0 has {_field(k - 5, rows[0])}"
                         for k in range(5, 6 + len(fields)) if row[k] != rows[0][k]]
        elif row[-1] != rows[0][-1]:
            problems.append(f"{op}: PZ_PIECE_BYTES differs: rank {j} {row[-1] or 'unset'}, rank 0 "
                            f"{rows[0][-1] or 'unset'}")
        elif row[4] != rows[0][4]:
            problems.append(f"{op}: rank {j} decides from different policy state than rank 0 "
                            f"(fingerprint {row[4]:#x} vs {rows[0][4]:#x})")
    if problems:
        raise MismatchError("; ".join(dict.fromkeys(problems)))
    if splits is None:
        return None
    mat = swap_all(tp, [*splits[0], *splits[1]], deadline)
    w = tp.world
    bad = [f"rank {i} sends {mat[i][j]} rows to rank {j}, which expects {mat[j][w + i]}"
           for i in range(w) for j in range(w) if mat[i][j] != mat[j][w + i]]
    if bad:
        raise MismatchError("all_to_all split mismatch: " + "; ".join(bad))
    return mat


# --- send/recv groups: PZ_CHECK_PLANS ---------------------------------------

def _specs(ts) -> list:
    return [(code_of(t.dtype), t.numel()) for t in ts]


def _digest(ts) -> int:
    return zlib.crc32(repr(_specs(ts)).encode()) & 0x7FFFFFFF


def check_pairs(tp: Transport, pairs: Dict[int, str], sends: dict, recvs: dict, deadline: Deadline) -> None:
    """Swap each pair's plan and a digest of its specs (with the first spec
    each way) both ways; both sides compare the same two messages and word
    the problem alike, so both raise alike."""
    msgs = {}
    for p, pl in pairs.items():
        ss, rs = sends.get(p, []), recvs.get(p, [])
        first_s = _specs(ss[:1])[0] if ss else (0, 0)
        first_r = _specs(rs[:1])[0] if rs else (0, 0)
        msgs[p] = [CHECK_PROTO, WIRE_VERSION, PLAN_IDS[pl], len(ss), len(rs), _digest(ss), _digest(rs),
                   *first_s, *first_r, 0]
    out = {p: torch.tensor(m, dtype=torch.int64, device=tp.ctrl_device) for p, m in msgs.items()}
    got = {p: torch.empty_like(t) for p, t in out.items()}
    tp.wait(tp.post([(SEND, t, p) for p, t in out.items()] + [(RECV, t, p) for p, t in got.items()]), deadline)
    problems = []
    for p in sorted(pairs):
        mine, theirs = msgs[p], got[p].tolist()
        lo, hi = sorted((tp.rank, p))
        a, b = (mine, theirs) if tp.rank == lo else (theirs, mine)  # both sides word it alike
        if theirs[0] != CHECK_PROTO:
            problems.append(f"ranks {lo} and {hi} are not both in a send/recv group")
            continue
        if a[1] != b[1]:
            problems.append(f"version mismatch: rank {lo} speaks wire/format version {_version_text(a[1])}, "
                            f"rank {hi} {_version_text(b[1])}")
            continue
        for snd, rcv, x, y in ((lo, hi, a, b), (hi, lo, b, a)):  # x sends to y
            if x[3] != y[4]:
                problems.append(_count_problem(snd, rcv, x[3], y[4], [x[7:9]], [y[9:11]]))
            elif x[5] != y[6]:
                more = "..." if x[3] > 1 else ""
                problems.append(f"size/dtype mismatch: rank {snd} sends {describe(*x[7:9])}{more}, rank {rcv} "
                                f"expects {describe(*y[9:11])}{more}")
        if a[2] != b[2] and not problems:
            problems.append(f"send/recv between ranks {lo} and {hi}: rank {lo} runs the {_PLAN_NAMES.get(a[2])} "
                            f"plan, rank {hi} the {_PLAN_NAMES.get(b[2])} plan (the plan rule diverged)")
    if problems:
        raise MismatchError("; ".join(problems))


# --- send/recv groups: the control round ------------------------------------

def control(tp: Transport, peers: List[int], mine: Dict[int, tuple], deadline: Deadline) -> tuple:
    """The control round with peers whose pair is not agreed. mine[p]: (send
    specs [dtype, numel, plan, piece], receive specs [dtype, numel]). Returns
    the peers' plans and piece sizes for what this rank receives from them."""
    theirs = _swap_control(tp, peers, mine, deadline)
    return _check_control(tp.rank, peers, mine, theirs)


def _swap_control(tp: Transport, peers: List[int], mine: Dict[int, tuple], deadline: Deadline) -> Dict[int, tuple]:
    """A fixed first message with the counts and the first spec each way,
    then the rest where a pair agreed on counts above one. Returns the peers'
    (first message, send specs, receive specs)."""
    dev = tp.ctrl_device

    def first(ss, rs):
        return [PROTO, WIRE_VERSION, len(ss), len(rs), *(ss[0] if ss else [0] * 4), *(rs[0] if rs else [0] * 2), 0, 0]

    out = {p: torch.tensor(first(*mine[p]), dtype=torch.int64, device=dev) for p in peers}
    got = {p: torch.empty(CTRL_WORDS, dtype=torch.int64, device=dev) for p in peers}
    tp.wait(tp.post([(SEND, out[p], p) for p in peers] + [(RECV, got[p], p) for p in peers]), deadline)
    msg1 = {p: got[p].tolist() for p in peers}
    rest_out, rest_in = {}, {}
    for p in peers:
        ss, rs = mine[p]
        m = msg1[p]
        if m[0] != PROTO or m[1] != WIRE_VERSION or (m[2], m[3]) != (len(rs), len(ss)) or max(m[2], m[3]) <= 1:
            continue  # nothing more to swap (a mismatch is reported from the first messages)
        # Counts agree and one exceeds 1, so both messages are non-empty.
        rest_out[p] = torch.tensor([v for s in ss[1:] for v in s] + [v for r in rs[1:] for v in r],
                                   dtype=torch.int64, device=dev)
        rest_in[p] = torch.empty(4 * max(m[2] - 1, 0) + 2 * max(m[3] - 1, 0), dtype=torch.int64, device=dev)
    if rest_out:
        tp.wait(tp.post([(SEND, t, p) for p, t in rest_out.items()] + [(RECV, t, p) for p, t in rest_in.items()]),
                deadline)
    theirs = {}
    for p in peers:
        m = msg1[p]
        ss = [m[4:8]] if m[2] else []
        rs = [m[8:10]] if m[3] else []
        if p in rest_in:
            v = rest_in[p].tolist()
            ns = max(m[2] - 1, 0)
            ss += [v[4 * i: 4 * i + 4] for i in range(ns)]
            rs += [v[4 * ns + 2 * i: 4 * ns + 2 * i + 2] for i in range(m[3] - 1)]
        theirs[p] = (m, ss, rs)
    return theirs


def _check_control(rank: int, peers: List[int], mine: Dict[int, tuple], theirs: Dict[int, tuple]) -> tuple:
    """Both sides run this on the same pair of messages, so both raise alike."""
    problems, plans, pieces = [], {}, {}
    for p in peers:
        (my_ss, my_rs), (m, ss, rs) = mine[p], theirs[p]
        if m[0] in (SPEC_PROTO, CHECK_PROTO):
            problems.append(f"rank {p} is in a collective while rank {rank} is in a send/recv exchange")
            continue
        if m[0] != PROTO:
            raise PeerError(f"rank {p} sent a garbled control message (not a portable_zip peer?)")
        if m[1] != WIRE_VERSION:
            problems.append(f"version mismatch with rank {p}: it speaks wire/format version {_version_text(m[1])}, "
                            f"this rank {_version_text(WIRE_VERSION)}")
            continue
        # Their sends against my receives, then my sends against theirs.
        # (Only first specs travel when counts differ: both sides see the same.)
        for sender, receiver, snd, rcv, n_snd, n_rcv in ((p, rank, ss, my_rs, m[2], len(my_rs)),
                                                         (rank, p, my_ss, rs, len(my_ss), m[3])):
            if n_snd != n_rcv:
                problems.append(_count_problem(sender, receiver, n_snd, n_rcv, snd, rcv))
                continue
            for i, (a, b) in enumerate(zip(snd, rcv)):
                if (a[0], a[1]) != (b[0], b[1]):
                    what = f"tensor {i}: " if n_snd > 1 else ""
                    problems.append(f"size/dtype mismatch: {what}rank {sender} sends {describe(a[0], a[1])}, "
                                    f"rank {receiver} expects {describe(b[0], b[1])}")
        if problems:
            continue
        plans[p] = [int(s[2]) == PLAN_CODED for s in ss]
        pieces[p] = [int(s[3]) for s in ss]
        for s in ss:
            if s[2] not in (PLAN_RAW, PLAN_CODED):
                raise PeerError(f"rank {p} announced an unknown plan {s[2]}")
            if s[2] == PLAN_CODED and (s[3] <= 0 or (s[3] < s[1] and s[3] % 2)):
                raise PeerError(f"rank {p} announced an invalid piece size {s[3]}")
    if problems:
        raise MismatchError("; ".join(problems))
    return plans, pieces


def _count_problem(sender, receiver, n_snd, n_rcv, snd, rcv) -> str:
    if n_snd == 1 and n_rcv == 0:
        return f"rank {sender} sends {describe(*snd[0][:2])} but rank {receiver} has no matching receive"
    if n_snd == 0 and n_rcv == 1:
        return f"rank {receiver} expects {describe(*rcv[0][:2])} but rank {sender} has no matching send"
    return f"rank {sender} sends {n_snd} tensors but rank {receiver} expects {n_rcv}"
