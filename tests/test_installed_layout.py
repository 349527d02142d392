"""`cbjax` and `python -m cbjax.profile` find their configs when installed (configs inside the
package as cbjax.configs, no repository around them), as .ci/wheel_check checks on a real wheel."""

import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package laid out as a wheel installs it: site/cbjax with configs/ inside, no pyproject.toml."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(REPO / "cbjax", site / "cbjax", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(REPO / "configs", site / "cbjax" / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    return site


@pytest.mark.parametrize("module, expected", [("cbjax.profile", "grid: small"), ("cbjax", "num_requests: 8")])
def test_apps_compose_from_the_installed_package(installed, tmp_path, env_cpu, module, expected):
    env = {k: v for k, v in env_cpu.items() if k != "CBJAX_CONFIG_DIR"}
    env["PYTHONPATH"] = str(installed)
    overrides = ["grid=small"] if module == "cbjax.profile" else ["workload.num_requests=8"]
    proc = subprocess.run(
        [sys.executable, "-m", module, "--cfg", "job", *overrides], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout
    probe = "import cbjax, cbjax.app.cli; print(cbjax.__file__, cbjax.app.cli.CONFIG_PATH)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert where.stdout.split() == [str(installed / "cbjax" / "__init__.py"), "pkg://cbjax.configs"]
