"""The package list for pyproject.toml's package-dir mapping.

Discovery names packages after their folders, so the renamed folders (kernels/ -> diffulex_kernels,
client/ -> diffulex_client) are listed here with their subpackages under the new name.
"""

import os

from setuptools import find_packages, setup


def packages_under(folder: str, import_name: str) -> list[str]:
    if not os.path.isdir(folder):  # a checkout without that part of the project
        return []
    return [import_name] + [f"{import_name}.{sub}" for sub in find_packages(folder)]


setup(
    packages=find_packages(include=["diffulex_backend", "diffulex_backend.*"])
    + packages_under("kernels", "diffulex_kernels")
    + packages_under("client", "diffulex_client")
)
