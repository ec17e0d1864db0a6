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


def test_the_wheel_ships_the_native_codec_source(tmp_path):
    # compression/native.py builds native_codecs.cpp on the user's machine: a wheel without it
    # would fall back to the slower kernels on every CPU run.
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", REPO,
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rapidfire_ray/compression/native_codecs.cpp" in names
