"""All-reduce traffic of a compiled program, read from its optimized HLO text.

An op inside a while loop runs once per iteration: a computation's count is the sum over
the ops that call it of the caller's count, times the loop's `known_trip_count` for a
while body. Loops whose trip count is data (the attention's tile loops) must hold no
all-reduce. `python benchmarks/tp_scaling.py` prints the totals beside `cbjax.sim.tp`.
"""

from __future__ import annotations

import re
from typing import Optional

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_SHAPE = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]")
# all-reduce, or the start of an async one (its -done moves nothing new)
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_CALL = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _bytes(result_type: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(result_type):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def all_reduce_traffic(hlo_text: str) -> tuple[int, int]:
    """(all-reduce ops executed per run, bytes they reduce) of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.startswith(" "):
            comps[current].append(line)
    if entry is None:
        raise ValueError("all_reduce_traffic: no ENTRY computation in the HLO text")
    callers: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for kind, callee in _CALL.findall(line):
                times = 1 if kind != "body" else (int(trip.group(1)) if trip else None)
                callers.setdefault(callee, []).append((name, times))
            for group in _BRANCHES.findall(line):
                for callee in group.replace("%", "").split(","):
                    callers.setdefault(callee.strip(), []).append((name, 1))
    counts: dict[str, Optional[int]] = {}

    def count(name: str) -> Optional[int]:
        """Runs per run of the module; None under a loop whose trip count is data."""
        if name not in counts:
            if name == entry:
                counts[name] = 1
            else:
                parts = [(count(c), k) for c, k in callers.get(name, [])]
                known = all(n is not None and k is not None for n, k in parts)
                counts[name] = sum(n * k for n, k in parts) if known else None
        return counts[name]

    ops = total = 0
    for name, lines in comps.items():
        for line in lines:
            m = _ALL_REDUCE.search(line)
            if m:
                n = count(name)
                if n is None:
                    raise ValueError(f"all_reduce_traffic: an all-reduce in {name} runs a data-dependent number of times")
                ops += n
                total += n * _bytes(m.group(1))
    return ops, total
