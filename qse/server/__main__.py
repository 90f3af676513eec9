"""`python -m qse.server [flags]`: the same as `qse serve [flags]`."""

import sys

from .cli import serve_main

raise SystemExit(serve_main(sys.argv[1:]))
