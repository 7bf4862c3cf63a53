"""`python -m oomdoctor` runs the command-line interface."""
from oomdoctor.cli import main

main()
