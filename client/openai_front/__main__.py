"""`python -m diffulex_client.openai_front` is the `diffulex-openai` command."""

import sys

from .cli import main

sys.exit(main())
