"""Packages for setuptools: everything under cbjax/, plus the repository's top-level configs/
shipped inside the package as cbjax.configs, so an installed wheel finds pkg://cbjax.configs."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["cbjax", "cbjax.*"]) + ["cbjax.configs"],
    package_dir={"cbjax.configs": "configs"},
)
