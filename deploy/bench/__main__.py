"""`python -m deploy.bench`: the same as `hstu-bench`."""
import sys

from deploy.bench.cli import main

sys.exit(main())
