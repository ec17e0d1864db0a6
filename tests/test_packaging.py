"""Every folder of the package is a real package, so `pip install .` (not only -e) ships it."""
from __future__ import annotations

import os

from setuptools import find_packages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_source_folder_is_found_as_a_package():
    found = set(find_packages(REPO, include=["rapidfire_ray*"]))
    folders = {os.path.relpath(root, REPO).replace(os.sep, ".")
               for root, _dirs, files in os.walk(os.path.join(REPO, "rapidfire_ray"))
               if "__pycache__" not in root and any(f.endswith(".py") for f in files)}
    assert folders <= found, f"folders without __init__.py: {sorted(folders - found)}"
