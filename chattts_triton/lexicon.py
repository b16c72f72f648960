"""`python -m chattts_triton.lexicon`: lists, adds and removes the pronunciation lexicon's entries of a repository
(`runtime/lexicon.py`)."""

import sys

from .runtime.lexicon import main

if __name__ == "__main__":
    sys.exit(main())
