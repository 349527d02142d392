"""The trace breakdown of a served run's time (cbjax.runtime.op_time), on hand-counted events."""

import jax
import jax.numpy as jnp
import pytest

from cbjax.runtime.op_time import Event, breakdown, op_kinds


def test_op_kinds_reads_a_compiled_program():
    def f(a, b):
        def body(x, _):
            return jnp.tanh(x @ b), None

        return jax.lax.scan(body, a, None, length=3)[0]

    kinds = op_kinds(jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile().as_text())
    by_kind = {}
    for name, kind in kinds.items():
        by_kind.setdefault(kind, []).append(name)
    assert len(by_kind["matmul (XLA dot)"]) == 1  # the one dot, inside the loop body
    assert len(by_kind["container"]) == 1 and by_kind["container"][0].startswith("while")
    assert any("tanh" in n for n in by_kind["other XLA ops"])


def test_op_kinds_sorts_custom_calls_by_target():
    text = "\n".join([
        '  %ffi_call.3 = f32[4,8]{1,0} custom-call(%a, %b), custom_call_target="cbjax_layer_matmul", api_version=API_VERSION_TYPED_FFI',
        '  ROOT %ffi_call.4 = (f32[4,2,8]{2,1,0}, f32[1]{0}) custom-call(%q, %k), custom_call_target="cbjax_single_groups"',
        '  %ffi_call.5 = f32[4]{0} custom-call(%q), custom_call_target="cbjax_block_groups_into"',
        '  %cc = f32[4]{0} custom-call(%q), custom_call_target="something_else"',
        '  %ffi_call.6 = f32[4,9]{1,0} custom-call(%h, %e), custom_call_target="cbjax_matmul_nt"',
    ])  # fmt: skip
    assert op_kinds(text) == {
        "ffi_call.3": "matmul (native)", "ffi_call.4": "attention (native)", "ffi_call.5": "attention (native)",
        "cc": "other XLA ops", "ffi_call.6": "matmul (native)",
    }  # fmt: skip


def test_breakdown_sums_ops_per_program_execution():
    small = {"mm": "matmul (native)", "att": "attention (native)", "norm": "other XLA ops", "while.1": "container"}
    large = {"mm": "matmul (XLA dot)", "norm": "other XLA ops"}  # the same name, another kind in another program
    x1, x2, x3 = "tf_XLAPjRtCpuClient/1", "tf_XLAEigen/2", "tf_XLAPjRtCpuClient/3"
    events = [
        Event(x1, "mm", 0.0, 50.0),  # before the first execution: not the run's
        Event("python", "mm", 150.0, 1000.0),  # the host thread: never an op
        # step 1 (small), launched at t=100, runs 105-195 on x1: a loop holding three ops, 10 us
        # between ops inside it, its body an execution nested in the step's
        Event(x1, "ThunkExecutor::Execute", 105.0, 90.0),
        Event(x1, "while.1", 110.0, 80.0),
        Event(x1, "ThunkExecutor::Execute", 112.0, 70.0),
        Event(x1, "mm", 110.0, 30.0),
        Event(x1, "att", 150.0, 20.0),
        Event(x1, "norm", 180.0, 10.0),
        # step 2 (large), launched at t=120 while step 1 runs (pipelined), runs 300-320 on x3 and
        # its wait for completion 320-480: two threads, overlapping
        Event(x3, "ThunkExecutor::Execute", 300.0, 20.0),
        Event(x3, "ThunkExecutor::Execute (wait for completion)", 320.0, 160.0),
        Event(x3, "mm", 310.0, 100.0),
        Event(x2, "mm", 350.0, 100.0),
        Event(x2, "norm", 450.0, 20.0),
        Event(x2, "norm", 500.0, 5.0),  # after the last execution: no step's
    ]
    steps = [(100.0, "small", small), (120.0, "large", large)]
    out = breakdown(events, steps, makespan_s=600e-6)
    s, g = out["groups"]["small"], out["groups"]["large"]
    assert s["steps"] == 1 and g["steps"] == 1
    assert s["matmul (native)"] == pytest.approx(30e-6)
    assert s["attention (native)"] == pytest.approx(20e-6)  # in step 1's execution, after step 2's launch
    assert s["other XLA ops"] == pytest.approx(10e-6)
    assert s["matmul (XLA dot)"] == 0.0
    assert g["matmul (XLA dot)"] == pytest.approx(200e-6)  # summed over both threads
    assert g["other XLA ops"] == pytest.approx(20e-6)
    assert g["matmul (native)"] == 0.0
    # busy wall: 105-195 (90) + 300-480 (180); ops' wall: 110-140, 150-170, 180-190 (60) + 310-470 (160)
    assert s["xla_busy_s"] == pytest.approx(90e-6) and g["xla_busy_s"] == pytest.approx(180e-6)
    assert s["between_ops_s"] == pytest.approx(30e-6) and g["between_ops_s"] == pytest.approx(20e-6)
    assert out["xla_busy_s"] == pytest.approx(270e-6)
    assert out["between_ops_s"] == pytest.approx(50e-6)
    assert out["host_only_s"] == pytest.approx(330e-6)
    with pytest.raises(ValueError, match="2 program executions in the trace for 3 steps"):
        breakdown(events, steps + [(130.0, "small", small)], makespan_s=600e-6)
