"""Interrupted runs (subprocess tests): SIGINT while serving, while writing, and between arms."""

import json
import signal
import subprocess
import sys
import time

import yaml

from conftest import REPO

# Runs the CLI with the simulator slowed to 5 ms an iteration and the file writer slowed to
# 0.5 s a file, printing markers on stderr so the test can signal at a known moment.
RUNNER = """
import sys, time
import cbjax.report.files, cbjax.report.tables, cbjax.app.run
from cbjax.sim.executor import SimExecutor

execute = SimExecutor.execute
def slow_execute(self, plan):
    if not getattr(self, "said", False):
        self.said = True
        print("MARK serving", file=sys.stderr, flush=True)
    time.sleep(0.005)
    return execute(self, plan)
SimExecutor.execute = slow_execute

write = cbjax.report.files.atomic_write_text
def slow_write(path, text):
    print("MARK writing " + path.name, file=sys.stderr, flush=True)
    time.sleep(0.5)
    write(path, text)
cbjax.report.tables.atomic_write_text = slow_write

from cbjax.app.cli import main
main()
"""
RUN = ["progress=false", "executor.cost_model=unit", "scheduler.max_num_seqs=4", "workload.num_requests=60",
       "workload.arrival=poisson", "workload.rate=4"]  # fmt: skip


def run_and_signal(tmp_path, env, args, marks, signum=signal.SIGINT, skip=0):
    """Start the CLI; send `signum` each time a stderr line starts with the next of `marks`,
    after letting the first `skip` matches pass."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    other = []
    todo = list(marks)
    for line in proc.stderr:
        if line.startswith("MARK"):
            if todo and line.startswith(todo[0]):
                if skip:
                    skip -= 1
                    continue
                todo.pop(0)
                proc.send_signal(signum)
        else:
            other.append(line)
    proc.wait(timeout=120)
    assert not todo, f"never saw {todo}; stderr: {''.join(other)}"
    return proc.returncode, "".join(other), proc.stdout.read()


def check_run_files(out, num_requests):
    """Every file under a final name parses in full; every request has exactly one row."""
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert yaml.safe_load((out / "config.yaml").read_text())["workload"]["num_requests"] == num_requests
    assert sorted(int(r["request_id"]) for r in rows) == list(range(num_requests))
    assert all(r["finish_reason"] for r in rows)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp")) and not (out / "requests.jsonl.partial").exists()
    return summary, rows


def test_sigint_while_serving_saves_every_request_and_exits_130(tmp_path, env_cpu):
    out = tmp_path / "run"
    code, err, stdout = run_and_signal(tmp_path, env_cpu, RUN + [f"hydra.run.dir={out}"], ["MARK serving"])
    assert code == 130, err
    assert "Traceback" not in err + stdout
    assert err.strip().splitlines() == [f"cbjax: interrupted by SIGINT; what finished is saved in {out}"]
    summary, rows = check_run_files(out, 60)
    assert summary["interrupted"] is True and summary["num_requests"] == 60
    fates = [r["finish_reason"] for r in rows]
    assert fates.count("aborted") == summary["num_aborted"]
    assert fates.count("not_arrived") == summary["num_not_arrived"] > 0
    total = summary["num_finished"] + summary["num_aborted"] + summary["num_rejected"] + summary["num_not_arrived"]
    assert total == 60
    # a request the run never reached has no finish time; every other ends at or after arriving
    never = [r for r in rows if r["finish_reason"] == "not_arrived"]
    assert all(r["finish_s"] is None and r["first_token_s"] is None for r in never)
    last_end = max(r["finish_s"] for r in rows if r["finish_s"] is not None)
    assert all(r["arrival_s"] > last_end for r in never)
    assert all(r["finish_s"] >= r["arrival_s"] for r in rows if r["finish_s"] is not None)
    assert "cbjax: interrupted by SIGINT" in (out / "cli.log").read_text()


def test_sigterm_is_handled_the_same_way(tmp_path, env_cpu):
    out = tmp_path / "run"
    code, err, _ = run_and_signal(tmp_path, env_cpu, RUN + [f"hydra.run.dir={out}"], ["MARK serving"], signal.SIGTERM)
    assert code == 130 and "interrupted by SIGTERM" in err
    assert check_run_files(out, 60)[0]["interrupted"] is True


def test_signals_while_writing_leave_no_half_file_under_a_final_name(tmp_path, env_cpu):
    out = tmp_path / "run"
    # the first lands while config.yaml is being written, the second while requests.jsonl is
    code, err, stdout = run_and_signal(
        tmp_path, env_cpu, RUN + [f"hydra.run.dir={out}"], ["MARK writing config.yaml", "MARK writing requests.jsonl"]
    )
    assert code == 130, err
    assert "Traceback" not in err + stdout and len(err.strip().splitlines()) == 1
    summary, rows = check_run_files(out, 60)
    assert summary["interrupted"] is False  # serving had finished: the save was interrupted
    assert summary["num_finished"] == 60 and all(r["finish_reason"] != "aborted" for r in rows)


def test_an_experiment_interrupted_between_arms_keeps_the_finished_ones(tmp_path, env_cpu):
    exp_dir = tmp_path / "configs" / "experiment"
    exp_dir.mkdir(parents=True)
    for group in (REPO / "configs").iterdir():
        if group.is_dir() and group.name != "experiment":
            (tmp_path / "configs" / group.name).symlink_to(group)
    (tmp_path / "configs" / "config.yaml").symlink_to(REPO / "configs" / "config.yaml")
    (exp_dir / "three.yaml").write_text(
        "# @package _global_\nexperiment:\n  name: three\n  arms:\n"
        "    a: {scheduler: {name: fcfs}}\n    b: {scheduler: {name: static}}\n    c: {scheduler: {name: sjf}}\n"
        "  tables:\n    - {title: t, arms: [a, b], metrics: [iterations]}\n"
    )
    env = dict(env_cpu, CBJAX_CONFIG_DIR=str(tmp_path / "configs"))
    out = tmp_path / "run"
    # the second arm's first iteration: arm a is done, b is cut short, c never starts
    code, err, _ = run_and_signal(
        tmp_path, env, RUN + ["experiment=three", f"hydra.run.dir={out}"], ["MARK serving"], skip=1
    )
    assert code == 130, err
    assert check_run_files(out / "a", 60)[0]["interrupted"] is False
    assert check_run_files(out / "b", 60)[0]["interrupted"] is True
    assert not (out / "c").exists()
    assert set(json.loads((out / "comparison.json").read_text())) == {"a"}
    assert "Interrupted: arms b, c are missing (finished: a)." in (out / "comparison.md").read_text()


def test_the_live_request_log_holds_finished_requests_before_the_end(tmp_path):
    from conftest import CheckingExecutor, make_requests
    from cbjax.config import CacheConfig, SchedulerConfig
    from cbjax.engine.offline import serve
    from cbjax.report.metrics import request_row
    from cbjax.report.files import RequestLog
    from cbjax.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=1), CacheConfig(num_pages=64, page_size=4), 1000)
    live = RequestLog(tmp_path / "requests.jsonl", request_row, flush_s=0.0)
    seen = []

    class Peeking(CheckingExecutor):
        def execute(self, plan):
            seen.append(len((tmp_path / "requests.jsonl.partial").read_text().splitlines()))
            return super().execute(plan)

    serve(make_requests([2, 2, 2]), sched, Peeking(sched), on_finish=live.write, tick=live.tick)
    # one slot: request i runs in iterations 2i+1 and 2i+2, so iteration 3 sees one row on disk
    assert seen == [0, 0, 1, 1, 2, 2]
    live.close()
    assert not (tmp_path / "requests.jsonl.partial").exists()


def test_the_live_request_log_flushes_within_flush_s(tmp_path):
    from cbjax.report.files import RequestLog
    from cbjax.core.request import Request

    live = RequestLog(tmp_path / "requests.jsonl", lambda r: {"request_id": r.request_id}, flush_s=0.2)
    partial = tmp_path / "requests.jsonl.partial"
    live.write(Request("a", 0.0, 1))
    assert partial.read_text() == ""  # buffered: written within flush_s of the last flush
    time.sleep(0.25)
    live.tick()
    assert partial.read_text() == '{"request_id": "a"}\n'
    live.close(remove=False)
    assert partial.exists()
