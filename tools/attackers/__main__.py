"""``python -m echo.tools.attackers KIND ...``: see :mod:`echo.tools.attackers`."""

import sys

from echo.tools.attackers import main

sys.exit(main())
