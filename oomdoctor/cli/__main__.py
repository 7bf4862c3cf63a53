"""`python -m oomdoctor.cli` runs the command-line interface (as the old cli.py module did)."""
from oomdoctor.cli import main

main()
