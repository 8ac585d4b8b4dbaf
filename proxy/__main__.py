"""``python -m proxy``: the same as the ``llmtap`` command."""

import sys

from proxy.cli import main

sys.exit(main())
