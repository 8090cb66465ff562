"""The agreement rule's messages (docs/COMM.md): every plan is a pure
function of facts both ends hold alike; what they might not hold alike
travels here and is checked, so a mismatch raises the same MismatchError on
every rank of the transfer.

- spec: a collective's (or the constructor's) spec, to every rank (SPEC_PROTO).

Point to point needs none: each message announces itself (p2p.py)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..codec import CODE_TO_DTYPE, FORMAT_VERSION, code_of
from .args import MODES
from .deadline import Deadline
from .errors import MismatchError, PeerError
from .transports.base import RECV, SEND, Transport

SPEC_PROTO = 0x505A4353  # "PZCS": a collective's (or the constructor's) spec message; same length
# Protocol 4 carrying stream format N. 2: a spec's word 10 is the policy's note; 3: the encoder's block
# plan (format.h choose_block_log2), which a receiver's stream_layout assumes, took 2^13 up to 2^24 symbols;
# 4: 2^12 up to 2^22 symbols, 2^13 up to 2^25; a negative word 10 is a raw plan's observation.
WIRE_VERSION = 4 + (FORMAT_VERSION << 8)
CTRL_WORDS = 12
W_NOTE = CTRL_WORDS - 2  # a collective's spec: the rank's observation for the policy (policy.report)
OPS = ["send", "recv", "broadcast", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
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
        if row[0] != SPEC_PROTO:
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
               piece_override: int, deadline: Deadline, splits=None, note: int = 0) -> tuple:
    """Swap a spec with every peer so a mismatched dtype, size, version, plan
    or policy state raises the same MismatchError on every rank. fields (up
    to 4 ints) must agree on all ranks; splits (all_to_all: input and output
    split sizes) are checked as a matrix in a second round, so every rank sees
    every pair's mismatch. note: this rank's word for the policy, which may
    differ between ranks. Returns (that matrix or None, every rank's note)."""
    spec = [SPEC_PROTO, WIRE_VERSION, OPS.index(op), PLAN_IDS[plan], fingerprint & 0x7FFFFFFF, code_of(dtype), *fields]
    # The last word: PZ_PIECE_BYTES, which sets the piece sizes collectives derive on both sides.
    rows = swap_all(tp, spec + [0] * (W_NOTE - len(spec)) + [note, piece_override], deadline)
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
    notes = [row[W_NOTE] for row in rows]
    if splits is None:
        return None, notes
    mat = swap_all(tp, [*splits[0], *splits[1]], deadline)
    w = tp.world
    bad = [f"rank {i} sends {mat[i][j]} rows to rank {j}, which expects {mat[j][w + i]}"
           for i in range(w) for j in range(w) if mat[i][j] != mat[j][w + i]]
    if bad:
        raise MismatchError("all_to_all split mismatch: " + "; ".join(bad))
    return mat, notes
