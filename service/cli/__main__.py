"""`python -m service.cli` — same as the `vge` console script."""

from service.cli import main

raise SystemExit(main())
