"""`python -m chattts_triton.serve`: the launcher (`launcher/serve.py`), at the path the Docker image, the Helm
chart and the Makefile run."""

import sys

from .launcher.serve import main

if __name__ == "__main__":
    sys.exit(main())
