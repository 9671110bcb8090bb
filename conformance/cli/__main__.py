import sys

from kda_conformance.cli import main

sys.exit(main())
