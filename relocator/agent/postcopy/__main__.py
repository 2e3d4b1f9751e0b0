"""`python -S -m relocator.agent.postcopy ...`: the keeper (relocator.agent.postcopy.keeper)."""

import sys

from relocator.agent.postcopy.keeper import main

sys.exit(main())
