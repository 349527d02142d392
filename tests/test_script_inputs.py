"""The research scripts' bad input, as a user meets it: a file a flag names that cannot be read,
or an output path that cannot be written, fails in one line naming the flag, before any work."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import calibrate  # noqa: E402
import calibrate_steps  # noqa: E402
import cluster_ratios  # noqa: E402
import tier_fidelity  # noqa: E402


def usage_error(capsys, main, argv, monkeypatch=None) -> str:
    """The last stderr line of `main(argv)`, which must stop as argparse's `error` does (status 2);
    in-process, its program name is pytest's."""
    if monkeypatch is not None:  # a main that reads sys.argv
        monkeypatch.setattr(sys, "argv", ["script", *argv])
        argv = None
    with pytest.raises(SystemExit) as stop:
        main() if argv is None else main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def bad_profiles(tmp_path):
    (tmp_path / "empty.json").write_text("")
    return {"missing": tmp_path / "none.json", "not JSON": tmp_path / "empty.json"}


@pytest.mark.parametrize("script", ["calibrate", "calibrate_steps", "cluster_ratios", "tier_fidelity"])
@pytest.mark.parametrize("kind", ["missing", "not JSON"])
def test_a_profile_that_cannot_be_read_fails_naming_the_flag(script, kind, tmp_path, capsys, monkeypatch):
    path = bad_profiles(tmp_path)[kind]
    argv = ["--profile", str(path)]
    module = {"calibrate": calibrate, "calibrate_steps": calibrate_steps, "cluster_ratios": cluster_ratios,
              "tier_fidelity": tier_fidelity}[script]  # fmt: skip
    line = usage_error(capsys, module.main, argv, monkeypatch if script == "calibrate_steps" else None)
    assert line.split(": error: ", 1)[1].startswith(f"--profile: cannot read {path} ("), line


@pytest.mark.parametrize("flag", ["--reports", "--residual-profiles"])
def test_calibrate_reads_every_file_it_names_before_any_run(flag, tmp_path, capsys):
    profile, missing = tmp_path / "p.json", tmp_path / "none.json"
    profile.write_text("{}")
    line = usage_error(capsys, calibrate.main, ["--profile", str(profile), flag, str(missing), "--cores", "0"])
    assert line.split(": error: ", 1)[1] == f"{flag}: cannot read {missing} (No such file or directory)", line


def blocked(tmp_path):
    """A folder no one can create, root included: it lies under a regular file."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "out"


# case -> (flag, the file it names under `blocked` or "" for the folder itself, the folder the
# error names under `blocked`, the rest of the command)
OUTPUTS = {
    "calibrate --out-dir": ("--out-dir", "", "", ["--profile", "p.json"]),
    "calibrate --doc": ("--doc", "C.md", "", ["--profile", "p.json"]),
    "steadiness": ("--out", "s.json", "", []),
    "steadiness --side-by-side": ("--out", "s.json", "", ["--side-by-side"]),
    "cluster_ratios": ("--out", "c.json", "", ["--profile", "p.json"]),
    "tier_fidelity": ("--out", "t.json", "", ["--profile", "p.json"]),
    "spec_fidelity": ("--out", "", "", ["--profile", "p.json"]),
    "train_length_predictor": ("--out", "p.npz", "", ["--correlated", "50", "--steps", "2"]),
    "reproduce --out": ("--out", "", "", ["--only", "ltr_toy"]),
    "reproduce --docs": ("--docs", "", "reproductions", ["--only", "ltr_toy"]),
    "external": ("--docs", "", "", []),
    "collect_sweep": ("--out", "sweep", "", ["SWEEP"]),
}


@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_an_output_path_that_cannot_be_written_fails_naming_the_flag_before_any_work(case, tmp_path, capsys,
                                                                                     monkeypatch):  # fmt: skip
    import importlib

    script = case.split()[0]
    flag, name, folder, rest = OUTPUTS[case]
    out = blocked(tmp_path)
    (tmp_path / "SWEEP").mkdir()
    rest = [str(tmp_path / a) if a in ("p.json", "SWEEP") else a for a in rest]  # p.json: absent
    argv = [*rest, flag, str(out / name) if name else str(out)]
    module = importlib.import_module(script)
    line = usage_error(capsys, module.main, argv, monkeypatch if script == "train_length_predictor" else None)
    named = out / folder if folder else out
    assert line.split(": error: ", 1)[1].startswith(f"{flag}: cannot write the output folder {named}: "), line


def test_tier_fidelity_names_cores_out_of_range(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    line = usage_error(capsys, tier_fidelity.main, ["--profile", str(profile), "--cores", "100000", "--out",
                                                    str(tmp_path / "t.json")])  # fmt: skip
    assert line.split(": error: ", 1)[1].startswith("--cores: must be in [1, "), line
