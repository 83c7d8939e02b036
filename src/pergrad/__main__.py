import sys

from pergrad.cli import main

sys.exit(main())
