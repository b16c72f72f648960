"""`python -m chattts_triton.voices`: lists, adds and removes the named voices of a repository
(`runtime/voices.py`)."""

import sys

from .runtime.voices import main

if __name__ == "__main__":
    sys.exit(main())
