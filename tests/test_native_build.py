"""How the native kernels package finds its compiler: GCC only (the sources use GCC's vector
extensions), whatever `CXX` names."""

from __future__ import annotations

import os

import pytest

kernels = pytest.importorskip("cbjax.kernels.native.build", reason="the native CPU kernels package is not installed")


def _fake(directory, name: str, banner: str):
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    return str(path)


def test_clang_is_never_picked_and_gcc_is(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    clang = _fake(tmp_path, "clang++", "Ubuntu clang version 17.0.6")
    monkeypatch.setenv("CXX", clang)
    assert kernels._compiler() is None  # CXX names clang, and no g++ or c++ is on PATH
    cxx = _fake(tmp_path, "c++", "Apple clang version 15.0.0 (clang-1500.3.9.4)")  # macOS's c++ is clang
    assert kernels._compiler() is None
    gcc = _fake(tmp_path, "g++", "g++ (Ubuntu 13.2.0-23ubuntu4) 13.2.0")
    assert kernels._compiler() == gcc
    os.unlink(cxx)
    monkeypatch.setenv("CXX", gcc)
    assert kernels._compiler() == gcc


def test_the_first_build_says_so_on_one_stderr_line(tmp_path, capsys):
    # a "compiler" that fails at once (`false`): the progress line comes before the build, the error after
    with pytest.raises(RuntimeError, match="failed"):
        kernels._build("false", tmp_path / "builds" / "lib.so")
    err = capsys.readouterr().err.splitlines()
    assert err == ["cbjax: building native CPU kernels (first use, ~30 s)..."]
