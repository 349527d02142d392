"""The engine side of cbjax-serve: the scheduler, the executor and their loop, the per-step
service log and the live request log; at the end, the run's outputs as an offline run writes
them. It runs on a thread of the server's process, or in an engine process of its own
(`cbjax.serve.remote`); either way the server sees only the loop's intake and its callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from cbjax.engine.loop import EngineLoop
from cbjax.report.metrics import request_row
from cbjax.report.files import RequestLog
from cbjax.core.request import Request
from cbjax.app.run import build_executor, write_outputs
from cbjax.scheduler.core import Scheduler
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
        scheduler = Scheduler(
            cfg.scheduler,
            cfg.cache,
            cfg.model.max_model_len,
            validate=self.executor.validate,
            eos_token_id=cfg.model.eos_token_id,
            vocab_size=cfg.model.vocab_size,
        )
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
        if hasattr(self.executor, "sampling"):
            self.executor.sampling = True
        self.executor.warmup()

    def finish(self) -> dict[str, Any]:
        """Once the loop has stopped: abort what is left, write requests.jsonl, summary.json and
        config.yaml, and release the executor; returns the summary."""
        self.engine.abort_all()
        self.tick()
        result = self.engine.result()
        summary = write_outputs(self.cfg, self.out_dir, result, self.service_log, self.executor, extra_rows=self.extra_rows)
        if self.live is not None:
            self.live.close()
        self.engine.close()
        self.executor.close()
        return summary
