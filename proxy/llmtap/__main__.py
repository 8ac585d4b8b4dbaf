"""``python -m llmtap``: the same as the ``llmtap`` command."""

import sys

from llmtap.cli import main

sys.exit(main())
