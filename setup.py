"""Thin shim: everything lives in pyproject.toml; this only lets tools that expect setup.py work."""

from setuptools import setup

setup()
