"""``python -m dpfsdp_verify ...`` is ``dpfsdp-verify ...``."""

import sys

from .gate.cli import main

if __name__ == "__main__":
    sys.exit(main())
