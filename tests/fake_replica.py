"""A stand-in engine executor for cluster tests of replica processes (no jax, so a child starts
in about a second): tokens are a hand-checkable function of what the executor was sent, K/V
export and import carry numpy arrays, and a request id can be made to fail its step.

Token of a row: (acc + num_computed + num_new_tokens) % 97, where `acc` is the sum of the
request's prompt ids and of the tokens it was given so far; on a decode replica `acc` starts
from the sum of the K/V the request brought (`import_kv`), so the tokens show the K/V crossed.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, MeshConfig, ModelConfig, RunConfig, SchedulerConfig
from cbjax.core.executor import StepOutput, SyncExecutor
from cbjax.core.request import Request, SamplingParams

MODEL = ModelConfig(max_model_len=64)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)
CACHE = CacheConfig(num_pages=64, page_size=4)


def config(backend: str = "processes", **cluster) -> RunConfig:
    executor = ExecutorConfig(name="jax", mesh=MeshConfig(1))
    cluster = ClusterConfig(backend=backend, **cluster)
    return RunConfig(model=MODEL, scheduler=SCHED, cache=CACHE, executor=executor, cluster=cluster, progress=False)


def workload(late: Optional[float] = None) -> list[Request]:
    """Six requests at t=0 with 8-token prompts and 5 tokens each; `late`: request 5 arrives then."""
    reqs = []
    for i in range(6):
        prompt = [(7 * i + j) % 50 for j in range(8)]
        arrival = late if late is not None and i == 5 else 0.0
        sampling = SamplingParams(max_tokens=5, ignore_eos=True)
        reqs.append(Request(str(i), arrival, len(prompt), prompt_token_ids=prompt, sampling=sampling))
    return reqs


class FakeEngine(SyncExecutor):
    virtual_clock = False
    reads_token_ids = True

    def __init__(self, cfg: RunConfig, fail_on: Optional[str] = None, how: str = "raise", step_s: float = 0.0):
        """Fails as `how` says: "raise" (an exception) or "exit" (the process ends, code 3) at
        the step that schedules request `fail_on`; "export" in `export_kv`; "build" at once."""
        if how == "build":
            raise ValueError("no executor here")
        self.how = how
        self.pipelined = cfg.executor.mesh.tensor == 1  # as the engine: a TP mesh steps one at a time
        self.fail_on, self.how, self.step_s = fail_on, how, step_s
        self.acc: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.page_value: dict[int, int] = {}
        self.steps = 0

    def execute(self, plan) -> StepOutput:
        if self.fail_on is not None and any(s.request_id == self.fail_on for s in plan.scheduled):
            if self.how == "exit":
                os._exit(3)
            raise ValueError(f"injected failure on request {self.fail_on}")
        time.sleep(self.step_s)
        self.steps += 1
        tokens = []
        for s in plan.scheduled:
            acc = self.acc.get(s.request_id, 0)
            if s.token_ids is not None:
                acc += sum(s.token_ids)
            elif s.feed_previous:
                acc += self.last[s.request_id]
            token = (acc + s.num_computed + s.num_new_tokens) % 97
            self.acc[s.request_id] = acc
            self.last[s.request_id] = token
            for page in s.page_table or ():
                self.page_value[page] = acc
            tokens.append(token)
        return StepOutput(token_ids=tokens)

    def export_kv(self, pages) -> np.ndarray:
        if self.how == "export":
            raise RuntimeError("no K/V")
        return np.array([self.page_value.get(p, 0) for p in pages], np.int64)

    def import_kv(self, request_id: str, kv: np.ndarray) -> None:
        self.acc[request_id] = int(kv.sum())

    def metrics(self) -> dict:
        return {
            "compiles_after_warmup": 0, "steps": self.steps, "pid": os.getpid(),
            "xla_flags": os.environ.get("XLA_FLAGS"), "jax_platforms": os.environ.get("JAX_PLATFORMS"),
        }  # fmt: skip


def build(cfg: RunConfig, fail_on: Optional[str] = None, how: str = "raise", step_s: float = 0.0) -> FakeEngine:
    """`make_executor`/`build` for a cluster of fakes (pickled by reference into children)."""
    return FakeEngine(cfg, fail_on, how, step_s)
