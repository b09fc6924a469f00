"""``python -m omni_async.cli``: the same as ``omni-async``."""

import sys

from omni_async.cli import main

sys.exit(main())
