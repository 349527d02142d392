"""The engine side of cbjax-serve: the scheduler, the executor and their loop, the per-step
service log and the live request log; at the end, the run's outputs as an offline run writes
them. It runs on a thread of the server's process, or in an engine process of its own
(`cbjax.serve.remote`); either way the server reaches it only through its `EngineClient`
(`cbjax.serve.local`, `cbjax.serve.remote`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Optional

from cbjax.engine.loop import EngineLoop
from cbjax.report.metrics import request_row
from cbjax.report.files import RequestLog
from cbjax.core.request import FinishReason, Request
from cbjax.core.results import LoadCounts
from cbjax.engine.offline import run_result
from cbjax.engine.online import run_online
from cbjax.app.run import build_executor, write_outputs
from cbjax.sim.pricing import build_scheduler
from cbjax.serve.config import ServeConfig
from cbjax.report.service import ServiceLog


class EngineHost:
    """Builds the loop over `cfg` (already resolved). `on_token`, `on_finish` and `tick` are the
    server's (EngineLoop's meanings, called on the loop's thread); each finished request is
    written to `out_dir`'s requests.jsonl before `on_finish` hears of it."""

    def __init__(
        self,
        cfg: ServeConfig,
        out_dir: Optional[Path],
        on_token: Callable[[Request, Optional[int], float], None],
        on_finish: Callable[[Request], None],
        tick: Callable[[], None],
    ):
        self.cfg, self.out_dir = cfg, out_dir
        self.executor = build_executor(cfg)
        scheduler = build_scheduler(cfg, self.executor)
        self.service_log = ServiceLog()
        self._on_finish, self._tick = on_finish, tick
        self.engine = EngineLoop(
            scheduler,
            self.executor,
            pace=cfg.executor.pace,
            on_step=self.service_log.on_step,
            on_token=on_token,
            on_finish=self.on_finish,
            tick=self.tick,
        )
        # the engine's tokens in each row, as an offline run writes them (the simulator has none)
        self.extra_rows = None if self.executor.virtual_clock else (lambda r: {"output_token_ids": r.output_token_ids})
        self.live: Optional[RequestLog] = None
        if out_dir is not None:
            extra = self.extra_rows
            self.live = RequestLog(out_dir / "requests.jsonl", lambda r: {**request_row(r), **(extra(r) if extra else {})})

    def on_finish(self, req: Request) -> None:
        if self.live is not None:
            self.live.write(req)
        self._on_finish(req)

    def tick(self) -> None:
        self._tick()
        if self.live is not None:
            self.live.tick()

    def warmup(self) -> None:
        """Compile before listening. A served request may sample, so the engine's sampler is
        compiled too (an offline run compiles it only when its workload samples)."""
        self.executor.warmup(sampling=True)

    # ---- the server's handle on the loop (thread-safe but `run`) ----
    def start(self, t0: Optional[float] = None) -> None:
        """Start the clock now (or at `t0` on the wall clock): arrivals count from here."""
        self.engine.clock.restart(t0)

    def run(self, stop: threading.Event, poll: Optional[Callable[[float], None]] = None) -> None:
        """Serve on this thread until `stop` is set (`cbjax.engine.online.run_online`)."""
        run_online(self.engine, stop, poll)

    def submit(self, req: Request, arrival_s: Optional[float] = None) -> None:
        self.engine.intake.submit(req, arrival_s)

    def cancel(self, request_id: str, reason: str = "client disconnected", finish_reason: FinishReason = FinishReason.ABORTED) -> None:
        self.engine.intake.cancel(request_id, reason, finish_reason)

    def close_admission(self) -> None:
        self.engine.intake.close_admission()

    def stamp(self) -> float:
        return self.engine.clock.stamp()

    def receive(self, key: object) -> float:
        return self.engine.intake.receive(key)

    def received(self, key: object) -> None:
        self.engine.intake.received(key)

    def counts(self) -> LoadCounts:
        return self.engine.scheduler.load()

    def finish(self) -> dict[str, Any]:
        """Once the loop has stopped: abort what is left, write requests.jsonl, summary.json and
        config.yaml, and release the executor; returns the summary."""
        self.engine.abort_all()
        self.tick()
        result = run_result(self.engine)
        summary = write_outputs(self.cfg, self.out_dir, result, self.service_log, self.executor, extra_rows=self.extra_rows)
        if self.live is not None:
            self.live.close()
        self.engine.close()
        self.executor.close()
        return summary

    def keep_rows(self) -> None:
        """After the loop failed (no summary can be written): the live log's rows, one per
        request that ended, become the run's requests.jsonl."""
        if self.live is not None:
            self.live.close(remove=False)
            self.live.path.replace(self.out_dir / "requests.jsonl")
        self.executor.close()
