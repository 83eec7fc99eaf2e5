"""``python -m sagellm_core.cli``: the ``sagellm`` command."""

import sys

from sagellm_core.cli import main

sys.exit(main())
