# All metadata lives in setup.cfg; this file exists for tools that still call setup.py.
from setuptools import setup

setup()
