"""`python -m gcache.server` runs gcache-server."""

import sys

from gcache.server.main import main

sys.exit(main())
