import sys

from pcppass.cli import main

sys.exit(main())
