"""`python -m cronlease_client run MODULE --queue Q`: see cronlease_client.cli."""

from __future__ import annotations

import sys

from cronlease_client.cli import main

# Guarded: process-pool children re-import the main module under another name.
if __name__ == "__main__":
    sys.exit(main(prog="python -m cronlease_client"))
