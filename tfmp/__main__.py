import sys

from tfmp.cli import main

sys.exit(main())
