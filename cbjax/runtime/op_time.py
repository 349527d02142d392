"""Where a served run's time goes, read from a JAX profiler trace of XLA:CPU.

Each op XLA:CPU runs (a fusion, a dot, a custom call) is one event on an XLA thread, named
after its HLO instruction. `op_kinds` reads a compiled step's HLO text and sorts its
instructions into kinds: the native matmul and attention custom calls, XLA's dots, loop
containers (not counted: their ops are), and everything else (norms, RoPE, KV writes,
gathers, argmax). `breakdown` takes the trace's events and the steps in launch order (each
marked by a profiler annotation on the host), pairs them with XLA's program executions in
order, and sums every kind's op time per step size, beside the wall time XLA was busy and the
host-only remainder. `python
benchmarks/peer_transformers.py --trace` prints it.
"""

from __future__ import annotations

import gzip
import json
import re
from bisect import bisect_right
from pathlib import Path
from typing import NamedTuple

KINDS = ("matmul (native)", "matmul (XLA dot)", "attention (native)", "other XLA ops")
_TARGET_KIND = {
    "cbjax_layer_matmul": "matmul (native)",
    "cbjax_layer_matmul_glu": "matmul (native)",
    "cbjax_layer_matmul_rope": "matmul (native)",
    "cbjax_matmul_nt": "matmul (native)",
    "cbjax_single_groups": "attention (native)",
    "cbjax_block_groups_into": "attention (native)",
}
_CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?\s([a-z][\w\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def op_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> kind, for every instruction of a compiled program's HLO text
    (containers map to "container")."""
    kinds = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, opcode = m.groups()
        if opcode in _CONTAINERS:
            kinds[name] = "container"
        elif opcode == "custom-call":
            target = _TARGET.search(line)
            kinds[name] = _TARGET_KIND.get(target.group(1) if target else "", "other XLA ops")
        elif opcode in ("dot", "convolution"):
            kinds[name] = "matmul (XLA dot)"
        else:
            kinds[name] = "other XLA ops"
    return kinds


class Event(NamedTuple):
    thread: str
    name: str
    start_us: float
    dur_us: float


def read_trace(directory: str) -> list[Event]:
    """The complete ('X') events of the newest `*.trace.json.gz` under `directory`."""
    files = sorted(Path(directory).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}")
    raw = json.loads(gzip.open(files[-1]).read())["traceEvents"]
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in raw
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    return [
        Event(threads.get((e["pid"], e["tid"]), ""), e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
        for e in raw
        if e.get("ph") == "X"
    ]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


EXECUTE = "ThunkExecutor::Execute"  # XLA:CPU's event for running a program's thunks


def executions(events: list[Event]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of each program execution, in order: a top-level `EXECUTE`
    event on a PjRt client thread (not inside another one on that thread; loop bodies nest),
    extended over the `EXECUTE (wait for completion)` event that follows it there."""
    by_thread: dict[str, list[Event]] = {}
    for e in events:
        if e.thread.startswith("tf_XLAPjRtCpuClient") and e.name.startswith(EXECUTE):
            by_thread.setdefault(e.thread, []).append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start_us, -e.dur_us))
        runs: list[list[float]] = []  # this thread's
        end = float("-inf")
        for e in evs:
            if e.start_us < end:  # nested
                continue
            end = e.start_us + e.dur_us
            if e.name == EXECUTE:
                runs.append([e.start_us, end])
            elif runs:  # the wait that follows this thread's execution
                runs[-1][1] = max(runs[-1][1], end)
        out += runs
    return sorted((a, b) for a, b in out)


def breakdown(events: list[Event], steps: list[tuple[float, str, dict[str, str]]], makespan_s: float) -> dict:
    """Seconds per kind and step group.

    `steps`: (the host's launch time in the trace's microseconds, group label, that step's
    `op_kinds`), one per step. The k-th step launched is the k-th program execution
    (`executions`): an XLA event belongs to the execution it starts in. Under pipelined serving
    the host launches step t+1 while step t runs, so the launch times do not bound the steps'
    work; the executions do. Returns {"groups": {group: {kind: op seconds summed over XLA's
    threads, "steps": count, "xla_busy_s": wall time of its executions, "between_ops_s": of
    that, no op event running}}, "xla_busy_s", "between_ops_s", "host_only_s" (makespan less
    XLA's busy time)}. A ValueError names both counts when the trace holds another number of
    executions than steps (another program ran in between, as the sampler does)."""
    steps = sorted(steps, key=lambda s: s[0])
    runs = executions(events)
    if len(runs) != len(steps):
        raise ValueError(f"breakdown: {len(runs)} program executions in the trace for {len(steps)} steps")
    starts = [a for a, _ in runs]
    groups: dict[str, dict] = {}
    busy: dict[str, list] = {}
    ops: dict[str, list] = {}
    for (_, label, _), run in zip(steps, runs):
        groups.setdefault(label, {k: 0.0 for k in KINDS} | {"steps": 0})
        groups[label]["steps"] += 1
        busy.setdefault(label, []).append(tuple(run))
        ops.setdefault(label, [])
    for e in events:
        if not e.thread.startswith("tf_XLA"):
            continue
        k = bisect_right(starts, e.start_us) - 1
        if k < 0 or e.start_us > runs[k][1]:  # outside every execution
            continue
        label, kind = steps[k][1], steps[k][2].get(e.name)
        if kind is None or kind == "container":  # the executor's own events, loops
            continue
        groups[label][kind] += e.dur_us * 1e-6
        ops[label].append((e.start_us, e.start_us + e.dur_us))
    for label, g in groups.items():
        g["xla_busy_s"] = _union_us(busy[label]) * 1e-6
        g["between_ops_s"] = g["xla_busy_s"] - _union_us(ops[label]) * 1e-6
    busy_s = _union_us([tuple(r) for r in runs]) * 1e-6  # the device runs one program at a time
    return {
        "groups": groups,
        "xla_busy_s": busy_s,
        "between_ops_s": sum(g["between_ops_s"] for g in groups.values()),
        "host_only_s": makespan_s - busy_s,
        "makespan_s": makespan_s,
    }
