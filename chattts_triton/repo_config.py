"""`python -m chattts_triton.repo_config` (`make configure`): rewrites an exported repository's model
configurations (`triton/repo_config.py`)."""

import sys

from .triton.repo_config import main

if __name__ == "__main__":
    sys.exit(main())
