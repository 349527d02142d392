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
