import sys

from pivotspec.cli.main import main

sys.exit(main())
