"""``python -m bench``."""

from bench.run import main

raise SystemExit(main())
