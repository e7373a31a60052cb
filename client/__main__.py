"""`python -m diffulex_client` is the `diffulex-client` command."""

import sys

from .cli import main

sys.exit(main())
