import sys

from medseg.cli.main import main

sys.exit(main())
