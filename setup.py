"""Which packages the distribution holds: everything else is in pyproject.toml.

The package ``attnres_probe`` is made of its own folder and four top-level folders of the
repository (``kernels/``, ``hooks/``, ``dashboards/``, ``reports/``), each mapped to a subpackage.
Every folder with an ``__init__.py`` under them is found here (``find_packages``), so a new
subfolder cannot be left out of the wheel (``tests/test_wheel.py`` builds one and installs it
outside the checkout).
"""

from setuptools import find_packages, setup

FOLDERS = {
    "attnres_probe": "attnres_probe",
    "attnres_probe.kernels": "kernels",
    "attnres_probe.hooks": "hooks",
    "attnres_probe.dashboards": "dashboards",
    "attnres_probe.reports": "reports",
}

packages = []
for package, folder in FOLDERS.items():
    packages += [package, *(f"{package}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=FOLDERS)
